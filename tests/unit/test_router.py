"""The router in process, over fake instances (`tests.support.fake_instances`): what it refuses
itself, what it sends each instance, its metrics, and the first-token relay of push."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from httpx_sse import connect_sse
from prometheus_client.parser import text_string_to_metric_families

from kvduplex.cli.main import parse_args
from kvduplex.common.config import ReturnMode
from kvduplex.common.config import TransferMode as Mode
from kvduplex.common.openai.render import FIRST_TOKEN_IDS_FIELD
from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.instance.server import Instance
from kvduplex.router.app import create_router_app
from kvduplex.router.config import RouterConfig
from kvduplex.router.relay import SentToken
from kvduplex.router.relay import Splice
from kvduplex.router.relay import splice_first_token
from kvduplex.router.state import RouterState
from tests.support.fake_instances import mock_instances

P, D = "http://p0", "http://d0"
D_ANSWER_ID = "cmpl-d0answer"
"""The id of D's streamed answer (its X-Request-ID header and its chunks' `id`)."""


def _chunk(choice: dict[str, Any]) -> str:
    return json.dumps({"id": D_ANSWER_ID, "object": "text_completion", "choices": [choice]})


@dataclass
class FakeInstances:
    """One P and one D: records what they get; D answers with `answer_ids`."""

    answer_ids: list[int] = field(default_factory=lambda: [104, 105])
    calls: list[tuple[str, dict[str, Any], httpx.Headers]] = field(default_factory=list)
    gate: threading.Event | None = None
    """When set, D's stream waits for it before its first event."""
    decode_first_token: tuple[int, str] | None = None
    """D's first token and its text, if not P's (a fallback that sampled another)."""

    def bodies(self, path: str) -> list[dict[str, Any]]:
        return [body for p, body, _ in self.calls if p == path]

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.path in ("/health", "/ready"):
            return httpx.Response(200, json={"status": "ok"})  # the router's probes
        body = json.loads(request.content) if request.content else {}
        self.calls.append((str(request.url), body, request.headers))
        url = str(request.url)
        if url == P + "/internal/push/prefill":
            ans: dict[str, Any] = {"xid": body["xid"], "first_token": self.answer_ids[0]}
            if body.get("logprobs") is not None:  # P computes the first token's
                top = [[self.answer_ids[0], -0.5], [99, -1.5]][: body["logprobs"]]
                lp = {"token_id": self.answer_ids[0], "logprob": -0.5, "rank": 1, "top": top}
                ans["first_token_logprobs"] = lp
            return httpx.Response(200, json=ans)
        if url == P + "/internal/prefill":
            return httpx.Response(200, json={"xid": body["xid"], "block_ids": [0], "num_tokens": 3})
        if url.endswith("/internal/push/cancel"):
            return httpx.Response(200, json={"xid": body["xid"], "cancelled": True})
        if not body.get("stream"):
            choice = {"index": 0, "text": "hi", "token_ids": self.answer_ids, "finish_reason": "length"}
            return httpx.Response(200, json={"id": "cmpl-x", "choices": [choice]})
        mark = bool((body.get("kv_transfer_params") or {}).get("mark_first_token"))
        headers = {"content-type": "text/event-stream", "x-request-id": D_ANSWER_ID}
        return httpx.Response(200, headers=headers, content=self._stream(mark))

    async def _stream(self, mark: bool = False) -> AsyncIterator[bytes]:
        """D's answer as an instance streams it; `mark`: the first chunk names its ids."""
        if self.gate is not None:
            await asyncio.to_thread(self.gate.wait, 10)
        steps = [(tok, chr(tok)) for tok in self.answer_ids]
        if self.decode_first_token is not None:
            steps[0] = self.decode_first_token
        for i, (tok, text) in enumerate(steps):
            finish = "length" if i == len(steps) - 1 else None
            choice = {"index": 0, "text": text, "token_ids": [tok], "finish_reason": finish}
            chunk = json.loads(_chunk(choice))
            if mark and i == 0:
                chunk[FIRST_TOKEN_IDS_FIELD] = [tok]
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"


def _router(fake: FakeInstances, mode: Mode = Mode.PUSH) -> TestClient:
    config = RouterConfig(prefill=(P,), decode=(D,), mode=mode)
    state = RouterState.create(config, ByteTokenizer(), make_client=mock_instances(fake.handle))
    return TestClient(create_router_app(state))


def _metric(client: TestClient, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


# ------------------------------------------------- refusals: the instance's words


SURROGATE = b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'
BAD = [
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}),
    ("/v1/completions", {"prompt": "x", "temperature": -1}),
    ("/v1/completions", {"prompt": "x", "n": 3}),
    ("/v1/completions", {"prompt": ""}),
    ("/v1/completions", {"prompt": []}),
    ("/v1/completions", {"prompt": ["a", "b"]}),
    ("/v1/completions", {"max_tokens": 3}),
    ("/v1/completions", {"prompt": "x", "echo": True}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "guided_json": {}}),
    ("/v1/completions", {"prompt": "x", "frobnicate": None, "best_of": 1}),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": -1}),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "prompt_cache_key": "k" * 600}),
    ("/v1/chat/completions", b"{not json"),
    ("/v1/chat/completions", SURROGATE),
]


@pytest.mark.parametrize(("path", "body"), BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_router_refuses_bad_input_in_the_instances_words(
    instance: Instance, path: str, body: dict[str, Any] | bytes
) -> None:
    fake = FakeInstances()
    content = body if isinstance(body, bytes) else json.dumps({"model": "tiny", **body}).encode()
    headers = {"content-type": "application/json"}
    with TestClient(instance.app) as direct, _router(fake) as router:
        want = direct.post(path, content=content, headers=headers)
        got = router.post(path, content=content, headers=headers)
    assert 400 <= want.status_code < 500, want.text
    assert (got.status_code, got.json()) == (want.status_code, want.json())
    assert fake.calls == [], "refused without reaching an instance"


# ------------------------------------------------- what the instances get


@pytest.mark.parametrize("mode", [Mode.PUSH, Mode.PULL])
def test_instances_get_the_prompt_ids_the_body_and_the_session(mode: Mode) -> None:
    fake = FakeInstances()
    tok = ByteTokenizer()
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": None}]
    body = {
        "model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0.0,
        "user": "\ud800", "kv_transfer_params": {"mode": "pull", "xid": "spoofed", "prefill_url": "x"},
    }  # fmt: skip
    with _router(fake, mode) as router:
        r = router.post(
            "/v1/chat/completions", content=json.dumps(body).encode(),
            headers={"content-type": "application/json", "x-session-id": "abc"},
        )  # fmt: skip
        assert r.status_code == 200, r.text
        r = router.post("/v1/chat/completions", json={**body, "user": "u", "prompt_cache_key": "k"})
        assert r.status_code == 200, r.text
    p_path = P + ("/internal/push/prefill" if mode is Mode.PUSH else "/internal/prefill")
    p_bodies = fake.bodies(p_path)
    d_bodies = fake.bodies(D + "/v1/chat/completions")
    ids = tok.encode("<|bos|><|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"
                     "<|im_start|>assistant\n", add_special_tokens=False)  # fmt: skip
    assert [b["prompt_token_ids"] for b in p_bodies] == [ids, ids]
    assert [b["session_id"] for b in p_bodies] == ["abc", "k"]
    assert [b["kv_transfer_params"]["session_id"] for b in d_bodies] == ["abc", "k"]
    assert {b["kv_transfer_params"]["mode"] for b in d_bodies} == {mode.value}
    assert all(b["kv_transfer_params"]["xid"] != "spoofed" for b in d_bodies)
    sent = {k: v for k, v in d_bodies[0].items() if k != "kv_transfer_params"}
    assert sent == {k: v for k, v in body.items() if k != "kv_transfer_params"}


@pytest.mark.parametrize("mode", [Mode.PUSH, Mode.PULL])
def test_prefill_samples_the_first_token_with_the_requests_penalties(mode: Mode) -> None:
    fake = FakeInstances()
    sampling = {"temperature": 0.7, "seed": 5, "min_p": 0.1, "repetition_penalty": 1.4,
                "presence_penalty": 0.5, "frequency_penalty": -0.5, "top_k": 9, "top_p": 0.8,
                "min_tokens": 2, "stop_token_ids": [7], "ignore_eos": True}  # fmt: skip
    with _router(fake, mode) as router:
        r = router.post("/v1/completions", json={"model": "tiny", "prompt": "hi", **sampling})
        assert r.status_code == 200, r.text
    p_path = P + ("/internal/push/prefill" if mode is Mode.PUSH else "/internal/prefill")
    (p_body,) = fake.bodies(p_path)
    assert {k: p_body[k] for k in sampling} == sampling
    (d_body,) = fake.bodies(D + "/v1/completions")
    assert {k: d_body[k] for k in sampling} == sampling


@pytest.mark.parametrize("stream", [False, True])
def test_push_carries_prefills_first_token_logprobs(stream: bool) -> None:
    """A request asking for logprobs is pushed: P computes its first token's (D never sees
    those logits) and the router's first chunk carries them."""
    fake = FakeInstances()
    body = {"model": "tiny", "prompt": "hi", "logprobs": 2, "stream": stream}
    with _router(fake, Mode.PUSH) as router:
        r = router.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert _metric(router, "kvduplex_router_requests_total", mode="push") == 1
    (p_body,) = fake.bodies(P + "/internal/push/prefill")
    assert p_body["logprobs"] == 2
    (d_body,) = fake.bodies(D + "/v1/completions")
    assert d_body["kv_transfer_params"]["mode"] == "push"
    if stream:
        first = json.loads(r.text.split("\n\n")[0][len("data: ") :])["choices"][0]
        assert first["text"] == "h" and first["logprobs"] == {
            "tokens": ["h"], "token_logprobs": [-0.5], "top_logprobs": [{"h": -0.5, "c": -1.5}],
            "text_offset": [0],
        }  # fmt: skip


@pytest.mark.parametrize("mode", [Mode.PUSH, Mode.PULL])
def test_client_request_id_is_echoed_and_reaches_no_instance(mode: Mode) -> None:
    """A client's X-Request-ID comes back on every answer (streamed, whole, refused) and
    is never sent on: no instance sees it, and the transfer id is the router's own."""
    fake = FakeInstances()
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0.0}
    headers = {"X-Request-ID": "client-1"}
    with _router(fake, mode) as router:
        for stream in (False, True):
            r = router.post("/v1/completions", json={**body, "stream": stream}, headers=headers)
            assert r.status_code == 200 and r.headers["x-request-id"] == "client-1", r.text
        r = router.post("/v1/completions", json={**body, "max_tokens": 0}, headers=headers)
        assert r.status_code == 400 and r.headers["x-request-id"] == "client-1"
        r = router.post("/v1/completions", json={**body, "stream": True})
        assert r.headers["x-request-id"] == D_ANSWER_ID, "without one: the answer's id"
    assert fake.calls
    for _, sent, sent_headers in fake.calls:
        assert "x-request-id" not in sent_headers
        assert "client-1" not in json.dumps(sent)


def test_metrics_count_sessions_and_flows() -> None:
    fake = FakeInstances()
    base = {"model": "tiny", "max_tokens": 2, "temperature": 0.0}
    with _router(fake) as router:
        for turn in range(3):
            prompt = list(range(1, 40 + 10 * turn))  # each turn extends the one before
            assert router.post("/v1/completions", json={**base, "prompt": prompt}).status_code == 200
        for _ in range(2):
            r = router.post("/v1/completions", json={**base, "prompt": [7, 8]}, headers={"x-session-id": "n"})
            assert r.status_code == 200
        assert _metric(router, "kvduplex_router_session_misses_total") == 2
        assert _metric(router, "kvduplex_router_session_hits_total") == 3
        assert _metric(router, "kvduplex_router_requests_total", mode="push") == 5
        assert _metric(router, "kvduplex_router_sessions") == 2
        health = router.get("/health").json()
        assert (health["status"], health["role"]) == ("ok", "router")
        assert [(i["role"], i["healthy"]) for i in health["instances"]] == [("prefill", True), ("decode", True)]


# ------------------------------------------------- push: P's first token first


def test_push_stream_sends_prefills_token_first_and_drops_decodes_copy() -> None:
    fake = FakeInstances(answer_ids=[65, 66, 67], gate=threading.Event())
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "temperature": 0.0,
            "stream": True, "return_token_ids": True}  # fmt: skip
    with _router(fake) as router, connect_sse(router, "POST", "/v1/completions", json=body) as src:
        events = src.iter_sse()
        first = json.loads(next(events).data)
        fake.gate.set()  # only now may D's stream begin: the first chunk came from P's answer
        rest = [e.data for e in events]
    assert first["choices"][0]["text"] == "A" and first["choices"][0]["token_ids"] == [65]
    assert first["id"] == D_ANSWER_ID, "P's token goes out under the id of D's answer"
    assert rest[-1] == "[DONE]"
    chunks = [json.loads(data) for data in rest[:-1]]
    assert all(FIRST_TOKEN_IDS_FIELD not in c for c in chunks), "internal: never to the client"
    choices = [c["choices"][0] for c in chunks]
    assert [c["token_ids"] for c in choices] == [[66], [67]]
    assert "".join(c["text"] for c in choices) == "BC" and choices[-1]["finish_reason"] == "length"
    (d_body,) = fake.bodies(D + "/v1/completions")
    assert d_body["kv_transfer_params"]["mark_first_token"] is True


@pytest.mark.parametrize("same_text", [False, True])
def test_push_stream_never_mixes_when_decodes_first_token_is_another(same_text: bool) -> None:
    """D fell back and sampled another first token than P's, already sent (one whose text
    is even the same, as two ids of one text can be): the stream ends with an error
    event instead of P's token followed by the rest of D's answer."""
    fake = FakeInstances(answer_ids=[65, 66, 67], gate=threading.Event())
    fake.decode_first_token = (300, "A") if same_text else (90, "Z")
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "temperature": 0.0,
            "stream": True, "return_token_ids": True}  # fmt: skip
    with _router(fake) as router, connect_sse(router, "POST", "/v1/completions", json=body) as src:
        events = src.iter_sse()
        first = json.loads(next(events).data)
        fake.gate.set()
        rest = [e.data for e in events]
        assert _metric(router, "kvduplex_router_instance_healthy", url=D, role="decode") == 1
        assert _metric(router, "kvduplex_router_first_token_diverged_total") == 1
    assert first["choices"][0]["token_ids"] == [65]
    assert rest[-1] == "[DONE]" and len(rest) == 2, rest
    error = json.loads(rest[0])["error"]
    assert (error["type"], error["code"]) == ("server_error", "decode_diverged")


def _event(choice: dict[str, Any], ids: list[int] | None = None) -> str:
    chunk: dict[str, Any] = {"id": "c", "choices": [choice]}
    if ids is not None:
        chunk[FIRST_TOKEN_IDS_FIELD] = ids
    return json.dumps(chunk)


def test_splice_first_token_of_decode_stream_by_id() -> None:
    sent = SentToken(97, "a")
    mid = {"index": 0, "text": "a", "token_ids": [97], "finish_reason": None}
    assert splice_first_token(_event(mid, [97]), sent) == (Splice.DROPPED, None)
    assert splice_first_token(_event(mid, [98]), sent) == (Splice.DIVERGED, None), "same text"
    assert splice_first_token(_event(mid), sent) == (Splice.DROPPED, None), "no ids: by text"
    other = {"index": 0, "text": "b", "token_ids": [98], "finish_reason": None}
    assert splice_first_token(_event(other), sent) == (Splice.DIVERGED, None)
    splice, kept = splice_first_token(_event(mid, [97]), None)  # nothing sent: relayed
    assert splice is Splice.RELAYED and kept is not None
    assert json.loads(kept) == {"id": "c", "choices": [mid]}, "less the id field"
    final = {"index": 0, "text": "\ufffd", "token_ids": [226], "finish_reason": "length"}
    splice, kept = splice_first_token(_event(final, [226]), SentToken(226, ""))
    assert splice is Splice.DROPPED and kept is not None
    choice = json.loads(kept)["choices"][0]
    assert choice == {"index": 0, "text": "\ufffd", "token_ids": [], "finish_reason": "length"}
    chat = {"index": 0, "delta": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
    splice, kept = splice_first_token(_event(chat, [5]), SentToken(5, "hi"))
    assert kept is not None and json.loads(kept)["choices"][0]["delta"] == {"content": ""}
    assert splice_first_token("[DONE]", sent) == (Splice.NOT_CONTENT, "[DONE]")
    usage = json.dumps({"choices": [], "usage": {}})
    assert splice_first_token(usage, sent) == (Splice.NOT_CONTENT, usage)


# ------------------------------------------------- flags


def test_router_flags_come_from_router_config_and_up_passes_them_on() -> None:
    argv = ["router", "--prefill", "http://p/", "--decode", "http://d", "--mode", "pull",
            "--session-ttl-s", "30", "--max-sessions", "5", "--return-mode", "push",
            "--short-append-tokens", "16", "--health-interval-s", "0.5", "--health-failures", "3",
            "--api-key", "sk-xyzzy"]  # fmt: skip
    cfg = parse_args(argv).router_config()
    assert (cfg.prefill, cfg.decode, cfg.mode) == (("http://p",), ("http://d",), Mode.PULL)
    assert (cfg.session_ttl_s, cfg.max_sessions) == (30.0, 5)
    assert (cfg.return_mode, cfg.short_append_tokens) == (ReturnMode.PUSH, 16)
    assert (cfg.health_interval_s, cfg.health_failures) == (0.5, 3)
    assert cfg.api_key == "sk-xyzzy" and "xyzzy" not in repr(cfg)
    up = parse_args(["up", "--return-mode", "pull", "--max-sessions", "9"])
    passed = up.router_flags()
    assert passed[passed.index("--return-mode") + 1] == "pull"
    assert passed[passed.index("--max-sessions") + 1] == "9" and "--mode" not in passed
    assert "--api-key" not in passed, "the local demo cluster has no API key"
    again = parse_args(["router", "--decode", "http://d", *passed])
    assert again.return_mode is ReturnMode.PULL and again.max_sessions == 9
    for bad, message in [
        ({"decode": ()}, "at least one --decode"),
        ({"prefill": ("p0",)}, "http://"),
        ({"max_sessions": 0}, "max_sessions"),
        ({"session_ttl_s": 0}, "session_ttl_s"),
        ({"short_append_tokens": -1}, "short_append_tokens"),
        ({"health_interval_s": 0}, "health_interval_s"),
        ({"health_timeout_s": -1}, "health_timeout_s"),
        ({"health_failures": 0}, "health_failures"),
    ]:
        with pytest.raises(ValueError, match=message):
            RouterConfig(**{"decode": ("http://d",), **bad})  # type: ignore[arg-type]
