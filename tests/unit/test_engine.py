"""Engine-level behaviour on the tiny preset: batching, prefix cache, preemption, sampling."""

from __future__ import annotations

import itertools
import random

import pytest

from kvduplex.common.engine_config import CacheConfig
from kvduplex.common.engine_config import EngineConfig
from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.common.engine_config import SchedulerConfig
from kvduplex.common.limits import RequestRejected
from kvduplex.common.sampling import SamplingParams
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.engine import RequestOutput
from kvduplex.engine.request import Request
from kvduplex.model.loader import LoadedModel
from kvduplex.model.loader import load_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model(ModelLoadConfig(model="tiny", seed=0))


def make_engine(
    tiny: LoadedModel,
    *,
    num_blocks: int = 256,
    block_size: int = 4,
    budget: int = 256,
    chunked: bool = True,
    caching: bool = True,
) -> LLMEngine:
    cfg = EngineConfig(
        model=ModelLoadConfig(model="tiny"),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, enable_chunked_prefill=chunked),
    )
    return LLMEngine(cfg, loaded=tiny)


_ids = itertools.count()


def run(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] = GREEDY
) -> tuple[list[list[int]], list[RequestOutput]]:
    """Add all prompts at once, step to completion, return token ids per prompt."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    rids = [f"r{next(_ids)}" for _ in prompts]
    for rid, prompt, p in zip(rids, prompts, plist, strict=False):
        engine.add_request(Request(rid, prompt, p))
    tokens: dict[str, list[int]] = {rid: [] for rid in rids}
    finals: dict[str, RequestOutput] = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
    assert set(finals) == set(rids), "every request must finish"
    return [tokens[r] for r in rids], [finals[r] for r in rids]


def assert_no_leak(engine: LLMEngine) -> None:
    engine.check_integrity()
    assert engine.block_pool.stats().num_in_use == 0
    assert len(engine.runner.tables) == 0, "the runner kept tables of finished requests"


def random_prompts(n: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 250) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_batch_equals_each_request_alone(tiny: LoadedModel) -> None:
    prompts = random_prompts(8, seed=1)
    alone_engine = make_engine(tiny, caching=False)
    alone = [run(alone_engine, [p])[0][0] for p in prompts]
    batch_engine = make_engine(tiny, caching=False)
    batched, _ = run(batch_engine, prompts)
    assert batched == alone
    assert_no_leak(batch_engine)


def test_prefix_cache_hit_gives_same_tokens(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    prompt = random_prompts(1, seed=2, lo=30, hi=30)[0]
    (miss,), (miss_out,) = run(engine, [prompt])
    (hit,), (hit_out,) = run(engine, [prompt])
    assert hit == miss
    assert miss_out.num_cached_tokens == 0
    # All full blocks but the one holding the last prompt token come from the cache.
    assert hit_out.num_cached_tokens == (len(prompt) - 1) // 4 * 4
    longer = [*prompt, 7, 8, 9, 10, 11]
    (ext,), (ext_out,) = run(engine, [longer])
    assert ext_out.num_cached_tokens >= 28
    cold = make_engine(tiny, caching=False)
    assert run(cold, [longer])[0][0] == ext
    assert_no_leak(engine)


def test_chunked_prefill_gives_same_tokens(tiny: LoadedModel) -> None:
    prompts = random_prompts(4, seed=3, lo=20, hi=60)
    ref, _ = run(make_engine(tiny, caching=False), prompts)
    engine = make_engine(tiny, caching=False, budget=7)
    chunked, _ = run(engine, prompts)
    assert all(len(r) == GREEDY.max_tokens for r in ref)
    assert chunked == ref
    assert_no_leak(engine)


def test_preemption_keeps_outputs_identical(tiny: LoadedModel) -> None:
    prompts = random_prompts(6, seed=4, lo=10, hi=20)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ref = [run(make_engine(tiny, caching=False), [p], params)[0][0] for p in prompts]
    # 6 requests of up to 44 tokens need up to 66 blocks of 4: 24 blocks force preemption.
    engine = make_engine(tiny, num_blocks=24, caching=False)
    preempted = 0
    original = engine.scheduler.schedule

    def counting_schedule():  # type: ignore[no-untyped-def]
        nonlocal preempted
        out = original()
        preempted += len(out.preempted_ids)
        return out

    engine.scheduler.schedule = counting_schedule  # type: ignore[method-assign]
    got, _ = run(engine, prompts, params)
    assert preempted > 0, "the pool was meant to be too small to run all requests at once"
    assert all(len(r) == 24 for r in ref)
    assert got == ref
    assert_no_leak(engine)


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny: LoadedModel) -> None:
    prompt = random_prompts(1, seed=5)[0]
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    engine = make_engine(tiny)
    (a,), _ = run(engine, [prompt], p)
    others = random_prompts(3, seed=6)
    outs, _ = run(engine, [*others, prompt], [GREEDY] * 3 + [p])
    assert outs[-1] == a
    q = SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True)
    (c,), _ = run(engine, [prompt], q)
    assert c != a
    assert_no_leak(engine)


def test_max_tokens_and_stop_token(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    prompt = random_prompts(1, seed=7)[0]
    (toks,), (out,) = run(engine, [prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert len(toks) == 10 and out.finish_reason == "length"
    stop_at = toks[4]
    first = toks.index(stop_at)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_at,))
    (stopped,), (sout,) = run(engine, [prompt], params)
    assert stopped == toks[: first + 1]
    assert sout.finish_reason == "stop"
    assert_no_leak(engine)


def test_stop_string_truncates_text(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    prompt = random_prompts(1, seed=8)[0]
    rid = "stop-text"
    engine.add_request(Request(rid, prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)))
    text = ""
    while engine.has_unfinished():
        for o in engine.step():
            text += o.new_text
    assert len(text) >= 6
    stop = text[3:6]
    engine.add_request(Request("stop-text-2", prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,))))
    got, reason = "", None
    while engine.has_unfinished():
        for o in engine.step():
            got += o.new_text
            reason = o.finish_reason if o.finished else reason
    assert got == text[: text.find(stop)]
    assert reason == "stop"
    assert_no_leak(engine)


def test_too_long_request_is_rejected(tiny: LoadedModel) -> None:
    engine = make_engine(tiny, num_blocks=8)
    with pytest.raises(RequestRejected, match="maximum context length"):
        engine.add_request(Request("long", [1] * 30, SamplingParams(max_tokens=8)))
    with pytest.raises(ValueError, match="at least one token"):
        Request("empty", [], SamplingParams(max_tokens=8))
    assert_no_leak(engine)


def test_abort_frees_blocks(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    engine.add_request(Request("a", random_prompts(1, seed=9)[0], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)))
    engine.step()
    engine.step()
    assert engine.block_pool.stats().num_in_use > 0
    assert engine.abort_request("a")
    assert not engine.abort_request("a")
    assert_no_leak(engine)
    # Whoever reads the request's outputs sees it end, once, from the next step.
    assert engine.has_unfinished(), "an output is pending"
    outs = [o for o in engine.step() if o.request_id == "a"]
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == "abort"
    assert outs[0].num_output_tokens == 2
    assert not [o for o in engine.step() if o.request_id == "a"]


def test_runner_tables_follow_the_scheduler_through_preemption(tiny: LoadedModel) -> None:
    engine = make_engine(tiny, num_blocks=24, block_size=4, budget=64)
    prompts = random_prompts(6, seed=11, lo=20, hi=30)
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"t{i}", p, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)))
    steps = 0
    while engine.has_unfinished() and steps < 2000:
        engine.step()
        steps += 1
        for req in engine.scheduler._running:
            rid = req.request_id
            if engine.runner.has_table(rid):
                row = engine.runner.tables.row_of(rid)
                held = engine.runner.tables.table[row, : engine.runner.tables.num_blocks[row]]
                assert held.tolist() == req.block_ids, f"{rid}: runner table differs"
    assert_no_leak(engine)
