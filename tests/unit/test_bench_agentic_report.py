"""The multi-turn report: per-turn rows, the turns >= 3 summary, ratios, KV attribution,
fitting the local run to its time budget, and which router flags a mode needs."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvduplex.bench import agentic_floors as floors
from kvduplex.bench import agentic_report as report
from kvduplex.bench.agentic import TurnRecord
from kvduplex.bench.agentic_matrix import COSTS
from kvduplex.bench.agentic_matrix import estimate_total_s
from kvduplex.bench.agentic_matrix import fit_to_budget
from kvduplex.bench.agentic_modes import MODES
from kvduplex.bench.agentic_modes import modes_named
from kvduplex.bench.agentic_modes import router_args
from kvduplex.bench.client import KVUsage
from kvduplex.bench.client import RequestResult
from kvduplex.bench.kvmetrics import BYTES
from kvduplex.bench.kvmetrics import ENGINE_TTFT
from kvduplex.bench.kvmetrics import Instance
from kvduplex.bench.kvmetrics import kv_moved
from kvduplex.bench.workload import AGENTIC
from kvduplex.bench.workload import REASONING
from kvduplex.bench.workload import WorkloadConfig


def _rec(mode: str, turn: int, ttft: float, *, session: int = 0, ok: bool = True,
         kv: KVUsage | None = None, prompt: int = 100, cached: int = 60,
         shape: str = "agentic") -> TurnRecord:  # fmt: skip
    res = RequestResult(
        ok=ok, ttft_s=ttft, tpot_s=ttft / 10, e2e_s=ttft * 2, prompt_tokens=prompt,
        cached_tokens=cached, kv=kv, error="" if ok else "HTTP 500",
    )  # fmt: skip
    return TurnRecord(mode, shape, 0, session, turn, 0.0, 10, 5, 0.0, res)


def test_per_turn_has_one_row_per_mode_shape_and_turn() -> None:
    recs = [_rec(m, t, 0.1 * (t + 1), session=s) for m in ("colocated", "push")
            for t in range(4) for s in range(3)]  # fmt: skip
    recs.append(_rec("push", 2, 9.0, session=3, ok=False))
    rows = report.per_turn(recs, {"colocated": False, "push": True})
    assert [(r.mode, r.turn) for r in rows] == [(m, str(t)) for m in ("colocated", "push") for t in range(4)]
    push2 = next(r for r in rows if r.mode == "push" and r.turn == "2")
    assert (push2.n, push2.errors) == (3, 1)
    assert push2.ttft_p50_ms == pytest.approx(300.0)  # the failed request's 9 s is not counted
    assert push2.tpot_p50_ms == pytest.approx(30.0)


def test_percentiles_interpolate_like_numpy() -> None:
    recs = [_rec("push", 3, t, session=i) for i, t in enumerate([1.0, 2.0, 3.0, 4.0, 10.0])]
    (row,) = report.summary(recs, {"push": True})
    assert row.ttft_p50_ms == pytest.approx(3000.0)
    assert row.ttft_p90_ms == pytest.approx(7600.0)  # 4 + 0.6 * (10 - 4) seconds


def test_summary_covers_turns_from_three_on() -> None:
    recs = [_rec("push", t, float(t), session=s) for t in range(6) for s in range(2)]
    (row,) = report.summary(recs, {"push": True})
    assert row.turn == ">=3" and row.n == 6
    assert row.ttft_p50_ms == pytest.approx(4000.0)


def test_prefill_split_prefers_usage_kv() -> None:
    kv = KVUsage(prefill_computed_tokens=30, decode_computed_tokens=2, bytes_to_decode=4096)
    with_kv = RequestResult(ok=True, prompt_tokens=100, cached_tokens=68, kv=kv)
    assert report.prefill_split(with_kv, disaggregated=True) == (30.0, 2.0)
    assert report.prefill_split(with_kv, disaggregated=False) == (32.0, None)
    without = RequestResult(ok=True, prompt_tokens=100, cached_tokens=68)
    assert report.prefill_split(without, disaggregated=True) == (32.0, None)
    assert report.prefill_split(without, disaggregated=False) == (32.0, None)


def test_means_of_prefilled_tokens_and_bytes() -> None:
    kv = [KVUsage(40, 0, 1000), KVUsage(20, 4, 3000)]
    recs = [_rec("push", 3, 1.0, session=i, kv=k) for i, k in enumerate(kv)]
    (row,) = report.summary(recs, {"push": True})
    assert (row.prefilled_p_mean, row.prefilled_d_mean) == (30.0, 2.0)
    assert row.bytes_p_to_d_mean == 2000.0
    (colo,) = report.summary([_rec("colocated", 3, 1.0, kv=kv[0])], {"colocated": False})
    assert colo.bytes_p_to_d_mean is None and colo.prefilled_d_mean is None
    (bare,) = report.summary([_rec("x", 3, 1.0)], {"x": True})
    assert bare.prefilled_p_mean == 40.0 and bare.prefilled_d_mean is None
    assert bare.bytes_p_to_d_mean is None


def test_ratios_between_modes_that_ran() -> None:
    recs = [_rec("colocated", 3, 2.0), _rec("push", 3, 4.0), _rec("push+duplex", 3, 3.0),
            _rec("push", 3, 8.0, shape="reasoning")]  # fmt: skip
    ratio = report.ratios(report.summary(recs, {}))
    assert ratio["agentic"]["ttft push+duplex / colocated"] == pytest.approx(1.5)
    assert ratio["agentic"]["ttft push+duplex / push"] == pytest.approx(0.75)
    assert ratio["agentic"]["tpot push+duplex / push"] == pytest.approx(0.75)
    assert "ttft push+duplex / push+return-pull" not in ratio["agentic"]
    assert ratio["reasoning"] == {}


def test_markdown_and_plot(tmp_path: Path) -> None:
    recs = [_rec(m, t, 0.1 * (t + 1)) for m in ("colocated", "push") for t in range(4)]
    turns, summ = report.per_turn(recs, {}), report.summary(recs, {})
    kv = {"push / agentic": {"p_to_d_bytes": 2.0**20, "d_to_p_bytes": None}}
    text = report.markdown(turns, summ, report.ratios(summ), kv, ["a note"])
    assert text.startswith("- a note")
    assert "| push / agentic | 1.00 | n/a |" in text
    assert text.count("| push | agentic |") == 5  # 4 turns + the summary row
    png = report.plot_ttft(turns, tmp_path / "p.png")
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG"


def _samples(**by_direction: float) -> dict:
    return {(BYTES, (("direction", d),)): v for d, v in by_direction.items()}


def test_kv_bytes_each_way_follow_the_instance_roles() -> None:
    p, d = Instance("http://p", "prefill"), Instance("http://d", "decode")
    before = {"http://p": _samples(write=100, read=0), "http://d": _samples(write=0, read=10)}
    after = {"http://p": _samples(write=600, read=7), "http://d": _samples(write=40, read=30)}
    ret = ("kvduplex_kv_return_bytes_total", (("direction", "sent"),))
    after["http://d"][ret] = 40.0
    moved = kv_moved([p, d], before, after)
    assert moved.p_to_d_bytes == 500 + 20  # P's WRITEs (push) and D's READs (pull)
    assert moved.d_to_p_bytes == 40 + 7  # D's WRITEs (duplex) and P's READs (return by pull)
    assert moved.per_instance["http://d"]["kvduplex_kv_return_bytes_total{direction=sent}"] == 40.0


def test_kv_bytes_are_unknown_without_the_counter() -> None:
    inst = [Instance("http://p", "prefill")]
    moved = kv_moved(inst, {"http://p": {}}, {"http://p": {}})
    assert moved.p_to_d_bytes is None and moved.d_to_p_bytes is None
    colo = kv_moved([Instance("http://c", "both")], {}, {"http://c": _samples(write=5)})
    assert colo.p_to_d_bytes is None


def test_fit_keeps_the_workload_when_it_fits_and_scales_it_when_not() -> None:
    configs = [WorkloadConfig(shape=AGENTIC), WorkloadConfig(shape=REASONING)]
    cost = COSTS["small"]
    same, est, notes = fit_to_budget(configs, 8, 1, cost, budget_s=1e9)
    assert same == configs and notes == []
    assert est == pytest.approx(estimate_total_s(configs, 8, 1, cost))
    fitted, est2, notes2 = fit_to_budget(configs, 8, 1, cost, budget_s=45 * 60)
    assert est2 <= 45 * 60 < est
    assert notes2 and "answers x" in notes2[0]
    assert fitted[1].shape.answer_tokens[1] < REASONING.answer_tokens[1]
    assert all(c.num_turns >= 5 for c in fitted)


def test_router_flags_of_a_mode() -> None:
    duplex, push = modes_named(["push+duplex", "push"])
    assert router_args(duplex, {"--mode"}) == "the router does not know --return-mode"
    assert router_args(duplex, {"--return-mode"}) == ("--return-mode", "push")
    assert router_args(push, {"--mode"}) == ()  # the default is not restated to an old router
    assert router_args(push, {"--return-mode"}) == ("--return-mode", "none")
    short = next(m for m in MODES if m.name == "push+duplex+short")
    assert router_args(short, {"--return-mode", "--short-append-tokens"}) == (
        "--return-mode", "push", "--short-append-tokens", "256",
    )  # fmt: skip
    with pytest.raises(ValueError, match="unknown modes"):
        modes_named(["push+magic"])


def test_history_hit_is_the_share_of_the_previous_turn_found_cached() -> None:
    t0 = _rec("push", 0, 1.0, prompt=100, cached=0)
    t0.result.completion_tokens = 60
    t1 = _rec("push", 1, 1.0, prompt=200, cached=120)
    (row,) = [r for r in report.per_turn([t0, t1], {"push": True}) if r.turn == "1"]
    assert row.history_hit_mean == pytest.approx(120 / 160)
    assert report.per_turn([t0, t1], {"push": True})[0].history_hit_mean is None


def test_block_bounds_count_turns_that_moved_more_than_new_or_answer_blocks() -> None:
    bpb, bs = 1000, 16
    t0 = _rec("push+duplex", 0, 1.0, prompt=100, cached=0)
    t0.result.completion_tokens = 40
    # 60 new tokens since turn 0's prompt and answer: at most 4 + 1 blocks P->D
    fine = _rec("push+duplex", 1, 1.0, prompt=200, kv=KVUsage(60, 0, 5 * bpb))
    fine.result.completion_tokens = 32
    fine.returned_bytes = 3 * bpb  # answer of 2 blocks, plus one
    over = _rec("push+duplex", 1, 1.0, session=1, prompt=200, kv=KVUsage(60, 0, 9 * bpb))
    over.result.completion_tokens = 32
    over.returned_bytes = 5 * bpb
    t0b = _rec("push+duplex", 0, 1.0, session=1, prompt=100, cached=0)
    t0b.result.completion_tokens = 40
    rows = {b.way: b for b in report.block_bounds([t0, fine, t0b, over], bpb, bs)}
    assert (rows["P→D"].n, rows["P→D"].over, rows["P→D"].max_excess) == (2, 1, 4)
    assert (rows["D→P"].n, rows["D→P"].over, rows["D→P"].max_excess) == (2, 1, 2)


def test_answer_hit_is_the_share_of_the_previous_answer_found_cached() -> None:
    t0 = _rec("push", 0, 1.0, prompt=100, cached=0)
    t0.result.completion_tokens = 40
    returned = _rec("push", 1, 1.0, prompt=200, cached=132)  # 32 of the 40 answer tokens
    lost = _rec("push", 1, 1.0, session=1, prompt=200, cached=96)  # not even all the prompt
    t0b = _rec("push", 0, 1.0, session=1, prompt=100, cached=0)
    t0b.result.completion_tokens = 40
    index = report.history_index([t0, returned, lost, t0b])
    assert report.answer_hit(returned, index) == pytest.approx(0.8)
    assert report.answer_hit(lost, index) == 0.0
    assert report.answer_hit(t0, index) is None


def test_an_answer_not_sent_back_is_neither_history_nor_a_hit_and_its_tokens_count_as_new() -> None:
    """A client that strips an answer's reasoning (or rewrites it) sends a prompt without
    it: there is no answer to hit, and the whole prompt past the previous one is new to D."""
    bpb, bs = 1000, 16
    t0 = _rec("push", 0, 1.0, prompt=100, cached=0)
    t0.result.completion_tokens = 80
    # 40 new tokens after turn 0's prompt (its 80-token answer left out): 3 + 1 blocks P->D
    stripped = _rec("push", 1, 1.0, prompt=140, cached=96, kv=KVUsage(44, 0, 4 * bpb))
    stripped.previous_sent_back = False
    index = report.history_index([t0, stripped])
    assert report.answer_hit(stripped, index) is None
    assert report.history_hit(stripped, index) == pytest.approx(96 / 100)
    (row,) = report.block_bounds([t0, stripped], bpb, bs)
    assert (row.way, row.over, row.mean_bound) == ("P→D", 0, 4)
    stripped.previous_sent_back = True  # read as sent back, the bound would be 0 + 1 blocks
    (row,) = report.block_bounds([t0, stripped], bpb, bs)
    assert (row.over, row.max_excess) == (1, 3)


def _engine_ttft(sum_s: float, count: float) -> dict:
    return {(ENGINE_TTFT + "_sum", ()): sum_s, (ENGINE_TTFT + "_count", ()): count}


def test_engine_ttft_counts_only_the_instances_that_compute_prompts() -> None:
    p, d = Instance("http://p", "prefill"), Instance("http://d", "decode")
    before = {"http://p": _engine_ttft(1.0, 2), "http://d": _engine_ttft(0.5, 2)}
    after = {"http://p": _engine_ttft(2.5, 5), "http://d": _engine_ttft(9.0, 5)}
    moved = kv_moved([p, d], before, after)
    assert (moved.engine_ttft_s, moved.engine_ttft_count) == (1.5, 3)  # D's TTFT is not a prefill
    colo = kv_moved([Instance("http://c", "both")], {}, {"http://c": _engine_ttft(0.4, 2)})
    assert (colo.engine_ttft_s, colo.engine_ttft_count) == (0.4, 2)
    assert kv_moved([p], {}, {"http://p": {}}).engine_ttft_count is None


def test_where_ttft_goes_and_the_floor_ratio() -> None:
    recs = [_rec("push", t, 0.5) for t in range(4)] + [_rec("push+duplex", t, 0.3) for t in range(4)]
    runs = [
        {"mode": "push", "shape": "agentic", "engine_ttft_s": 1.6, "engine_ttft_count": 4},
        {"mode": "push+duplex", "shape": "agentic", "engine_ttft_s": 0.8, "engine_ttft_count": 4},
    ]
    rows = floors.engine_times(recs, runs)
    push = next(r for r in rows if r.mode == "push")
    assert (push.n, push.client_ttft_mean_ms, push.engine_ttft_mean_ms) == (4, 500.0, 400.0)
    assert push.outside_ms == pytest.approx(100.0)
    (ratio,) = floors.engine_ratios(rows)
    assert ratio[:2] == ["agentic", "push+duplex / push"]
    assert ratio[2] == pytest.approx(0.6) and ratio[3] == pytest.approx(0.5)
    text = "\n".join(floors.engine_time_lines(rows))
    assert "engine (floor)" in text and "| push+duplex / push |" in text
    assert floors.engine_time_lines(floors.engine_times(recs, [])) == []  # an endpoint: none


def _decoding(mode: str, turn: int, start: float, ttft: float, e2e: float, tpot: float,
              rep: int = 0) -> TurnRecord:  # fmt: skip
    res = RequestResult(ok=True, ttft_s=ttft, tpot_s=tpot, e2e_s=e2e, prompt_tokens=10)
    return TurnRecord(mode, "agentic", rep, turn, turn, 0.0, 10, 5, start, res)


def test_decodes_at_once_weigh_each_overlap_by_its_time() -> None:
    a = _decoding("push", 3, 0.0, 1.0, 5.0, 0.1)  # decodes 1..5
    b = _decoding("push", 4, 2.0, 1.0, 3.0, 0.1)  # decodes 3..5: half of a's decode
    c = _decoding("push", 5, 10.0, 1.0, 2.0, 0.1)  # alone
    load = floors.decodes_at_once([a, b, c])
    assert load[id(a)] == pytest.approx(1.5) and load[id(b)] == pytest.approx(2.0)
    assert load[id(c)] == pytest.approx(1.0)


def test_tpot_at_equal_load_takes_out_what_load_explains() -> None:
    # push: TPOT = 10 + 20 * decodes at once; duplex runs at a higher load on the same line,
    # plus 5% of its own: measured it is far above push, at equal load only 5% above.
    def run(mode: str, extra: float, loads: range) -> list[TurnRecord]:
        recs = []
        for k in loads:  # k requests decoding together over the same second
            tpot = (10 + 20 * k) * extra / 1e3
            recs += [_decoding(mode, 3, 100.0 * k, 1.0, 2.0, tpot) for _ in range(k)]
        return recs

    rows = floors.decode_loads(run("push", 1.0, range(1, 5)) + run("push+duplex", 1.05, range(3, 5)))
    push = next(r for r in rows if r.mode == "push")
    assert push.fit == pytest.approx((10.0, 20.0))
    assert push.tpot_at_ms(3.0) == pytest.approx(70.0)
    (ratio,) = floors.load_ratios(rows)
    assert ratio[:2] == ["agentic", "tpot push+duplex / push"]
    assert ratio[2:] == [pytest.approx(85.5 / 70, rel=1e-3), pytest.approx(1.05)]
    text = "\n".join(floors.decode_load_lines(rows))
    assert "at equal load" in text and "| push+duplex |" in text
    assert floors.decode_loads([_decoding("push", 1, 0.0, 1.0, 2.0, 0.1)]) == []  # turns < 3
