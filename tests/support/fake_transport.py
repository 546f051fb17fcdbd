"""InProcessTransport: the `Transport` between pools in one process, for tests.

Endpoints live on an `InProcessFabric` (think "the network"): ``connect``
looks the peer up by engine id, a transfer copies regions with torch at post
time and delivers its notification into the target's queue afterwards. Same
`Transport` base, same validation and metrics as `NixlTransport`, plus fault
injection for tests of the flows built on top::

    fabric = InProcessFabric()
    p, d = fabric.endpoint(pool_p, layout), fabric.endpoint(pool_d, layout)
    peer = p.connect(d.local_metadata())
    p.fail_next("boom")          # next transfer ends FAILED, nothing copied
    p.hang_next()                # next transfer stays PENDING until its deadline
    p.slow_next(0.2)             # next transfer lands (DONE) 0.2 s after its post
    p.land_late_next(0.5)        # next transfer FAILs at its deadline, then lands 0.5 s later
    p.land_late_next(None, corrupt=True); ...; p.land_late()   # ... lands (garbage) when told
    p.forge_next_sender("x")     # next notification's envelope claims engine "x"
    p.drop_next_notif(match)     # next notification (matching) is lost on the way
    d.chaos = NotifChaos(seed, p_drop=.03, p_dup=.03, p_reorder=.03)   # a lossy fabric

Deadlines and late landings run on threading timers, or, on a fabric built with
`ManualTimers`, only when the test moves that clock (`ManualTimers.advance_to`):
no thread at all, for tests stepped in one thread.

Each endpoint is its own agent (``inprocess-<engine id>``): a notification
reaches its target as delivered by the sending endpoint's agent, with the
envelope's claimed sender beside it, and the target's `Transport` checks the
two against the peers it connected to, as over NIXL. Closing an endpoint fails
the transfers in flight to it, like a dead peer.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import logging
import random
import threading
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Protocol
from typing import TypeVar

import torch

from kvduplex.common.fingerprint import ModelFingerprint
from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.model.dtypes import dtype_from_name
from kvduplex.transport.base import Incoming
from kvduplex.transport.base import Post
from kvduplex.transport.base import Transport
from kvduplex.transport.base import check_compatible
from kvduplex.transport.messages import HandshakeInfo
from kvduplex.transport.messages import LayoutInfo
from kvduplex.transport.metrics import TransferMetrics
from kvduplex.transport.protocol import FailureKind
from kvduplex.transport.protocol import PeerHandle
from kvduplex.transport.protocol import PeerUnavailableError
from kvduplex.transport.protocol import TransferError
from kvduplex.transport.protocol import TransferHandle
from kvduplex.transport.protocol import TransferOp
from kvduplex.transport.protocol import TransferState

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Timer(Protocol):
    def cancel(self) -> None: ...


@dataclass(order=True)
class _ManualTimer:
    at: float
    seq: int
    fn: Callable[..., None] = field(compare=False)
    args: tuple[Any, ...] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        self.cancelled = True


class ManualTimers:
    """The fabric's timers on a clock the test moves (one thread, no sleeps)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now
        self._due: list[_ManualTimer] = []
        self._seq = itertools.count()

    def start(self, delay_s: float, fn: Callable[..., None], args: tuple[Any, ...]) -> Timer:
        timer = _ManualTimer(self.now + delay_s, next(self._seq), fn, args)
        heapq.heappush(self._due, timer)
        return timer

    @property
    def num_pending(self) -> int:
        """Timers not fired (nor cancelled) yet."""
        return sum(1 for t in self._due if not t.cancelled)

    def advance_to(self, now: float) -> int:
        """Move the clock to ``now``, firing every timer due by then, in time order (those
        they start included); how many fired."""
        fired = 0
        while self._due and self._due[0].at <= now:
            timer = heapq.heappop(self._due)
            self.now = max(self.now, timer.at)
            if not timer.cancelled:
                fired += 1
                timer.fn(*timer.args)
        self.now = max(self.now, now)
        return fired


class InProcessFabric:
    """Connects `InProcessTransport` endpoints of one process by engine id."""

    def __init__(self, timers: ManualTimers | None = None) -> None:
        """``timers``: run deadlines and late landings on that clock (else on threads)."""
        self._lock = threading.Lock()
        self._endpoints: dict[str, InProcessTransport] = {}
        self.timers = timers

    def start_timer(self, delay_s: float, fn: Callable[..., None], *args: Any) -> Timer:
        if self.timers is not None:
            return self.timers.start(delay_s, fn, args)
        timer = threading.Timer(delay_s, fn, args=args)
        timer.daemon = True
        timer.start()
        return timer

    def endpoint(
        self,
        pool: torch.Tensor,
        layout: KVCacheLayout,
        *,
        engine_id: str | None = None,
        default_deadline_s: float = 10.0,
        metrics: TransferMetrics | None = None,
        fingerprint: ModelFingerprint | None = None,
    ) -> InProcessTransport:
        """A new endpoint over ``pool`` (shape and dtype must match ``layout``), serving
        what ``fingerprint`` says (None: no model, as a transfer test's)."""
        ep = InProcessTransport(
            self, pool, layout, engine_id, default_deadline_s, metrics, fingerprint
        )
        with self._lock:
            self._endpoints[ep.engine_id] = ep
        return ep

    def lookup(self, engine_id: str) -> InProcessTransport | None:
        with self._lock:
            return self._endpoints.get(engine_id)

    def endpoints(self) -> list[InProcessTransport]:
        with self._lock:
            return list(self._endpoints.values())

    def _remove(self, engine_id: str) -> None:
        with self._lock:
            self._endpoints.pop(engine_id, None)


class _FaultKind(enum.Enum):
    FAIL = "fail"
    """End FAILED at once; nothing copied."""
    HANG = "hang"
    """Stay PENDING until the deadline, then FAILED and settled (cleanly cancelled)."""
    LATE = "late"
    """FAILED at the deadline while it may still land; lands ``late_s`` later, then settles."""
    SLOW = "slow"
    """Lands and ends DONE ``late_s`` after its post (a slow link), unless its peer goes
    first (then FAILED, nothing copied)."""


@dataclass
class _Fault:
    kind: _FaultKind
    reason: str
    late_s: float | None = None
    corrupt: bool = False


@dataclass
class _Late:
    """A transfer that failed at its deadline and is still on its way."""

    post: Post
    target: InProcessTransport
    corrupt: bool
    timer: Timer | None = None
    expired: bool = False


class NotifChaos:
    """What a lossy fabric does to notifications: drop, duplicate, or hold one back and
    deliver it after the next (reorder), each with its probability; seeded."""

    def __init__(
        self, seed: int, p_drop: float = 0.0, p_dup: float = 0.0, p_reorder: float = 0.0,
        spare: Callable[[Any], bool] | None = None,
    ) -> None:  # fmt: skip
        """``spare(notif)``: notifications never touched (e.g. those without a resend)."""
        self._rng = random.Random(seed)
        self.p_drop, self.p_dup, self.p_reorder = p_drop, p_dup, p_reorder
        self._spare = spare
        self._held: Any = None
        self._lock = threading.Lock()
        self.num_dropped = self.num_duplicated = self.num_reordered = 0

    def apply(self, notif: T) -> list[T]:
        """The notifications to deliver now, in order, given that ``notif`` arrived."""
        with self._lock:
            out: list[T] = []
            if self._spare is not None and self._spare(notif):
                out.append(notif)
            else:
                r = self._rng.random()
                if r < self.p_drop:
                    self.num_dropped += 1
                elif r < self.p_drop + self.p_dup:
                    self.num_duplicated += 1
                    out += [notif, notif]
                elif r < self.p_drop + self.p_dup + self.p_reorder and self._held is None:
                    self.num_reordered += 1
                    self._held = notif
                    return []
                else:
                    out.append(notif)
            if self._held is not None:
                out.append(self._held)
                self._held = None
            return out


class InProcessTransport(Transport):
    """One endpoint of an `InProcessFabric`; see the module docstring."""

    def __init__(
        self,
        fabric: InProcessFabric,
        pool: torch.Tensor,  # (L, 2, NB, BS, H, D)
        layout: KVCacheLayout,
        engine_id: str | None,
        default_deadline_s: float,
        metrics: TransferMetrics | None,
        fingerprint: ModelFingerprint | None = None,
    ) -> None:
        super().__init__(
            layout, engine_id or uuid.uuid4().hex, default_deadline_s, metrics, fingerprint
        )
        if tuple(pool.shape) != layout.shape or pool.dtype != dtype_from_name(layout.dtype):
            raise ValueError(
                f"pool {tuple(pool.shape)} {pool.dtype} does not match layout {layout}"
            )
        self._fabric = fabric
        self._pool = pool
        self._regions = pool.view(layout.num_layers * 2 * layout.num_blocks, -1)  # (regions, elems)
        self._peers: dict[str, PeerHandle] = {}
        self._faults: deque[_Fault] = deque()
        self._hung: dict[int, tuple[TransferHandle, Timer]] = {}
        self._late: dict[int, _Late] = {}
        self._forged: deque[str] = deque()
        self._drops: deque[Callable[[bytes], bool]] = deque()
        self.num_notifs_dropped = 0
        """Notifications lost to `drop_next_notif` (for tests)."""
        self.num_posted = 0
        """Transfers posted so far (for tests)."""
        self.late_check: Callable[[Post], None] | None = None
        """Runs just before a late transfer lands (a test's invariant)."""
        self.chaos: NotifChaos | None = None
        """Faults of the notifications this endpoint receives."""

    # -- fault injection --------------------------------------------------

    def fail_next(self, reason: str = "injected failure") -> None:
        """The next transfer posted here ends FAILED with ``reason``; nothing is copied."""
        with self._lock:
            self._faults.append(_Fault(_FaultKind.FAIL, reason))

    def hang_next(self) -> None:
        """The next transfer posted here never completes: it fails at its deadline."""
        with self._lock:
            self._faults.append(_Fault(_FaultKind.HANG, "hang"))

    def slow_next(self, delay_s: float, *, copy_at_post: bool = False) -> None:
        """The next transfer posted here lands (copied, DONE, its notification sent)
        ``delay_s`` seconds after its post, as over a slow link. ``copy_at_post``: the
        bytes are copied at the post, on the poster's thread, and only its end waits (a
        NIC's copy costs the CPU nothing meanwhile; a benchmark's forward then shares it
        with no copy)."""
        with self._lock:
            self._faults.append(_Fault(_FaultKind.SLOW, "slow", delay_s, corrupt=copy_at_post))

    def land_late_next(self, late_s: float | None, *, corrupt: bool = False) -> None:
        """The next transfer posted here ends FAILED at its deadline but may still land:
        its data (and notification) arrive ``late_s`` seconds after the deadline (None:
        when `land_late` is called), and only then is it settled; a disconnect or close
        before that settles it without landing. ``corrupt``: what lands is garbage (as
        stale KV from a source block reused meanwhile would be)."""
        with self._lock:
            self._faults.append(_Fault(_FaultKind.LATE, "late", late_s, corrupt))

    def num_late(self) -> int:
        """Transfers that failed at their deadline and have not landed or settled yet."""
        with self._lock:
            return sum(1 for lt in self._late.values() if lt.expired)

    def land_late(self, check: Callable[[Post], None] | None = None) -> int:
        """Land now every late transfer past its deadline; ``check(post)`` runs just
        before each copy (a test's invariant). Returns how many landed."""
        with self._lock:
            due = [lt for lt in self._late.values() if lt.expired]
        for lt in due:
            if check is not None:
                check(lt.post)
            self._land_late(lt)
        return len(due)

    def forge_next_sender(self, engine_id: str) -> None:
        """The envelope of the next notification sent from here (by `send_notif` or with
        a WRITE) names ``engine_id`` as its sender; its agent stays ours."""
        with self._lock:
            self._forged.append(engine_id)

    def drop_next_notif(self, match: Callable[[bytes], bool] | None = None) -> None:
        """Lose the next notification sent from here whose payload ``match``es (any, if
        None), as a network would: the sender believes it went out."""
        with self._lock:
            self._drops.append(match or (lambda _payload: True))

    # -- Transport -----------------------------------------------------------

    @property
    def agent_name(self) -> str:
        return f"inprocess-{self.engine_id}"

    def local_metadata(self) -> HandshakeInfo:
        return HandshakeInfo(
            engine_id=self.engine_id,
            agent_name=self.agent_name,
            agent_metadata=b"",
            layout=LayoutInfo.from_layout(self._layout),
            base_address=int(self._pool.data_ptr()),
            transport="inprocess",
            fingerprint=self.fingerprint,
        )

    def connect(self, info: HandshakeInfo) -> PeerHandle:
        peer_layout = check_compatible(
            self._layout, self.engine_id, info, "inprocess", self.fingerprint
        )
        if self._fabric.lookup(info.engine_id) is None:
            raise TransferError(f"no in-process endpoint {info.engine_id} on this fabric")
        with self._lock:
            self._ensure_open()
            handle = self._peers.get(info.engine_id)
            is_new = handle is None
            if handle is None:
                handle = PeerHandle(info.engine_id, info.agent_name, peer_layout)
                self._peers[info.engine_id] = handle
        if is_new:
            self._peer_connected(handle)
        return handle

    def is_connected(self, engine_id: str) -> bool:
        with self._lock:
            return engine_id in self._peers

    def disconnect(self, peer: PeerHandle) -> None:
        with self._lock:
            known = self._peers.pop(peer.engine_id, None)
        if known is not None:
            self._peer_disconnected(known)
        self._fail_hung(lambda h: h.peer_engine_id == peer.engine_id, "peer disconnected")
        # Only our own late transfers stop: as over NIXL, the peer's one-sided WRITEs and
        # READs into or from our pool use its endpoint, which our teardown does not touch.
        self._drop_late(lambda h: h.peer_engine_id == peer.engine_id, "peer endpoint torn down")

    def send_notif(self, peer: PeerHandle, payload: bytes, xid: str | None = None) -> None:
        target = self._target(peer)
        if target is None:
            self.peer_usage.failed(peer.engine_id, "peer is gone")
            raise PeerUnavailableError(f"xid={xid}: peer {peer.engine_id} is gone")
        self.peer_usage.used(peer.engine_id)
        self._touch()
        self._send(target, xid, payload)

    def _shutdown(self) -> None:
        self._fabric._remove(self.engine_id)
        self._fail_hung(lambda h: True, "transport closed")
        self._drop_late(lambda h: True, "transport closed")
        # Peers' transfers in flight to us fail like transfers to a dead process.
        for other in self._fabric.endpoints():
            other._fail_hung(
                lambda h: h.peer_engine_id == self.engine_id, "peer closed", FailureKind.PEER
            )
            other._drop_late(lambda h: h.peer_engine_id == self.engine_id, "peer closed")

    # -- internals -------------------------------------------------------------

    def _post(self, post: Post) -> None:
        peer, handle = post.peer, post.handle
        with self._lock:
            self._ensure_open()
            if peer.engine_id not in self._peers:
                raise TransferError(f"peer {peer.engine_id} is not connected")
            fault = self._faults.popleft() if self._faults else None
            self.num_posted += 1
        if fault is not None and fault.kind is _FaultKind.FAIL:
            self._complete(handle, TransferState.FAILED, fault.reason, FailureKind.INJECTED)
            return
        target = self._target(peer)
        if target is None:
            self._complete(handle, TransferState.FAILED, "peer is gone", FailureKind.PEER)
            return
        if fault is not None and fault.kind is _FaultKind.SLOW:
            assert fault.late_s is not None
            copied = fault.corrupt  # for SLOW: copied at the post
            if copied:
                self._copy(post, target)
            self._fabric.start_timer(fault.late_s, self._land_slow, post, copied)
            return
        if fault is not None and fault.kind is _FaultKind.HANG:
            with self._lock:
                timer = self._fabric.start_timer(handle.deadline_s, self._expire, handle)
                self._hung[id(handle)] = (handle, timer)
            return
        if fault is not None:  # LATE
            late = _Late(post, target, fault.corrupt)
            with self._lock:
                self._late[id(handle)] = late
                late.timer = self._fabric.start_timer(
                    handle.deadline_s, self._expire_late, late, fault.late_s
                )
            return
        self._copy(post, target)
        self._complete(handle, TransferState.DONE)
        self._deliver_notif(post, target)

    def _copy(self, post: Post, target: InProcessTransport, corrupt: bool = False) -> None:
        li = torch.from_numpy(post.local.astype("int64"))
        ri = torch.from_numpy(post.remote.astype("int64"))
        if post.handle.op is TransferOp.WRITE:
            data = self._regions.index_select(0, li)
            dst, idx = target._regions, ri
        else:
            data = target._regions.index_select(0, ri)
            dst, idx = self._regions, li
        if corrupt:
            data = torch.randn(data.shape, generator=torch.Generator().manual_seed(0)).to(data)
        dst.index_copy_(0, idx, data)

    def _deliver_notif(self, post: Post, target: InProcessTransport) -> None:
        if post.notif is not None:
            self._send(target, post.handle.xid, post.notif)

    def _send(self, target: InProcessTransport, xid: str | None, payload: bytes) -> None:
        """Deliver one notification to ``target`` from our agent (faults applied)."""
        with self._lock:
            claimed = self._forged.popleft() if self._forged else self.engine_id
            drop = next((m for m in self._drops if m(payload)), None)
            if drop is not None:
                self._drops.remove(drop)
                self.num_notifs_dropped += 1
        self.metrics.on_notification("sent")
        if drop is not None:
            logger.info("xid=%s: fault: notification to %s dropped", xid, target.engine_id)
            return
        incoming = Incoming(self.agent_name, claimed, xid, payload)
        batch = [incoming] if target.chaos is None else target.chaos.apply(incoming)
        if batch:
            target._deliver(batch)

    def _land_slow(self, post: Post, copied: bool) -> None:
        target = self._target(post.peer)
        if target is None or self._closed:
            self._complete(post.handle, TransferState.FAILED, "peer is gone", FailureKind.PEER)
            return
        if not copied:
            self._copy(post, target)
        self._complete(post.handle, TransferState.DONE)
        self._deliver_notif(post, target)

    def _expire_late(self, late: _Late, late_s: float | None) -> None:
        """A LATE transfer's deadline: it fails, and lands `late_s` from now."""
        handle = late.post.handle
        with self._lock:
            if id(handle) not in self._late:
                return  # torn down before its deadline
            late.expired = True
            if late_s is not None:
                late.timer = self._fabric.start_timer(late_s, self._land_late, late)
        reason = f"deadline exceeded after {handle.deadline_s:g} s"
        self._complete(handle, TransferState.FAILED, reason, FailureKind.DEADLINE,
                       may_still_land=True)  # fmt: skip

    def _land_late(self, late: _Late) -> None:
        with self._lock:
            if self._late.pop(id(late.post.handle), None) is None:
                return
        if not late.target._closed:
            if self.late_check is not None:
                self.late_check(late.post)
            self._copy(late.post, late.target, late.corrupt)
            self._deliver_notif(late.post, late.target)
        self._settle(late.post.handle, "landed after its deadline")

    def _drop_late(self, pred: Callable[[TransferHandle], bool], why: str) -> None:
        """The endpoint is torn down: late transfers matching ``pred`` never land."""
        with self._lock:
            doomed = [lt for lt in self._late.values() if pred(lt.post.handle)]
            for lt in doomed:
                del self._late[id(lt.post.handle)]
        for lt in doomed:
            if lt.timer is not None:
                lt.timer.cancel()
            h = lt.post.handle
            if not h.done():
                self._complete(h, TransferState.FAILED, why, FailureKind.DISCONNECTED)
            self._settle(h, why)

    def _target(self, peer: PeerHandle) -> InProcessTransport | None:
        target = self._fabric.lookup(peer.engine_id)
        if target is None or target._closed:
            return None
        return target

    def _expire(self, handle: TransferHandle) -> None:
        with self._lock:
            self._hung.pop(id(handle), None)
        self._complete(
            handle,
            TransferState.FAILED,
            f"deadline exceeded after {handle.deadline_s:g} s",
            FailureKind.DEADLINE,
        )

    def _fail_hung(
        self,
        pred: Callable[[TransferHandle], bool],
        reason: str,
        failure: FailureKind = FailureKind.DISCONNECTED,
    ) -> None:
        with self._lock:
            doomed = [(h, t) for h, t in self._hung.values() if pred(h)]
            for h, _ in doomed:
                self._hung.pop(id(h), None)
        for h, timer in doomed:
            timer.cancel()
            self._complete(h, TransferState.FAILED, reason, failure)


__all__ = ["InProcessFabric", "InProcessTransport", "ManualTimers", "NotifChaos"]
