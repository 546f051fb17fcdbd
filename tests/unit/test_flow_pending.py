"""Every future a flow hands another thread is resolved: a registration queued as the
engine dies, and a retained turn's READ whose engine died or whose handler raised."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest

from kvduplex.kvflow.inbox import EngineGoneError
from kvduplex.kvflow.inbox import FlowInbox
from kvduplex.model.loader import LoadedModel
from tests.unit.flow_pair import Pair
from tests.unit.flow_pair import tiny as tiny  # the module-scoped model fixture
from tests.unit.test_retained_turns import _turn


class _Table:
    def register(self, spec: Any) -> None:
        pass


def test_a_registration_queued_as_the_engine_dies_fails() -> None:
    """The engine dies between the inbox's liveness check and its taking the reply: the
    death's fail_pending ran already, and the reply still fails (the route answers 503)."""
    alive = [True]
    inbox: FlowInbox

    def is_alive() -> bool:
        was = alive[0]
        if was:  # the engine dies right after this check answers
            alive[0] = False
            inbox.fail_pending(RuntimeError("the engine loop has ended"))
        return was

    inbox = FlowInbox(is_alive=is_alive)
    reply = inbox.register(object(), _Table())
    assert reply.done(), "nothing drains the inbox any more: the reply must fail now"
    with pytest.raises(EngineGoneError):
        reply.result(0)


def _start_read(s: Pair, xid: str) -> Future[int]:
    _turn(s, f"{xid}-turn", f"{xid}-session")
    info = s.ad.call(lambda _e: s.df.retainer.describe(f"{xid}-session")).result(5)
    assert info is not None
    return s.ap.call(lambda _e: s.pf.reader.start(
        s.d_peer, xid, info["block_ids"], info["keys"], info["token_ids"], 30.0,
    )).result(5)  # fmt: skip


def test_a_retained_read_fails_when_prefills_engine_dies(tiny: LoadedModel) -> None:
    with Pair(tiny, transfer_timeout_s=30) as s:
        s.tp.hang_next()  # the READ never ends
        done = _start_read(s, "rd1")
        s.ap.shutdown()
        with pytest.raises(EngineGoneError):
            done.result(5)


def test_a_retained_read_fails_when_its_handler_raises(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Pair(tiny) as s:
        def broken(*_a: object) -> None:
            raise RuntimeError("cache_blocks broke")

        monkeypatch.setattr(s.pf.reader.engine, "cache_blocks", broken)
        done = _start_read(s, "rd2")
        with pytest.raises(RuntimeError, match="cache_blocks broke"):
            done.result(5)
