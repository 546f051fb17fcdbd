"""`PushDecode.cancel` for a push decode has not heard of yet (the router cancels a push
as soon as prefill fails, which can be before decode got the request): the cancel is kept
for the request still to come, which then computes its prompt here without waiting for
KV; kept for a wait at most, and `MAX_EARLY_CANCELS` of them at most.

A real `KVReceiver` (no transport: nothing here sends) under a fake engine handle, and a
clock of the test's own in place of `time.monotonic`."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvduplex.engine.scheduler_output import KVReceiveFailed
from kvduplex.engine.scheduler_output import RemoteKVAllocation
from kvduplex.kvflow import push_decode
from kvduplex.kvflow.inbox import FlowInbox
from kvduplex.kvflow.push_decode import PushDecode
from kvduplex.kvflow.push_decode import PushSpec
from kvduplex.kvflow.receiver import KVReceiver
from kvduplex.model.loader import LoadedModel
from tests.unit.flow_common import _reference
from tests.unit.flow_common import tiny as tiny  # the module-scoped model fixture
from tests.unit.flow_sim import Sim

WAIT_S = 10.0
BLOCK_SIZE = 4


class _Clock:
    """`time.monotonic` as `push_decode` reads it, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    clock = _Clock()
    monkeypatch.setattr(push_decode, "time", clock)
    return clock


@pytest.fixture
def push() -> PushDecode:
    engine: Any = SimpleNamespace(block_size=BLOCK_SIZE, is_healthy=False)  # no heartbeats
    inbox = FlowInbox()
    receiver = KVReceiver(None, engine, inbox, None, wait_s=WAIT_S, quarantine_s=WAIT_S)  # type: ignore[arg-type]
    return PushDecode(receiver, engine)


def _spec(xid: str) -> PushSpec:
    return PushSpec(xid, peer=SimpleNamespace(engine_id="p"), prefill_url="http://p0")  # type: ignore[arg-type]


def _admit(push: PushDecode, xid: str) -> None:
    """Admission of the request for `xid`: blocks for its whole 8-token prompt."""
    push.start(RemoteKVAllocation("req-" + xid, xid, (0, 1), 0, 2 * BLOCK_SIZE))


def _is_cancelled(push: PushDecode, xid: str) -> bool:
    """`xid`'s request, registered, will compute its prompt here when admitted."""
    return push.owns(xid) and xid in push._cancelled


def test_a_cancel_before_the_request_makes_it_compute_its_prompt_here(
    push: PushDecode, clock: _Clock
) -> None:
    """1. The router's cancel comes first: unknown (False), and kept; 2. the request comes:
    no spec is kept for it; 3. at admission it computes its prompt here (its blocks are
    fresh: nothing to discard). Another xid is untouched by the cancel."""
    assert push.cancel("x1", "prefill failed") is False  # 1.
    push.register(_spec("x2"))
    assert push.owns("x2") and push.num_specs() == 1, "another xid registers as always"
    push.register(_spec("x1"))  # 2.
    assert push.owns("x1") and push.num_specs() == 2, "kept (cancelled) until admission"
    _admit(push, "x1")  # 3.
    assert push.take_finished() == [KVReceiveFailed("req-x1", discard_blocks=False)]
    assert not push.receiver.is_waiting("x1"), "no registration with prefill"
    assert push.stats.num_fallbacks == 1, "counted as the fallback it is"


def test_an_early_cancel_is_used_once(push: PushDecode, clock: _Clock) -> None:
    """The kept cancel goes with the request it was for: while that request queues, its
    xid is in use; once it was admitted, a later request that uses the same xid (a
    retry) waits for its KV as any does."""
    push.cancel("x1", "prefill failed")
    push.register(_spec("x1"))
    with pytest.raises(ValueError, match="in use"):
        push.register(_spec("x1"))
    _admit(push, "x1")
    assert not push.owns("x1") and push.num_specs() == 0
    push.register(_spec("x1"))
    assert push.owns("x1") and not _is_cancelled(push, "x1"), "this one waits for its KV"


def test_a_cancel_of_a_registered_request_is_not_kept(push: PushDecode, clock: _Clock) -> None:
    """A cancel of a request decode has (not admitted yet) ends its spec (True): that
    request computes its prompt here when admitted (a fallback), and nothing is kept for
    a request to come."""
    push.register(_spec("x1"))
    assert push.cancel("x1", "prefill failed") is True
    assert push.owns("x1"), "kept (cancelled) until admission"
    _admit(push, "x1")
    assert push.take_finished() == [KVReceiveFailed("req-x1", discard_blocks=False)]
    assert push.stats.num_fallbacks == 1
    push.register(_spec("x1"))
    assert push.owns("x1") and not _is_cancelled(push, "x1")


def test_an_early_cancel_is_dropped_by_the_tick_after_a_wait(
    push: PushDecode, clock: _Clock
) -> None:
    """Kept for a wait (`wait_s`) from when it came: the pump's tick drops it then, and a
    request that comes after that waits for its KV as any does."""
    push.cancel("old", "prefill failed")
    clock.now += 5.0
    push.cancel("new", "prefill failed")
    push._tick(clock.now + WAIT_S - 5.0 - 0.001)  # "old" just short of a wait: both kept
    push._tick(clock.now + WAIT_S - 5.0)  # "old" a wait old: dropped; "new" kept
    push.register(_spec("old"))
    push.register(_spec("new"))
    assert not _is_cancelled(push, "old"), "a dropped cancel holds no request"
    assert _is_cancelled(push, "new"), "a cancel younger than a wait is kept"


def test_at_most_max_early_cancels_are_kept(
    push: PushDecode, clock: _Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past `MAX_EARLY_CANCELS`, the oldest cancel goes first."""
    monkeypatch.setattr(push_decode, "MAX_EARLY_CANCELS", 2)
    for xid in ("x1", "x2", "x3"):
        clock.now += 1.0
        assert push.cancel(xid, "prefill failed") is False
    for xid in ("x1", "x2", "x3"):
        push.register(_spec(xid))
    assert not _is_cancelled(push, "x1"), "the oldest was dropped"
    assert _is_cancelled(push, "x2") and _is_cancelled(push, "x3")


def test_a_cancelled_push_is_admitted_as_a_push_and_leaves_nothing(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a real decode engine and its connector: a push cancelled before its request
    came, and one cancelled while its request queued, are admitted by the push flow (not
    taken for a pull), decode the exact answer over their own prefill, count as
    fallbacks and leave no table entry behind."""
    s = Sim(tiny, monkeypatch)
    push = s.df.push
    assert push.cancel("early", "prefill failed") is False
    s.push_decode("early")
    s.run(lambda: s.finished("d-early"))
    assert s.outputs["d-early"] == _reference(tiny)

    push.register(s.push_spec("late"))
    assert push.cancel("late", "prefill failed") is True
    s.decode("late")
    s.run(lambda: s.finished("d-late"))
    assert s.outputs["d-late"] == _reference(tiny)
    assert push.stats.num_fallbacks == 2
    tables = s.df.tables()
    assert tables["push_specs"] == 0 and tables["receive_waits"] == 0
    s.assert_clean()
