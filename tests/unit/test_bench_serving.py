"""The serving benchmark's summary: ratios between modes from per-request results."""

from __future__ import annotations

import pytest

from kvduplex.bench.client import RequestResult
from kvduplex.bench.serving import Cell
from kvduplex.bench.serving import summarize


def _cell(mode: str, load: str, ttfts: list[float], handoffs: list[float] | None = None) -> Cell:
    results = [RequestResult(ok=True, ttft_s=t, e2e_s=t + 1.0, tpot_s=0.01) for t in ttfts]
    return Cell(mode, 512, load, results=results, handoff_s=handoffs or [])


def test_queue_floor_comes_from_low_load_handoffs() -> None:
    cells = [
        _cell("colocated", "low", [2.0], [0.01]),
        _cell("pull", "low", [2.3], [0.31]),
        _cell("push", "low", [2.02], [0.03]),
        _cell("colocated", "queue", [6.0, 6.0]),
        _cell("pull", "queue", [6.3, 6.3]),
        _cell("push", "queue", [6.0, 6.0]),
    ]
    _, ratios = summarize(cells)
    low, queue = (next(r for r in ratios if r["load"] == load) for load in ("low", "queue"))
    assert "push_p90_over_pull_floor" not in low
    # prefill = 2.0 - 0.01; floor = (1.99 + 0.03) / (1.99 + 0.31)
    assert queue["push_p90_over_pull_floor"] == pytest.approx(2.02 / 2.30)
    assert queue["push_p90_ttft_over_pull"] == pytest.approx(6.0 / 6.3)
    assert low["push_overhead_over_pull_engine"] == pytest.approx(0.02 / 0.30)


def test_queue_floor_needs_the_low_load_in_the_same_run() -> None:
    cells = [_cell(m, "queue", [5.0]) for m in ("colocated", "pull", "push")]
    _, ratios = summarize(cells)
    assert "push_p90_over_pull_floor" not in ratios[0]


def test_percentiles_interpolate_over_successful_requests() -> None:
    cell = _cell("push", "low", [1.0, 2.0, 3.0, 4.0, 5.0], [0.1, 0.3])
    cell.results.append(RequestResult(ok=False, ttft_s=100.0))
    assert cell.stat("ttft_s", 50) == pytest.approx(3.0)
    assert cell.stat("ttft_s", 90) == pytest.approx(4.6)
    assert cell.handoff(50) == pytest.approx(0.2)
    assert _cell("push", "low", []).stat("ttft_s", 50) == 0.0
    assert _cell("push", "low", [1.0]).handoff(50) is None
