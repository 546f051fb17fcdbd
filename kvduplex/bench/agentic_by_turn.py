"""The multi-turn report by turn index, and prompt tokens by where they came from.

By turn: one table per shape, a row per turn index, for each mode its TTFT
p50 and p90 and the prompt tokens computed per request (on P and D together;
see `agentic_report.prefill_split`). Sessions of a shape that draws its turn
count have fewer requests at the later indices: the n column says how many.

By source: what the servers' /metrics count over each run (see
`kvduplex.bench.prompt_sources`), summed over a mode's runs of a shape and
divided by its requests; one row per role (prefill, decode, a colocated
instance, the router, or an endpoint given alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvduplex.bench.agentic import TurnRecord
from kvduplex.bench.agentic_report import Stats
from kvduplex.bench.tables import markdown_table

SOURCE_ORDER = ("local_compute", "local_cache_hit", "external_kv_transfer",
                "returned_answer_hit", "returned_answer_miss")  # fmt: skip
"""Sources in the order the table shows them (others follow, sorted)."""
_NOT_PROMPT = ("returned_answer_hit", "returned_answer_miss")
"""Sources that count a part of another (returned answers within P's cache hits)."""


def _prefilled(s: Stats) -> float | None:
    if s.prefilled_p_mean is None:
        return None
    return s.prefilled_p_mean + (s.prefilled_d_mean or 0.0)


def by_turn_lines(turns: list[Stats]) -> list[str]:
    """Markdown: per shape, TTFT p50/p90 (ms) and prefilled tokens per request by turn index,
    the modes side by side."""
    lines: list[str] = []
    for shape in dict.fromkeys(s.shape for s in turns):
        rows = [s for s in turns if s.shape == shape]
        modes = list(dict.fromkeys(s.mode for s in rows))
        by = {(s.mode, s.turn): s for s in rows}
        header = ["turn", "n"]
        for m in modes:
            header += [f"{m} TTFT p50", f"{m} p90", f"{m} prefilled"]
        body: list[list[object]] = []
        for turn in sorted({s.turn for s in rows}, key=int):
            got = [by.get((m, turn)) for m in modes]
            row: list[object] = [turn, max(s.n for s in got if s is not None)]
            for s in got:
                row += [None, None, None] if s is None else [s.ttft_p50_ms, s.ttft_p90_ms, _prefilled(s)]
            body.append(row)
        lines += ["", f"By turn ({shape}; ms, prompt tokens computed per request):", ""]
        lines += markdown_table(header, body)
    return lines


@dataclass
class SourceRow:
    """Prompt tokens per request by source, on the servers of one role, over a mode's runs."""

    mode: str
    shape: str
    role: str
    requests: int
    tokens: dict[str, float]
    """source -> tokens per request."""

    @property
    def not_computed_share(self) -> float | None:
        """Of the prompt tokens this role's servers served, the share they did not compute."""
        served = {k: v for k, v in self.tokens.items() if k not in _NOT_PROMPT}
        total = sum(served.values())
        if not total or "local_compute" not in served:
            return None
        return 1.0 - served["local_compute"] / total


def source_rows(records: list[TurnRecord], runs: list[dict[str, Any]]) -> list[SourceRow]:
    """One row per (mode, shape, role) whose runs counted sources."""
    requests: dict[tuple[str, str], int] = {}
    for r in records:
        key = (r.mode, r.shape)
        requests[key] = requests.get(key, 0) + 1
    sums: dict[tuple[str, str, str], dict[str, float]] = {}
    for run in runs:
        for role, by_source in (run.get("sources") or {}).items():
            acc = sums.setdefault((run["mode"], run["shape"], role), {})
            for source, tokens in by_source.items():
                acc[source] = acc.get(source, 0.0) + tokens
    rows = []
    for (mode, shape, role), acc in sums.items():
        n = requests.get((mode, shape), 0)
        if n:
            rows.append(SourceRow(mode, shape, role, n, {k: v / n for k, v in acc.items()}))
    return rows


def source_lines(rows: list[SourceRow]) -> list[str]:
    """Markdown: the rows with a column per source seen."""
    if not rows:
        return []
    seen = {k for r in rows for k in r.tokens}
    sources = [s for s in SOURCE_ORDER if s in seen] + sorted(seen - set(SOURCE_ORDER))
    body: list[list[object]] = [
        [f"{r.mode} / {r.shape}", r.role, r.requests, *(r.tokens.get(s) for s in sources),
         r.not_computed_share]
        for r in rows
    ]  # fmt: skip
    header = ["mode / shape", "where", "requests", *sources, "not computed there"]
    return ["", "Prompt tokens by source per request (servers' /metrics):", "",
            *markdown_table(header, body)]  # fmt: skip
