"""The multi-turn workload: seeded plans, lengths, texts, history growth, chat shapes."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict
from dataclasses import replace

import pytest

from kvduplex.bench.conversation import AGENT_COMMAND_CHARS
from kvduplex.bench.conversation import TOOL_NAME
from kvduplex.bench.conversation import ChatConversation
from kvduplex.bench.conversation import PromptForm
from kvduplex.bench.conversation import TokenConversation
from kvduplex.bench.conversation import new_conversation
from kvduplex.bench.conversation import text_ids
from kvduplex.bench.workload import AGENTIC
from kvduplex.bench.workload import REASONING
from kvduplex.bench.workload import Shape
from kvduplex.bench.workload import WorkloadConfig
from kvduplex.bench.workload import input_texts
from kvduplex.bench.workload import plan_sessions
from kvduplex.bench.workload import seeded_text
from kvduplex.bench.workload import session_id
from kvduplex.bench.workload import system_prompt


def test_plans_are_a_function_of_the_config() -> None:
    config = WorkloadConfig(seed=7)
    assert plan_sessions(config) == plan_sessions(WorkloadConfig(seed=7))
    assert plan_sessions(config) != plan_sessions(replace(config, seed=8))
    assert plan_sessions(config) != plan_sessions(replace(config, shape=REASONING))


@pytest.mark.parametrize("shape", [AGENTIC, REASONING])
def test_lengths_and_think_times_stay_in_their_ranges(shape: Shape) -> None:
    config = WorkloadConfig(shape=shape, num_sessions=6, num_turns=8, seed=3)
    plans = plan_sessions(config)
    assert [p.index for p in plans] == list(range(6))
    for plan in plans:
        assert [t.index for t in plan.turns] == list(range(8))
        assert plan.turns[0].think_s == 0.0
        for turn in plan.turns[1:]:
            assert 0.5 <= turn.think_s <= 2.0
        for turn in plan.turns:
            assert shape.input_tokens[0] <= turn.input_tokens <= shape.input_tokens[1]
            assert shape.answer_tokens[0] <= turn.answer_tokens <= shape.answer_tokens[1]
    inputs = {t.input_tokens for p in plans for t in p.turns}
    assert len(inputs) > 10  # drawn, not constant


def test_the_salt_changes_the_words_not_the_lengths() -> None:
    config = WorkloadConfig(num_sessions=2, num_turns=4)
    plan = plan_sessions(config)[1]
    a = input_texts(config, plan, salt="push-r0")
    b = input_texts(config, plan, salt="colocated-r0")
    assert a == input_texts(config, plan, salt="push-r0")
    assert a != b
    assert [len(t) for t in a] == [len(t) for t in b] == [t.input_tokens for t in plan.turns]
    assert all(t.isascii() for t in a + b)
    assert session_id("push-r0", config, plan) != session_id("colocated-r0", config, plan)


def test_system_prompt_is_shared_and_exactly_sized() -> None:
    config = WorkloadConfig(system_tokens=1000, seed=1)
    text = system_prompt(config)
    assert len(text_ids(text)) == 1000
    assert text == system_prompt(replace(config, shape=REASONING, num_sessions=1))
    assert text != system_prompt(replace(config, seed=2))


def test_token_history_grows_by_answer_and_new_input() -> None:
    conv = TokenConversation(model="tiny", session="s0", system="SYS")
    first = conv.next_request("abc", max_tokens=5)
    assert first.path == "/v1/completions"
    assert first.body["prompt"] == text_ids("SYS") + text_ids("abc")
    assert first.body["max_tokens"] == 5 and first.body["ignore_eos"] is True
    assert first.body["prompt_cache_key"] == "s0" and first.headers == {"X-Session-Id": "s0"}
    answer = [300, 257, 65]  # ids as generated, specials and out-of-byte ids included
    conv.add_answer("ignored text", answer)
    second = conv.next_request("de", max_tokens=6)
    assert second.body["prompt"] == first.body["prompt"] + answer + text_ids("de")
    assert first.body["prompt"] == text_ids("SYS") + text_ids("abc")  # not aliased


def test_agentic_chat_turns_are_tool_calls_and_tool_results() -> None:
    conv = new_conversation(PromptForm.CHAT, "m", "s1", "SYS", shape="agentic", chat_plain=False)
    assert isinstance(conv, ChatConversation)
    first = conv.next_request("task", max_tokens=4)
    assert first.path == "/v1/chat/completions"
    assert first.body["messages"] == [
        {"role": "system", "content": "SYS"}, {"role": "user", "content": "task"},
    ]  # fmt: skip
    assert first.body["tools"][0]["function"]["name"] == TOOL_NAME
    assert first.body["prompt_cache_key"] == "s1" and first.headers == {"X-Session-Id": "s1"}
    assert not conv.add_answer("ls -la", [1, 2])  # rewritten into a call
    second = conv.next_request("out", max_tokens=4)
    assistant, tool = second.body["messages"][2:]
    assert assistant["role"] == "assistant" and assistant["content"] is None
    (call,) = assistant["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == TOOL_NAME
    assert json.loads(call["function"]["arguments"]) == {"command": "ls -la"}
    assert tool == {"role": "tool", "tool_call_id": call["id"], "content": "out"}
    conv.add_answer("cat x", [])
    third = conv.next_request("more", max_tokens=4)
    ids = [m["tool_calls"][0]["id"] for m in third.body["messages"] if m.get("tool_calls")]
    assert len(ids) == len(set(ids)) == 2


@pytest.mark.parametrize(("shape", "plain"), [("agentic", True), ("reasoning", False)])
def test_plain_chat_has_only_user_and_assistant_text(shape: str, plain: bool) -> None:
    conv = new_conversation(PromptForm.CHAT, "m", "s2", "SYS", shape=shape, chat_plain=plain)
    conv.next_request("q1", max_tokens=4)
    assert conv.add_answer("a1", [])
    req = conv.next_request("q2", max_tokens=4)
    assert "tools" not in req.body
    assert req.body["messages"] == [
        {"role": "system", "content": "SYS"}, {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
    ]  # fmt: skip


def test_an_agent_sends_calls_back_as_received_and_strips_reasoning() -> None:
    conv = new_conversation(PromptForm.AGENT, "m", "s3", "SYS", shape="agentic", chat_plain=True)
    first = conv.next_request("task", max_tokens=8)
    assert first.body["tool_choice"] == "required" and first.body["parallel_tool_calls"] is False
    command = first.body["tools"][0]["function"]["parameters"]["properties"]["command"]
    assert command["maxLength"] == AGENT_COMMAND_CHARS  # the call's grammar can end
    call = {"id": "chatcmpl-tool-1", "type": "function",
            "function": {"name": TOOL_NAME, "arguments": '{"command": "ls"}'}}  # fmt: skip
    received = {"role": "assistant", "content": None, "tool_calls": [call]}
    assert conv.add_answer("", [1, 2], received)  # sent back as generated
    second = conv.next_request("exit 0", max_tokens=8)
    assert second.body["tool_choice"] == "none"
    assert second.body["messages"][2:] == [
        received, {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "exit 0"},
    ]  # fmt: skip
    stripped = {"role": "assistant", "content": None, "reasoning_content": "hmm"}
    assert not conv.add_answer("", [3], stripped)  # its reasoning stripped: not as generated
    third = conv.next_request("next", max_tokens=8)
    assert third.body["tool_choice"] == "required"
    assert third.body["messages"][4:] == [
        {"role": "assistant", "content": ""}, {"role": "user", "content": "next"},
    ]  # fmt: skip


def test_scaled_shape_keeps_at_least_one_token() -> None:
    s = REASONING.scaled(input_scale=0.01, answer_scale=0.5)
    assert s.input_tokens == (1, 2) and s.answer_tokens == (200, 400)


@pytest.mark.parametrize(
    "kwargs",
    [{"num_sessions": 0}, {"num_turns": 0}, {"system_tokens": 0}, {"think_time_s": (2.0, 1.0)}],
)
def test_bad_configs_say_what_to_change(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="must be"):
        WorkloadConfig(**kwargs)


def test_bad_shape_ranges_are_refused() -> None:
    with pytest.raises(ValueError, match="answer_tokens"):
        Shape("x", (1, 2), (5, 4))


def test_seeded_text_has_exactly_the_asked_length() -> None:
    rng = random.Random(0)
    for n in range(1, 400):
        text = seeded_text(rng, n)
        assert len(text) == len(text_ids(text)) == n


def _digest(config: WorkloadConfig) -> str:
    plans = plan_sessions(config)
    data = {"plans": [asdict(p) for p in plans], "system": system_prompt(config),
            "texts": [input_texts(config, p, "push-r0") for p in plans]}  # fmt: skip
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (WorkloadConfig(shape=AGENTIC, seed=0),
         "e616205b6820b8925d4f241910906ac1496532fd769e65cbb3014b38ef2feb66"),
        (WorkloadConfig(shape=REASONING.scaled(0.4, 0.4), seed=7, num_sessions=3, num_turns=5),
         "791e7913fc6a35922db628fce14f48fd55f277d79c5a5fb380e3e9a822a09f56"),
    ],
)  # fmt: skip
def test_the_shapes_plans_and_texts_stay_what_they_were(config: WorkloadConfig, expected: str) -> None:
    """Results of earlier runs compare with new ones only while a seed plans the same work."""
    assert _digest(config) == expected
