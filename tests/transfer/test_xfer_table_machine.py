"""Property-based (hypothesis stateful) test of the NIXL transfer table over a
scripted agent: whatever order posts, completions, deadlines, refused releases,
disconnects and endpoint teardowns come in, a transfer is *settled* (its blocks
may be reused) only once NIXL has finished and released it or its peer's endpoint
is gone (a release of an active transfer is only a cancel); every transfer ends
final; and each one is final and settled exactly once."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine
from hypothesis.stateful import invariant
from hypothesis.stateful import precondition
from hypothesis.stateful import rule

from kvduplex.transport.nixl_xfers import Job
from kvduplex.transport.nixl_xfers import XferTable
from kvduplex.transport.protocol import FailureKind
from kvduplex.transport.protocol import TransferHandle
from kvduplex.transport.protocol import TransferOp
from kvduplex.transport.protocol import TransferState

PEERS = ("d0", "d1")


class Agent:
    """Stands in for `NixlAgent`: NIXL's transfer states are the test's to set."""

    def __init__(self) -> None:
        self.status: dict[int, str] = {}
        self.peer: dict[int, str] = {}
        self.refuse: set[int] = set()
        self.released: set[int] = set()
        self.released_finished: set[int] = set()
        """Released once NIXL had finished them (DONE or ERR): nothing more can move."""
        self.removed: set[str] = set()
        self._next = 0
        self.post_status = "PROC"

    def post(self, op: str, _l: Any, _li: Any, dlist: Any, *_rest: Any) -> tuple[int, str]:
        self._next += 1
        self.status[self._next] = self.post_status
        self.peer[self._next] = dlist
        return self._next, self.post_status

    def check(self, xfer: int) -> str:
        return self.status[xfer]

    def try_release(self, xfer: int, what: str | None) -> bool:
        if xfer in self.refuse:
            return False
        self.released.add(xfer)
        if self.status[xfer] in ("DONE", "ERR"):
            self.released_finished.add(xfer)
        return True

    def try_send_notif(self, agent_name: str, msg: bytes) -> bool:
        return True


class XferTableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.agent = Agent()
        self.finals: dict[int, int] = {}
        self.settles: dict[int, int] = {}
        self.handles: list[TransferHandle] = []
        self.xfer_of: dict[int, int] = {}  # id(handle) -> agent's xfer, once posted
        self.table = XferTable(
            self.agent, None, self._complete, self._settle, lambda: None, 1 << 40  # type: ignore[arg-type]
        )

    def _complete(
        self, h: TransferHandle, state: TransferState, reason: str | None = None,
        failure: FailureKind | None = None, *, may_still_land: bool = False,
    ) -> None:  # fmt: skip
        if h.finish(state, reason, failure, may_still_land=may_still_land):
            self.finals[id(h)] = self.finals.get(id(h), 0) + 1
        if h.settled:
            self._note_settled(h)

    def _settle(self, h: TransferHandle, why: str) -> None:
        if h.settle():
            self._note_settled(h)

    def _note_settled(self, h: TransferHandle) -> None:
        self.settles[id(h)] = self.settles.get(id(h), 0) + 1
        if h.state is TransferState.DONE:
            return
        x = self.xfer_of.get(id(h))
        if x is None:
            return  # never posted: nothing could move
        # A release of an active transfer only cancels it: it may be on the wire still.
        ok = x in self.agent.released_finished or self.agent.peer[x] in self.agent.removed
        assert ok, f"{h} settled while NIXL still holds its transfer"

    @rule(peer=st.sampled_from(PEERS), inline_done=st.booleans())
    def post(self, peer: str, inline_done: bool) -> None:
        if peer in self.agent.removed:
            return
        h = TransferHandle(f"x{len(self.handles)}", TransferOp.WRITE, peer, 2, 64, 30.0)
        self.handles.append(h)
        self.agent.post_status = "DONE" if inline_done else "PROC"
        idx = np.zeros(2, dtype=np.int32)
        self.table.submit(Job(h, peer, "agent-" + peer, peer, idx, idx, b""))
        self.xfer_of[id(h)] = self.agent._next

    def _posted(self) -> list[int]:
        return [x for x, s in self.agent.status.items() if s == "PROC"]

    @precondition(lambda self: bool(self._posted()))
    @rule(data=st.data(), outcome=st.sampled_from(["DONE", "ERR"]))
    def nixl_finishes(self, data: st.DataObject, outcome: str) -> None:
        x = data.draw(st.sampled_from(self._posted()))
        self.agent.status[x] = outcome

    @precondition(lambda self: bool(self.handles))
    @rule(data=st.data())
    def deadline_passes(self, data: st.DataObject) -> None:
        h = data.draw(st.sampled_from(self.handles))
        h.expires_at = time.monotonic() - 1

    @precondition(lambda self: bool(self.agent.status))
    @rule(data=st.data(), refuse=st.booleans())
    def nixl_release_policy(self, data: st.DataObject, refuse: bool) -> None:
        x = data.draw(st.sampled_from(sorted(self.agent.status)))
        if refuse:
            self.agent.refuse.add(x)
        else:
            self.agent.refuse.discard(x)

    @rule()
    def progress(self) -> None:
        self.table.check_all()
        self.table.retry_releases()

    @rule(peer=st.sampled_from(PEERS), tear_down=st.booleans())
    def disconnect(self, peer: str, tear_down: bool) -> None:
        self.table.fail(peer, "peer disconnected", FailureKind.DISCONNECTED)
        if tear_down:  # the endpoint removed (NixlTransport.disconnect always does)
            self.agent.removed.add(peer)
            self.table.settle_peer(peer, "peer endpoint torn down")

    @invariant()
    def each_once(self) -> None:
        assert all(n == 1 for n in self.finals.values())
        assert all(n == 1 for n in self.settles.values())
        for h in self.handles:
            assert not (h.settled and not h.done()), "settled before final"
            assert not (h.state is TransferState.DONE and not h.settled)

    def teardown(self) -> None:
        # In the end NIXL finishes everything and releases it, and every peer's endpoint
        # is torn down (as `close` does): all handles settle.
        self.agent.refuse.clear()
        for x in self._posted():
            self.agent.status[x] = "DONE"
        for h in self.handles:
            h.expires_at = time.monotonic() - 1
        self.table.check_all()
        self.table.retry_releases()
        self.agent.removed.update(PEERS)
        self.table.settle_peer(None, "transport closed")
        for h in self.handles:
            assert h.done() and h.settled, h


XferTableMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_xfer_table_machine = XferTableMachine.TestCase
