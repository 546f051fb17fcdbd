"""The coding-agent shape (drawn system prompt, turns and think times) and sizing a workload
to oversubscribe prefill's pool."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvduplex.bench.agentic_cli import workload_configs
from kvduplex.bench.agentic_matrix import COSTS
from kvduplex.bench.agentic_matrix import _warmup_configs
from kvduplex.bench.agentic_matrix import fit_to_budget
from kvduplex.bench.agentic_modes import kv_bytes_per_token
from kvduplex.bench.agentic_sizing import endpoint_pool_tokens
from kvduplex.bench.agentic_sizing import expected_history_tokens
from kvduplex.bench.agentic_sizing import history_tokens
from kvduplex.bench.agentic_sizing import oversubscribe
from kvduplex.bench.agentic_sizing import pool_tokens_for_mb
from kvduplex.bench.agentic_sizing import size_for_oversubscription
from kvduplex.bench.agentic_sizing import workload_kv_tokens
from kvduplex.bench.conversation import PromptForm
from kvduplex.bench.conversation import new_conversation
from kvduplex.bench.conversation import text_ids
from kvduplex.bench.workload import AGENTIC
from kvduplex.bench.workload import CODING_AGENT
from kvduplex.bench.workload import Shape
from kvduplex.bench.workload import WorkloadConfig
from kvduplex.bench.workload import plan_sessions
from kvduplex.bench.workload import system_prompt
from kvduplex.bench.workload import system_tokens_of
from kvduplex.cli.main import parse_args
from kvduplex.common.engine_config import CacheConfig
from kvduplex.common.presets import PRESETS
from kvduplex.engine.runner import num_blocks_for_memory


def _coding(seed: int = 0, sessions: int = 12) -> WorkloadConfig:
    system = system_tokens_of(CODING_AGENT, seed)
    assert system is not None
    return WorkloadConfig(shape=CODING_AGENT, num_sessions=sessions, system_tokens=system, seed=seed)


def test_the_plan_is_seeded_and_stable() -> None:
    assert plan_sessions(_coding(3)) == plan_sessions(_coding(3))
    assert plan_sessions(_coding(3)) != plan_sessions(_coding(4))
    # session s does not depend on how many sessions there are
    assert plan_sessions(_coding(3, sessions=5)) == plan_sessions(_coding(3, sessions=12))[:5]
    assert system_tokens_of(CODING_AGENT, 3) == system_tokens_of(CODING_AGENT, 3)
    assert system_prompt(_coding(3)) == system_prompt(_coding(3, sessions=1))


def test_turns_lengths_and_think_times_stay_in_their_ranges() -> None:
    plans = plan_sessions(_coding(1, sessions=40))
    counts = [len(p.turns) for p in plans]
    assert all(20 <= n <= 40 for n in counts) and len(set(counts)) > 5  # drawn per session
    turns = [t for p in plans for t in p.turns]
    assert all(500 <= t.input_tokens <= 4000 and 100 <= t.answer_tokens <= 600 for t in turns)
    assert all(t.think_s == 0.0 for t in turns if t.index == 0)
    thinks = [t.think_s for t in turns if t.index > 0]
    assert all(2.0 <= s <= 30.0 for s in thinks) and min(thinks) < 5 and max(thinks) > 27
    assert all(8000 <= (system_tokens_of(CODING_AGENT, s) or 0) <= 16000 for s in range(20))


def test_the_system_prompt_is_instructions_then_tool_definitions_exactly_sized() -> None:
    config = _coding(2)
    text = system_prompt(config)
    assert len(text_ids(text)) == config.system_tokens and text.isascii()
    assert text.startswith("You are a coding agent")
    tools = [json.loads(line) for line in text.split("# Tools\n", 1)[1].splitlines()[:-1]]
    assert len(tools) > 10 and all(t["function"]["parameters"]["type"] == "object" for t in tools)
    # chat form: answers are tool calls, inputs tool results
    conv = new_conversation(PromptForm.CHAT, "m", "s", text, shape="coding_agent", chat_plain=False)
    assert "tools" in conv.next_request("out", max_tokens=4).body


def test_flags_given_replace_the_shapes_own_ranges() -> None:
    args = ["bench", "--workload", "agentic", "--shapes", "coding_agent", "--seed", "5"]
    (drawn,) = workload_configs(parse_args(args))
    assert drawn.shape == CODING_AGENT and drawn.system_tokens == system_tokens_of(CODING_AGENT, 5)
    (scaled,) = workload_configs(parse_args([*args, "--length-scale", "0.1"]))
    assert scaled.shape.input_tokens == (50, 400) and scaled.shape.system_tokens == (800, 1600)
    assert 800 <= scaled.system_tokens <= 1600 and scaled.shape.turns == (20, 40)
    given = ["--turns", "4", "--system-tokens", "300", "--think-max", "0", "--think-min", "0"]
    (fixed,) = workload_configs(parse_args([*args, *given]))
    assert (fixed.shape.turns, fixed.shape.think_s, fixed.shape.system_tokens) == (None, None, None)
    assert fixed.system_tokens == 300
    assert all(len(p.turns) == 4 and all(t.think_s == 0 for t in p.turns) for p in plan_sessions(fixed))
    (quick,) = workload_configs(parse_args([*args, "--quick"]))
    assert (quick.num_sessions, quick.system_tokens, quick.shape.turns) == (2, 128, None)


def test_a_warm_up_per_distinct_system_prompt() -> None:
    agentic = WorkloadConfig(shape=AGENTIC)
    warm = _warmup_configs([agentic, replace(agentic, num_sessions=2), _coding(0)])
    assert [w.shape.tools_in_system for w in warm] == [False, True]
    assert [system_prompt(w) for w in warm] == [system_prompt(agentic), system_prompt(_coding(0))]


def test_fitting_drops_turns_from_a_drawn_range() -> None:
    config = replace(_coding(0, sessions=2), shape=CODING_AGENT.scaled(0.05, 0.05, 0.05))
    (fitted,), _, notes = fit_to_budget([config], 8, 1, COSTS["tiny"], budget_s=1.0)
    assert fitted.shape.turns == (17, 37) and "turns 20-40 -> 17-37" in notes


def test_pool_tokens_are_the_engines_whole_blocks() -> None:
    block = CacheConfig().block_size
    per_token = kv_bytes_per_token("long")
    assert per_token == PRESETS["long"].kv_bytes_per_token(4) == 8192
    for mb in (64, 512, 1000):
        blocks = num_blocks_for_memory(PRESETS["long"], block, "float32", mb)
        assert pool_tokens_for_mb(mb, per_token, block) == blocks * block
    assert pool_tokens_for_mb(512, per_token, block) == 65536


def test_oversubscription_counts_the_system_prompt_once_and_every_history() -> None:
    shape = Shape("fixed", (100, 100), (50, 50))  # 4 turns: 600 tokens of history a session
    config = WorkloadConfig(shape=shape, num_turns=4, system_tokens=1000)
    # 1000 + 600 n >= factor * 10_000
    expected = {1: 15, 2: 32, 4: 65}
    for factor, n in expected.items():
        sized = size_for_oversubscription(config, factor, 10_000)
        assert sized.config.num_sessions == n
        assert sized.kv_tokens == workload_kv_tokens(sized.config) == 1000 + 600 * n
    assert size_for_oversubscription(config, 0.01, 10_000).config.num_sessions == 1
    with pytest.raises(ValueError, match="lower --oversubscription"):
        size_for_oversubscription(config, 1, 10**9)
    with pytest.raises(ValueError, match="must be > 0"):
        size_for_oversubscription(config, 0, 10_000)


def test_oversubscribing_the_coding_agent_reaches_each_factor_within_one_session() -> None:
    config = replace(_coding(0), shape=CODING_AGENT.scaled(0.1, 0.1, 0.1), system_tokens=1200)
    pool = pool_tokens_for_mb(512, kv_bytes_per_token("long"), 16)
    notes: list[str] = []
    sized = {f: oversubscribe([config], f, pool, notes)[0] for f in (1, 2, 4)}
    assert sized[1].num_sessions < sized[2].num_sessions < sized[4].num_sessions
    for factor, c in sized.items():
        total = workload_kv_tokens(c)
        last = history_tokens(plan_sessions(c)[-1])
        assert factor * pool <= total < factor * pool + last
    assert len(notes) == 3 and "x the prefill pool's 65536 tokens (asked: 2x)" in notes[1]
    # the mean session the notes quote: 30 turns of (225 + 35) tokens
    assert expected_history_tokens(config) == pytest.approx(30 * (225 + 35))


def test_an_endpoint_pool_given_is_used_as_is() -> None:
    assert endpoint_pool_tokens(4096, "http://127.0.0.1:9", ()) == 4096
