"""Chat answers sent back unchanged keep their generated ids, and the duplex return is on
by default and adaptive: a push router started without ``--return-mode`` over one P and
one D, against a colocated instance given the same messages.

The answer hit of a turn is the share of the previous answer's tokens that P had cached
when the turn arrived, of those it could cache: the answer but its last token (which has
no KV), up to the last full block.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from kvduplex.cluster import LocalCluster
from kvduplex.cluster import free_port
from tests.integration.conftest import assert_pool_clean
from tests.integration.conftest import metric
from tests.integration.conftest import wait_until
from tests.skips import skip_module_without_nixl

pytestmark = pytest.mark.integration

skip_module_without_nixl()

BS = 8
_SERVE = ["serve", "--model", "tiny", "--block-size", str(BS), "--num-blocks", "400",
          "--log-level", "warning"]  # fmt: skip


@dataclass
class Rig:
    prefill: str
    decode: str
    reference: str
    router: str

    @property
    def instances(self) -> list[str]:
        return [self.prefill, self.decode, self.reference]


@pytest.fixture(scope="module")
def rig(cluster: LocalCluster) -> Rig:
    p = cluster.start("prefill", [*_SERVE, "--role", "prefill"], free_port())
    d = cluster.start("decode", [*_SERVE, "--role", "decode"], free_port())
    ref = cluster.start("reference", [*_SERVE, "--role", "both"], free_port())
    cluster.wait_healthy(timeout_s=180)
    args = ["router", "--model", "tiny", "--prefill", p.url, "--decode", d.url]  # no return flag
    router = cluster.start("router", args, free_port())
    cluster.wait_healthy(timeout_s=60)
    # The router learns P's block size from its probes (the answer hit counts full blocks).
    wait_until(lambda: _probed(router.url), timeout_s=60, what="the router's first probes")
    return Rig(p.url, d.url, ref.url, router.url)


def _probed(router: str) -> bool:
    return all(i["engine_id"] for i in httpx.get(router + "/health", timeout=5).json()["instances"])


def _return_stats(rig: Rig) -> dict[str, int]:
    return dict(httpx.get(rig.decode + "/internal/kv/return/stats", timeout=10).json())


def _returns_settled(rig: Rig) -> bool:
    st = _return_stats(rig)
    return bool(st["num_offered"] == st["num_done"] + st["num_declined"] + st["num_failed"])


def _post(url: str, path: str, body: dict[str, Any], stream: bool) -> tuple[list[int], str, dict]:
    """Answer ids, text and usage (and, not streamed, the body's prompt ids under usage's
    ``prompt_token_ids``)."""
    body = {**body, "return_token_ids": True}
    if not stream:
        resp = httpx.post(url + path, json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        choice = out["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert "kvduplex_answer_token_ids" not in out
        return (
            list(choice["token_ids"]),
            text,
            {**out["usage"], "prompt_token_ids": out["prompt_token_ids"]},
        )
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    ids: list[int] = []
    text: list[str] = []
    usage: dict = {}
    with httpx.stream("POST", url + path, json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "kvduplex_answer_token_ids" not in chunk
            for choice in chunk["choices"]:
                ids.extend(choice.get("token_ids") or [])
                text.append((choice.get("delta") or {}).get("content") or "")
            usage = chunk.get("usage") or usage
    return ids, "".join(text), usage


def _answer_hit(prev_prompt: int, prev_answer: int, cached: int) -> float:
    """The share of the previous answer that P had cached, of what it could cache."""
    end = (prev_prompt + prev_answer - 1) // BS * BS
    return min(max(cached - prev_prompt, 0), end - prev_prompt) / (end - prev_prompt)


def _chat_turn(
    rig: Rig, messages: list[dict[str, Any]], session: str, stream: bool
) -> tuple[str, dict]:
    """One turn through the router and the reference: same answer, token for token (and,
    not streamed, the same prompt ids); the answer's text and the router's usage."""
    wait_until(lambda: _returns_settled(rig), timeout_s=60, what="returns to settle")
    body = {"model": "tiny", "messages": messages, "max_tokens": 16, "temperature": 0.0,
            "ignore_eos": True, "prompt_cache_key": session}  # fmt: skip
    got_ids, got_text, usage = _post(rig.router, "/v1/chat/completions", body, stream)
    want_ids, want_text, want_usage = _post(rig.reference, "/v1/chat/completions", body, False)
    assert got_ids == want_ids and got_text == want_text
    if not stream:
        assert usage["prompt_token_ids"] == want_usage["prompt_token_ids"]
    assert usage["prompt_tokens"] == want_usage["prompt_tokens"]
    return got_text, usage


def _session_view(rig: Rig, session: str) -> dict[str, Any]:
    views = httpx.get(rig.router + "/sessions", timeout=10).json()["sessions"]
    (view,) = [v for v in views if v["session_id"] == session]
    return dict(view)


def test_chat_answers_sent_back_unchanged_are_hit_and_match_colocated(rig: Rig) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse. " * 4}]
    prev: tuple[int, int] | None = None
    hits = []
    for turn in range(6):
        messages.append({"role": "user", "content": f"step {turn}: list files under /tmp/{turn}"})
        answer, usage = _chat_turn(rig, messages, "reuse-1", stream=turn % 2 == 1)
        if prev is not None:
            hits.append(_answer_hit(*prev, usage["prompt_tokens_details"]["cached_tokens"]))
        prev = (usage["prompt_tokens"], usage["completion_tokens"])
        messages.append({"role": "assistant", "content": answer})  # as returned
    assert min(hits) >= 0.95, hits
    view = _session_view(rig, "reuse-1")
    assert view["is_returning"] and view["answer_hit_rate"] >= 0.95, view
    assert metric(rig.router, "kvduplex_router_answer_tokens_total", outcome="hit") > 0
    for url in rig.instances:
        assert_pool_clean(url)


def test_edited_answers_miss_stop_the_return_and_it_resumes(rig: Rig) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent. " * 4}]
    offered: list[int] = []
    skipped = metric(rig.router, "kvduplex_router_returns_skipped_total")
    prev_prompt = prev_answer = 0
    for turn in range(6):
        edited = turn < 3  # answers of turns 0-2 come back edited, later ones unchanged
        messages.append({"role": "user", "content": f"do {turn}"})
        answer, usage = _chat_turn(rig, messages, "edit-1", stream=False)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        if 1 <= turn <= 3:  # the previous answer came back edited: none of it is cached
            assert cached <= prev_prompt, (turn, cached, prev_prompt)
        if turn == 5:  # turn 4's answer, returned (turn 4 sent turn 3's back unchanged)
            hit = _answer_hit(prev_prompt, prev_answer, cached)
            assert hit >= 0.95, hit
        prev_prompt, prev_answer = usage["prompt_tokens"], usage["completion_tokens"]
        wait_until(lambda: _returns_settled(rig), timeout_s=60, what="returns to settle")
        offered.append(_return_stats(rig)["num_offered"])
        messages.append({"role": "assistant", "content": "Edited: " + answer if edited else answer})
    # Turn 0 was returned; turns 1-3 (each sending back an edited answer) were not; turn 4
    # sent turn 3's answer back unchanged, so the return resumed there.
    assert offered[1] == offered[2] == offered[3] == offered[0], offered
    assert offered[4] == offered[3] + 1 and offered[5] == offered[4] + 1, offered
    assert metric(rig.router, "kvduplex_router_returns_skipped_total") == skipped + 3
    for url in rig.instances:
        assert_pool_clean(url)


def test_router_without_a_return_flag_returns_token_id_turns(rig: Rig) -> None:
    """Six turns of a token-id session: from the second on, P holds the previous answer."""
    rng = random.Random(7)
    history = [rng.randrange(1, 250) for _ in range(45)]
    prev: tuple[int, int] | None = None
    for turn in range(6):
        wait_until(lambda: _returns_settled(rig), timeout_s=60, what="returns to settle")
        body = {"model": "tiny", "prompt": history, "max_tokens": 12 + turn, "temperature": 0.0,
                "ignore_eos": True, "prompt_cache_key": "ids-1"}  # fmt: skip
        got, _, usage = _post(rig.router, "/v1/completions", body, stream=turn % 2 == 0)
        want, _, _ = _post(rig.reference, "/v1/completions", body, False)
        assert got == want, turn
        if prev is not None:
            hit = _answer_hit(*prev, usage["prompt_tokens_details"]["cached_tokens"])
            assert hit == 1.0, (turn, usage)
        prev = (len(history), len(got))
        history = history + got + [rng.randrange(1, 250) for _ in range(10)]
    for url in rig.instances:
        assert_pool_clean(url)
