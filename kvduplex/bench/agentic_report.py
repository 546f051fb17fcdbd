"""Aggregate a multi-turn workload's records: per turn index, per mode, ratios, plot.

Tokens prefilled per request come from the non-standard ``usage.kv`` when the
server sends it (P's and D's share apart). Without it they are estimated as
``prompt_tokens - cached_tokens`` and counted as P's (for a colocated endpoint:
the instance's); D's share is then unknown.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvduplex.bench.agentic import TurnRecord
from kvduplex.bench.client import RequestResult
from kvduplex.bench.tables import markdown_table

SUMMARY_MIN_TURN = 3
"""The summary covers turns with index >= this: the history is long by then."""

RATIOS: tuple[tuple[str, str, str, str], ...] = (
    ("ttft push+duplex / colocated", "push+duplex", "colocated", "ttft_p50_ms"),
    ("ttft push+duplex / push", "push+duplex", "push", "ttft_p50_ms"),
    ("ttft push+duplex / push+return-pull", "push+duplex", "push+return-pull", "ttft_p50_ms"),
    ("tpot push+duplex / push", "push+duplex", "push", "tpot_p50_ms"),
    ("ttft 2p1d push+duplex / 2p1d push", "2p1d-push+duplex", "2p1d-push", "ttft_p50_ms"),
    ("ttft push+duplex+short / push+duplex", "push+duplex+short", "push+duplex", "ttft_p50_ms"),
    ("tpot push+duplex+short / push+duplex", "push+duplex+short", "push+duplex", "tpot_p50_ms"),
)
"""(name, numerator mode, denominator mode, statistic), over turns >= SUMMARY_MIN_TURN."""


def prefill_split(result: RequestResult, disaggregated: bool) -> tuple[float, float | None]:
    """Prompt tokens computed (on P or the colocated instance, on D or None if unknown)."""
    kv = result.kv
    if kv is not None:
        if disaggregated:
            return float(kv.prefill_computed_tokens), float(kv.decode_computed_tokens)
        return float(kv.prefill_computed_tokens + kv.decode_computed_tokens), None
    return float(max(0, result.prompt_tokens - result.cached_tokens)), None


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def mean_known(values: Iterable[float | None]) -> float | None:
    """The mean of the values that are not None (None if there are none)."""
    known = [v for v in values if v is not None]
    return float(np.mean(known)) if known else None


def to_ms(v: float | None) -> float | None:
    return None if v is None else v * 1e3


@dataclass
class Stats:
    """Figures over a set of requests (one turn index, or turns >= 3) of one mode and shape."""

    mode: str
    shape: str
    turn: str
    """The turn index, or e.g. '>=3'."""
    n: int
    errors: int
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    tpot_p50_ms: float | None
    tpot_p90_ms: float | None
    e2e_p50_ms: float | None
    prompt_tokens_mean: float | None
    cached_tokens_mean: float | None
    prefilled_p_mean: float | None
    """Prompt tokens computed on P (colocated: on the instance), mean per request."""
    prefilled_d_mean: float | None
    """Prompt tokens computed on D, mean per request (None: not reported)."""
    bytes_p_to_d_mean: float | None
    """KV bytes that reached D per request (``usage.kv``; None: not reported, or colocated)."""
    bytes_d_to_p_mean: float | None = None
    """KV bytes D wrote back to P per request (duplex; None: not known)."""
    history_hit_mean: float | None = None
    """Of the previous turn's prompt and answer, the share this turn found cached (turns >= 1)."""
    answer_hit_mean: float | None = None
    """Of the previous turn's answer, the share this turn found cached (see `answer_hit`)."""


HistoryKey = tuple[str, str, int, int, int]
"""(mode, shape, repetition, session, turn)."""


def history_index(records: list[TurnRecord]) -> dict[HistoryKey, TurnRecord]:
    return {(r.mode, r.shape, r.repetition, r.session, r.turn): r for r in records}


def history_hit(r: TurnRecord, index: dict[HistoryKey, TurnRecord]) -> float | None:
    """cached_tokens / (previous prompt + previous answer), at most 1; None on turn 0.

    With token-id prompts this is near 1 (all but the last partial block); in
    chat form it shows how much of the re-rendered history reproduces the ids
    generated.
    """
    prev = index.get((r.mode, r.shape, r.repetition, r.session, r.turn - 1))
    if prev is None or not prev.result.ok or not r.result.ok:
        return None
    history = prev.result.prompt_tokens + _answer_in_history(r, prev)
    return min(1.0, r.result.cached_tokens / history) if history else None


def _answer_in_history(r: TurnRecord, prev: TurnRecord) -> int:
    """The tokens of `prev`'s answer that `r`'s prompt holds as generated: all of them, or
    none where the client rewrote it or stripped its reasoning."""
    return prev.result.completion_tokens if r.previous_sent_back else 0


def answer_hit(r: TurnRecord, index: dict[HistoryKey, TurnRecord]) -> float | None:
    """(cached_tokens - previous prompt) / previous answer, within [0, 1]; None on turn 0.

    How much of the KV generated for the previous answer this turn reused. With
    token-id prompts the next prompt holds the answer's ids, so it is near 1
    when the answer's KV is cached (returned to P, or kept by a colocated
    instance) and near 0 without a return. In chat form it is near 0 wherever
    the re-rendered assistant turn departs from the ids generated (text that
    re-encodes differently). None where the client did not send the answer back as
    generated (rewritten, or its reasoning stripped): there is nothing to hit.
    """
    prev = index.get((r.mode, r.shape, r.repetition, r.session, r.turn - 1))
    if prev is None or not prev.result.ok or not r.result.ok or not _answer_in_history(r, prev):
        return None
    reused = r.result.cached_tokens - prev.result.prompt_tokens
    return min(1.0, max(0.0, reused / prev.result.completion_tokens))


def stats_of(
    mode: str,
    shape: str,
    turn: str,
    records: list[TurnRecord],
    disaggregated: bool,
    history: dict[HistoryKey, TurnRecord] | None = None,
) -> Stats:
    """`history` (see `history_index`) holds the previous turns for the history hit."""
    ok = [r.result for r in records if r.result.ok]
    index = history or {}
    splits = [prefill_split(r, disaggregated) for r in ok]
    return Stats(
        mode=mode, shape=shape, turn=turn, n=len(ok), errors=len(records) - len(ok),
        ttft_p50_ms=to_ms(_pct([r.ttft_s for r in ok], 50)),
        ttft_p90_ms=to_ms(_pct([r.ttft_s for r in ok], 90)),
        tpot_p50_ms=to_ms(_pct([r.tpot_s for r in ok], 50)),
        tpot_p90_ms=to_ms(_pct([r.tpot_s for r in ok], 90)),
        e2e_p50_ms=to_ms(_pct([r.e2e_s for r in ok], 50)),
        prompt_tokens_mean=mean_known(float(r.prompt_tokens) for r in ok),
        cached_tokens_mean=mean_known(float(r.cached_tokens) for r in ok),
        prefilled_p_mean=mean_known(p for p, _ in splits),
        prefilled_d_mean=mean_known(d for _, d in splits),
        bytes_p_to_d_mean=mean_known(
            float(r.kv.bytes_to_decode) if r.kv and disaggregated else None for r in ok
        ),
        bytes_d_to_p_mean=mean_known(
            None if r.returned_bytes is None else float(r.returned_bytes)
            for r in records if r.result.ok
        ),
        history_hit_mean=mean_known(history_hit(r, index) for r in records),
        answer_hit_mean=mean_known(answer_hit(r, index) for r in records),
    )  # fmt: skip


def by_mode_shape(records: list[TurnRecord]) -> dict[tuple[str, str], list[TurnRecord]]:
    out: dict[tuple[str, str], list[TurnRecord]] = {}
    for r in records:
        out.setdefault((r.mode, r.shape), []).append(r)
    return out


def per_turn(records: list[TurnRecord], disaggregated: dict[str, bool]) -> list[Stats]:
    """One row per (mode, shape, turn index), in the order the modes first appear."""
    rows = []
    index = history_index(records)
    for (mode, shape), recs in by_mode_shape(records).items():
        for turn in sorted({r.turn for r in recs}):
            of_turn = [r for r in recs if r.turn == turn]
            rows.append(
                stats_of(mode, shape, str(turn), of_turn, disaggregated.get(mode, False), index)
            )
    return rows


def summary(
    records: list[TurnRecord], disaggregated: dict[str, bool], min_turn: int = SUMMARY_MIN_TURN
) -> list[Stats]:
    """One row per (mode, shape) over the turns with index >= `min_turn`."""
    index = history_index(records)
    return [
        stats_of(mode, shape, f">={min_turn}", [r for r in recs if r.turn >= min_turn],
                 disaggregated.get(mode, False), index)
        for (mode, shape), recs in by_mode_shape(records).items()
    ]  # fmt: skip


def ratios(rows: list[Stats]) -> dict[str, dict[str, float]]:
    """shape -> {ratio name: value} for the RATIOS whose modes both ran."""
    by = {(s.mode, s.shape): s for s in rows}
    out: dict[str, dict[str, float]] = {}
    for shape in dict.fromkeys(s.shape for s in rows):
        entry: dict[str, float] = {}
        for name, num, den, stat in RATIOS:
            a, b = by.get((num, shape)), by.get((den, shape))
            va = getattr(a, stat) if a else None
            vb = getattr(b, stat) if b else None
            if va is not None and vb:
                entry[name] = va / vb
        out[shape] = entry
    return out


@dataclass
class BlockBound:
    """Blocks moved per turn against the bound the design sets, over turns >= 1 of a mode/shape.

    P->D: at most the blocks of the tokens that are new since the previous turn's
    prompt and answer (the prompt alone where the client did not send the answer back as
    generated), plus one (the partial block they start in). D->P: at most
    the blocks of what D computed (the answer; on a short append also the new
    input) plus one (the block holding the end of what P computed).
    """

    mode: str
    shape: str
    way: str
    n: int
    mean_blocks: float
    mean_bound: float
    over: int
    """Turns that moved more blocks than their bound."""
    max_excess: int


def block_bounds(
    records: list[TurnRecord], bytes_per_block: int, block_size: int
) -> list[BlockBound]:
    index = history_index(records)
    rows = []
    for (mode, shape), recs in by_mode_shape(records).items():
        pairs: dict[str, list[tuple[int, int]]] = {"P→D": [], "D→P": []}
        for r in recs:
            prev = index.get((r.mode, r.shape, r.repetition, r.session, r.turn - 1))
            if prev is None or not (prev.result.ok and r.result.ok):
                continue
            if r.result.kv is not None and r.result.kv.bytes_to_decode:
                new = (
                    r.result.prompt_tokens - prev.result.prompt_tokens - _answer_in_history(r, prev)
                )
                pairs["P→D"].append(
                    (
                        r.result.kv.bytes_to_decode // bytes_per_block,
                        -(-max(new, 0) // block_size) + 1,
                    )
                )
            if r.returned_bytes:
                # what D computed: the answer, and the prompt's tail on a short append
                on_d = r.result.completion_tokens + (
                    r.result.kv.decode_computed_tokens if r.result.kv else 0
                )
                pairs["D→P"].append(
                    (r.returned_bytes // bytes_per_block, -(-on_d // block_size) + 1)
                )
        for way, got in pairs.items():
            if got:
                excess = [moved - bound for moved, bound in got]
                rows.append(BlockBound(
                    mode, shape, way, len(got), float(np.mean([m for m, _ in got])),
                    float(np.mean([b for _, b in got])), sum(e > 0 for e in excess),
                    max(excess),
                ))  # fmt: skip
    return rows


def bounds_table(rows: list[BlockBound]) -> list[str]:
    return markdown_table(
        ["mode", "shape", "way", "turns", "blocks/turn", "bound/turn", "over bound", "max excess"],
        [[b.mode, b.shape, b.way, b.n, b.mean_blocks, b.mean_bound, b.over, b.max_excess]
         for b in rows],
    )  # fmt: skip


_COLS = ("n", "errors", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "e2e_p50_ms",
         "prompt_tokens_mean", "cached_tokens_mean", "prefilled_p_mean", "prefilled_d_mean")  # fmt: skip


def _kib(v: float | None) -> float | None:
    return None if v is None else v / 1024


def stats_table(rows: list[Stats]) -> list[str]:
    header = ["mode", "shape", "turn", *_COLS, "KiB P→D/req", "KiB D→P/req", "history hit",
              "answer hit"]  # fmt: skip
    body: list[list[object]] = [
        [s.mode, s.shape, s.turn, *(getattr(s, c) for c in _COLS), _kib(s.bytes_p_to_d_mean),
         _kib(s.bytes_d_to_p_mean), s.history_hit_mean, s.answer_hit_mean]
        for s in rows
    ]  # fmt: skip
    return markdown_table(header, body)


def kv_table(kv_by_mode: dict[str, dict[str, float | None]]) -> list[str]:
    """mode/shape -> {p_to_d_bytes, d_to_p_bytes} summed over the runs (all turns)."""
    body: list[list[object]] = [
        [key, _mib(v.get("p_to_d_bytes")), _mib(v.get("d_to_p_bytes"))]
        for key, v in kv_by_mode.items()
    ]
    return markdown_table(["mode / shape", "MiB P→D (all turns)", "MiB D→P (all turns)"], body)


def _mib(v: float | None) -> float | None:
    return None if v is None else v / 2**20


def markdown(
    turns: list[Stats],
    summ: list[Stats],
    ratio: dict[str, dict[str, float]],
    kv_by_mode: dict[str, dict[str, float | None]],
    notes: list[str],
    bounds: list[BlockBound] | None = None,
    floors: list[str] | None = None,
    sections: list[str] | None = None,
) -> str:
    """The whole report as Markdown: notes, summary, ratios, `floors` (Markdown lines from
    `agentic_floors.floor_lines`), KV moved, `sections` (Markdown lines, e.g. from
    `agentic_by_turn`), per-turn rows."""
    lines = [f"- {n}" for n in notes]
    lines += ["", f"Summary over turns >= {SUMMARY_MIN_TURN} (ms, tokens per request):", ""]
    lines += stats_table(summ)
    for shape, entry in ratio.items():
        if entry:
            lines += ["", f"Ratios ({shape}, p50, turns >= {SUMMARY_MIN_TURN}):", ""]
            lines += markdown_table(["ratio", "value"], [[k, v] for k, v in entry.items()])
    lines += floors or []
    if kv_by_mode:
        lines += ["", "KV moved (instances' /metrics):", "", *kv_table(kv_by_mode)]
    if bounds:
        lines += ["", "Blocks moved per turn against their bound (turns >= 1):", ""]
        lines += bounds_table(bounds)
    lines += sections or []
    lines += ["", "Per turn index:", "", *stats_table(turns)]
    return "\n".join(lines)


def ratio_lines(ratio: dict[str, dict[str, float]]) -> list[str]:
    """One printable line per shape with its ratios."""
    return [
        f"{shape}: " + ", ".join(f"{k} {v:.2f}" for k, v in entry.items())
        for shape, entry in ratio.items()
        if entry
    ]


def plot_ttft(turns: list[Stats], path: Path) -> Path | None:
    """PNG of TTFT by turn index, one line per mode (p50 solid, p90 dashed), one panel per
    shape.

    None (and no file) when matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    shapes = list(dict.fromkeys(s.shape for s in turns))
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        for mode in dict.fromkeys(s.mode for s in turns if s.shape == shape):
            pts = [(int(s.turn), s.ttft_p50_ms, s.ttft_p90_ms) for s in turns
                   if s.shape == shape and s.mode == mode and s.ttft_p50_ms is not None]  # fmt: skip
            if pts:
                xs, p50, p90 = zip(*pts, strict=True)
                (line,) = ax.plot(xs, p50, marker="o", label=mode)
                ax.plot(xs, p90, linestyle="--", linewidth=0.8, color=line.get_color())
        ax.set_title(f"{shape}: TTFT p50 (p90 dashed) by turn")
        ax.set_xlabel("turn index")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("TTFT (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
