"""The flow I/O threads: a blocking call for one peer (an HTTP release, a handshake, a
quarantine check) never holds up a notification to another peer."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any
from typing import cast

from kvduplex.kvflow.flow_io import CheckSender
from kvduplex.kvflow.flow_io import FlowIO
from kvduplex.kvflow.flow_io import Notify
from kvduplex.kvflow.flow_io import NotifyEngine
from kvduplex.kvflow.flow_io import ReleaseLease
from kvduplex.kvflow.inbox import FlowInbox
from kvduplex.kvflow.messages import KVAliveAck
from kvduplex.kvflow.messages import KVFailed


class _Transport:
    """Sends to ``down`` fail; every send is recorded with its time, and sets the event
    of its peer (`sent_to`)."""

    def __init__(self, down: set[str] | None = None) -> None:
        self.down = down or set()
        self.sent: list[tuple[str, float]] = []
        self._lock = threading.Lock()
        self._events: dict[str, threading.Event] = {}

    def sent_to(self, engine_id: str) -> threading.Event:
        """Set once something was sent to ``engine_id`` (any thread)."""
        with self._lock:
            return self._events.setdefault(engine_id, threading.Event())

    def send_notif(self, peer: Any, payload: bytes, xid: str) -> None:
        if peer.engine_id in self.down:
            raise ConnectionError(f"{peer.engine_id} is unreachable")
        self.sent.append((peer.engine_id, time.monotonic()))
        self.sent_to(peer.engine_id).set()

    def is_connected(self, engine_id: str) -> bool:
        return engine_id not in self.down

    def disconnect(self, peer: Any) -> None:
        pass


def _peer(engine_id: str) -> Any:
    return SimpleNamespace(engine_id=engine_id)


def _sent_to(transport: _Transport, engine_id: str, within_s: float = 2.0) -> bool:
    """Whether the flow I/O thread sent to ``engine_id`` within ``within_s`` (the other
    peer's call still blocks meanwhile)."""
    return transport.sent_to(engine_id).wait(within_s)


def test_a_stuck_lease_release_does_not_delay_a_send_to_another_peer() -> None:
    transport = _Transport()
    io = FlowIO(cast(Any, transport), FlowInbox())
    stuck = threading.Event()
    try:
        io.submit(ReleaseLease(lambda _url, _xid: stuck.wait(10), "http://p2", "x2"))
        io.submit(Notify(_peer("p1"), KVAliveAck("x1", 0)))
        assert _sent_to(transport, "p1"), "P1's acknowledgement waited for P2's release"
    finally:
        stuck.set()
        io.close()


def test_a_stuck_sender_check_does_not_delay_a_send_to_another_peer() -> None:
    transport = _Transport(down={"p2"})
    io = FlowIO(cast(Any, transport), FlowInbox())
    stuck = threading.Event()
    target = SimpleNamespace(on_sender_checked=lambda *_a: None)
    try:
        io.submit(CheckSender("x2", _peer("p2"), cast(Any, target),
                              lambda _e: stuck.wait(10), None))  # fmt: skip
        io.submit(Notify(_peer("p1"), KVAliveAck("x1", 0)))
        assert _sent_to(transport, "p1"), "P1's acknowledgement waited for P2's check"
    finally:
        stuck.set()
        io.close()


def test_a_send_that_must_reconnect_does_not_delay_a_send_to_another_peer() -> None:
    transport = _Transport(down={"p2"})
    stuck = threading.Event()

    def reconnect(engine_id: str) -> Any:
        stuck.wait(10)  # a handshake to a partitioned peer
        return None

    io = FlowIO(cast(Any, transport), FlowInbox(), reconnect=reconnect)
    try:
        io.submit(Notify(_peer("p2"), KVFailed("x2", "gone"), reconnect=True))
        io.submit(NotifyEngine("p3", KVFailed("x3", "no such transfer")))  # not connected
        io.submit(Notify(_peer("p1"), KVAliveAck("x1", 0)))
        assert _sent_to(transport, "p1"), "P1's acknowledgement waited for P2's handshake"
    finally:
        stuck.set()
        io.close()


def test_a_failed_send_is_sent_again_over_a_fresh_connection() -> None:
    transport = _Transport(down={"p2"})
    fresh = _peer("p2-again")
    io = FlowIO(cast(Any, transport), FlowInbox(), reconnect=lambda _e: fresh)
    io.carry_out(Notify(_peer("p2"), KVFailed("x2", "gone"), reconnect=True))
    assert [e for e, _ in transport.sent] == ["p2-again"]


def test_a_sender_check_that_fails_is_answered_all_the_same() -> None:
    """A wait asks its sender nothing more until the check's answer comes: a check that
    fails on the way (here, the reconnect) still answers, "not gone"."""
    transport = _Transport(down={"p2"})
    inbox = FlowInbox()
    answers: list[tuple[str, bool]] = []
    target = SimpleNamespace(on_sender_checked=lambda xid, gone, _now: answers.append((xid, gone)))

    def reconnect(engine_id: str) -> Any:
        raise RuntimeError(f"no route to {engine_id}")

    io = FlowIO(cast(Any, transport), inbox)
    io.carry_out(CheckSender("x2", _peer("p2"), cast(Any, target), lambda _e: False, reconnect))
    inbox.drain()
    assert answers == [("x2", False)]
