"""Every future a flow hands another thread is resolved: a registration queued as the
engine dies, and a retained turn's READ whose engine died or whose handler raised."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest

from kvduplex.kvflow.inbox import EngineGoneError
from kvduplex.kvflow.inbox import FlowInbox
from kvduplex.model.loader import LoadedModel
from tests.unit.flow_common import tiny as tiny  # the module-scoped model fixture
from tests.unit.flow_sim import Sim
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


def _start_read(s: Sim, xid: str) -> Future[int]:
    _turn(s, f"{xid}-turn", f"{xid}-session")
    info = s.df.retainer.describe(f"{xid}-session")
    assert info is not None
    return s.pf.reader.start(
        s.d_peer, xid, info["block_ids"], info["keys"], info["token_ids"], 30.0,
    )  # fmt: skip


def test_a_retained_read_fails_when_prefills_engine_dies(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch, transfer_timeout_s=30)
    s.tp.hang_next()  # the READ never ends
    done = _start_read(s, "rd1")
    s.step()
    assert not done.done()
    s.ap.shutdown()  # P's engine loop ends
    with pytest.raises(EngineGoneError):
        done.result(0)


def test_a_retained_read_fails_when_its_handler_raises(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch)

    def broken(*_a: object) -> None:
        raise RuntimeError("cache_blocks broke")

    monkeypatch.setattr(s.pf.reader.engine, "cache_blocks", broken)
    done = _start_read(s, "rd2")
    s.run(done.done)
    with pytest.raises(RuntimeError, match="cache_blocks broke"):
        done.result(0)
