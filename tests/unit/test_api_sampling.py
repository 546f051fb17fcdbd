"""Sampling parameters and logprobs at the OpenAI API of one instance (in process):
the response shapes, the refusals (unknown fields, n), and the fields accepted and
ignored."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from httpx_sse import connect_sse

from kvduplex.common.openai import render
from kvduplex.common.openai.protocol import IGNORED_FIELDS
from kvduplex.common.sampling import JSON_LOGPROB_FLOOR
from kvduplex.common.sampling import TokenLogprobs
from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.instance.server import Instance

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
COMPLETION = {"model": "tiny", "prompt": "hello hello", "max_tokens": 5, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(instance: Instance) -> Iterator[TestClient]:
    with TestClient(instance.app) as c:
        yield c
    stats = instance.async_engine.call(
        lambda e: (e.check_integrity(), e.block_pool.stats())
    ).result(10)[1]
    assert stats.num_in_use == 0, "a request left blocks in use"


def _ok(client: TestClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _refused(client: TestClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err: dict[str, Any] = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    return err


def _check_chat_entry(entry: dict[str, Any], k: int) -> None:
    assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
    assert entry["logprob"] <= 0 and bytes(entry["bytes"]).decode("utf-8", "replace")
    top = entry["top_logprobs"]
    assert len(top) == k
    assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
    assert all(set(t) == {"token", "logprob", "bytes"} for t in top)
    if k:
        assert top[0]["logprob"] >= entry["logprob"]


@pytest.mark.parametrize("k", [0, 3, 20])
def test_chat_logprobs_have_openais_shape(client: TestClient, k: int) -> None:
    body = _ok(
        client, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": k, "seed": 1}
    )
    choice = body["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] == 5
    for entry in content:
        _check_chat_entry(entry, k)
    assert "".join(e["token"] for e in content).startswith(choice["message"]["content"])


def test_greedy_chat_logprobs_name_the_most_likely_token(client: TestClient) -> None:
    body = _ok(
        client,
        "/v1/chat/completions",
        {**CHAT, "logprobs": True, "top_logprobs": 2, "temperature": 0},
    )
    for entry in body["choices"][0]["logprobs"]["content"]:
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert math.isclose(entry["top_logprobs"][0]["logprob"], entry["logprob"])


def test_completion_logprobs_have_openais_shape(client: TestClient) -> None:
    body = _ok(
        client,
        "/v1/completions",
        {**COMPLETION, "logprobs": 2, "temperature": 0, "return_token_ids": True},
    )
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(5)]
    for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert top[tok] == value  # greedy: the token is the most likely one, and in the map
        assert len(top) <= 3 and max(top.values()) == value


def test_no_logprobs_unless_asked(client: TestClient) -> None:
    assert _ok(client, "/v1/completions", COMPLETION)["choices"][0]["logprobs"] is None
    assert (
        _ok(client, "/v1/chat/completions", {**CHAT, "logprobs": False})["choices"][0]["logprobs"]
        is None
    )


@pytest.mark.parametrize("chat", [True, False])
def test_streamed_logprobs_equal_the_whole_answers(client: TestClient, chat: bool) -> None:
    if chat:
        path, body = (
            "/v1/chat/completions",
            {**CHAT, "logprobs": True, "top_logprobs": 2, "temperature": 0},
        )
    else:
        path, body = "/v1/completions", {**COMPLETION, "logprobs": 2, "temperature": 0}
    whole = _ok(client, path, body)["choices"][0]["logprobs"]
    parts: list[dict[str, Any]] = []
    with connect_sse(client, "POST", path, json={**body, "stream": True}) as events:
        for event in events.iter_sse():
            if event.data != "[DONE]":
                choice = json.loads(event.data)["choices"][0]
                if choice["logprobs"] is not None:
                    parts.append(choice["logprobs"])
    if chat:
        assert [e for p in parts for e in p["content"]] == whole["content"]
    else:
        for key in whole:
            assert [x for p in parts for x in p[key]] == whole[key], key


def test_penalties_and_min_p_reach_the_engine(client: TestClient) -> None:
    base = {**COMPLETION, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
    plain = _ok(client, "/v1/completions", base)["choices"][0]["token_ids"]
    for extra in (
        {"repetition_penalty": 2.0},
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
    ):
        got = _ok(client, "/v1/completions", {**base, **extra})["choices"][0]["token_ids"]
        assert got != plain, extra
    hot = {**base, "temperature": 1.5, "seed": 2}
    assert _ok(client, "/v1/completions", {**hot, "min_p": 1.0})["choices"][0]["token_ids"] == plain
    assert _ok(client, "/v1/completions", hot)["choices"][0]["token_ids"] != plain


def test_min_tokens_answers_with_that_many_real_tokens(client: TestClient) -> None:
    """The tiny preset's greedy answer to this prompt is EOS at once: min_tokens masks
    EOS until 4 tokens are out, as vLLM's, instead of counting EOS tokens."""
    eos = set(ByteTokenizer().eos_token_ids)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi there"}],
            "max_tokens": 6, "temperature": 0, "return_token_ids": True}  # fmt: skip
    plain = _ok(client, "/v1/chat/completions", chat)["choices"][0]
    assert plain["token_ids"][0] in eos and plain["message"]["content"] == ""
    choice = _ok(client, "/v1/chat/completions", {**chat, "min_tokens": 4})["choices"][0]
    real = [t for t in choice["token_ids"] if t not in eos]
    assert len(real) >= 4 and choice["token_ids"][:4] == real[:4]
    assert len(choice["message"]["content"]) >= 4


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_fields_are_refused_by_name(client: TestClient, path: str) -> None:
    body = CHAT if path.endswith("chat/completions") else COMPLETION
    err = _refused(client, path, {**body, "frobnicate": 1, "guided_regex": None})
    assert "frobnicate" in err["message"] and "guided_regex" in err["message"]
    assert err["param"] in ("frobnicate", "guided_regex")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_ignored_fields_are_accepted(client: TestClient, path: str) -> None:
    body = CHAT if path.endswith("chat/completions") else COMPLETION
    values = {"user": "u", "safety_identifier": "s", "metadata": {"k": "v"}, "store": False,
              "service_tier": "auto", "parallel_tool_calls": True}  # fmt: skip
    assert set(values) == IGNORED_FIELDS
    if path == "/v1/completions":
        values.pop("parallel_tool_calls")  # a chat field
    _ok(client, path, {**body, **values})


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"n": 2}, "n"),
        ("/v1/chat/completions", {"n": 4}, "n"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"logprobs": -1}, "logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "body"),
        ("/v1/completions", {"min_p": 1.5}, "min_p"),
        ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
        ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ],
)
def test_bad_sampling_values_are_refused(
    client: TestClient, path: str, extra: dict[str, Any], param: str
) -> None:
    body = CHAT if path.endswith("chat/completions") else COMPLETION
    err = _refused(client, path, {**body, **extra})
    assert err["param"] == param, err
    if param != "body":
        assert param in err["message"]
    else:
        assert "top_logprobs" in err["message"]


def test_logprob_rendering_of_split_characters_infinities_and_gaps() -> None:
    tok = ByteTokenizer()
    e_acute = "é".encode()  # two byte tokens, neither a character alone
    entries = [
        TokenLogprobs(e_acute[0], -0.5, 1, ((e_acute[0], -0.5), (e_acute[1], -1.0), (104, -2.0))),
        None,  # a token whose logits this instance never saw
        TokenLogprobs(ByteTokenizer.EOS_ID, float("-inf"), 9, ()),
    ]
    chat = render.chat_logprobs(tok, entries)["content"]
    assert [e["bytes"] for e in chat] == [[e_acute[0]], list(b"<|eos|>")]
    assert chat[0]["top_logprobs"][1] == {"token": "\ufffd", "logprob": -1.0, "bytes": [e_acute[1]]}
    assert chat[1]["logprob"] == JSON_LOGPROB_FLOOR
    done = render.completion_logprobs(tok, entries, text_offset=7)
    assert done["tokens"] == ["\ufffd", "<|eos|>"] and done["text_offset"] == [7, 8]
    # Both bytes decode to U+FFFD: the map keeps the likelier one's logprob.
    assert done["top_logprobs"][0] == {"\ufffd": -0.5, "h": -2.0}
    assert done["token_logprobs"][1] == JSON_LOGPROB_FLOOR


def test_the_openai_client_sends_the_fields_and_reads_the_logprobs(client: TestClient) -> None:
    oa = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)
    chat = oa.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, seed=3,
        logprobs=True, top_logprobs=2, frequency_penalty=0.5, presence_penalty=0.1,
        extra_body={"min_p": 0.1, "repetition_penalty": 1.2},
    )  # fmt: skip
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content is not None and len(content) == 3
    assert all(len(e.top_logprobs) == 2 and e.bytes for e in content)
    done = oa.completions.create(model="tiny", prompt="hi", max_tokens=3, logprobs=2)
    lp = done.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 3
    with pytest.raises(openai.BadRequestError, match="n=2 is not supported"):
        oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2)
