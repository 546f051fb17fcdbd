"""Disaggregated serving end to end, push (layer-wise) and pull, against a colocated instance.

One prefill (P, chunked prefill with a small token budget), one decode (D),
a colocated reference, and two routers over the same P and D: one in push
mode, one in pull mode. Every test ends with all pools consistent and empty
of request blocks.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvduplex.cluster import LocalCluster
from kvduplex.cluster import Process
from kvduplex.cluster import free_port
from tests.integration.conftest import Deployment
from tests.integration.conftest import assert_pool_clean
from tests.integration.conftest import kv_stats
from tests.integration.conftest import metric
from tests.integration.conftest import start_deployment
from tests.integration.conftest import start_router
from tests.integration.conftest import stream
from tests.integration.conftest import wait_until
from tests.skips import skip_module_without_nixl

pytestmark = pytest.mark.integration

skip_module_without_nixl()

_SERVE = [
    "serve",
    "--model",
    "tiny",
    "--num-blocks",
    "160",
    "--block-size",
    "8",
    "--log-level",
    "warning",
]
MODES = ["push", "pull"]


@pytest.fixture(scope="module")
def dep(cluster: LocalCluster) -> Deployment:
    # P's budget of 24 tokens per step makes every prompt over 24 tokens a chunked prefill.
    return start_deployment(
        cluster, _SERVE, modes=tuple(MODES), prefill_flags=("--max-num-batched-tokens", "24")
    )


@pytest.fixture(autouse=True)
def clean_pools(dep: Deployment) -> Iterator[None]:
    yield
    for url in dep.instances:
        assert_pool_clean(url)


def _body(prompt: str | list[int], max_tokens: int = 10, **extra: object) -> dict:
    return {
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True, **extra,
    }  # fmt: skip


def _complete(url: str, body: dict, path: str = "/v1/completions") -> list[int]:
    resp = httpx.post(url + path, json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    ids = list(resp.json()["choices"][0]["token_ids"])
    assert len(ids) == body["max_tokens"], ids  # every body ignores EOS
    return ids


def _push_stats(url: str) -> dict:
    return dict(httpx.get(url + "/internal/kv/push/stats", timeout=10).json())


def _ids(n: int, salt: int) -> list[int]:
    """A token-id prompt of `n` tokens, distinct per salt."""
    return [(salt * 131 + i * 7) % 250 + 1 for i in range(n)]


# Lengths: shorter than a block, not a multiple of 8, exact multiples, several P chunks.
LENGTHS = [3, 13, 16, 40, 77]


@pytest.mark.parametrize("mode", MODES)
def test_concurrent_mixed_lengths_match_colocated(dep: Deployment, mode: str) -> None:
    bodies = [_body(_ids(n, salt=n + len(mode)), max_tokens=4 + n % 7) for n in LENGTHS]
    push_before = _push_stats(dep.decode)
    with ThreadPoolExecutor(len(bodies)) as pool:
        routed = list(pool.map(lambda b: _complete(dep.routers[mode], b), bodies))
    assert routed == [_complete(dep.reference, b) for b in bodies]
    after = _push_stats(dep.decode)
    if mode == "push":
        assert after["num_received"] == push_before["num_received"] + len(bodies)
        assert after["num_fallbacks"] == push_before["num_fallbacks"]
    else:
        assert after["num_received"] == push_before["num_received"]


@pytest.mark.parametrize("mode", MODES)
def test_streaming_completion_and_chat_match_colocated(dep: Deployment, mode: str) -> None:
    body = _body(_ids(45, salt=3 + len(mode)), max_tokens=8)
    routed_ids, routed_text, chunks = stream(dep.routers[mode], "/v1/completions", body)
    ref_ids, ref_text, _ = stream(dep.reference, "/v1/completions", body)
    assert routed_ids == ref_ids and routed_text == ref_text
    assert len({c["id"] for c in chunks}) == 1, "one id for the whole answer"
    chat = _body("", max_tokens=6)
    del chat["prompt"]
    chat["messages"] = [{"role": "user", "content": f"hello over the {mode} path, streamed"}]
    path = "/v1/chat/completions"
    routed_ids, routed_text, chunks = stream(dep.routers[mode], path, chat)
    ref_ids, ref_text, _ = stream(dep.reference, path, chat)
    assert routed_ids == ref_ids and routed_text == ref_text
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert _complete(dep.routers[mode], chat, path) == ref_ids


AGENT_CHAT: list[dict] = [
    {"role": "system", "content": "You are an agent with tools."},
    {"role": "user", "content": "What is in /tmp?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "ls", "arguments": '{"path": "/tmp"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "a.txt b.txt"},
]  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "ls", "description": "List a folder",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
def test_agentic_chat_with_tools_matches_colocated(dep: Deployment, mode: str) -> None:
    """Tools, a tool call with null content and its result render the same on the router
    (which prefills by its ids) and on the instance."""
    chat = _body("", max_tokens=6)
    del chat["prompt"]
    chat.update(messages=AGENT_CHAT, tools=TOOLS, tool_choice="none")  # no parser here
    path = "/v1/chat/completions"
    routed_ids, routed_text, _ = stream(dep.routers[mode], path, chat)
    ref_ids, ref_text, _ = stream(dep.reference, path, chat)
    assert routed_ids == ref_ids and routed_text == ref_text
    resp = httpx.post(dep.routers[mode] + path, json=chat, timeout=120)
    assert resp.status_code == 200, resp.text
    ref = httpx.post(dep.reference + path, json=chat, timeout=120).json()
    assert resp.json()["prompt_token_ids"] == ref["prompt_token_ids"]
    assert resp.json()["choices"][0]["token_ids"] == ref_ids
    assert ref["usage"]["prompt_tokens"] > 100  # the tools and the call are in the prompt


def test_push_streams_prefill_first_token_then_the_rest(dep: Deployment) -> None:
    """max_tokens=1 and an early stop: D's copy of the first token never doubles P's."""
    for max_tokens in (1, 2):
        body = _body(_ids(30, salt=50 + max_tokens), max_tokens=max_tokens)
        ids, _, chunks = stream(dep.routers["push"], "/v1/completions", body)
        assert ids == _complete(dep.reference, body)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_decode_prefix_hit_shrinks_the_push(dep: Deployment) -> None:
    history = _ids(64, salt=77)
    first = _body(history, max_tokens=3)
    assert _complete(dep.routers["push"], first) == _complete(dep.reference, first)
    before = _push_stats(dep.decode)
    hits_before = metric(dep.decode, "kvduplex_kv_remote_prefix_hit_tokens_total")
    follow = _body([*history, 9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], max_tokens=5)
    assert _complete(dep.routers["push"], follow) == _complete(dep.reference, follow)
    after = _push_stats(dep.decode)
    # D held the 64-token history (8 blocks): only the 2 blocks of new tokens moved.
    assert after["num_skipped_blocks"] - before["num_skipped_blocks"] == 8
    assert after["num_received_blocks"] - before["num_received_blocks"] == 2
    assert metric(dep.decode, "kvduplex_kv_remote_prefix_hit_tokens_total") - hits_before == 64


@pytest.mark.parametrize("mode", MODES)
def test_usage_cached_tokens_are_prefills_prefix_hits(dep: Deployment, mode: str) -> None:
    prompt = _ids(45, salt=300 + len(mode))
    _complete(dep.routers[mode], _body(prompt, max_tokens=2))
    resp = httpx.post(dep.routers[mode] + "/v1/completions", json=_body(prompt, max_tokens=2), timeout=120)
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    # P computed the prompt: 5 full blocks of 8 came from its prefix cache, the rest it computed.
    assert usage["prompt_tokens"] == 45 and usage["prompt_tokens_details"]["cached_tokens"] == 40


def test_push_metrics_on_both_sides(dep: Deployment) -> None:
    written = metric(dep.prefill, "kvduplex_kv_transfer_bytes_total", direction="write")
    pushes = metric(dep.prefill, "kvduplex_kv_pushes_total", outcome="done")
    body = _body(_ids(50, salt=91), max_tokens=3)
    assert _complete(dep.routers["push"], body) == _complete(dep.reference, body)
    wait_until(
        lambda: metric(dep.prefill, "kvduplex_kv_pushes_total", outcome="done") == pushes + 1,
        what="the push counted on prefill",
    )
    assert metric(dep.prefill, "kvduplex_kv_transfer_bytes_total", direction="write") > written
    assert metric(dep.prefill, "kvduplex_kv_push_transfer_seconds_total") > 0
    exposed = metric(dep.prefill, "kvduplex_kv_push_exposed_seconds_total")
    assert 0 <= exposed <= metric(dep.prefill, "kvduplex_kv_push_transfer_seconds_total")
    assert metric(dep.decode, "kvduplex_kv_received_tokens_total") > 0


def test_internal_push_routes_reject_bad_input(dep: Deployment) -> None:
    for url in (dep.prefill, dep.decode):
        resp = httpx.post(url + "/internal/push/cancel", json={"xid": "nope"}, timeout=10)
        assert resp.status_code == 404 and "error" in resp.json()
        resp = httpx.post(url + "/internal/push/cancel", json={"xid": 3}, timeout=10)
        assert resp.status_code == 400
    bad = {"xid": "x", "prompt_token_ids": [], "decode_url": dep.decode}
    assert (
        httpx.post(dep.prefill + "/internal/push/prefill", json=bad, timeout=10).status_code == 400
    )
    nowhere = {
        "xid": "x2",
        "prompt_token_ids": [1, 2, 3],
        "decode_url": f"http://127.0.0.1:{free_port()}",
    }
    resp = httpx.post(dep.prefill + "/internal/push/prefill", json=nowhere, timeout=30)
    assert resp.status_code == 502 and "cannot reach decode" in resp.json()["error"]["message"]
    bad_params = _body([1, 2, 3], kv_transfer_params={"mode": "teleport", "xid": "x"})
    assert (
        httpx.post(dep.decode + "/v1/completions", json=bad_params, timeout=10).status_code == 400
    )


def test_router_rejects_bad_input_without_leaking(dep: Deployment) -> None:
    # D refuses at once (past the context length, which only an instance knows) and the
    # router cancels P, racing P's admission of the prefill: repeated, since a cancel
    # between P's expect and add once leaked.
    for salt in range(20):
        resp = httpx.post(
            dep.routers["push"] + "/v1/completions",
            json=_body(_ids(20, salt=500 + salt), max_tokens=10**6),
            timeout=30,
        )
        assert resp.status_code == 400 and "context length" in resp.json()["error"]["message"]
    # What needs no model the router refuses itself, as the instance would.
    bad = _body(_ids(20, salt=499), max_tokens=0)
    routed = httpx.post(dep.routers["push"] + "/v1/completions", json=bad, timeout=30)
    direct = httpx.post(dep.decode + "/v1/completions", json=bad, timeout=30)
    assert routed.status_code == direct.status_code == 400
    assert routed.json() == direct.json()
    resp = httpx.post(
        dep.routers["push"] + "/v1/completions", content=b"{not json", timeout=30,
        headers={"content-type": "application/json"},
    )  # fmt: skip
    assert resp.status_code == 400


def test_registration_after_prefill_finished_through_the_router(
    cluster: LocalCluster, dep: Deployment
) -> None:
    """D has one seat, taken by a long answer: the push waits in D's queue, so its
    registration reaches P only after P's prefill ended."""
    d = cluster.start(
        "decode-one-seat", [*_SERVE, "--role", "decode", "--max-num-seqs", "1"], free_port()
    )
    cluster.wait_healthy(timeout_s=120)
    r = start_router(cluster, "router-one-seat", "push", dep.prefill, d.url)
    cluster.wait_healthy(timeout_s=60)
    try:
        late_before = _push_stats(dep.prefill)["num_late_registrations"]
        long_answer = _body(_ids(12, salt=60), max_tokens=200)
        queued = _body(_ids(70, salt=61), max_tokens=5)
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(_complete, r.url, long_answer)
            wait_until(lambda: kv_stats(d.url)["num_running"] == 1, what="the seat taken")
            second = pool.submit(_complete, r.url, queued)
            assert second.result() == _complete(dep.reference, queued)
            assert first.result() == _complete(dep.reference, long_answer)
        assert _push_stats(dep.prefill)["num_late_registrations"] > late_before
        assert_pool_clean(d.url)
    finally:
        cluster.stop_process(r)
        cluster.stop_process(d)


# ---- a queue on P longer than decode's wait ----


def test_prefill_queue_longer_than_the_wait_does_not_fall_back(
    cluster: LocalCluster, dep: Deployment
) -> None:
    """P computes one token per step, so a burst queues on it for several times D's 1 s
    wait; P's heartbeats keep D waiting, and D computes none of the prompts itself.

    P sends a job's k-th heartbeat no sooner than k/3 of the wait after D registered,
    so more than 2 heartbeats per request mean some request waited past D's 1 s. The
    burst (6 x 600 tokens, one step each) keeps P busy for seconds even on a fast core
    (6 x 300 took under 1 s of P's time on some); both hold all six at once."""
    blocks = ["--num-blocks", "480"]  # 6 x 76 blocks of 8
    p = cluster.start(
        "prefill-slow",
        [*_SERVE, *blocks, "--role", "prefill", "--max-num-batched-tokens", "1",
         "--kv-wait-timeout-s", "1"],
        free_port(),
    )  # fmt: skip
    d = cluster.start(
        "decode-1s-wait",
        [*_SERVE, *blocks, "--role", "decode", "--kv-wait-timeout-s", "1"],
        free_port(),
    )
    procs = [p, d]
    try:
        cluster.wait_healthy(timeout_s=180)
        r = start_router(cluster, "router-slow", "push", p.url, d.url)
        procs.append(r)
        cluster.wait_healthy(timeout_s=60)
        bodies = [_body(_ids(600, salt=400 + i), max_tokens=3) for i in range(6)]
        with ThreadPoolExecutor(len(bodies)) as pool:
            got = list(pool.map(lambda b: _complete(r.url, b), bodies))
        assert got == [_complete(dep.reference, b) for b in bodies]
        d_stats = _push_stats(d.url)
        num_alive = d_stats["num_alive_received"]
        assert num_alive > 2 * len(bodies), f"P never queued past D's wait ({num_alive})"
        assert d_stats["num_fallbacks"] == 0 and d_stats["num_received"] == len(bodies)
        assert _push_stats(p.url)["num_done"] == len(bodies)
        for url in (p.url, d.url):
            assert_pool_clean(url)
    finally:
        for proc in reversed(procs):
            cluster.stop_process(proc)


# ---- failures: P that never writes ----


@pytest.fixture(scope="module")
def stalled(cluster: LocalCluster, dep: Deployment) -> Iterator[tuple[Process, Process, str]]:
    """A P and D with a 2 s push deadline behind their own push router."""
    p = cluster.start("prefill-stall", [*_SERVE, "--role", "prefill"], free_port())
    d = cluster.start(
        "decode-short-wait",
        [*_SERVE, "--role", "decode", "--kv-wait-timeout-s", "2", "--transfer-timeout-s", "2"],
        free_port(),
    )
    cluster.wait_healthy(timeout_s=180)
    r = start_router(cluster, "router-stall", "push", p.url, d.url)
    cluster.wait_healthy(timeout_s=60)
    yield p, d, r.url
    os.killpg(p.popen.pid, signal.SIGCONT)


def test_push_whose_prefill_never_writes_falls_back(
    dep: Deployment, stalled: tuple[Process, Process, str]
) -> None:
    p, d, router = stalled
    warm = _body(_ids(20, salt=11), max_tokens=2)
    assert _complete(router, warm) == _complete(dep.reference, warm)  # handshakes done
    before = _push_stats(d.url)
    deadlines = metric(d.url, "kvduplex_kv_fallbacks_total", reason="deadline")
    os.killpg(p.popen.pid, signal.SIGSTOP)
    try:
        body = _body(_ids(37, salt=12), max_tokens=6)
        stream_ids, _, _ = stream(router, "/v1/completions", body)
        full = _complete(router, _body(_ids(29, salt=13), max_tokens=4))
        assert stream_ids == _complete(dep.reference, body)
        assert full == _complete(dep.reference, _body(_ids(29, salt=13), max_tokens=4))
        # Each request fell back once, at its deadline, and nothing arrived from P.
        stats = _push_stats(d.url)
        assert stats["num_fallbacks"] == before["num_fallbacks"] + 2
        assert stats["num_received"] == before["num_received"]
        assert metric(d.url, "kvduplex_kv_fallbacks_total", reason="deadline") == deadlines + 2
    finally:
        os.killpg(p.popen.pid, signal.SIGCONT)
    # Resumed, P learns of the cancellations; nothing stays allocated anywhere
    # (D's quarantined blocks come back at the latest one transfer deadline later).
    for url in (p.url, d.url):
        assert_pool_clean(url)
    again = _body(_ids(33, salt=14), max_tokens=3)
    assert _complete(router, again) == _complete(dep.reference, again)
    assert _push_stats(d.url)["num_fallbacks"] == stats["num_fallbacks"]


PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "kind": {"type": "string", "enum": ["cat", "dog", "fish"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "kind", "age", "tags"],
}
CALC = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "required": ["a", "b"],
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                   "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}}]  # fmt: skip


def _sse_chunks(url: str, body: dict) -> list[dict]:
    import json

    from httpx_sse import connect_sse

    body = {**body, "stream": True}
    with (
        httpx.Client(timeout=120) as http,
        connect_sse(http, "POST", url + "/v1/chat/completions", json=body) as src,
    ):
        assert src.response.status_code == 200
        return [json.loads(e.data) for e in src.iter_sse() if e.data != "[DONE]"]


def test_structured_output_through_push_matches_colocated(dep: Deployment) -> None:
    """Prefill samples the first token under the grammar, decode goes on from it under the
    same grammar: the answer is valid and token-exact with a colocated instance, streamed
    (prefill's first token spliced in first) or not; forced tool calls too."""
    import json

    import jsonschema_rs

    path, push = "/v1/chat/completions", dep.routers["push"]
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
    chat = {
        "model": "tiny", "messages": [{"role": "user", "content": "a pet as JSON, over push"}],
        "max_tokens": 200, "temperature": 1.0, "seed": 11, "return_token_ids": True,
    }  # fmt: skip
    free = httpx.post(dep.reference + path, json={**chat, "max_tokens": 1}, timeout=120).json()
    assert free["choices"][0]["message"]["content"] != "{", "pick a prompt the grammar changes"
    before = _push_stats(dep.decode)
    diverged = metric(push, "kvduplex_router_first_token_diverged_total")
    structured = {**chat, "response_format": fmt}
    ref = httpx.post(dep.reference + path, json=structured, timeout=120).json()["choices"][0]
    routed = httpx.post(push + path, json=structured, timeout=120).json()["choices"][0]
    assert ref["finish_reason"] == routed["finish_reason"] == "stop"
    assert routed["token_ids"] == ref["token_ids"]
    jsonschema_rs.validate(PET, json.loads(routed["message"]["content"]))
    chunks = _sse_chunks(push, structured)
    assert chunks[0]["choices"][0]["delta"]["content"] == "{"  # prefill's token, spliced
    streamed_ids = [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]]
    assert streamed_ids == ref["token_ids"]
    tools = {**chat, "tools": CALC, "tool_choice": "required", "parallel_tool_calls": False}
    ref_calls = httpx.post(dep.reference + path, json=tools, timeout=120).json()["choices"][0]
    routed_calls = httpx.post(push + path, json=tools, timeout=120).json()["choices"][0]
    assert routed_calls["finish_reason"] == ref_calls["finish_reason"] == "tool_calls"
    assert routed_calls["token_ids"] == ref_calls["token_ids"]
    add = CALC[0]["function"]["parameters"]
    for call in routed_calls["message"]["tool_calls"]:
        jsonschema_rs.validate(add, json.loads(call["function"]["arguments"]))
    streamed = _sse_chunks(push, tools)
    assert streamed[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(c["choices"][0]["delta"].get("content") for c in streamed if c["choices"])
    streamed_ids = [t for c in streamed if c["choices"] for t in c["choices"][0]["token_ids"]]
    assert streamed_ids == ref_calls["token_ids"]
    # Every answer came through the push (no fallback): the first tokens were prefill's.
    after = _push_stats(dep.decode)
    assert after["num_received"] == before["num_received"] + 4
    assert after["num_fallbacks"] == before["num_fallbacks"]
    assert metric(push, "kvduplex_router_first_token_diverged_total") == diverged
    pulled = httpx.post(dep.routers["pull"] + path, json=structured, timeout=120).json()
    assert pulled["choices"][0]["token_ids"] == ref["token_ids"]
    bad_schema = {"name": "x", "schema": {"type": "y"}}
    bad = {**chat, "response_format": {"type": "json_schema", "json_schema": bad_schema}}
    for mode in MODES:
        resp = httpx.post(dep.routers[mode] + path, json=bad, timeout=120)
        assert resp.status_code == 400 and "schema cannot be used" in resp.text, resp.text
