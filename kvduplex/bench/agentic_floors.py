"""What the same run puts under the multi-turn targets: where TTFT goes, and decode load.

Two of the benchmark's ratios have a floor that no transfer design can go
under, and both are measured in the run they bound:

* **TTFT.** The prompt-computing instance's own TTFT (arrival at its engine to
  its first token, from its /metrics) against the client's: what is left is
  the router, the HTTP hops and the first token's relay.
* **TPOT.** A decode step's time grows with the decodes batched together. In a
  closed loop of sessions, a mode whose turns start sooner keeps more of them
  decoding at once, so its TPOT rises for that reason alone. For each request
  the time-weighted number of decodes at once over its decode is taken from
  the records (all requests of the same run), a line TPOT = a + b * decodes
  is fitted to each mode's requests, and a mode is compared with the
  denominator's line at its own load: what is left is the cost of the mode's
  mechanism (the return's work on decode), not of its load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvduplex.bench.agentic import TurnRecord
from kvduplex.bench.agentic_report import SUMMARY_MIN_TURN
from kvduplex.bench.agentic_report import by_mode_shape
from kvduplex.bench.agentic_report import mean_known
from kvduplex.bench.agentic_report import to_ms
from kvduplex.bench.tables import markdown_table


@dataclass
class EngineTime:
    """Where a mode's TTFT goes, means over all turns of its runs (seconds in ms):
    the client's TTFT and the prompt-computing instance's own (arrival at its engine
    to the first token: P's, or the colocated instance's), from its /metrics."""

    mode: str
    shape: str
    n: int
    client_ttft_mean_ms: float | None
    engine_ttft_mean_ms: float | None
    """None where no prompt-computing instance exposes its TTFT (an endpoint)."""
    outside_ms: float | None
    """client - engine: router, HTTP hops, the first token's relay."""


def engine_times(records: list[TurnRecord], runs: list[dict[str, Any]]) -> list[EngineTime]:
    """One row per (mode, shape) that ran: client TTFT mean against the engine's."""
    sums: dict[tuple[str, str], list[float]] = {}
    for run in runs:
        if run.get("engine_ttft_count"):
            acc = sums.setdefault((run["mode"], run["shape"]), [0.0, 0.0])
            acc[0] += run["engine_ttft_s"]
            acc[1] += run["engine_ttft_count"]
    rows = []
    for (mode, shape), recs in by_mode_shape(records).items():
        client = mean_known(r.result.ttft_s for r in recs if r.result.ok)
        total = sums.get((mode, shape))
        engine = total[0] / total[1] if total else None
        outside = client - engine if client is not None and engine is not None else None
        rows.append(
            EngineTime(mode, shape, sum(r.result.ok for r in recs), to_ms(client), to_ms(engine),
                       to_ms(outside))
        )  # fmt: skip
    return rows


ENGINE_RATIOS: tuple[tuple[str, str, str], ...] = (
    ("push+duplex / push", "push+duplex", "push"),
    ("push+duplex / colocated", "push+duplex", "colocated"),
    ("2p1d push+duplex / 2p1d push", "2p1d-push+duplex", "2p1d-push"),
)


def engine_ratios(rows: list[EngineTime]) -> list[list[object]]:
    """[shape, ratio, client TTFT means' ratio, engine TTFT means' ratio (the floor)]."""
    by = {(r.mode, r.shape): r for r in rows}
    out: list[list[object]] = []
    for shape in dict.fromkeys(r.shape for r in rows):
        for name, num, den in ENGINE_RATIOS:
            a, b = by.get((num, shape)), by.get((den, shape))
            if a and b and a.engine_ttft_mean_ms and b.engine_ttft_mean_ms:
                client = (a.client_ttft_mean_ms or 0.0) / (b.client_ttft_mean_ms or 1.0)
                out.append([shape, name, client, a.engine_ttft_mean_ms / b.engine_ttft_mean_ms])
    return out


def engine_time_lines(rows: list[EngineTime]) -> list[str]:
    """The engine-time table and its ratios, as Markdown lines (none without engine times)."""
    if not any(r.engine_ttft_mean_ms is not None for r in rows):
        return []
    head = ["mode", "shape", "n", "client TTFT mean (ms)", "engine TTFT mean (ms)", "outside (ms)"]
    body: list[list[object]] = [
        [r.mode, r.shape, r.n, r.client_ttft_mean_ms, r.engine_ttft_mean_ms, r.outside_ms]
        for r in rows
    ]
    return _floor_tables(
        "Where TTFT goes (means over all turns; engine: arrival at the prompt-computing "
        "instance's engine to its first token, from its /metrics):", head, body,
        "TTFT ratios of means: the client's, and the engine's (the floor no transfer "
        "design can go under):", ["client", "engine (floor)"], engine_ratios(rows),
    )  # fmt: skip


def _floor_tables(
    title: str, head: list[str], body: list[list[object]],
    ratio_title: str, ratio_head: list[str], ratio_rows: list[list[object]],
) -> list[str]:  # fmt: skip
    """A floor's table, then its ratios' (if any), as Markdown lines."""
    lines = ["", title, "", *markdown_table(head, body)]
    if ratio_rows:
        lines += ["", ratio_title, "", *markdown_table(["shape", "ratio", *ratio_head], ratio_rows)]
    return lines


@dataclass
class DecodeLoad:
    """How loaded decoding was while a mode's requests (turns >= 3) decoded."""

    mode: str
    shape: str
    n: int
    decodes_mean: float
    """Mean over the requests of the time-weighted decodes at once during each one's decode
    (itself included)."""
    tpot_mean_ms: float
    fit: tuple[float, float] | None
    """(a, b) of TPOT ms = a + b * decodes over the mode's requests; None with fewer than
    three requests or no spread in load."""

    def tpot_at_ms(self, decodes: float) -> float | None:
        """This mode's fitted TPOT at another load."""
        return None if self.fit is None else self.fit[0] + self.fit[1] * decodes


def decodes_at_once(run: list[TurnRecord]) -> dict[int, float]:
    """id(record) -> time-weighted decodes at once over its decode, for one run's records.

    A request decodes from its first token (start + TTFT) to its end (start + e2e).
    """
    spans = {
        id(r): (r.start_s + r.result.ttft_s, r.start_s + r.result.e2e_s)
        for r in run if r.result.ok
    }  # fmt: skip
    out = {}
    for key, (a, b) in spans.items():
        if b > a:
            overlap = sum(max(0.0, min(b, e) - max(a, s)) for s, e in spans.values())
            out[key] = overlap / (b - a)
    return out


def decode_loads(records: list[TurnRecord], min_turn: int = SUMMARY_MIN_TURN) -> list[DecodeLoad]:
    """One row per (mode, shape) with requests of turns >= `min_turn` that decoded."""
    runs: dict[tuple[str, str, int], list[TurnRecord]] = {}
    for r in records:
        runs.setdefault((r.mode, r.shape, r.repetition), []).append(r)
    load: dict[int, float] = {}
    for run in runs.values():
        load.update(decodes_at_once(run))
    rows = []
    for (mode, shape), recs in by_mode_shape(records).items():
        pts = [(load[id(r)], r.result.tpot_s * 1e3) for r in recs
               if r.turn >= min_turn and id(r) in load and r.result.tpot_s > 0]  # fmt: skip
        if not pts:
            continue
        x, y = np.array(pts).T
        fit = None
        if len(pts) >= 3 and np.ptp(x) > 0:
            b, a = np.polyfit(x, y, 1)
            fit = (float(a), float(b))
        rows.append(DecodeLoad(mode, shape, len(pts), float(x.mean()), float(y.mean()), fit))
    return rows


LOAD_RATIOS: tuple[tuple[str, str, str], ...] = (
    ("tpot push+duplex / push", "push+duplex", "push"),
    ("tpot push+duplex+short / push+duplex", "push+duplex+short", "push+duplex"),
)


def load_ratios(rows: list[DecodeLoad]) -> list[list[object]]:
    """[shape, ratio, TPOT means' ratio, ratio to the denominator's fitted TPOT at the
    numerator's load (the mechanism's own cost)]."""
    by = {(r.mode, r.shape): r for r in rows}
    out: list[list[object]] = []
    for shape in dict.fromkeys(r.shape for r in rows):
        for name, num, den in LOAD_RATIOS:
            a, b = by.get((num, shape)), by.get((den, shape))
            if a and b and b.tpot_mean_ms:
                at_load = b.tpot_at_ms(a.decodes_mean)
                out.append([shape, name, a.tpot_mean_ms / b.tpot_mean_ms,
                            a.tpot_mean_ms / at_load if at_load else None])  # fmt: skip
    return out


def decode_load_lines(rows: list[DecodeLoad]) -> list[str]:
    """The decode-load table and its ratios, as Markdown lines (none without rows)."""
    if not rows:
        return []
    head = ["mode", "shape", "n", "decodes at once (mean)", "TPOT mean (ms)", "fit a (ms)",
            "fit b (ms per decode)"]  # fmt: skip
    body: list[list[object]] = [
        [r.mode, r.shape, r.n, r.decodes_mean, r.tpot_mean_ms,
         r.fit[0] if r.fit else None, r.fit[1] if r.fit else None]
        for r in rows
    ]  # fmt: skip
    return _floor_tables(
        f"Decode load (turns >= {SUMMARY_MIN_TURN}; decodes at once over each request's "
        "decode, from the records; TPOT = a + b * decodes fitted per mode):", head, body,
        "TPOT ratios of means: as measured, and against the denominator's fitted TPOT "
        "at the numerator's load (what the mechanism itself costs):",
        ["measured", "at equal load"], load_ratios(rows),
    )  # fmt: skip


def floor_lines(engine: list[EngineTime], load: list[DecodeLoad]) -> list[str]:
    """Both floors' Markdown lines, for `agentic_report.markdown`."""
    return engine_time_lines(engine) + decode_load_lines(load)
