"""Tool-call and reasoning parsers over known answers: whole, token by token, and in
random cuts, which must all add up to the same message."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from kvduplex.cli.main import parse_args
from kvduplex.cli.settings import parsing_flags
from kvduplex.common.openai.chat_output import ChatOutputParser
from kvduplex.common.openai.chat_output import ParsedMessage
from kvduplex.common.openai.chat_output import check_tool_choice
from kvduplex.common.openai.chat_output import output_parser
from kvduplex.common.openai.parsing_config import ParsingConfig
from kvduplex.common.openai.protocol import ChatCompletionRequest
from kvduplex.common.openai.reasoning import ThinkParser
from kvduplex.common.openai.reasoning import starts_in_reasoning

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
]


def _ids() -> itertools.count[int]:
    return itertools.count()


def _request(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **fields}
    )


def _parser(
    tool: str = "", reasoning: str = "", tail: str = "", **fields: object
) -> ChatOutputParser:
    flags = ParsingConfig(tool_call_parser=tool, reasoning_parser=reasoning, enable_auto_tool_choice=bool(tool))
    counter = _ids()
    parser = output_parser(_request(**fields), flags, tail, new_id=lambda: f"call_{next(counter)}")
    assert parser is not None
    return parser


@dataclass
class Streamed:
    """A stream's deltas added up the way a client adds them."""

    content: str = ""
    reasoning: str = ""
    calls: dict[int, dict] | None = None
    finish_reason: str | None = None
    num_deltas: int = 0

    def message(self, has_reasoning_parser: bool) -> dict:
        calls = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["args"]},
            }
            for _, c in sorted((self.calls or {}).items())
        ]
        out: dict = {"role": "assistant", "content": self.content or None}
        if has_reasoning_parser:
            out["reasoning_content"] = self.reasoning or None
        if calls:
            out["tool_calls"] = calls
        return out


def stream(parser: ChatOutputParser, pieces: list[str], finish_reason: str = "stop") -> Streamed:
    out = Streamed(calls={})
    assert out.calls is not None
    deltas = [parser.feed(p).to_json() for p in pieces]
    last, out.finish_reason = parser.finish(finish_reason)
    deltas.append(last.to_json())
    for d in deltas:
        out.num_deltas += bool(d)
        out.content += d.get("content", "")
        out.reasoning += d.get("reasoning_content", "")
        for c in d.get("tool_calls", []):
            if "id" in c:
                assert c["index"] not in out.calls, "a call is announced once"
                assert c["index"] == len(out.calls), "calls are announced in order"
                assert c["type"] == "function" and c["function"]["name"]
                out.calls[c["index"]] = {"id": c["id"], "name": c["function"]["name"], "args": ""}
            else:
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
            out.calls[c["index"]]["args"] += c["function"]["arguments"]
    return out


def cuts(text: str, rng: random.Random) -> list[str]:
    """`text` cut at random places (pieces of 1 to 8 characters, some empty)."""
    out, i = [], 0
    while i < len(text):
        n = rng.choice([0, 1, 1, 2, 3, 5, 8])
        out.append(text[i : i + n])
        i += n
    return out


def check_consistent(
    make: object, text: str, trials: int = 40, finish_reason: str = "stop"
) -> ParsedMessage:
    """The whole answer's message; every streamed cutting adds up to it."""
    assert callable(make)
    whole = make().parse(text, finish_reason)
    want = whole.to_json()
    has_reasoning = whole.has_reasoning_parser
    per_char = stream(make(), list(text), finish_reason)
    assert per_char.message(has_reasoning) == want and per_char.finish_reason == whole.finish_reason
    rng = random.Random(len(text))
    for _ in range(trials):
        got = stream(make(), cuts(text, rng), finish_reason)
        assert got.message(has_reasoning) == want, text
        assert got.finish_reason == whole.finish_reason
    return whole


def _call(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


# --------------------------------------------------------------------------- hermes


def test_hermes_one_call_without_content() -> None:
    text = _call("get_weather", {"city": "Paris", "unit": "c"})
    msg = check_consistent(lambda: _parser("hermes"), text)
    assert msg.content is None and msg.finish_reason == "tool_calls"
    [call] = msg.tool_calls
    assert call.id == "call_0" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "c"}
    assert call.arguments == '{"city": "Paris", "unit": "c"}', "the model's own text"


def test_hermes_content_and_several_calls() -> None:
    nested = {"q": "a } b </x> {", "opts": {"deep": [1, {"k": "}}"}]}, "n": -1.5e3}
    text = (
        "Let me check both.\n" + _call("get_weather", {"city": "Oslo"}) + "\n"
        + _call("search", nested) + "\nDone."
    )  # fmt: skip
    msg = check_consistent(lambda: _parser("hermes"), text)
    assert msg.content == "Let me check both.\n\n\nDone.", "the text outside the blocks"
    assert [c.name for c in msg.tool_calls] == ["get_weather", "search"]
    assert [c.id for c in msg.tool_calls] == ["call_0", "call_1"]
    assert json.loads(msg.tool_calls[1].arguments) == nested


def test_hermes_plain_answer_is_content_unchanged() -> None:
    text = "No tools needed: 2 < 3 and <tool is not a tag.\n"
    msg = check_consistent(lambda: _parser("hermes"), text)
    assert msg.content == text and msg.tool_calls == [] and msg.finish_reason == "stop"


def test_hermes_partial_markup_is_never_streamed_as_content() -> None:
    parser = _parser("hermes")
    seen = [parser.feed(p).to_json() for p in ["Hi <", "tool_", "call>", '{"name": "f", "argu']]
    assert seen[0] == {"content": "Hi"}  # the space waits too: it may sit next to a call
    assert seen[1] == {} and seen[2] == {} and seen[3] == {}
    announced = parser.feed('ments": {"a').to_json()
    assert announced == {
        "tool_calls": [
            {"index": 0, "id": "call_0", "type": "function",
             "function": {"name": "f", "arguments": '{"a'}},
        ]
    }  # fmt: skip
    assert parser.feed('": 1}').to_json() == {
        "tool_calls": [{"index": 0, "function": {"arguments": '": 1'}}]
    }
    assert parser.feed("}\n</tool_call>").to_json() == {
        "tool_calls": [{"index": 0, "function": {"arguments": "}"}}]
    }


def test_hermes_arguments_before_name_are_sent_whole() -> None:
    text = '<tool_call>{"arguments": {"x": [1, 2]}, "name": "f"}</tool_call>'
    msg = check_consistent(lambda: _parser("hermes"), text)
    [call] = msg.tool_calls
    assert call.name == "f" and json.loads(call.arguments) == {"x": [1, 2]}


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>not json</tool_call> after",
        '<tool_call>{"arguments": {}}</tool_call>',
        "ends inside a tag <tool_ca",
    ],
)
def test_hermes_block_without_a_call_is_content(text: str) -> None:
    msg = check_consistent(lambda: _parser("hermes"), text)
    assert msg.tool_calls == [] and msg.content == text.strip()


@pytest.mark.parametrize("tool", ["hermes", "llama3_json"])
def test_deeply_nested_output_is_content_not_a_crash(tool: str) -> None:
    deep = "[" * 50_000
    text = f'<tool_call>{{"arguments": {deep}</tool_call>' if tool == "hermes" else "{" + deep
    msg = _parser(tool).parse(text, "stop")
    assert msg.tool_calls == [] and msg.content == text


def test_hermes_call_cut_by_max_tokens_keeps_its_text() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {"path": "/tm'
    msg = check_consistent(lambda: _parser("hermes"), text, finish_reason="length")
    [call] = msg.tool_calls
    assert call.arguments == '{"path": "/tm'
    assert msg.finish_reason == "length" and msg.content is None


CUT_CALLS = [
    ("hermes", 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "', '{"city": "'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par', '{"city": "Par'),
]
"""(parser, an answer a stop string or EOS cut inside its call, the call's arguments so far)"""


@pytest.mark.parametrize(("tool", "text", "args"), CUT_CALLS)
def test_call_cut_by_a_stop_is_content_in_a_whole_answer(tool: str, text: str, args: str) -> None:
    """As vLLM: a call that does not parse leaves the answer's text as content, and the
    finish reason the engine gave ("stop": a stop string or EOS)."""
    msg = _parser(tool).parse(text, "stop")
    assert msg.tool_calls == [] and msg.finish_reason == "stop"
    assert msg.content == text
    # max_tokens keeps the call: "length" says it is partial.
    cut = _parser(tool).parse(text, "length")
    assert [(c.name, c.arguments) for c in cut.tool_calls] == [("get_weather", args)]
    assert cut.finish_reason == "length"


@pytest.mark.parametrize(("tool", "text", "args"), CUT_CALLS)
def test_call_cut_by_a_stop_in_a_stream_ends_as_for_max_tokens(
    tool: str, text: str, args: str
) -> None:
    """A stream sent the call's deltas before the cut: they stand, the rest of its text
    follows as for ``length``, and the finish reason stays "stop", never "tool_calls"."""
    want = _parser(tool).parse(text, "length").to_json()
    rng = random.Random(7)
    for pieces in [list(text), *(cuts(text, rng) for _ in range(20))]:
        got = stream(_parser(tool), pieces, "stop")
        assert got.message(has_reasoning_parser=False) == want
        assert got.finish_reason == "stop"
        [call] = (got.calls or {}).values()
        assert call["args"] == args


def test_a_whole_call_before_a_cut_one_stays_a_call() -> None:
    whole = _call("get_weather", {"city": "Oslo"})
    text = whole + '\n<tool_call>\n{"name": "clock", "arguments": {"tz'
    msg = _parser("hermes").parse(text, "stop")
    assert [c.name for c in msg.tool_calls] == ["get_weather"]
    assert msg.content == text[len(whole) :] and msg.finish_reason == "tool_calls"
    streamed = stream(_parser("hermes"), list(text), "stop")
    assert streamed.finish_reason == "tool_calls" and len(streamed.calls or {}) == 2


@pytest.mark.parametrize("tool", ["hermes", "llama3_json"])
def test_a_stop_string_at_the_end_markup_leaves_a_whole_call(tool: str) -> None:
    """stop: ["</tool_call>"] (or EOS right after the object): the object is whole JSON,
    so the call stands and the answer ends in "tool_calls"."""
    obj = json.dumps({"name": "get_weather", "parameters": {"city": "Paris"}})
    text = f"<tool_call>\n{obj}\n" if tool == "hermes" else obj
    msg = check_consistent(lambda: _parser(tool), text)
    [call] = msg.tool_calls
    assert json.loads(call.arguments) == {"city": "Paris"} and msg.finish_reason == "tool_calls"


# --------------------------------------------------------------------------- llama3_json


def test_llama3_json_calls_separated_by_semicolons() -> None:
    a = {"name": "get_weather", "parameters": {"city": "Rome; Italy"}}
    b = {"name": "clock", "parameters": {}}
    for text in (
        json.dumps(a) + "; " + json.dumps(b),
        "<|python_tag|>" + json.dumps(a) + ";" + json.dumps(b),
    ):
        msg = check_consistent(lambda: _parser("llama3_json"), text)
        assert msg.content is None and msg.finish_reason == "tool_calls"
        assert [c.name for c in msg.tool_calls] == ["get_weather", "clock"]
        assert json.loads(msg.tool_calls[0].arguments) == {"city": "Rome; Italy"}
        assert msg.tool_calls[1].arguments == "{}"


@pytest.mark.parametrize(
    "text", ["The weather is fine.", ' {"answer": 42} is JSON but no call', "<|python", "{"]
)
def test_llama3_json_other_answers_are_content(text: str) -> None:
    msg = check_consistent(lambda: _parser("llama3_json"), text)
    assert msg.tool_calls == [] and msg.content == text.lstrip()


def test_llama3_json_text_after_the_calls_is_content() -> None:
    text = '{"name": "f", "parameters": {"a": 1}}\nThat is all.'
    msg = check_consistent(lambda: _parser("llama3_json"), text)
    assert [c.arguments for c in msg.tool_calls] == ['{"a": 1}'] and msg.content == "That is all."


# --------------------------------------------------------------------------- reasoning


@pytest.mark.parametrize(
    ("parser", "tail", "text", "reasoning", "content"),
    [
        (
            "deepseek_r1",
            "<|im_start|>assistant\n",
            "<think>\nhmm\n</think>\n\nYes.",
            "\nhmm\n",
            "\n\nYes.",
        ),
        ("deepseek_r1", "<|im_start|>assistant\n", "hmm</think>Yes.", "hmm", "Yes."),
        (
            "deepseek_r1",
            "assistant\n<think>\n",
            "hmm, </thin the tag</think>Yes.",
            "hmm, </thin the tag",
            "Yes.",
        ),
        ("qwen3", "assistant\n<think>\n", "hmm</think>Yes.", "hmm", "Yes."),
        ("qwen3", "assistant\n", "<think>hmm</think>Yes.", "hmm", "Yes."),
        ("qwen3", "assistant\n", "Yes, no thinking. </think>", None, "Yes, no thinking. </think>"),
        (
            "qwen3",
            "assistant\n<think>\n\n</think>\n\n",
            "<think>x</think>",
            None,
            "<think>x</think>",
        ),
        ("deepseek_r1", "assistant\n", "cut short by max_tok", "cut short by max_tok", None),
        ("qwen3", "assistant\n", "<thin", None, "<thin"),
    ],
)
def test_reasoning_split(
    parser: str, tail: str, text: str, reasoning: str | None, content: str | None
) -> None:
    msg = check_consistent(lambda: _parser(reasoning=parser, tail=tail), text)
    assert (msg.reasoning_content, msg.content) == (reasoning, content)
    assert msg.to_json()["reasoning_content"] == reasoning


def test_reasoning_then_tool_calls() -> None:
    text = "<think>\nThe user wants weather.\n</think>\n\nChecking." + _call(
        "get_weather", {"city": "Lima"}
    )
    msg = check_consistent(lambda: _parser("hermes", "qwen3", tail="assistant\n"), text)
    assert msg.reasoning_content == "\nThe user wants weather.\n"
    assert msg.content == "\n\nChecking." and msg.finish_reason == "tool_calls"
    assert [c.name for c in msg.tool_calls] == ["get_weather"]


def test_tool_call_markup_inside_reasoning_is_reasoning() -> None:
    text = "<think>maybe " + _call("f", {}) + "</think>ok"
    msg = check_consistent(lambda: _parser("hermes", "deepseek_r1"), text)
    assert (
        msg.tool_calls == []
        and msg.content == "ok"
        and "<tool_call>" in (msg.reasoning_content or "")
    )


def test_think_parser_streams_reasoning_as_it_comes() -> None:
    p = ThinkParser(starts_in_reasoning("qwen3", "x<think>\n"))
    assert p.feed("step one, ") == ("step one, ", "")
    assert p.feed("two</th") == ("two", "")
    assert p.feed("ink>Answer") == ("", "Answer")
    assert p.finish() == ("", "")


# --------------------------------------------------------------------------- requests


def test_which_requests_are_parsed() -> None:
    flags = ParsingConfig(tool_call_parser="hermes", enable_auto_tool_choice=True)
    assert output_parser(_request(), flags, "") is not None
    assert output_parser(_request(tool_choice="none"), flags, "") is None
    assert output_parser(_request(tools=None), flags, "") is None
    no_auto = ParsingConfig(tool_call_parser="hermes")
    assert output_parser(_request(), no_auto, "") is None
    assert output_parser(_request(), ParsingConfig(), "") is None
    with pytest.raises(ValueError, match="enable-auto-tool-choice"):
        check_tool_choice(_request(tool_choice="auto"), no_auto)
    check_tool_choice(_request(tool_choice="auto"), flags)
    check_tool_choice(_request(tool_choice="none"), no_auto)


def test_parsing_config_names_what_to_change() -> None:
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ParsingConfig(tool_call_parser="mistral")
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        ParsingConfig(reasoning_parser="r2")
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ParsingConfig(enable_auto_tool_choice=True)


def test_serve_and_router_take_vllm_flag_names() -> None:
    flags = [
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
        "--enable-auto-tool-choice",
    ]
    serve = parse_args(["serve", *flags]).server_config()
    assert serve.parsing == ParsingConfig(
        tool_call_parser="hermes", reasoning_parser="qwen3", enable_auto_tool_choice=True
    )
    router = parse_args(["router", "--decode", "http://d", *flags]).router_config()
    assert router.parsing == serve.parsing
    assert parse_args(["serve"]).server_config().parsing == ParsingConfig()
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        parse_args(["serve", "--enable-auto-tool-choice"])
    # `kvduplex up` hands them on to the router (or the colocated instance) it starts.
    up = parse_args(["up", *flags])
    assert parsing_flags(up.parsing) == flags


def test_parsers_do_not_import_torch() -> None:
    code = (
        "import sys; import kvduplex.common.openai.chat_output; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- any text

FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<tool_", "<think>", "</think>", "</th", "<|python_tag|>",
    '{"name": "f", "arguments": ', '{"name": "g", "parameters": ', '{"arguments": {}, "name": "h"}',
    "{", "}", "}}", '"a"', ": ", ", ", "[1, 2]", '"x}y"', "\\", '"\\"', ";", " ", "\n", "ok", "<",
]  # fmt: skip


@given(
    parts=st.lists(st.sampled_from(FRAGMENTS), max_size=14),
    tool=st.sampled_from(["", "hermes", "llama3_json"]),
    reasoning=st.sampled_from(["", "deepseek_r1", "qwen3"]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=300, deadline=None, derandomize=True)
def test_any_text_streams_to_its_whole_result(
    parts: list[str], tool: str, reasoning: str, seed: int
) -> None:
    """Whatever the model writes, a stream cut anywhere adds up to the whole answer's
    message, and nothing raises. A whole answer that a stop cut inside a call (content)
    differs from the stream (the call's deltas went out), which ends as for length."""
    if not tool and not reasoning:
        tool = "hermes"
    text = "".join(parts)
    whole = _parser(tool, reasoning).parse(text, "stop")
    kept = _parser(tool, reasoning).parse(text, "length")
    got = stream(_parser(tool, reasoning), cuts(text, random.Random(seed)))
    assert got.message(whole.has_reasoning_parser) == kept.to_json()
    assert got.finish_reason == whole.finish_reason
    if len(whole.tool_calls) == len(kept.tool_calls):  # no call cut short
        assert whole.to_json() == kept.to_json()
    else:  # the last call was cut short: its text is content
        assert len(whole.tool_calls) == len(kept.tool_calls) - 1
        assert (whole.content or "").rstrip().endswith(kept.tool_calls[-1].arguments.rstrip())
