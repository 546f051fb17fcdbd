"""`calls.until_unhealthy`: a call to an instance ends once the instance is marked down.

The call runs in its caller's task, which is cancelled once when the instance is marked
down; that cancel becomes `InstanceDown`. A cancel of the caller's own passes through as
itself, and a call that ends on its own leaves no cancel behind.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.router import push_flow
from kvduplex.router.backends import BackendPool
from kvduplex.router.calls import InstanceDown
from kvduplex.router.calls import until_unhealthy
from kvduplex.router.config import RouterConfig
from kvduplex.router.state import RouterState
from tests.support.fake_instances import mock_instances


def _pool() -> BackendPool:
    return BackendPool(["http://d"], half_life_s=30.0)


async def _hung(started: asyncio.Event, ended: list[str]) -> str:
    started.set()
    try:
        await asyncio.Event().wait()  # an instance that never answers
    except asyncio.CancelledError:
        ended.append("cancelled")
        raise
    return "unreachable"


def test_a_call_to_an_instance_marked_down_ends_with_instance_down() -> None:
    async def run() -> tuple[list[str], int]:
        pool = _pool()
        b = pool.backends[0]
        started, ended = asyncio.Event(), []

        async def caller() -> None:
            with pytest.raises(InstanceDown):
                await until_unhealthy(b, _hung(started, ended))

        task = asyncio.ensure_future(caller())
        await started.wait()
        pool.mark_failed(b, now=1.0)
        await task
        return ended, task.cancelling()

    ended, cancelling = asyncio.run(run())
    assert ended == ["cancelled"], "the call itself was cancelled"
    assert cancelling == 0, "no cancel left on the caller's task"


def test_the_callers_own_cancel_passes_through_even_when_the_instance_fails_too() -> None:
    async def run() -> list[str]:
        pool = _pool()
        b = pool.backends[0]
        started, ended = asyncio.Event(), []
        task = asyncio.ensure_future(until_unhealthy(b, _hung(started, ended)))
        await started.wait()
        task.cancel()  # the caller's
        pool.mark_failed(b, now=1.0)  # and the instance's, before the task runs again
        with pytest.raises(asyncio.CancelledError):
            await task
        return ended

    assert asyncio.run(run()) == ["cancelled"]


def test_a_call_that_ends_on_its_own_returns_and_stops_watching() -> None:
    async def answer() -> str:
        await asyncio.sleep(0)
        return "ok"

    async def run() -> tuple[str, int, int]:
        pool = _pool()
        b = pool.backends[0]
        result = await until_unhealthy(b, answer())
        task = asyncio.current_task()
        assert task is not None
        return result, len(b.watchers), task.cancelling()

    assert asyncio.run(run()) == ("ok", 0, 0)


def test_a_call_to_an_instance_already_down_never_starts() -> None:
    async def run() -> None:
        pool = _pool()
        b = pool.backends[0]
        pool.mark_failed(b, now=1.0)
        started, ended = asyncio.Event(), []
        call = _hung(started, ended)
        with pytest.raises(InstanceDown):
            await until_unhealthy(b, call)
        assert not started.is_set()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"not json", None),
        (b"[1, 2]", None),
        (b'{"block_ids": [3], "pin_s": 4.0}', {"block_ids": [3], "pin_left_s": 4.0}),
    ],
)
def test_a_retained_turn_that_d_answers_unreadably_is_none(
    content: bytes, expected: dict[str, object] | None
) -> None:
    """``--return-mode pull``: D's answer about a session's retained turn is read when it is
    a JSON object; anything else means no retained turn (P computes the turn over its own
    cache), never a 500."""
    d_url = "http://d0"

    def handle(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/internal/kv/retained"
        return httpx.Response(200, content=content)

    async def run() -> dict[str, object] | None:
        config = RouterConfig(prefill=("http://p0",), decode=(d_url,))
        state = RouterState.create(config, ByteTokenizer(), make_client=mock_instances(handle))
        d = state.policy.decode.by_url(d_url)
        assert d is not None
        try:
            return await push_flow._retained(state, d, "s")
        finally:
            await state.aclose()

    got = asyncio.run(run())
    if expected is None:
        assert got is None
    else:
        assert got == {"decode_url": d_url, **expected}
