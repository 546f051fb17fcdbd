"""Scheduler lifecycle over a fake model, as numbered steps: schedule, execute, update.

The fake model keeps a fake KV cache (block -> slot -> (position, token)) and
computes each next token from the tokens it READS BACK from the KV cache
through the block table, so a wrong block table, a bad prefix-cache hit or a
missing remote write changes the generated sequence (or fails loudly).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from kvduplex.common.engine_config import SchedulerConfig
from kvduplex.common.sampling import SamplingParams
from kvduplex.engine.block_pool import BlockPool
from kvduplex.engine.kv_manager import KVCacheManager
from kvduplex.engine.request import FinishReason
from kvduplex.engine.request import RemoteKVSpec
from kvduplex.engine.request import Request
from kvduplex.engine.request import RequestStatus
from kvduplex.engine.scheduler import Scheduler
from kvduplex.engine.scheduler import SchedulerOutput

BS = 4
EOS = 1


def next_token(tokens: list[int]) -> int:
    """Deterministic fake LM: a function of every previous token; never EOS (1) or 0."""
    acc = 17
    for t in tokens:
        acc = (acc * 31 + t) % 1_000_003
    return 2 + acc % 97


def reference(prompt: list[int], n: int) -> list[int]:
    tokens, out = list(prompt), []
    for _ in range(n):
        out.append(next_token(tokens))
        tokens.append(out[-1])
    return out


def params(max_tokens: int = 8, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, extra_eos_token_ids=(EOS,), **kw)  # type: ignore[arg-type]


class Harness:
    def __init__(
        self,
        num_blocks: int = 64,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 64,
        chunked: bool = True,
        threshold: int = 0,
        caching: bool = True,
        prefill_with_decodes: int = 0,
    ) -> None:
        self.pool = BlockPool(num_blocks, enable_caching=caching)
        self.kv = KVCacheManager(self.pool, BS, b"fake-model")
        self.sched = Scheduler(
            SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                enable_chunked_prefill=chunked,
                long_prefill_token_threshold=threshold,
                max_prefill_tokens_with_decodes=prefill_with_decodes,
            ),
            self.kv,
        )
        self.kv_store: dict[int, dict[int, tuple[int, int]]] = {}
        self.clock = 0.0
        # What a runner holds, built from the steps' deltas alone; the fake model
        # reads and writes KV through these tables, not the requests' own.
        self.tables: dict[str, list[int]] = {}

    def add(
        self, rid: str, prompt: list[int], sp: SamplingParams | None = None, **kw: object
    ) -> Request:
        self.clock += 1.0
        r = Request(rid, prompt, sp or params(), arrival_time=self.clock, **kw)  # type: ignore[arg-type]
        self.sched.add_request(r)
        return r

    def write(self, block_table: list[int], pos: int, token: int) -> None:
        block = block_table[pos // BS]
        # Never write into a block that is shared or registered in the prefix cache.
        assert self.pool.ref_count(block) == 1, f"write into shared block {block}"
        assert self.pool.key_of(block) is None, f"write into cached block {block}"
        self.kv_store.setdefault(block, {})[pos % BS] = (pos, token)

    def read(self, block_table: list[int], end: int) -> list[int]:
        tokens = []
        for pos in range(end):
            slot = self.kv_store.get(block_table[pos // BS], {}).get(pos % BS)
            assert slot is not None and slot[0] == pos, f"no KV for position {pos}"
            tokens.append(slot[1])
        return tokens

    def sync_tables(self, out: SchedulerOutput) -> None:
        for rid in out.dropped_table_ids:
            del self.tables[rid]  # only tables the runner was sent are dropped
        for seq in out.seqs:
            rid = seq.request_id
            if seq.replaces_table:
                self.tables[rid] = list(seq.new_block_ids)
            else:
                self.tables[rid].extend(seq.new_block_ids)
            req = self.sched.get_request(rid)
            assert req is not None, rid
            assert self.tables[rid] == req.block_ids, f"{rid}: runner table drifted"

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        self.sync_tables(out)
        sampled = {}
        for seq in out.seqs:
            table = self.tables[seq.request_id]
            assert len(table) * BS >= seq.start_pos + seq.num_new_tokens
            for i, t in enumerate(seq.token_ids):
                self.write(table, seq.start_pos + i, t)
            if seq.needs_sample:
                end = seq.start_pos + seq.num_new_tokens
                sampled[seq.request_id] = next_token(self.read(table, end))
        return sampled

    def step(self) -> tuple[SchedulerOutput, list[Request]]:
        out = self.sched.schedule()
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.seqs)
        assert len(out.seqs) <= self.sched.config.max_num_seqs
        finished = self.sched.update(out, self.execute(out))
        self.pool.check_integrity()
        return out, finished

    def run(self, max_steps: int = 500) -> int:
        for n in range(max_steps):
            if not self.sched.has_unfinished():
                return n
            self.step()
        raise AssertionError("requests did not finish")

    def send_remote(self, r: Request) -> int:
        """A fake sender fills the blocks the receiver lacks; returns its first token."""
        for pos in range(r.num_cached_tokens, r.num_prompt_tokens):
            self.write(r.block_ids, pos, r.prompt_token_ids[pos])
        return next_token(list(r.prompt_token_ids))

    def assert_no_leaks(self) -> None:
        self.pool.check_integrity()
        assert self.pool.stats().num_in_use == 0, self.pool.stats()
        assert not self.sched.has_unfinished()
        self.sync_tables(self.sched.schedule())  # an empty step still drops tables
        assert self.tables == {}, f"tables of finished requests kept: {sorted(self.tables)}"


def allocated(out: SchedulerOutput) -> list[str]:
    return [a.request_id for a in out.remote_kv_allocated]


def by_id(out: SchedulerOutput) -> dict[str, tuple[int, int, bool]]:
    return {s.request_id: (s.start_pos, s.num_new_tokens, s.needs_sample) for s in out.seqs}


# ---- batching ----


def test_continuous_batching_admits_while_others_decode() -> None:
    h = Harness()
    a = h.add("a", list(range(10, 16)), params(4))
    # 1. A prefills its 6 tokens and samples its first token.
    out, _ = h.step()
    assert by_id(out) == {"a": (0, 6, True)}
    # 2. B arrives; A decodes and B prefills in the same step, decodes first.
    b = h.add("b", list(range(20, 25)), params(3))
    out, _ = h.step()
    assert [s.request_id for s in out.seqs] == ["a", "b"]
    assert by_id(out) == {"a": (6, 1, True), "b": (0, 5, True)}
    # 3.. both run to completion with the tokens the model alone would produce.
    h.run()
    assert a.output_token_ids == reference(a.prompt_token_ids, 4)
    assert b.output_token_ids == reference(b.prompt_token_ids, 3)
    assert a.finish_reason is FinishReason.LENGTH and a.status is RequestStatus.FINISHED_LENGTH
    h.assert_no_leaks()


def test_prefill_tokens_are_capped_while_requests_decode() -> None:
    h = Harness(max_num_batched_tokens=64, prefill_with_decodes=8)
    a = h.add("a", list(range(10, 30)), params(4))
    b = h.add("b", list(range(40, 70)), params(3))
    # 1. Nothing decodes yet: the whole budget prefills (all of a, 44 tokens of b).
    out, _ = h.step()
    assert by_id(out) == {"a": (0, 20, True), "b": (0, 30, True)}
    c = h.add("c", list(range(100, 130)), params(2))
    # 2. a and b decode: c gets at most 8 prefill tokens in each step that decodes.
    out, _ = h.step()
    assert by_id(out) == {"a": (20, 1, True), "b": (30, 1, True), "c": (0, 8, False)}
    out, _ = h.step()
    assert by_id(out)["c"] == (8, 8, False)
    # 3. to completion, with the tokens the model alone would produce.
    h.run()
    for r, n in ((a, 4), (b, 3), (c, 2)):
        assert r.output_token_ids == reference(r.prompt_token_ids, n)
    h.assert_no_leaks()


def test_max_num_seqs_limits_running() -> None:
    h = Harness(max_num_seqs=2)
    reqs = [h.add(f"r{i}", [i + 5] * 3, params(3)) for i in range(3)]
    # 1. Two seats: the third waits.
    out, _ = h.step()
    assert set(by_id(out)) == {"r0", "r1"} and h.sched.num_waiting == 1
    # 2-3. Decodes until r0 and r1 finish; 4. r2 is admitted.
    h.step()
    _, finished = h.step()
    assert {r.request_id for r in finished} == {"r0", "r1"}
    out, _ = h.step()
    assert set(by_id(out)) == {"r2"}
    h.run()
    assert all(r.output_token_ids == reference(r.prompt_token_ids, 3) for r in reqs)
    h.assert_no_leaks()


def test_chunked_prefill_splits_under_budget() -> None:
    h = Harness(max_num_batched_tokens=8)
    d = h.add("d", [3, 4], params(6))
    # 1. D prefills and starts decoding.
    h.step()
    p = h.add("p", list(range(30, 50)), params(2))  # 20 tokens
    # 2-4. D's decode takes 1 token of the 8; P's chunks take the rest: 7, 7, 6.
    chunks = []
    for _ in range(3):
        out, _ = h.step()
        assert by_id(out)["d"][1] == 1 and out.num_batched_tokens <= 8
        chunks.append(by_id(out)["p"])
    assert chunks == [(0, 7, False), (7, 7, False), (14, 6, True)]
    h.run()
    assert p.output_token_ids == reference(p.prompt_token_ids, 2)
    assert d.output_token_ids == reference(d.prompt_token_ids, 6)
    h.assert_no_leaks()


def test_long_prefill_threshold_caps_chunks() -> None:
    h = Harness(max_num_batched_tokens=64, threshold=5)
    p = h.add("p", list(range(30, 42)), params(1))
    starts = []
    while h.sched.has_unfinished():
        out, _ = h.step()
        starts.append(by_id(out)["p"])
    assert starts == [(0, 5, False), (5, 5, False), (10, 2, True)]
    assert p.output_token_ids == reference(p.prompt_token_ids, 1)
    h.assert_no_leaks()


def test_unchunked_prompt_larger_than_budget_runs_alone() -> None:
    h = Harness(max_num_batched_tokens=8, chunked=False)
    d = h.add("d", [3, 4], params(3))
    # 1. D prefills.
    h.step()
    big = h.add("big", list(range(30, 50)), params(2))
    # 2-3. D decodes; BIG does not fit the budget next to it, so it waits.
    for _ in range(2):
        out, _ = h.step()
        assert set(by_id(out)) == {"d"}
    assert d.is_finished
    # 4. Nothing else runs: BIG is admitted alone, whole.
    out, _ = h.step()
    assert by_id(out) == {"big": (0, 20, True)} and out.num_batched_tokens == 20
    h.run()
    assert big.output_token_ids == reference(big.prompt_token_ids, 2)
    h.assert_no_leaks()


def test_unchunked_small_prompts_are_never_split() -> None:
    h = Harness(max_num_batched_tokens=10, chunked=False)
    h.add("a", list(range(6)), params(2))
    h.add("b", list(range(6)), params(2))
    # 1. A fits (6 of 10); B would need 6 more: it waits instead of being split.
    out, _ = h.step()
    assert by_id(out) == {"a": (0, 6, True)}
    h.run()
    h.assert_no_leaks()


# ---- prefix cache ----


def test_prefix_cache_hit_skips_computed_tokens() -> None:
    h = Harness()
    a = h.add("a", list(range(10)), params(2))
    h.run()
    # A's two full prompt blocks are cached: B computes only from position 8.
    b = h.add("b", [*range(8), 70, 71, 72], params(2))
    out, _ = h.step()
    assert by_id(out) == {"b": (8, 3, True)}
    assert b.num_cached_tokens == 8
    h.run()
    assert b.output_token_ids == reference(b.prompt_token_ids, 2)
    # A repeated prompt still recomputes its last token to get logits.
    c = h.add("c", list(a.prompt_token_ids[:8]), params(1))
    out, _ = h.step()
    assert by_id(out) == {"c": (4, 4, True)}
    assert c.output_token_ids == reference(c.prompt_token_ids, 1)
    h.assert_no_leaks()


def test_generated_blocks_serve_the_next_turn() -> None:
    h = Harness()
    a = h.add("a", list(range(6)), params(6))
    h.run()
    history = [*a.prompt_token_ids, *a.output_token_ids]  # 12 tokens; KV of the first 11 computed
    b = h.add("b", [*history, 5, 5], params(1))
    out, _ = h.step()
    assert by_id(out)["b"][0] == 8  # blocks 0 and 1 (incl. generated tokens) hit
    assert b.output_token_ids == reference(b.prompt_token_ids, 1)
    h.assert_no_leaks()


# ---- preemption ----


def test_preemption_recomputes_and_produces_the_same_tokens() -> None:
    # 6 blocks of 4 = 24 slots; each request needs 8 + 8 = 16 slots eventually.
    h = Harness(num_blocks=6)
    a = h.add("a", list(range(40, 48)), params(8))
    b = h.add("b", list(range(60, 68)), params(8))
    preempted: list[str] = []
    saw_preempted_status = False
    for _ in range(100):
        if not h.sched.has_unfinished():
            break
        out, _ = h.step()
        preempted += out.preempted_ids
        if b.status is RequestStatus.PREEMPTED:
            saw_preempted_status = True
            assert b.block_ids == [] and b.num_computed_tokens == 0
            assert h.sched.num_waiting == 1
        for rid in out.preempted_ids:
            assert rid not in by_id(out)  # a victim is not in the batch
    # B arrived last, so B is the one preempted; it resumes and finishes.
    assert preempted and set(preempted) == {"b"} and saw_preempted_status
    assert b.num_preemptions >= 1
    assert a.output_token_ids == reference(a.prompt_token_ids, 8)
    assert b.output_token_ids == reference(b.prompt_token_ids, 8)
    h.assert_no_leaks()


def test_preempted_victim_scheduled_earlier_in_the_step_is_dropped() -> None:
    """A young request's decode, already in the batch, is preempted for an older prefill."""
    h = Harness(num_blocks=3, max_num_batched_tokens=8, threshold=4)
    old = h.add("old", list(range(10, 22)), params(1))  # 12 tokens: 3 chunks of 4, 3 blocks
    young = h.add("young", [7, 8], params(4))
    # 1. OLD's first chunk and YOUNG's prompt: one block each.
    out, _ = h.step()
    assert by_id(out) == {"old": (0, 4, False), "young": (0, 2, True)}
    # 2. YOUNG decodes in its block; OLD's second chunk takes the last free block.
    out, _ = h.step()
    assert by_id(out) == {"young": (2, 1, True), "old": (4, 4, False)}
    # 3. YOUNG's decode is scheduled first, then OLD's last chunk finds no block:
    #    YOUNG (the latest arrival) is preempted and leaves this step's batch.
    out, _ = h.step()
    assert out.preempted_ids == ["young"]
    assert by_id(out) == {"old": (8, 4, True)}
    assert young.status is RequestStatus.PREEMPTED and young.num_output_tokens == 2
    # 4.. YOUNG recomputes its 4 tokens and finishes with the same output.
    h.run()
    assert old.output_token_ids == reference(old.prompt_token_ids, 1)
    assert young.output_token_ids == reference(young.prompt_token_ids, 4)
    h.assert_no_leaks()


def test_request_too_long_for_the_pool_finishes_by_length() -> None:
    h = Harness(num_blocks=2)  # 8 slots
    r = h.add("r", list(range(6)), params(10))
    h.run()
    # The step after 6 + 2 tokens would need a ninth slot.
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert r.output_token_ids == reference(r.prompt_token_ids, 3)
    h.assert_no_leaks()


def test_prompt_that_never_fits_is_rejected() -> None:
    h = Harness(num_blocks=2)
    with pytest.raises(ValueError, match="pool has only 2"):
        h.add("r", list(range(9)))
    assert not h.sched.has_unfinished()
    h.add("ok", list(range(8)))  # exactly fits
    with pytest.raises(ValueError, match="already in use"):
        h.add("ok", [1])


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), chunked=st.booleans(), num_blocks=st.integers(7, 16))
def test_random_workloads_match_reference(seed: int, chunked: bool, num_blocks: int) -> None:
    """Shared prefixes, a small pool and a tight budget: outputs never change."""
    rng = random.Random(seed)
    h = Harness(num_blocks=num_blocks, max_num_seqs=4, max_num_batched_tokens=12, chunked=chunked)
    base = [rng.randrange(2, 50) for _ in range(12)]
    reqs = []
    for i in range(6):
        prompt = base[: rng.randrange(1, 12)] + [
            rng.randrange(2, 50) for _ in range(rng.randrange(0, 8))
        ]
        reqs.append(h.add(f"r{i}", prompt or [3], params(rng.randrange(1, 8))))
        for _ in range(rng.randrange(0, 3)):
            h.step()
    h.run()
    for r in reqs:
        assert r.status is not RequestStatus.FINISHED_ABORTED
        if (
            r.status is RequestStatus.FINISHED_LENGTH
            and r.num_output_tokens < r.sampling_params.max_tokens
        ):
            assert r.num_tokens > h.kv.max_num_tokens  # stopped only by the pool's capacity
        assert r.output_token_ids == reference(r.prompt_token_ids, r.num_output_tokens)
    h.assert_no_leaks()


# ---- stop conditions ----


def test_eos_stops_unless_ignored() -> None:
    prompt = [5, 6, 7]
    ref = reference(prompt, 6)
    assert ref[2] not in ref[:2]
    for ignore, expected_len in ((False, 3), (True, 6)):
        h = Harness()
        sp = SamplingParams(max_tokens=6, extra_eos_token_ids=(ref[2],), ignore_eos=ignore)
        r = h.add("r", prompt, sp)
        h.run()
        assert r.output_token_ids == ref[:expected_len]
        assert r.finish_reason is (FinishReason.LENGTH if ignore else FinishReason.STOP)
        assert r.stop_reason is None
        h.assert_no_leaks()


def test_stop_token_ids_set_stop_reason_even_with_ignore_eos() -> None:
    prompt = [9, 9]
    ref = reference(prompt, 8)
    h = Harness()
    r = h.add("r", prompt, params(8, stop_token_ids=(ref[3],), ignore_eos=True))
    h.run()
    n = ref.index(ref[3]) + 1
    assert r.output_token_ids == ref[:n]
    assert r.finish_reason is FinishReason.STOP and r.stop_reason == ref[3]
    h.assert_no_leaks()


def test_min_tokens_defers_stop_conditions() -> None:
    prompt = [11, 12, 13]
    ref = reference(prompt, 6)
    assert ref[0] not in ref[1:6]
    h = Harness()
    # The first token is a stop token but 4 tokens are required first; it never recurs.
    r = h.add("r", prompt, params(6, stop_token_ids=(ref[0],), min_tokens=4))
    h.run()
    assert r.output_token_ids == ref
    assert r.finish_reason is FinishReason.LENGTH
    h.assert_no_leaks()


def test_finish_request_and_abort_between_schedule_and_update() -> None:
    h = Harness()
    a = h.add("a", [4, 4, 4], params(8))
    b = h.add("b", [5, 5, 5], params(8))
    h.step()
    # 2. Schedule; the engine finishes A (stop string) and the client aborts B
    #    while the step runs; update must skip both.
    out = h.sched.schedule()
    sampled = h.execute(out)
    assert h.sched.finish_request("a", FinishReason.STOP)
    assert h.sched.abort_request("b")
    assert h.sched.update(out, sampled) == []
    assert a.status is RequestStatus.FINISHED_STOPPED and a.num_output_tokens == 1
    assert b.status is RequestStatus.FINISHED_ABORTED
    assert not h.sched.finish_request("a", FinishReason.STOP)
    h.assert_no_leaks()


def test_missing_sampled_token_is_an_error() -> None:
    h = Harness()
    h.add("a", [4, 4], params(2))
    out = h.sched.schedule()
    with pytest.raises(ValueError, match="sampled token"):
        h.sched.update(out, {})


# ---- abort in every state ----


def test_abort_in_every_state_frees_blocks() -> None:
    h = Harness(num_blocks=6, max_num_batched_tokens=4)
    # WAITING (never scheduled)
    w = h.add("w", [1, 2, 3])
    assert h.sched.abort_request("w") and w.status is RequestStatus.FINISHED_ABORTED
    assert h.sched.num_waiting == 0
    # RUNNING mid-prefill (chunked: 4 of 10 tokens computed)
    p = h.add("p", list(range(2, 12)))
    h.step()
    assert p.status is RequestStatus.RUNNING and 0 < p.num_computed_tokens < 10 and p.block_ids
    assert h.sched.abort_request("p")
    h.assert_no_leaks()
    # RUNNING decoding
    d = h.add("d", [3, 3], params(8))
    h.step()
    h.step()
    assert d.num_output_tokens == 2
    assert h.sched.abort_request("d") and d.block_ids == []
    h.assert_no_leaks()
    # PREEMPTED: waiting at the front of the queue, no blocks
    x = h.add("x", list(range(2, 10)), params(8))  # arrived first: keeps running
    y = h.add("y", list(range(20, 28)), params(8))
    for _ in range(40):
        h.step()
        if y.status is RequestStatus.PREEMPTED:
            break
    assert y.status is RequestStatus.PREEMPTED
    assert h.sched.abort_request("y") and h.sched.num_waiting == 0
    assert x.status is RequestStatus.RUNNING and h.sched.abort_request("x")
    h.assert_no_leaks()
    # WAITING_FOR_REMOTE_KV: blocks allocated for the whole prompt
    r = h.add("r", list(range(2, 9)), remote_kv=RemoteKVSpec("xid-1"))
    out, _ = h.step()
    assert allocated(out) == [r.request_id] and len(r.block_ids) == 2
    assert h.sched.abort_request("r") and r.status is RequestStatus.FINISHED_ABORTED
    assert h.sched.num_waiting_for_remote_kv == 0
    with pytest.raises(KeyError):
        h.sched.on_remote_kv_done("r", 5)
    h.assert_no_leaks()
    # Held after finishing: abort releases the lease
    held = h.add("held", [4, 4], params(1), hold_blocks_on_finish=True)
    h.run()
    assert held.is_finished and h.pool.stats().num_in_use == 1
    assert h.sched.abort_request("held")
    assert held.status is RequestStatus.FINISHED_LENGTH
    # Unknown id
    assert not h.sched.abort_request("nope")
    h.assert_no_leaks()


def test_held_blocks_released_only_on_release_held() -> None:
    h = Harness()
    r = h.add("r", list(range(2, 12)), params(2), hold_blocks_on_finish=True)
    h.run()
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert not h.sched.has_unfinished()
    assert h.sched.get_request("r") is r and h.sched.num_held == 1
    assert len(r.block_ids) == 3 and h.pool.stats().num_in_use == 3
    # Other traffic does not take the held blocks.
    h.add("other", list(range(2, 12)), params(2))
    h.run()
    assert h.pool.stats().num_in_use == 3
    assert h.sched.release_held("r")
    assert not h.sched.release_held("r")
    assert h.sched.get_request("r") is None
    h.assert_no_leaks()


def test_aborted_request_is_not_held() -> None:
    h = Harness()
    r = h.add("r", list(range(2, 12)), hold_blocks_on_finish=True)
    h.step()
    assert h.sched.abort_request("r")
    assert h.sched.num_held == 0 and r.block_ids == []
    h.assert_no_leaks()


# ---- remote KV ----


def cache_prefix(h: Harness, prompt: list[int]) -> None:
    """Run a request over `prompt` so that its full blocks are in the prefix cache."""
    h.add("warm-" + str(len(prompt)), prompt, params(1))
    h.run()


def test_remote_kv_done_decodes_from_the_senders_first_token() -> None:
    h = Harness()
    cache_prefix(h, list(range(2, 12)))  # blocks of tokens 2..9 cached
    prompt = [*range(2, 10), 50, 51, 52, 53, 54, 55]  # 14 tokens: 8 cached here
    r = h.add("r", prompt, params(5), remote_kv=RemoteKVSpec("xid-7", "prefill-0"))
    # 1. Blocks for the whole prompt; reported once; nothing computed.
    out, _ = h.step()
    assert allocated(out) == [r.request_id] and out.seqs == []
    assert r.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert r.num_cached_tokens == 8 and len(r.block_ids) == 4
    # 2. Still waiting: not scheduled, not reported again.
    out, _ = h.step()
    assert allocated(out) == [] and out.seqs == []
    assert h.sched.num_waiting_for_remote_kv == 1 and h.sched.has_unfinished()
    # 3. The sender writes tokens 8..13 and samples the first token.
    first = h.send_remote(r)
    assert h.sched.on_remote_kv_done("r", first) is False
    assert r.status is RequestStatus.RUNNING and r.output_token_ids == [first]
    assert r.num_computed_tokens == 14
    assert h.pool.key_of(r.block_ids[2]) is not None  # the received full block is cached
    # 4. Decoding follows: one token per step, starting at position 14.
    out, _ = h.step()
    assert by_id(out) == {"r": (14, 1, True)}
    h.run()
    assert r.output_token_ids == reference(prompt, 5)
    h.assert_no_leaks()


def test_remote_kv_first_token_can_finish_the_request() -> None:
    h = Harness()
    r = h.add("r", [3, 4, 5], params(1), remote_kv=RemoteKVSpec("xid"))
    out, _ = h.step()
    assert allocated(out) == [r.request_id] and r.num_cached_tokens == 0
    assert h.sched.on_remote_kv_done("r", h.send_remote(r)) is True
    assert r.status is RequestStatus.FINISHED_LENGTH
    h.assert_no_leaks()


def test_remote_kv_failed_falls_back_to_local_prefill() -> None:
    h = Harness(max_num_batched_tokens=4)
    cache_prefix(h, list(range(2, 12)))
    prompt = [*range(2, 10), 50, 51, 52, 53, 54, 55]
    r = h.add("r", prompt, params(3), remote_kv=RemoteKVSpec("xid-9"))
    # 1. Admitted for remote KV.
    out, _ = h.step()
    assert allocated(out) == [r.request_id]
    blocks = list(r.block_ids)
    # 2. The transfer fails: blocks kept, computing resumes after the local hit.
    h.sched.on_remote_kv_failed("r")
    assert r.status is RequestStatus.RUNNING and r.num_computed_tokens == 8
    assert r.block_ids == blocks
    # 3-4. The uncached 6 tokens are prefilled in chunks under the budget of 4.
    out, _ = h.step()
    assert by_id(out) == {"r": (8, 4, False)}
    out, _ = h.step()
    assert by_id(out) == {"r": (12, 2, True)}
    h.run()
    assert r.output_token_ids == reference(prompt, 3)
    h.assert_no_leaks()


def test_remote_kv_full_hit_then_failure_never_writes_a_shared_block() -> None:
    h = Harness()
    cache_prefix(h, list(range(2, 12)))
    prompt = list(range(2, 10))  # 8 tokens, all cached here
    r = h.add("r", prompt, params(2), remote_kv=RemoteKVSpec("xid"))
    h.step()
    assert r.num_cached_tokens == 8 and len(r.block_ids) == 2  # remote KV allows a full hit
    h.sched.on_remote_kv_failed("r")
    # The last token must be computed for logits; its cached block is swapped for a fresh one.
    out, _ = h.step()
    assert by_id(out) == {"r": (4, 4, True)}  # Harness.write asserts the block is private
    assert r.num_cached_tokens == 4
    h.run()
    assert r.output_token_ids == reference(prompt, 2)
    h.assert_no_leaks()


def test_remote_kv_done_without_first_token_recomputes_the_last_token() -> None:
    h = Harness()
    prompt = list(range(2, 9))
    r = h.add("r", prompt, params(2), remote_kv=RemoteKVSpec("xid"))
    h.step()
    h.send_remote(r)
    assert h.sched.on_remote_kv_done("r", None) is False
    out, _ = h.step()
    assert by_id(out) == {"r": (6, 1, True)}
    h.run()
    assert r.output_token_ids == reference(prompt, 2)
    h.assert_no_leaks()


def test_remote_kv_admission_waits_for_blocks_in_order() -> None:
    h = Harness(num_blocks=3, max_num_seqs=4)
    a = h.add("a", list(range(2, 10)), params(4))  # 2 blocks, a third once decoding
    r = h.add("r", list(range(20, 28)), params(1), remote_kv=RemoteKVSpec("xid"))
    c = h.add("c", [5], params(1))
    # 1. A takes 2 blocks; R needs 2, only 1 is free: R waits, and C behind it (FCFS).
    out, _ = h.step()
    assert set(by_id(out)) == {"a"} and allocated(out) == []
    assert h.sched.num_waiting == 2
    # 2.. A decodes to the end; then R gets its blocks and C its seat.
    while not a.is_finished:
        out, _ = h.step()
        assert allocated(out) == []
    out, _ = h.step()
    assert allocated(out) == [r.request_id] and by_id(out) == {"c": (0, 1, True)}
    assert h.sched.on_remote_kv_done("r", h.send_remote(r)) is True
    h.run()
    assert c.output_token_ids == reference([5], 1)
    h.assert_no_leaks()


def test_request_waiting_for_remote_kv_holds_a_seat() -> None:
    h = Harness(max_num_seqs=1)
    r = h.add("r", [6, 6, 6], params(2), remote_kv=RemoteKVSpec("xid"))
    c = h.add("c", [5], params(1))
    # 1-2. R holds the only seat while it waits; C is not admitted.
    for _ in range(2):
        out, _ = h.step()
        assert out.seqs == [] and c.status is RequestStatus.WAITING
    # 3. R decodes from the sender's token; C still waits for the seat.
    assert h.sched.on_remote_kv_done("r", h.send_remote(r)) is False
    out, _ = h.step()
    assert by_id(out) == {"r": (3, 1, True)}
    # 4. R finished in step 3: C is admitted.
    out, _ = h.step()
    assert by_id(out) == {"c": (0, 1, True)}
    assert r.output_token_ids == reference([6, 6, 6], 2)
    assert c.output_token_ids == reference([5], 1)
    h.assert_no_leaks()


# ---- block tables travel as deltas ----


def test_steps_send_only_new_block_ids_and_drop_finished_tables() -> None:
    h = Harness()
    h.add("a", list(range(10, 16)), params(max_tokens=4))  # 6 tokens: blocks 0..1
    out, _ = h.step()
    (seq,) = out.seqs
    assert seq.replaces_table and seq.new_block_ids == h.tables["a"] and len(seq.new_block_ids) == 2
    out, _ = h.step()  # decodes position 6: no new block
    assert out.seqs[0].new_block_ids == [] and not out.seqs[0].replaces_table
    out, _ = h.step()  # position 7: still block 1
    assert out.seqs[0].new_block_ids == []
    out, finished = h.step()  # position 8: block 2 appended; the 4th token finishes it
    assert len(h.tables["a"]) == 3 and out.seqs[0].new_block_ids == h.tables["a"][2:]
    assert [r.request_id for r in finished] == ["a"]
    out, _ = h.step()
    assert out.dropped_table_ids == ["a"] and not out.seqs
    h.assert_no_leaks()


def test_preempted_request_sends_its_whole_table_again() -> None:
    h = Harness(num_blocks=6, max_num_batched_tokens=64)
    h.add("a", list(range(10, 18)), params(max_tokens=12))
    h.add("b", list(range(30, 38)), params(max_tokens=12))
    saw_drop = saw_replace = False
    for _ in range(200):
        if not h.sched.has_unfinished():
            break
        out, _ = h.step()
        saw_drop |= bool(set(out.dropped_table_ids) & set(out.preempted_ids))
        saw_replace |= any(s.replaces_table and s.start_pos > 0 for s in out.seqs)
    assert saw_drop and saw_replace, "the pool was meant to force a preemption and a re-admission"
    h.assert_no_leaks()
