"""A deadline ends the wait, not the transfer: FAILED handles that may still land
stay unsettled until nothing of them can move (the fake's late transfers, and the
NIXL transfer table over a scripted agent)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kvduplex.transport.nixl_xfers import Job
from kvduplex.transport.nixl_xfers import XferTable
from kvduplex.transport.protocol import FailureKind
from kvduplex.transport.protocol import TransferHandle
from kvduplex.transport.protocol import TransferOp
from kvduplex.transport.protocol import TransferState
from tests.transfer.test_fake import Pair
from tests.transfer.test_fake import pair as pair  # the fixture

pytestmark = pytest.mark.timeout(30)


def _wait_final(h: TransferHandle) -> None:
    assert h.wait(5) is not TransferState.PENDING


def test_a_late_write_fails_at_its_deadline_and_settles_only_when_it_lands(pair: Pair) -> None:
    settled = threading.Event()
    before = pair.pool_d[:, :, 3].clone()
    pair.p.land_late_next(None)
    h = pair.p.transfer(TransferOp.WRITE, pair.to_d, "late1", [1], [3], deadline_s=0.1)
    h.add_settled_callback(lambda _: settled.set())
    _wait_final(h)
    assert h.state is TransferState.FAILED and h.failure is FailureKind.DEADLINE
    assert h.may_still_land and not h.settled and not settled.is_set()
    assert torch.equal(pair.pool_d[:, :, 3], before), "nothing landed yet"
    assert pair.p.num_late() == 1

    assert pair.p.land_late() == 1
    assert torch.equal(pair.pool_d[:, :, 3], pair.pool_p[:, :, 1]), "it landed after all"
    assert settled.is_set() and h.settled and not h.may_still_land
    assert pair.p.num_late() == 0


def test_a_corrupt_late_read_lands_garbage(pair: Pair) -> None:
    pair.p.land_late_next(None, corrupt=True)
    h = pair.p.transfer(TransferOp.READ, pair.to_d, "late2", [2], [5], deadline_s=0.1)
    _wait_final(h)
    assert pair.p.land_late() == 1
    assert not torch.equal(pair.pool_p[:, :, 2], pair.pool_d[:, :, 5])
    assert h.settled


def test_tearing_the_initiators_endpoint_down_settles_a_late_transfer_unlanded(
    pair: Pair,
) -> None:
    before = pair.pool_d[:, :, 4].clone()
    pair.p.land_late_next(None)
    h = pair.p.transfer(TransferOp.WRITE, pair.to_d, "late3", [1], [4], deadline_s=0.1)
    _wait_final(h)
    assert h.may_still_land
    pair.p.disconnect(pair.to_d)
    assert h.settled and not h.may_still_land
    assert pair.p.land_late() == 0
    assert torch.equal(pair.pool_d[:, :, 4], before), "a torn-down endpoint lands nothing"


def test_the_targets_teardown_does_not_stop_the_initiators_transfer(pair: Pair) -> None:
    """A one-sided WRITE uses the initiator's endpoint and the target's registration:
    the target dropping its own endpoint to the initiator stops nothing (as over NIXL)."""
    pair.p.land_late_next(None)
    h = pair.p.transfer(TransferOp.WRITE, pair.to_d, "late5", [1], [4], deadline_s=0.1)
    _wait_final(h)
    pair.d.disconnect(pair.to_p)
    assert h.may_still_land
    assert pair.p.land_late() == 1
    assert torch.equal(pair.pool_d[:, :, 4], pair.pool_p[:, :, 1])
    assert h.settled


def test_a_late_transfer_lands_by_itself_after_its_delay(pair: Pair) -> None:
    pair.p.land_late_next(0.05)
    h = pair.p.transfer(TransferOp.WRITE, pair.to_d, "late4", [6], [7], deadline_s=0.05)
    assert h.wait_settled(5)
    assert h.state is TransferState.FAILED
    assert torch.equal(pair.pool_d[:, :, 7], pair.pool_p[:, :, 6])


def test_done_and_plainly_failed_transfers_are_settled_at_once(pair: Pair) -> None:
    h = pair.p.transfer(TransferOp.WRITE, pair.to_d, "ok", [1], [1])
    _wait_final(h)
    assert h.state is TransferState.DONE and h.settled
    pair.p.fail_next("boom")
    h2 = pair.p.transfer(TransferOp.WRITE, pair.to_d, "bad", [1], [1])
    assert h2.state is TransferState.FAILED and h2.settled and not h2.may_still_land
    pair.p.hang_next()  # a transfer the backend cancelled cleanly at its deadline
    h3 = pair.p.transfer(TransferOp.WRITE, pair.to_d, "hung", [1], [1], deadline_s=0.05)
    _wait_final(h3)
    assert h3.settled


# ---- the NIXL transfer table, over a scripted agent ----


class ScriptedAgent:
    """Stands in for `NixlAgent`: transfers stay "PROC" until the test says otherwise,
    and a release of an active transfer can be refused."""

    def __init__(self) -> None:
        self.status: dict[int, str] = {}
        self.refuse_release: set[int] = set()
        self.released: list[int] = []
        self.checked_after_release: list[int] = []
        """NIXL would read a freed handle for each of these."""
        self.on_check: Callable[[], None] | None = None
        """Runs inside the next check (another thread's turn mid-poll)."""
        self._next = 0

    def post(self, *args: Any, **kwargs: Any) -> tuple[int, str]:
        self._next += 1
        self.status[self._next] = "PROC"
        return self._next, "PROC"

    def check(self, xfer: int) -> str:
        if xfer in self.released:
            self.checked_after_release.append(xfer)
        if self.on_check is not None:
            hook, self.on_check = self.on_check, None
            hook()
        return self.status[xfer]

    def try_release(self, xfer: int, what: str | None) -> bool:
        if xfer in self.refuse_release:
            return False
        self.released.append(xfer)
        return True

    def try_send_notif(self, agent_name: str, msg: bytes) -> bool:
        return True


class Table:
    def __init__(self) -> None:
        self.agent = ScriptedAgent()
        self.settled: list[str] = []
        self.table = XferTable(self.agent, None, self._complete, self._settle, lambda: None, 1 << 30)  # type: ignore[arg-type]

    @staticmethod
    def _complete(
        h: TransferHandle, state: TransferState, reason: str | None = None,
        failure: FailureKind | None = None, *, may_still_land: bool = False,
    ) -> None:  # fmt: skip
        h.finish(state, reason, failure, may_still_land=may_still_land)

    def _settle(self, h: TransferHandle, why: str) -> None:
        if h.settle():
            self.settled.append(why)

    def submit(self, xid: str, deadline_s: float, peer: str = "d") -> TransferHandle:
        h = TransferHandle(xid, TransferOp.WRITE, peer, 2, 64, deadline_s)
        idx = np.zeros(2, dtype=np.int32)
        self.table.submit(Job(h, peer, "agent-" + peer, None, idx, idx, b""))
        return h


def test_nixl_table_keeps_polling_a_transfer_past_its_deadline_until_nixl_ends_it() -> None:
    t = Table()
    h = t.submit("x", deadline_s=30)
    t.table.check_all()
    assert h.state is TransferState.PENDING
    h.expires_at = time.monotonic() - 1  # its deadline passes
    t.table.check_all()
    assert h.state is TransferState.FAILED and h.failure is FailureKind.DEADLINE
    assert h.may_still_land
    assert t.agent.released == [], "an active transfer is not released at its deadline"
    assert t.table.busy, "still polled"
    t.table.check_all()
    assert h.may_still_land
    t.agent.status[1] = "DONE"  # NIXL finished it after all: now nothing can land
    t.table.check_all()
    assert h.settled and t.agent.released == [1] and not t.table.busy
    assert h.state is TransferState.FAILED, "the wait already ended FAILED"


def test_nixl_table_settles_a_refused_release_once_it_is_released() -> None:
    t = Table()
    h = t.submit("y", deadline_s=30)
    t.agent.status[1] = "ERR"
    t.agent.refuse_release.add(1)
    t.table.check_all()
    assert h.state is TransferState.FAILED and h.may_still_land
    t.table.retry_releases()
    assert h.may_still_land
    t.agent.refuse_release.clear()
    t.table.retry_releases()
    assert h.settled


def test_nixl_table_settles_unreleased_transfers_when_the_peer_is_torn_down() -> None:
    t = Table()
    h = t.submit("z", deadline_s=30)
    other = t.submit("w", deadline_s=30, peer="e")
    t.agent.refuse_release.update({1, 2})
    t.table.fail("d", "peer disconnected", FailureKind.DISCONNECTED)
    assert h.state is TransferState.FAILED and h.may_still_land
    assert other.state is TransferState.PENDING
    t.table.settle_peer("d", "peer endpoint torn down")
    assert h.settled and t.settled == ["peer endpoint torn down"]
    assert not other.done()


class ObservedLock:
    """A lock that tells when a thread has to wait for it."""

    def __init__(self, contended: threading.Event) -> None:
        self._lock = threading.Lock()
        self._contended = contended

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            self._contended.set()
            self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_nixl_table_never_checks_a_handle_that_a_concurrent_fail_released() -> None:
    """A disconnect fails a peer's transfers on its own thread while the progress
    thread polls them: NIXL is never asked about a handle once it was released."""
    t = Table()
    first, second = t.submit("a", deadline_s=30), t.submit("b", deadline_s=30)
    fail_ran_or_waits = threading.Event()
    t.table._lock = ObservedLock(fail_ran_or_waits)  # type: ignore[assignment]

    def disconnect() -> None:
        t.table.fail("d", "peer disconnected", FailureKind.DISCONNECTED)
        fail_ran_or_waits.set()

    failing = threading.Thread(target=disconnect)

    def fail_mid_poll() -> None:
        failing.start()
        assert fail_ran_or_waits.wait(10)

    t.agent.on_check = fail_mid_poll  # while the poll checks the first transfer
    t.table.check_all()
    failing.join(10)
    assert first.state is TransferState.FAILED and second.state is TransferState.FAILED
    assert sorted(t.agent.released) == [1, 2]
    assert t.agent.checked_after_release == []
    assert not t.table.busy


# ---- the NIXL transport's teardown, over a scripted agent ----


class TeardownAgent(ScriptedAgent):
    """Stands in for `NixlAgent` inside a `NixlTransport`: removing a peer can fail."""

    def __init__(self, name: str, backend_params: object = None) -> None:
        super().__init__()
        self.name = name
        self.remove_fails = False
        self.removed: list[str] = []

    def register(self, *args: Any) -> None:
        pass

    def prep_dlist(self, *args: Any) -> object:
        return object()

    def metadata(self) -> bytes:
        return b"md"

    def add_peer(self, metadata: bytes) -> str:
        return metadata.decode()

    def try_remove_peer(self, agent_name: str, dlist: Any) -> bool:
        if self.remove_fails:
            return False  # NIXL raised; the agent logged it and went on
        self.removed.append(agent_name)
        return True

    def new_notifs(self) -> dict[str, list[bytes]]:
        return {}

    def try_close(self, local_dlist: Any) -> None:
        pass


def test_a_failed_endpoint_teardown_does_not_settle_a_cancelled_transfer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A transfer cancelled while active may still be on the wire until its peer's
    endpoint is really gone: a removal NIXL refused settles nothing; a later
    teardown that succeeds does."""
    from kvduplex.common.kv_layout import KVCacheLayout
    from kvduplex.engine.kv_cache import allocate_kv_pool
    from kvduplex.transport import nixl as nixl_transport
    from kvduplex.transport.messages import HandshakeInfo
    from kvduplex.transport.messages import LayoutInfo

    monkeypatch.setattr(nixl_transport, "NixlAgent", TeardownAgent)
    layout = KVCacheLayout(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
    t = nixl_transport.NixlTransport(allocate_kv_pool(layout), layout, engine_id="p")
    agent: TeardownAgent = t._agent  # type: ignore[assignment]
    try:
        info = HandshakeInfo("d", "agent-d", b"agent-d", LayoutInfo.from_layout(layout), 0)
        peer = t.connect(info)
        h = t.transfer(TransferOp.WRITE, peer, "x1", [1], [2], deadline_s=30)
        settled = threading.Event()
        h.add_settled_callback(lambda _: settled.set())
        agent.remove_fails = True
        t.disconnect(peer)  # fails the WRITE (released while active: cancelled)
        assert h.state is TransferState.FAILED and h.may_still_land
        assert not h.settled and not settled.is_set(), "the endpoint is still there"
        agent.remove_fails = False
        t.disconnect(peer)  # the teardown is tried again, and now succeeds
        assert agent.removed == ["agent-d"]
        assert h.settled and settled.is_set() and not h.may_still_land
    finally:
        t.close()
