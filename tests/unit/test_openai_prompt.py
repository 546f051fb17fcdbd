"""Prompt ids of OpenAI requests (kvduplex.common.openai.prompt): messages with tools and tool
calls through the byte tokenizer's template and through a Hugging Face template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from kvduplex.common.model_source import load_tokenizer
from kvduplex.common.openai.prompt import PromptError
from kvduplex.common.openai.prompt import prompt_token_ids
from kvduplex.common.openai.prompt import template_messages
from kvduplex.common.openai.protocol import ChatCompletionRequest
from kvduplex.common.openai.protocol import CompletionRequest
from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.common.tokenizer import HFTokenizer
from tests.unit.test_tokenizer import write_hf_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
AGENT_TURNS: list[dict[str, Any]] = [
    {"role": "system", "content": "You are an agent."},
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"},
]


def _chat(**body: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "tiny", **body})


def test_null_content_is_empty_text() -> None:
    tok = ByteTokenizer()
    with_null = _chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}])
    with_empty = _chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}])
    assert prompt_token_ids(with_null, tok) == prompt_token_ids(with_empty, tok)


def test_plain_chat_renders_as_before_tools_existed() -> None:
    tok = ByteTokenizer()
    req = _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}])
    expected = "<|bos|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert prompt_token_ids(req, tok) == tok.encode(expected, add_special_tokens=False)
    assert prompt_token_ids(_chat(messages=req.messages, tools=[]), tok) == prompt_token_ids(req, tok)


def test_byte_template_renders_tools_calls_and_results_as_json() -> None:
    tok = ByteTokenizer()
    req = _chat(messages=AGENT_TURNS, tools=[WEATHER], tool_choice="auto")
    text = tok.decode(prompt_token_ids(req, tok), skip_special_tokens=False)
    calls = [{"id": "call_1", "name": "get_weather", "arguments": {"city": "Oslo"}}]
    assert text == (
        f"<|bos|><|im_start|>tools\n{json.dumps([WEATHER])}<|im_end|>\n"
        "<|im_start|>system\nYou are an agent.<|im_end|>\n"
        "<|im_start|>user\nWeather in Oslo?<|im_end|>\n"
        f"<|im_start|>assistant\n<tool_calls>{json.dumps(calls)}</tool_calls><|im_end|>\n"
        "<|im_start|>tool\n<tool_call_id>call_1</tool_call_id>-3 C, snow<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_arguments_that_are_not_a_json_object_stay_text() -> None:
    turns = json.loads(json.dumps(AGENT_TURNS))
    for args, expected in [("{broken", "{broken"), ("[1, 2]", "[1, 2]"), ('"\\ud800"', '"\\ud800"')]:
        turns[2]["tool_calls"][0]["function"]["arguments"] = args
        msgs = template_messages(_chat(messages=turns).messages)
        assert msgs[2]["tool_calls"][0]["function"]["arguments"] == expected
    turns[2]["tool_calls"][0]["function"]["arguments"] = '{"bad": "\\ud800"}'  # lone surrogate
    msgs = template_messages(_chat(messages=turns).messages)
    assert msgs[2]["tool_calls"][0]["function"]["arguments"] == '{"bad": "\\ud800"}'
    assert prompt_token_ids(_chat(messages=turns), ByteTokenizer())


TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|im_start|>system\n# Tools:{% for t in tools %} "
    "{{ t.function.name }}: {{ t.function.parameters | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call id={{ c.id }}>{{ c.function.name }}"
    "(city={{ c.function.arguments.city }})</call>{% endfor %}"
    "{% if m.tool_call_id %}[result of {{ m.tool_call_id }}]{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_hf_template_gets_tools_and_tool_calls_as_transformers_passes_them(tmp_path: Path) -> None:
    write_hf_tokenizer(tmp_path, chat_template=TOOL_TEMPLATE)
    tok = HFTokenizer(tmp_path)
    req = _chat(messages=AGENT_TURNS, tools=[WEATHER])
    text = tok.decode(prompt_token_ids(req, tok), skip_special_tokens=False)
    params = json.dumps(WEATHER["function"]["parameters"])
    assert text == (
        f"<s><|im_start|>system\n# Tools: get_weather: {params}<|im_end|>\n"
        "<|im_start|>system\nYou are an agent.<|im_end|>\n"
        "<|im_start|>user\nWeather in Oslo?<|im_end|>\n"
        "<|im_start|>assistant\n<call id=call_1>get_weather(city=Oslo)</call><|im_end|>\n"
        "<|im_start|>tool\n-3 C, snow[result of call_1]<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_load_tokenizer_honours_config_eos_ids(tmp_path: Path) -> None:
    write_hf_tokenizer(tmp_path)
    config = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "num_hidden_layers": 1, "intermediate_size": 128, "vocab_size": 300, "eos_token_id": [1],
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    tok = load_tokenizer(str(tmp_path))
    assert tok.eos_token_ids == (3, 1)  # the tokenizer's <|im_end|>, then config.json's </s>
    assert isinstance(load_tokenizer("tiny"), ByteTokenizer)
    with pytest.raises(ValueError, match="neither a preset"):
        load_tokenizer(str(tmp_path / "missing"))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tool_choice": "required"}, "tool_choice 'required' needs tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "needs tools"),
        ({"tool_choice": "any"}, "tool_choice 'any' is not supported"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "at least 1 character"),
        ({"n": 2}, "n=2 is not supported"),
        ({"top_logprobs": 3}, "top_logprobs needs logprobs: true"),
        ({"functions": []}, "Extra inputs are not permitted"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, None),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": [AGENT_TURNS[2]["tool_calls"][0]]}]},
            "tool_calls belong to assistant messages",
        ),
    ],
)
def test_what_stays_refused(body: dict[str, Any], message: str | None) -> None:
    full = {"messages": [{"role": "user", "content": "hi"}], **body}
    if message is None:
        _chat(**full)  # an empty list of calls is no call
        return
    with pytest.raises(ValidationError, match=message):
        _chat(**full)


def test_completion_prompts() -> None:
    tok = ByteTokenizer()
    assert prompt_token_ids(CompletionRequest(prompt="ab"), tok) == [tok.BOS_ID, 97, 98]
    assert prompt_token_ids(CompletionRequest(prompt=[[5, 6]]), tok) == [5, 6]
    for prompt, param in [("", "prompt"), ([], "prompt"), (["a", "b"], "prompt")]:
        with pytest.raises(PromptError) as info:
            prompt_token_ids(CompletionRequest(prompt=prompt), tok)
        assert info.value.param == param
