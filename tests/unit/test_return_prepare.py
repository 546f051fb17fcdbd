"""The return flow's decode half (`ReturnDecodeSide`): what a request's KV params say of
its finished turn reaches the request before the engine has it, through decode's
``prepare`` hook; a return target that cannot be reached leaves the turn unreturned."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any
from typing import cast

import pytest

from kvduplex.common.config import ReturnMode
from kvduplex.common.sampling import SamplingParams
from kvduplex.engine.request import Request as EngineRequest
from kvduplex.instance.decode_routes import DecodePreparer
from kvduplex.instance.state import Generation
from kvduplex.kvflow.return_flow import ReturnDecodeSide
from kvduplex.kvflow.return_flow import ReturnPrefillSide
from kvduplex.kvflow.return_flow import ReturnTarget
from kvduplex.kvflow.return_pull import RetainSpec
from kvduplex.kvflow.returns import ReturnSpec
from kvduplex.kvflow.returns import ReturnStats
from kvduplex.transport.protocol import PeerUnavailableError

PEER = SimpleNamespace(engine_id="p-engine")


class _Directory:
    """``get_peer`` of a directory that knows one prefill instance, at http://p."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str | None]] = []

    def get_peer(self, url: str, engine_id: str | None) -> Any:
        self.asked.append((url, engine_id))
        if url != "http://p":
            raise PeerUnavailableError(f"{url} refused the connection")
        return PEER


def _side(directory: _Directory, stats: ReturnStats | None = None) -> ReturnDecodeSide:
    offerer = SimpleNamespace(stats=stats or ReturnStats(), records=lambda: {})
    retainer = SimpleNamespace(num_retained=lambda: 2)
    return ReturnDecodeSide(cast(Any, offerer), cast(Any, retainer), directory.get_peer)


def _request() -> EngineRequest:
    return EngineRequest("d-1", list(range(20)), SamplingParams())


class _Raw:
    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    async def json(self) -> Any:
        return self.body


def test_the_route_hands_the_return_target_to_the_request() -> None:
    directory = _Directory()
    preparer = DecodePreparer(
        _side(directory), cast(Any, None), cast(Any, None), cast(Any, None), lambda u, x: None
    )
    params = {"mode": "local", "session_id": "s1", "return_to": "http://p",
              "return_engine_id": "p-engine", "return_from_block": 2, "return_max_tokens": 40}  # fmt: skip
    gen = Generation(_request(), cast(Any, None))
    asyncio.run(preparer(cast(Any, _Raw({"kv_transfer_params": params})), gen))
    assert directory.asked == [("http://p", "p-engine")]
    assert gen.request.connector_meta == ReturnSpec("s1", cast(Any, PEER), 2, 40)
    assert gen.request.hold_blocks_on_finish
    assert gen.request.session_id == "s1"  # its blocks are kept as the session's


def test_an_unreachable_return_target_leaves_the_turn_unreturned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    req = _request()
    target = ReturnTarget("s1", ReturnMode.PUSH, "http://gone")
    with caplog.at_level(logging.WARNING, logger="kvduplex.kvflow.return_flow"):
        assert not asyncio.run(_side(_Directory()).prepare(req, target))
    assert req.connector_meta is None and not req.hold_blocks_on_finish
    assert "session s1: no connection to http://gone" in caplog.text


def test_pull_mode_keeps_the_turn_for_the_next_read_without_connecting() -> None:
    directory = _Directory()
    req = _request()
    assert asyncio.run(_side(directory).prepare(req, ReturnTarget("s1", ReturnMode.PULL)))
    assert req.connector_meta == RetainSpec("s1") and req.hold_blocks_on_finish
    assert directory.asked == []


def test_push_mode_without_a_target_returns_nothing() -> None:
    req = _request()
    assert not asyncio.run(_side(_Directory()).prepare(req, ReturnTarget("s1", ReturnMode.PUSH)))
    assert req.connector_meta is None and not req.hold_blocks_on_finish


def test_stats_are_copies_the_engine_thread_does_not_change() -> None:
    live = ReturnStats(num_offered=1)
    side = _side(_Directory(), live)
    seen = side.stats()
    live.num_offered += 1  # the engine thread counts on
    assert (seen.num_offered, side.stats().num_offered, side.num_retained()) == (1, 2, 2)
    accepted = ReturnStats(num_accepted=3)
    prefill = ReturnPrefillSide(cast(Any, SimpleNamespace(stats=accepted))).stats()
    accepted.num_accepted += 1
    assert prefill.num_accepted == 3
