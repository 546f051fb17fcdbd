"""What the router learns of each answer it relays, and the adaptive duplex return:
`relay.tap_answer`, `SessionTable.note_answer` / `reuses_answer`, the answer-hit metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry
from prometheus_client import generate_latest

from kvduplex.common.openai.chat_output import ChatOutputParser
from kvduplex.common.openai.reasoning import ThinkParser
from kvduplex.common.openai.reasoning import starts_in_reasoning
from kvduplex.common.openai.transcript import ANSWER_IDS_FIELD
from kvduplex.common.openai.transcript import message_key
from kvduplex.router.answers import RelayedAnswer
from kvduplex.router.answers import return_limit
from kvduplex.router.answers import tap_answer
from kvduplex.router.metrics import RouterMetrics
from kvduplex.router.policy import RoutingPolicy
from kvduplex.router.sessions import SessionTable


async def _parts(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def _tap(parts: list[bytes], is_stream: bool, is_chat: bool) -> tuple[bytes, list[RelayedAnswer]]:
    seen: list[RelayedAnswer] = []

    async def run() -> bytes:
        return b"".join(
            [p async for p in tap_answer(_parts(*parts), is_stream, is_chat, seen.append)]
        )

    return asyncio.run(run()), seen


def test_a_stream_loses_decodes_report_and_yields_the_message_as_received() -> None:
    events = [
        {"choices": [{"delta": {"role": "assistant", "content": "he"}, "token_ids": [104, 101]}]},
        {"choices": [{"delta": {"content": "llo"}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"completion_tokens": 5}},
        {ANSWER_IDS_FIELD: [104, 101, 108, 108, 111]},
    ]
    raw = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"
    # Cut anywhere: events are reassembled before they are read.
    out, seen = _tap([raw[:7], raw[7:90], raw[90:]], is_stream=True, is_chat=True)
    assert ANSWER_IDS_FIELD.encode() not in out
    assert out == raw[: raw.index(b'data: {"' + ANSWER_IDS_FIELD.encode())] + b"data: [DONE]\n\n"
    (answer,) = seen
    assert answer.num_tokens == 5 and answer.token_ids == [104, 101, 108, 108, 111]
    assert answer.message == {"role": "assistant", "content": "hello"}


def test_a_whole_body_loses_the_field_and_a_cut_stream_records_nothing() -> None:
    body = {"choices": [{"message": {"role": "assistant", "content": "hi"}}],
            "usage": {"completion_tokens": 2}, ANSWER_IDS_FIELD: [104, 105]}  # fmt: skip
    out, seen = _tap([json.dumps(body).encode()], is_stream=False, is_chat=True)
    assert ANSWER_IDS_FIELD not in json.loads(out)
    assert seen == [RelayedAnswer(2, [104, 105], {"role": "assistant", "content": "hi"})]

    async def cut() -> AsyncIterator[bytes]:
        yield b'data: {"choices": [{"text": "a"}]}\n\n'
        raise ConnectionError("decode died")

    got: list[RelayedAnswer] = []

    async def run() -> None:
        async for _ in tap_answer(cut(), True, False, got.append):
            pass

    with contextlib.suppress(ConnectionError):
        asyncio.run(run())
    assert got == []


def test_the_return_stops_when_an_answer_is_not_sent_back_and_resumes_when_it_is() -> None:
    table = SessionTable(ttl_s=60.0, max_sessions=10)
    prompt = list(range(20))
    answer = [300, 301, 302, 303]
    s = table.record("s", "p", "d", prompt, now=0.0)
    assert s.is_returning and s.reuses_answer(prompt) is None  # no answer known yet
    message = {"role": "assistant", "content": "abcd"}
    table.note_answer("s", prompt, len(answer), answer, message, now=0.0)
    s = table.get("s", 0.0)
    assert s is not None and s.answer_end == len(prompt) + len(answer) - 1
    # The answer is in the book for the next prompt, owned by the session.
    assert table.answers.place(message, 0.0) is not None
    kept = [*prompt, *answer, 7, 8]
    edited = [*prompt, 1, 2, 3, 7, 8]
    assert s.reuses_answer(kept) is True and s.reuses_answer(edited) is False
    assert s.reuses_answer(prompt) is False  # shorter than the answer's end
    s = table.record("s", "p", "d", edited, now=1.0, reuses_answer=False)
    assert not s.is_returning
    s = table.record("s", "p", "d", [*edited, 9], now=2.0)  # unknown: the state stays
    assert not s.is_returning
    s = table.record("s", "p", "d", [*edited, 9, 10], now=3.0, reuses_answer=True)
    assert s.is_returning
    # A later turn recorded meanwhile: the old answer is ignored.
    table.note_answer("s", prompt, 4, answer, message, now=3.0)
    assert table.get("s", 3.0).answer_end is None  # type: ignore[union-attr]
    # Forgetting the session forgets its answers.
    table.record("t", "p", "d", [1], now=100.0)
    assert table.get("s", 100.0) is None and table.answers.place(message, 100.0) is None


def _may_reason(parser: str, prompt_tail: str) -> bool:
    return ChatOutputParser(ThinkParser(starts_in_reasoning(parser, prompt_tail)), None) \
        .may_start_with_reasoning  # fmt: skip


def test_a_reasoning_answer_is_returned_up_to_its_prompt_until_reasoning_comes_back() -> None:
    # Which answers may begin with reasoning, by parser and the template's prompt end.
    assert _may_reason("deepseek_r1", "<|assistant|>") and _may_reason("qwen3", "<think>\n")
    assert _may_reason("qwen3", "assistant\n")  # only if it opens one: it may
    assert not _may_reason("qwen3", "<think>\n\n</think>\n\n")  # thinking off
    assert not ChatOutputParser(None, None).may_start_with_reasoning
    assert return_limit(True, False, 40) == 40
    assert return_limit(True, True, 40) is None and return_limit(False, False, 40) is None

    table = SessionTable(ttl_s=60.0, max_sessions=10)
    prompt, answer = list(range(20)), [300, 301, 302, 303]
    s = table.record("s", "p", "d", prompt, now=0.0)
    assert not s.sends_reasoning  # the default: the client strips reasoning
    table.note_return_limit("s", return_limit(True, s.sends_reasoning, len(prompt)))
    stripped = {"role": "assistant", "content": "", "reasoning_content": "abcd"}
    table.note_answer("s", prompt, len(answer), answer, stripped, now=0.0)
    # The client sent the answer back stripped: the return, limited to the prompt, was hit
    # and goes on; the session still strips.
    nxt = [*prompt, 9, 9]
    s = table.record("s", "p", "d", nxt, now=1.0, reuses_answer=False)
    assert s.is_returning and not s.sends_reasoning and s.return_limit is None
    # A turn returned whole (no reasoning possible, e.g. a forced tool call) and edited:
    # the return stops, as for any changed answer.
    table.note_answer("s", nxt, len(answer), answer, {"role": "assistant", "content": "x"})
    s = table.record("s", "p", "d", [*nxt, 1, 2, 3, 4, 5], now=2.0, reuses_answer=False)
    assert not s.is_returning and not s.sends_reasoning
    # An answer with reasoning that comes back whole: the session sends reasoning back.
    table.note_answer("s", [*nxt, 1, 2, 3, 4, 5], len(answer), answer, stripped, now=2.0)
    s = table.record("s", "p", "d", list(range(40)), now=3.0, reuses_answer=True)
    assert s.is_returning and s.sends_reasoning
    assert return_limit(True, s.sends_reasoning, 40) is None


def test_policy_routes_carry_the_reuse_and_the_metrics_count_hits() -> None:
    policy = RoutingPolicy(["http://p"], ["http://d"], clock=lambda: 0.0)
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry, policy)
    prompt, answer = list(range(30)), [400, 401, 402]
    first = policy.route(prompt, "s")
    assert first.is_returning and first.reuses_answer is None
    policy.sessions.note_answer("s", prompt, 3, answer)
    second = [*prompt, *answer, 5]
    nxt = policy.route(second, "s")
    assert nxt.reuses_answer is True and nxt.is_returning
    policy.sessions.note_answer("s", second, 2, [410, 411])
    other = policy.route([*second, 9, 9, 5, 6], "s")
    assert other.reuses_answer is False and not other.is_returning
    policy.sessions.note_answer_hit("s", 3, 4)
    metrics.note_answer_hit(3, 4)
    text = generate_latest(registry).decode()
    assert 'kvduplex_router_answer_tokens_total{outcome="hit"} 3.0' in text
    assert 'kvduplex_router_answer_tokens_total{outcome="miss"} 1.0' in text
    assert "kvduplex_router_sessions_returning 0.0" in text
    # One live session, at 0.75: in the gauge histogram's buckets from 0.75 up.
    assert 'kvduplex_router_session_answer_hit_ratio_bucket{le="0.5"} 0.0' in text
    assert 'kvduplex_router_session_answer_hit_ratio_bucket{le="0.75"} 1.0' in text
    assert message_key({"content": "x"}) != message_key({"content": "y"})


def test_the_sessions_view_lists_answer_hits_and_needs_the_api_key() -> None:
    from fastapi.testclient import TestClient

    from kvduplex.common.tokenizer import ByteTokenizer
    from kvduplex.router.app import create_router_app
    from kvduplex.router.config import RouterConfig
    from kvduplex.router.state import RouterState

    state = RouterState.create(RouterConfig(decode=("http://d",), api_key="k"), ByteTokenizer())
    state.policy.route([1, 2, 3], "mine")
    state.policy.sessions.note_answer_hit("mine", 3, 4)
    client = TestClient(create_router_app(state))  # no lifespan: no probes
    assert client.get("/sessions").status_code == 401
    resp = client.get("/sessions", headers={"Authorization": "Bearer k"})
    assert resp.status_code == 200
    (view,) = resp.json()["sessions"]
    assert view["session_id"] == "mine" and view["answer_hit_rate"] == 0.75
