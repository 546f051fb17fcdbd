"""Duplex sessions end to end: several multi-turn sessions through a push router with
``--return-mode push``, against a colocated instance with prefix caching.

Each turn's greedy answer must equal the colocated instance's for the same
history, token for token; from the second turn on, prefill computes only the
new tokens (its prefix cache holds the history, answers included, returned by
decode). Pools small enough to evict and decline, a restarted prefill, and a
prefill killed during a return never cost a wrong token or a leaked block.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from dataclasses import field
from functools import partial

import httpx
import pytest

from kvduplex.bench.conversation import TOOL_NAME
from kvduplex.bench.conversation import tool_definitions
from kvduplex.cluster import LocalCluster
from kvduplex.cluster import Process
from kvduplex.cluster import free_port
from tests.integration.conftest import assert_pool_clean
from tests.integration.conftest import wait_until
from tests.skips import skip_module_without_nixl

pytestmark = pytest.mark.integration

skip_module_without_nixl()

BS = 8
NUM_TURNS = 8
_SERVE = ["serve", "--model", "tiny", "--block-size", str(BS), "--log-level", "warning"]


@dataclass
class Duplex:
    cluster: LocalCluster
    prefill: Process
    decode: Process
    reference: str
    router: str
    instances: list[str] = field(default_factory=list)


def _start(cluster: LocalCluster, name: str, num_blocks: int, role: str) -> Process:
    args = [*_SERVE, "--num-blocks", str(num_blocks), "--role", role]
    return cluster.start(name, args, free_port())


def _deploy(cluster: LocalCluster, tag: str, p_blocks: int, d_blocks: int) -> Duplex:
    p = _start(cluster, f"prefill-{tag}", p_blocks, "prefill")
    d = _start(cluster, f"decode-{tag}", d_blocks, "decode")
    ref = _start(cluster, f"reference-{tag}", 400, "both")
    cluster.wait_healthy(timeout_s=180)
    args = ["router", "--mode", "push", "--return-mode", "push", "--model", "tiny",
            "--prefill", p.url, "--decode", d.url]  # fmt: skip
    r = cluster.start(f"router-{tag}", args, free_port())
    cluster.wait_healthy(timeout_s=60)
    return Duplex(cluster, p, d, ref.url, r.url, [p.url, d.url, ref.url])


@pytest.fixture(scope="module")
def dup(cluster: LocalCluster) -> Duplex:
    return _deploy(cluster, "roomy", 400, 400)


def _new_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 250) for _ in range(n)]


def _complete(url: str, body: dict, session: str, stream: bool) -> tuple[list[int], dict]:
    """Token ids and usage of a completion (streamed or not)."""
    body = {**body, "prompt_cache_key": session, "return_token_ids": True}
    if not stream:
        resp = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        return list(out["choices"][0]["token_ids"]), out["usage"]
    ids: list[int] = []
    usage: dict = {}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                ids.extend(choice.get("token_ids") or [])
            usage = chunk.get("usage") or usage
    return ids, usage


def _session(
    dup: Duplex, name: str, seed: int, stream: bool, turns: int = NUM_TURNS,
    between_turns: Callable[[], None] = lambda: None,
) -> list[dict]:  # fmt: skip
    """Run one token-id session; per turn: prompt length, new tokens, usage.
    `between_turns` runs after each turn's answer, before the next turn."""
    rng = random.Random(seed)
    history = _new_ids(rng, 40 + rng.randrange(30))
    log = []
    for turn in range(turns):
        body = {"model": "tiny", "prompt": history, "max_tokens": 12 + rng.randrange(12),
                "temperature": 0.0, "ignore_eos": True}  # fmt: skip
        got, usage = _complete(dup.router, body, name, stream)
        want, _ = _complete(dup.reference, body, f"ref-{name}", stream=False)
        assert got == want, f"session {name} turn {turn}: {got} != {want}"
        log.append({"turn": turn, "prompt": len(history), "usage": usage})
        new = _new_ids(rng, 5 + rng.randrange(20))
        log[-1]["new"] = len(new)
        history = history + got + new
        between_turns()
    return log


def test_concurrent_sessions_match_colocated_and_prefill_only_new_tokens(dup: Duplex) -> None:
    baseline = _num_offered(dup.decode.url)
    answered = itertools.count(1)

    def returned() -> None:
        # The next turn comes after the answers' returns landed, as a client that reads its
        # answer before it sends the next turn sees it: every turn answered so far offers
        # its answer's blocks, and every offer has ended.
        num_answered = next(answered)
        wait_until(
            lambda: _num_offered(dup.decode.url) >= baseline + num_answered
            and _returns_settled(dup.decode.url),
            what="the answered turns' returns",
        )

    with ThreadPoolExecutor(3) as pool:
        logs = list(
            pool.map(
                lambda i: _session(dup, f"s{i}", 100 + i, i % 2 == 0, between_turns=returned),
                range(3),
            )
        )
    for log in logs:
        for prev, cur in itertools.pairwise(log):
            computed = cur["usage"]["kv"]["prefill_computed_tokens"]
            # Only the new input, the answer's last token (no KV) and a partial block.
            assert computed <= prev["new"] + 1 + BS, (prev, cur)
            assert cur["usage"]["prompt_tokens_details"]["cached_tokens"] >= cur["prompt"] - computed
    stats = httpx.get(dup.decode.url + "/internal/kv/return/stats", timeout=10).json()
    assert stats["num_done"] > 0 and stats["num_failed"] == 0
    for url in dup.instances:
        assert_pool_clean(url)


def test_chat_session_matches_colocated(dup: Duplex) -> None:
    messages: list[dict] = [{"role": "system", "content": "You are terse. " * 4}]
    for turn in range(NUM_TURNS):
        messages.append({"role": "user", "content": f"step {turn}: list files under /tmp/{turn}"})
        body = {"model": "tiny", "messages": messages, "max_tokens": 16, "temperature": 0.0,
                "ignore_eos": True, "prompt_cache_key": "chat-1"}  # fmt: skip
        got = httpx.post(dup.router + "/v1/chat/completions", json=body, timeout=120)
        want = httpx.post(dup.reference + "/v1/chat/completions", json=body, timeout=120)
        assert got.status_code == want.status_code == 200, got.text
        answer = got.json()["choices"][0]["message"]["content"]
        assert answer == want.json()["choices"][0]["message"]["content"]
        messages.append({"role": "assistant", "content": answer})
    for url in dup.instances:
        assert_pool_clean(url)


def test_agentic_chat_with_tools_matches_colocated_and_hits_the_returned_history(
    dup: Duplex,
) -> None:
    """Tools, assistant ``tool_calls`` with ``content: null`` and ``tool`` messages go
    through P like any turn; the returned KV covers the history up to where the
    re-rendered assistant turn departs from the ids D generated."""
    tools = tool_definitions()
    messages: list[dict] = [
        {"role": "system", "content": "You run shell commands. " * 3},
        {"role": "user", "content": "find the failing test"},
    ]
    cached: list[int] = []
    for turn in range(NUM_TURNS):
        body = {"model": "tiny", "messages": messages, "tools": tools, "max_tokens": 12,
                "temperature": 0.0, "ignore_eos": True, "prompt_cache_key": "tools-1"}  # fmt: skip
        got = httpx.post(dup.router + "/v1/chat/completions", json=body, timeout=120)
        want = httpx.post(dup.reference + "/v1/chat/completions", json=body, timeout=120)
        assert got.status_code == want.status_code == 200, got.text
        answer = got.json()["choices"][0]["message"]["content"]
        assert answer == want.json()["choices"][0]["message"]["content"]
        cached.append(got.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        call = {"id": f"call_{turn}", "type": "function",
                "function": {"name": TOOL_NAME, "arguments": json.dumps({"command": f"ls {turn}"})}}  # fmt: skip
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": f"out {turn} " * 6})
    # Every later turn finds at least the previous turn's prompt cached.
    assert all(b > a for a, b in itertools.pairwise(cached)), cached
    for url in dup.instances:
        assert_pool_clean(url)


def test_small_pools_evict_and_decline_yet_answer_exactly(cluster: LocalCluster) -> None:
    small = _deploy(cluster, "small", 24, 40)  # a few sessions' histories do not fit
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda i: _session(small, f"e{i}", 300 + i, stream=False), range(2)))
        for url in small.instances:
            assert_pool_clean(url)
    finally:
        for proc in (small.prefill, small.decode):
            cluster.stop_process(proc)


def test_prefill_restarted_mid_session_still_answers_exactly(dup: Duplex) -> None:
    log = _session(dup, "r1", 500, stream=False, turns=2)
    assert log
    dup.cluster.stop_process(dup.prefill)
    port = int(dup.prefill.url.rsplit(":", 1)[1])
    dup.prefill = _start_at(dup.cluster, "prefill-roomy-2", port)
    dup.instances[0] = dup.prefill.url
    _session(dup, "r1-after", 500, stream=True, turns=3)  # same history: P holds none of it
    for url in dup.instances:
        assert_pool_clean(url)


def _start_at(cluster: LocalCluster, name: str, port: int) -> Process:
    proc = cluster.start(name, [*_SERVE, "--num-blocks", "400", "--role", "prefill"], port)
    cluster.wait_healthy(timeout_s=180)
    return proc


def test_prefill_killed_during_returns_leaves_decode_clean(cluster: LocalCluster) -> None:
    dead = _deploy(cluster, "kill", 400, 400)
    try:
        _session(dead, "k1", 700, stream=False, turns=2)
        cluster.kill_process(dead.prefill)  # returns in flight or not yet answered
        wait_until(lambda: not dead.prefill.is_alive(), what="prefill to die")
        # Decode's offers to the dead prefill expire; its pool ends clean.
        assert_pool_clean(dead.decode.url)
        body = {"model": "tiny", "prompt": _new_ids(random.Random(1), 50), "max_tokens": 8,
                "temperature": 0.0, "ignore_eos": True}  # fmt: skip
        got, _ = _complete(dead.router, body, "k2", stream=False)  # decode computes it
        want, _ = _complete(dead.reference, body, "k2-ref", stream=False)
        assert got == want
        assert_pool_clean(dead.decode.url)
    finally:
        cluster.stop_process(dead.decode)


def test_short_appends_skip_prefill_and_the_next_long_turn_still_hits(dup: Duplex) -> None:
    """With --short-append-tokens, a turn adding little goes to decode alone; decode returns
    it, so a later long turn through prefill computes only its new input."""
    args = ["router", "--mode", "push", "--return-mode", "push", "--short-append-tokens", "64",
            "--model", "tiny", "--prefill", dup.prefill.url, "--decode", dup.decode.url]  # fmt: skip
    router = dup.cluster.start("router-short", args, free_port())
    wait_until(partial(_healthy, router.url), timeout_s=60, what="the router")
    try:
        rng = random.Random(900)
        history = _new_ids(rng, 60)
        new_lens = [0, 10, 20, 100, 15]  # turn 3 is long: through prefill
        offered = -1
        for turn, n_new in enumerate(new_lens):
            if turn == 3:  # turn 2 (short: decode computed it) is offered from the first block
                wait_until(partial(_offered_more, dup.decode.url, offered), what="turn 2's offer")
            wait_until(lambda: _returns_settled(dup.decode.url), what="returns to settle")
            offered = _num_offered(dup.decode.url)
            history = history + _new_ids(rng, n_new)
            body = {"model": "tiny", "prompt": history, "max_tokens": 12, "temperature": 0.0,
                    "ignore_eos": True}  # fmt: skip
            got, usage = _complete(router.url, body, "short-1", stream=turn % 2 == 1)
            want, _ = _complete(dup.reference, body, "short-1-ref", stream=False)
            assert got == want, f"turn {turn}"
            kv = usage["kv"]
            if turn in (1, 2, 4):  # short: decode computed it, prefill nothing
                assert kv["prefill_computed_tokens"] == 0, (turn, usage)
                assert kv["decode_computed_tokens"] <= n_new + 12 + BS, (turn, usage)
            if turn == 3:  # long: prefill has the history, short turns included
                assert kv["prefill_computed_tokens"] <= n_new + 1 + BS, (turn, usage)
            history = history + got
        metrics = httpx.get(router.url + "/metrics", timeout=10).text
        assert 'kvduplex_router_requests_total{mode="short_append"} 3.0' in metrics
    finally:
        dup.cluster.stop_process(router)
    for url in dup.instances:
        assert_pool_clean(url)


def _returns_settled(decode_url: str) -> bool:
    """No return of decode's is still in flight (each offer ended one way or another)."""
    st = httpx.get(decode_url + "/internal/kv/return/stats", timeout=10).json()
    return bool(st["num_offered"] == st["num_done"] + st["num_declined"] + st["num_failed"])


def _offered_more(decode_url: str, than: int) -> bool:
    return _num_offered(decode_url) > than


def _num_offered(decode_url: str) -> int:
    st = httpx.get(decode_url + "/internal/kv/return/stats", timeout=10).json()
    return int(st["num_offered"])


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
