"""Closing the flow I/O threads loses no send silently: one whose first try fails while
`close` runs is still handed to the waits thread, which connects afresh and sends it;
one submitted after `close` is logged."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace
from typing import Any
from typing import cast

import pytest

from kvduplex.kvflow.flow_io import FlowIO
from kvduplex.kvflow.flow_io import Notify
from kvduplex.kvflow.inbox import FlowInbox
from kvduplex.kvflow.messages import KVFailed


class _Transport:
    """The first send blocks until ``go`` is set, then fails (the peer's endpoint is
    gone); later sends succeed and are recorded."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.go = threading.Event()
        self.num_tries = 0
        self.sent: list[str] = []

    def send_notif(self, peer: Any, payload: bytes, xid: str) -> None:
        self.num_tries += 1
        if self.num_tries == 1:
            self.entered.set()
            assert self.go.wait(10), "the test never let the first send go on"
            raise ConnectionError(f"no endpoint to {peer.engine_id}")
        self.sent.append(peer.engine_id)


def _peer(engine_id: str) -> Any:
    return SimpleNamespace(engine_id=engine_id)


def test_a_send_handed_to_reconnect_while_closing_is_still_sent() -> None:
    transport = _Transport()
    reconnected: list[str] = []

    def reconnect(engine_id: str) -> Any:
        reconnected.append(engine_id)
        return _peer(engine_id)

    io = FlowIO(cast(Any, transport), FlowInbox(), reconnect=reconnect)
    io.submit(Notify(_peer("d1"), KVFailed("x1", "gave up"), reconnect=True))
    assert transport.entered.wait(10)
    io.close()  # while the first try is under way
    transport.go.set()
    assert io._send_thread is not None and io._wait_thread is not None
    io._send_thread.join(10)
    io._wait_thread.join(10)
    assert not io._send_thread.is_alive() and not io._wait_thread.is_alive()
    assert reconnected == ["d1"], "the send handed over to reconnect was dropped"
    assert transport.sent == ["d1"]


def test_a_request_after_close_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    io = FlowIO(cast(Any, _Transport()), FlowInbox())
    io.close()
    with caplog.at_level(logging.INFO, logger="kvduplex.kvflow.flow_io"):
        io.submit(Notify(_peer("d1"), KVFailed("x1", "gave up")))
    assert "dropping Notify" in caplog.text
