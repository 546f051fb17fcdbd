"""Prompt tokens by source and pool sizes from /metrics, and the report by turn index."""

from __future__ import annotations

from kvduplex.bench import agentic_by_turn as by_turn
from kvduplex.bench import agentic_report as report
from kvduplex.bench.agentic import TurnRecord
from kvduplex.bench.client import KVUsage
from kvduplex.bench.client import RequestResult
from kvduplex.bench.prompt_sources import Samples
from kvduplex.bench.prompt_sources import pool_tokens
from kvduplex.bench.prompt_sources import prompt_sources
from kvduplex.bench.prompt_sources import sources_by_role


def _kvduplex(computed: float, hit: float, received: float | None = None) -> Samples:
    out: Samples = {
        ("kvduplex_request_prompt_computed_tokens_sum", ()): computed,
        ("kvduplex_prefix_cache_hit_tokens_total", ()): hit,
    }
    if received is not None:
        out[("kvduplex_kv_received_tokens_total", ())] = received
    return out


def test_kvduplex_counters_read_as_vllms_sources() -> None:
    p = prompt_sources(_kvduplex(100, 40), _kvduplex(400, 1040))
    assert p == {"local_compute": 300, "local_cache_hit": 1000}
    d = prompt_sources(_kvduplex(0, 0, 0), _kvduplex(8, 900, 300))
    assert d == {"local_compute": 8, "local_cache_hit": 900, "external_kv_transfer": 300}
    answers = "kvduplex_router_answer_tokens_total"
    router: Samples = {(answers, (("outcome", "hit"),)): 90.0, (answers, (("outcome", "miss"),)): 10.0}
    assert prompt_sources({}, router) == {"returned_answer_hit": 90, "returned_answer_miss": 10}
    assert prompt_sources({}, {("process_cpu_seconds_total", ()): 3.0}) == {}


def test_a_servers_own_sources_are_read_as_they_are() -> None:
    name = "vllm:prompt_tokens_by_source_total"

    def vllm(compute: float, hit: float, disk: float) -> Samples:
        return {
            (name, (("engine", "0"), ("source", "local_compute"))): compute,
            (name, (("engine", "1"), ("source", "local_compute"))): compute,
            (name, (("engine", "0"), ("source", "local_cache_hit"))): hit,
            (name, (("engine", "0"), ("source", "disk"))): disk,
            ("kvduplex_prefix_cache_hit_tokens_total", ()): 7.0,  # not read: the family wins
        }

    got = prompt_sources(vllm(10, 0, 0), vllm(60, 200, 30))
    assert got == {"local_compute": 100, "local_cache_hit": 200, "disk": 30}


def test_sources_add_up_per_role() -> None:
    roles = {"http://p1": "prefill", "http://p2": "prefill", "http://d": "decode", "http://r": "router"}
    after = {"http://p1": _kvduplex(10, 5), "http://p2": _kvduplex(20, 0), "http://d": _kvduplex(1, 2, 30)}
    got = sources_by_role(roles, {}, after)
    assert got == {
        "prefill": {"local_compute": 30, "local_cache_hit": 5},
        "decode": {"local_compute": 1, "local_cache_hit": 2, "external_kv_transfer": 30},
    }  # the router exposed nothing


def test_pool_tokens_from_kvduplex_or_vllm_metrics() -> None:
    assert pool_tokens({("kvduplex_kv_blocks_total", ()): 256.0}, 16) == 4096
    assert pool_tokens({("kvduplex_kv_blocks_total", ()): 256.0}, None) is None
    info = ("vllm:cache_config_info", (("block_size", "16"), ("num_gpu_blocks", "5691")))
    assert pool_tokens({info: 1.0}, None) == 5691 * 16
    bad = ("vllm:cache_config_info", (("block_size", "16"), ("num_gpu_blocks", "None")))
    assert pool_tokens({bad: 1.0}, None) is None
    assert pool_tokens({}, 16) is None


def _rec(mode: str, turn: int, session: int, ttft: float, kv: KVUsage | None = None) -> TurnRecord:
    res = RequestResult(ok=True, ttft_s=ttft, prompt_tokens=1000, cached_tokens=900, kv=kv)
    return TurnRecord(mode, "coding_agent", 0, session, turn, 0.0, 10, 5, 0.0, res)


def test_source_rows_are_tokens_per_request_and_the_share_not_computed() -> None:
    recs = [_rec("push", t, s, 1.0) for t in range(2) for s in range(2)]
    runs = [
        {"mode": "push", "shape": "coding_agent", "sources": {
            "prefill": {"local_compute": 400, "local_cache_hit": 3600, "returned_answer_hit": 800},
            "decode": {"local_cache_hit": 3000, "external_kv_transfer": 1000},
        }},
        {"mode": "push", "shape": "coding_agent", "sources": {}},
    ]  # fmt: skip
    rows = {r.role: r for r in by_turn.source_rows(recs, runs)}
    assert rows["prefill"].requests == 4
    assert rows["prefill"].tokens == {"local_compute": 100, "local_cache_hit": 900, "returned_answer_hit": 200}
    assert rows["prefill"].not_computed_share == 0.9  # the returned answers are part of the hits
    assert rows["decode"].not_computed_share is None  # no local_compute counted
    text = "\n".join(by_turn.source_lines(list(rows.values())))
    assert "| local_compute | local_cache_hit | external_kv_transfer | returned_answer_hit |" in text
    assert "| push / coding_agent | prefill | 4 | 100 | 900 | n/a | 200 | 0.90 |" in text
    assert by_turn.source_lines([]) == []


def test_by_turn_puts_the_modes_side_by_side() -> None:
    recs = [_rec("push", t, s, 0.1 * (t + 1) * (s + 1), KVUsage(50, 2, 0)) for t in range(3) for s in range(2)]
    recs += [_rec("push+duplex", t, 0, 0.05, KVUsage(20, 0, 0)) for t in range(2)]
    turns = report.per_turn(recs, {"push": True, "push+duplex": True})
    text = "\n".join(by_turn.by_turn_lines(turns))
    assert "| turn | n | push TTFT p50 | push p90 | push prefilled | push+duplex TTFT p50 |" in text
    # turn 1: push's two sessions took 0.2 and 0.4 s; duplex ran one session, to turn 1
    assert "| 1 | 2 | 300 | 380 | 52 | 50 | 50 | 20 |" in text
    assert "| 2 | 2 | 450 | 570 | 52 | n/a | n/a | n/a |" in text
