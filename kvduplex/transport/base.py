"""The `Transport` interface and the part of it both backends share.

`Transport` is an abstract base class: its public methods are the contract the
flows program against (see `kvduplex.transport.protocol` for the transfer
lifecycle and the types). It implements what does not depend on the backend:

* the request side: ``transfer`` (blocks) and ``transfer_regions`` validate,
  turn blocks or regions into index arrays (`kvduplex.transport.regions`) and
  hand them to the backend's ``_post``;
* completion: ``_complete`` finishes a handle once, with metrics and a
  lifecycle log line;
* received notifications: who sent each one (``_deliver``, below), their queue
  (``poll_notifs``);
* ``close``: marks the transport closed once, wakes ``poll_notifs`` waiters,
  then runs the backend's ``_shutdown``.

A backend (`NixlTransport`, `InProcessTransport`) implements ``local_metadata``,
``connect``, ``disconnect``, ``send_notif``, ``_post`` and ``_shutdown``, and
tells the base which agent each connected peer speaks through
(``_peer_connected``, ``_peer_disconnected``)::

    transfer() ─► _submit ─► _post (backend) ─► ... ─► _complete ─► DONE | FAILED
    (peer)     ─► backend receives ─► _deliver ─► poll_notifs()

A notification's sender is the agent that delivered it, never what its
envelope claims. ``_deliver`` maps the delivering agent to the engine id of a
peer this transport connected to (from that peer's handshake) and refuses,
logs and counts (``kvduplex_kv_notifications_refused_total{reason}``)::

    agent of a connected peer, envelope names that peer ──► queued for poll_notifs
    agent of a connected peer, envelope names another   ──► refused: forged_sender
    agent never connected ──► held up to unknown_agent_grace_s (a peer that
        registers before our own connect to it, a race of two handshakes)
        ──► released when we connect to it, else refused: unknown_agent
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvduplex.common.fingerprint import ModelFingerprint
from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.common.kv_layout import KVKind
from kvduplex.transport.messages import HANDSHAKE_VERSION
from kvduplex.transport.messages import HandshakeInfo
from kvduplex.transport.messages import NotifRefusal
from kvduplex.transport.metrics import TransferMetrics
from kvduplex.transport.peer_usage import PeerUsage
from kvduplex.transport.protocol import ALL_KINDS
from kvduplex.transport.protocol import FailureKind
from kvduplex.transport.protocol import IncompatibleLayoutError
from kvduplex.transport.protocol import IncompatibleModelError
from kvduplex.transport.protocol import Notification
from kvduplex.transport.protocol import PeerHandle
from kvduplex.transport.protocol import Region
from kvduplex.transport.protocol import TransferError
from kvduplex.transport.protocol import TransferHandle
from kvduplex.transport.protocol import TransferOp
from kvduplex.transport.protocol import TransferState
from kvduplex.transport.regions import IndexArray
from kvduplex.transport.regions import RegionIndexer
from kvduplex.transport.regions import region_indices

logger = logging.getLogger(__name__)


def check_compatible(
    layout: KVCacheLayout,
    engine_id: str,
    info: HandshakeInfo,
    expected_transport: str,
    fingerprint: ModelFingerprint | None = None,
) -> KVCacheLayout:
    """The peer's layout if ``info`` describes a pool we can exchange blocks with, of an
    instance that serves what we serve (``fingerprint``: ours; None for a transport
    built without a model, which pairs only with another such).

    Raises IncompatibleModelError naming each fingerprint field that differs,
    IncompatibleLayoutError saying what else differs and what to change.
    """
    who = f"peer {info.engine_id} ({info.transport})"
    if info.version != HANDSHAKE_VERSION:
        raise IncompatibleLayoutError(
            f"{who} speaks handshake version {info.version}, this instance {HANDSHAKE_VERSION}; "
            "run the same kvduplex version on both"
        )
    if info.transport != expected_transport:
        raise IncompatibleLayoutError(
            f"{who} uses transport {info.transport!r}, this instance {expected_transport!r}"
        )
    if info.engine_id == engine_id:
        raise IncompatibleLayoutError(f"{who} is this instance itself; connect to another instance")
    _check_fingerprint(who, fingerprint, info.fingerprint)
    try:
        peer_layout = info.layout.to_layout()
    except ValueError as exc:
        raise IncompatibleLayoutError(f"{who} sent an invalid KV layout: {exc}") from exc
    diff = layout.incompatibility(peer_layout)
    if diff is not None:
        raise IncompatibleLayoutError(
            f"{who} has an incompatible KV cache layout ({diff}); start both instances "
            "with the same model, dtype and block size"
        )
    return peer_layout


def _check_fingerprint(
    who: str, ours: ModelFingerprint | None, theirs: ModelFingerprint | None
) -> None:
    """Raises IncompatibleModelError unless both fingerprints are equal (or both absent)."""
    if ours is None and theirs is None:
        return
    if ours is None or theirs is None:
        missing = "this instance has" if ours is None else f"{who} sent"
        raise IncompatibleModelError(
            f"{who} cannot exchange KV with this instance: {missing} no model fingerprint"
        )
    diffs = ours.differences(theirs)
    if diffs:
        raise IncompatibleModelError(
            f"{who} serves another model, so no KV moves between them ({'; '.join(diffs)}); "
            "start both instances with the same model, weights (preset seed), tokenizer, "
            "chat template, dtype and block size"
        )


@dataclass(frozen=True)
class Incoming:
    """A notification as a backend received it, before `Transport._deliver` checks it."""

    agent: str
    """The transport agent that delivered it (NIXL: the remote agent's name)."""
    claimed: str
    """The engine id its envelope names as the sender."""
    xid: str | None
    payload: bytes


@dataclass
class _Held:
    """A notification from an agent not connected (yet), kept until ``until``."""

    incoming: Incoming
    until: float


@dataclass(frozen=True)
class Post:
    """One transfer `Transport._submit` hands its backend's `_post`."""

    peer: PeerHandle
    handle: TransferHandle
    """Carries the op, the xid and the deadline; the backend finishes it."""
    local: IndexArray
    """Indices into our registered regions, paired with ``remote``."""
    remote: IndexArray
    notif: bytes | None
    """WRITE only: the caller's payload, delivered to the peer after the data."""


class Transport(abc.ABC):
    """Moves KV regions between this instance's pool and connected peers' pools.

    One per instance. Thread-safe: any thread may post transfers; completions,
    deadlines and notifications are handled by the transport's own progress.
    """

    def __init__(
        self,
        layout: KVCacheLayout,
        engine_id: str,
        default_deadline_s: float,
        metrics: TransferMetrics | None,
        fingerprint: ModelFingerprint | None = None,
    ) -> None:
        """``fingerprint``: what this instance serves, sent in its handshake and compared
        with each peer's at `connect` (`check_compatible`)."""
        if default_deadline_s <= 0:
            raise ValueError(f"default_deadline_s must be > 0, got {default_deadline_s}")
        if layout.num_layers * 2 * layout.num_blocks >= 2**31:
            raise ValueError("the pool has more than 2**31 regions; use larger blocks")
        self._layout = layout
        self._block_bytes = layout.block_bytes
        self._indexers: dict[KVCacheLayout, RegionIndexer] = {layout: RegionIndexer(layout)}
        self._engine_id = engine_id
        self._fingerprint = fingerprint
        self.default_deadline_s = default_deadline_s
        self.metrics = metrics if metrics is not None else TransferMetrics.default()
        self._last_activity = time.monotonic()
        self._lock = threading.Lock()
        """Guards the notification queue and ``_closed``; backends guard their peers with it."""
        self._notif_cv = threading.Condition(self._lock)
        self._notifs: deque[Notification] = deque()
        self._closed = False
        self._agents: dict[str, str] = {}
        """Agent name -> engine id of each connected peer (under ``_lock``)."""
        self._held: deque[_Held] = deque()
        self.unknown_agent_grace_s = 2.0
        """How long a notification from an agent we have not connected to waits for our
        connect to it before it is refused."""
        self.max_held_notifs = 256
        """Held notifications at most; beyond, the oldest is refused."""
        self.peer_usage = PeerUsage()
        """Each peer's last use, unsettled transfers and failures (`PeerDirectory.sweep`)."""

    @property
    def layout(self) -> KVCacheLayout:
        return self._layout

    @property
    def fingerprint(self) -> ModelFingerprint | None:
        """What this instance serves (None: a transport built without a model)."""
        return self._fingerprint

    @property
    def engine_id(self) -> str:
        """Chosen at start; a restarted instance has a new one."""
        return self._engine_id

    @property
    def last_activity(self) -> float:
        """`time.monotonic()` of the latest post, sent or received notification (or of
        creation): how long the transport has been idle, for pollers that back off."""
        return self._last_activity

    # -- connection (backend) -------------------------------------------------

    @abc.abstractmethod
    def local_metadata(self) -> HandshakeInfo:
        """What a peer passes to its `connect` to reach this instance."""

    @abc.abstractmethod
    def connect(self, info: HandshakeInfo) -> PeerHandle:
        """Load a peer and prepare its descriptors once; idempotent per engine id.

        Raises IncompatibleModelError if the peer serves something else (its
        fingerprint differs), IncompatibleLayoutError if the layouts cannot exchange
        blocks, TransferError if the transport refuses the peer.
        """

    @abc.abstractmethod
    def disconnect(self, peer: PeerHandle) -> None:
        """Fail the peer's in-flight transfers, tear its endpoint down and forget it;
        idempotent. Afterwards nothing of a transfer with the peer can land."""

    @abc.abstractmethod
    def is_connected(self, engine_id: str) -> bool:
        """Whether a peer with this engine id is connected (not disconnected since)."""

    def num_peers(self) -> int:
        """Peers this transport holds state for (connected ones; a backend adds those it
        could not tear down yet)."""
        with self._lock:
            return len(self._agents)

    # -- transfers ----------------------------------------------------------------

    def transfer(
        self,
        op: TransferOp,
        peer: PeerHandle,
        xid: str,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        *,
        layers: Sequence[int] | None = None,
        kinds: Sequence[KVKind] = ALL_KINDS,
        notif: bytes | None = None,
        deadline_s: float | None = None,
    ) -> TransferHandle:
        """Move block ``local_blocks[i]`` to or from the peer's ``remote_blocks[i]``, for
        each layer and kind: a WRITE puts ours into the peer's, a READ the peer's into ours.

        ``layers`` None means all. ``notif`` (WRITE only) is delivered to the peer once,
        after the data, as a `Notification` carrying ``xid``. ``deadline_s`` None means
        the transport's default.
        """
        local, remote = self._block_indices(peer, local_blocks, remote_blocks, layers, kinds)
        return self._submit(op, peer, xid, local, remote, notif, deadline_s)

    def transfer_regions(
        self,
        op: TransferOp,
        peer: PeerHandle,
        xid: str,
        local: Sequence[Region],
        remote: Sequence[Region],
        *,
        notif: bytes | None = None,
        deadline_s: float | None = None,
    ) -> TransferHandle:
        """`transfer` of arbitrary regions: ``local[i]`` with the peer's ``remote[i]``."""
        li, ri = self._region_pair(peer, local, remote)
        return self._submit(op, peer, xid, li, ri, notif, deadline_s)

    def state(self, handle: TransferHandle) -> TransferState:
        return handle.state

    def set_compute_busy(self, busy: bool) -> None:  # noqa: B027 - optional for transports
        """The instance's engine starts (True) or ends (False) a forward on this CPU.

        A transport that polls in the background may poll less meanwhile, so
        that it does not take the core the forward runs on. No-op by default.
        """

    # -- notifications ------------------------------------------------------------

    @abc.abstractmethod
    def send_notif(self, peer: PeerHandle, payload: bytes, xid: str | None = None) -> None:
        """Send a small standalone notification; raises PeerUnavailableError if it cannot."""

    def poll_notifs(self, timeout: float = 0.0) -> list[Notification]:
        """Take the notifications received so far, waiting up to ``timeout`` s for one.

        Each one's ``peer_engine_id`` is the connected peer whose agent delivered it.
        """
        with self._notif_cv:
            if not self._notifs and timeout > 0:
                self._notif_cv.wait_for(lambda: bool(self._notifs) or self._closed, timeout)
            out = list(self._notifs)
            self._notifs.clear()
            refused = self._expire_held(time.monotonic())
        self._refuse(refused)
        return out

    # -- shutdown -----------------------------------------------------------------

    def close(self) -> None:
        """Fail everything in flight, stop progress, release the pool registration.

        Idempotent: the first call wakes ``poll_notifs`` waiters and runs the
        backend's ``_shutdown``; later calls return at once.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._notif_cv.notify_all()
        self._shutdown()

    # -- backend side ---------------------------------------------------------------

    @abc.abstractmethod
    def _post(self, post: Post) -> None:
        """Start moving ``post.local[i]`` <-> ``post.remote[i]``; finish ``post.handle``
        now or later.

        May raise: the caller turns the exception into a FAILED handle.
        """

    @abc.abstractmethod
    def _shutdown(self) -> None:
        """The backend's part of `close`, run once after ``_closed`` is set: fail what
        is in flight, stop progress, release registrations."""

    def _deliver(self, received: Sequence[Incoming]) -> None:
        """Check who sent each received notification; queue it for `poll_notifs` under
        the engine id of the peer whose agent delivered it, hold it (agent not
        connected yet) or refuse it (see the module docstring). Dropped once closed."""
        now = time.monotonic()
        refused: list[tuple[Incoming, NotifRefusal]] = []
        accepted = 0
        with self._notif_cv:
            if self._closed:
                return
            refused.extend(self._expire_held(now))
            for inc in received:
                engine_id = self._agents.get(inc.agent)
                if engine_id is None:
                    refused.extend(self._hold(inc, now))
                elif inc.claimed != engine_id:
                    refused.append((inc, NotifRefusal.FORGED_SENDER))
                else:
                    self._notifs.append(Notification(engine_id, inc.xid, inc.payload))
                    self.peer_usage.used(engine_id)
                    accepted += 1
            if accepted:
                self._notif_cv.notify_all()
        self._touch()
        for _ in range(accepted):
            self.metrics.on_notification("received")
        self._refuse(refused)

    def _peer_connected(self, peer: PeerHandle) -> None:
        """Backends call this once ``peer`` is connected: notifications its agent delivers
        are now the peer's; those held for that agent are checked and queued."""
        self.peer_usage.connected(peer.engine_id)
        refused: list[tuple[Incoming, NotifRefusal]] = []
        accepted = 0
        with self._notif_cv:
            self._agents[peer.agent_name] = peer.engine_id
            keep: deque[_Held] = deque()
            for held in self._held:
                inc = held.incoming
                if inc.agent != peer.agent_name:
                    keep.append(held)
                elif inc.claimed != peer.engine_id:
                    refused.append((inc, NotifRefusal.FORGED_SENDER))
                else:
                    self._notifs.append(Notification(peer.engine_id, inc.xid, inc.payload))
                    accepted += 1
            self._held = keep
            if accepted:
                self._notif_cv.notify_all()
        for _ in range(accepted):
            self.metrics.on_notification("received")
        self._refuse(refused)

    def _peer_disconnected(self, peer: PeerHandle) -> None:
        """Backends call this when ``peer`` is forgotten: its agent is a stranger again."""
        with self._lock:
            if self._agents.get(peer.agent_name) == peer.engine_id:
                del self._agents[peer.agent_name]
        self.peer_usage.disconnected(peer.engine_id)

    def _hold(self, inc: Incoming, now: float) -> list[tuple[Incoming, NotifRefusal]]:
        """Keep a notification from an unknown agent a while (call with ``_lock`` held);
        returns what must be refused now."""
        if self.unknown_agent_grace_s <= 0:
            return [(inc, NotifRefusal.UNKNOWN_AGENT)]
        self._held.append(_Held(inc, now + self.unknown_agent_grace_s))
        out: list[tuple[Incoming, NotifRefusal]] = []
        while len(self._held) > self.max_held_notifs:
            out.append((self._held.popleft().incoming, NotifRefusal.UNKNOWN_AGENT))
        return out

    def _expire_held(self, now: float) -> list[tuple[Incoming, NotifRefusal]]:
        """Held notifications whose grace ran out (call with ``_lock`` held)."""
        out: list[tuple[Incoming, NotifRefusal]] = []
        while self._held and self._held[0].until <= now:
            out.append((self._held.popleft().incoming, NotifRefusal.UNKNOWN_AGENT))
        return out

    def _refuse(self, refused: Sequence[tuple[Incoming, NotifRefusal]]) -> None:
        for inc, reason in refused:
            self.metrics.on_notification_refused(reason)
            logger.warning(
                "xid=%s: notification refused (%s): delivered by agent %s, claims engine %s",
                inc.xid, reason.value, inc.agent, inc.claimed,
            )  # fmt: skip

    def _ensure_open(self) -> None:
        """Raise TransferError if the transport is closed (call with ``_lock`` held)."""
        if self._closed:
            raise TransferError("transport is closed")

    def _touch(self) -> None:
        """Record activity now (a post, a notification sent or received)."""
        self._last_activity = time.monotonic()

    # -- request-side helpers ------------------------------------------------------

    def _block_indices(
        self,
        peer: PeerHandle,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        layers: Sequence[int] | None,
        kinds: Sequence[KVKind],
    ) -> tuple[IndexArray, IndexArray]:
        if len(local_blocks) != len(remote_blocks):
            raise ValueError(
                f"local_blocks ({len(local_blocks)}) and remote_blocks ({len(remote_blocks)}) "
                "must have the same length"
            )
        local = self._indexer(self._layout)(local_blocks, layers, kinds)
        remote = self._indexer(peer.layout)(remote_blocks, layers, kinds)
        return local, remote

    def _indexer(self, layout: KVCacheLayout) -> RegionIndexer:
        indexer = self._indexers.get(layout)
        if indexer is None:
            indexer = self._indexers[layout] = RegionIndexer(layout)
        return indexer

    def _region_pair(
        self, peer: PeerHandle, local: Sequence[Region], remote: Sequence[Region]
    ) -> tuple[IndexArray, IndexArray]:
        if len(local) != len(remote):
            raise ValueError(
                f"local ({len(local)}) and remote ({len(remote)}) regions differ in length"
            )
        return region_indices(self._layout, local), region_indices(peer.layout, remote)

    def _submit(
        self,
        op: TransferOp,
        peer: PeerHandle,
        xid: str,
        local: IndexArray,
        remote: IndexArray,
        notif: bytes | None,
        deadline_s: float | None,
    ) -> TransferHandle:
        if notif is not None and op is not TransferOp.WRITE:
            raise ValueError("only a WRITE carries a notification")
        deadline = self.default_deadline_s if deadline_s is None else deadline_s
        if deadline <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline}")
        handle = TransferHandle(
            xid=xid,
            op=op,
            peer_engine_id=peer.engine_id,
            num_descriptors=int(local.size),
            num_bytes=int(local.size) * self._block_bytes,
            deadline_s=deadline,
        )
        self._touch()
        self.peer_usage.posted(handle)  # unsettled until it settles: never torn down idly
        t0 = time.perf_counter()
        try:
            self._post(Post(peer, handle, local, remote, notif))
        except Exception as exc:  # a post failure is a FAILED transfer, never an escape
            logger.warning("xid=%s %s to %s failed to post: %s", xid, op.value, peer.engine_id, exc)
            self._complete(handle, TransferState.FAILED, f"post failed: {exc}", FailureKind.POST)
        handle.post_time_s = time.perf_counter() - t0
        self.metrics.on_posted(handle)
        logger.debug(
            "xid=%s %s posted to %s: %d descriptors, %d bytes, post %.1f us",
            xid, op.value, peer.engine_id, handle.num_descriptors, handle.num_bytes,
            handle.post_time_s * 1e6,
        )  # fmt: skip
        return handle

    def _complete(
        self,
        handle: TransferHandle,
        state: TransferState,
        reason: str | None = None,
        failure: FailureKind | None = None,
        *,
        may_still_land: bool = False,
    ) -> None:
        """Finish ``handle`` once, with metrics and a lifecycle log line.

        ``may_still_land``: the transfer failed (its wait ended) but the backend
        cannot rule out that its data still moves; it calls `_settle` once it can.
        """
        if not handle.finish(state, reason, failure, may_still_land=may_still_land):
            return
        if state is TransferState.DONE:
            self.metrics.on_done(handle)
            logger.debug(
                "xid=%s %s done: %d bytes in %.3f ms",
                handle.xid, handle.op.value, handle.num_bytes, (handle.duration_s or 0.0) * 1e3,
            )  # fmt: skip
        else:
            self.metrics.on_failed(handle.op, failure or FailureKind.PEER)
            if failure in (FailureKind.PEER, FailureKind.POST, None):
                self.peer_usage.failed(handle.peer_engine_id, reason or "transfer failed")
            logger.warning(
                "xid=%s %s to %s failed: %s%s",
                handle.xid,
                handle.op.value,
                handle.peer_engine_id,
                reason,
                " (may still land until settled)" if may_still_land else "",
            )

    def _settle(self, handle: TransferHandle, why: str) -> None:
        """A transfer that failed while it could still land cannot any more."""
        if handle.settle():
            logger.info("xid=%s %s to %s settled: %s", handle.xid, handle.op.value,
                        handle.peer_engine_id, why)  # fmt: skip


__all__ = ["Incoming", "Transport", "check_compatible"]
