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
    p.forge_next_sender("x")     # next notification's envelope claims engine "x"
    p.drop_next_notif(match)     # next notification (matching) is lost on the way

Each endpoint is its own agent (``inprocess-<engine id>``): a notification
reaches its target as delivered by the sending endpoint's agent, with the
envelope's claimed sender beside it, and the target's `Transport` checks the
two against the peers it connected to, as over NIXL. Closing an endpoint fails
the transfers in flight to it, like a dead peer.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvduplex.engine.kv_cache import KVCacheLayout
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


class InProcessFabric:
    """Connects `InProcessTransport` endpoints of one process by engine id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._endpoints: dict[str, InProcessTransport] = {}

    def endpoint(
        self,
        pool: torch.Tensor,
        layout: KVCacheLayout,
        *,
        engine_id: str | None = None,
        default_deadline_s: float = 10.0,
        metrics: TransferMetrics | None = None,
    ) -> InProcessTransport:
        """A new endpoint over ``pool`` (shape and dtype must match ``layout``)."""
        ep = InProcessTransport(self, pool, layout, engine_id, default_deadline_s, metrics)
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


@dataclass
class _Fault:
    kind: FailureKind | None  # INJECTED: fail; None: hang
    reason: str


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
    ) -> None:
        super().__init__(layout, engine_id or uuid.uuid4().hex, default_deadline_s, metrics)
        if tuple(pool.shape) != layout.shape or pool.dtype != layout.torch_dtype:
            raise ValueError(
                f"pool {tuple(pool.shape)} {pool.dtype} does not match layout {layout}"
            )
        self._fabric = fabric
        self._pool = pool
        self._regions = pool.view(layout.num_layers * 2 * layout.num_blocks, -1)  # (regions, elems)
        self._peers: dict[str, PeerHandle] = {}
        self._faults: deque[_Fault] = deque()
        self._hung: dict[int, tuple[TransferHandle, threading.Timer]] = {}
        self._forged: deque[str] = deque()
        self._drops: deque[Callable[[bytes], bool]] = deque()
        self.num_notifs_dropped = 0
        """Notifications lost to `drop_next_notif` (for tests)."""
        self.num_posted = 0
        """Transfers posted so far (for tests)."""

    # -- fault injection --------------------------------------------------

    def fail_next(self, reason: str = "injected failure") -> None:
        """The next transfer posted here ends FAILED with ``reason``; nothing is copied."""
        with self._lock:
            self._faults.append(_Fault(FailureKind.INJECTED, reason))

    def hang_next(self) -> None:
        """The next transfer posted here never completes: it fails at its deadline."""
        with self._lock:
            self._faults.append(_Fault(None, "hang"))

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
        )

    def connect(self, info: HandshakeInfo) -> PeerHandle:
        peer_layout = check_compatible(
            self._layout, self.engine_id, info, expected_transport="inprocess"
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

    def disconnect(self, peer: PeerHandle) -> None:
        with self._lock:
            known = self._peers.pop(peer.engine_id, None)
        if known is not None:
            self._peer_disconnected(known)
        self._fail_hung(lambda h: h.peer_engine_id == peer.engine_id, "peer disconnected")

    def send_notif(self, peer: PeerHandle, payload: bytes, xid: str | None = None) -> None:
        target = self._target(peer)
        if target is None:
            raise PeerUnavailableError(f"xid={xid}: peer {peer.engine_id} is gone")
        self._touch()
        self._send(target, xid, payload)

    def _shutdown(self) -> None:
        self._fabric._remove(self.engine_id)
        self._fail_hung(lambda h: True, "transport closed")
        # Peers' transfers in flight to us fail like transfers to a dead process.
        for other in self._fabric.endpoints():
            other._fail_hung(
                lambda h: h.peer_engine_id == self.engine_id, "peer closed", FailureKind.PEER
            )

    # -- internals -------------------------------------------------------------

    def _post(self, post: Post) -> None:
        peer, handle, local, remote = post.peer, post.handle, post.local, post.remote
        with self._lock:
            self._ensure_open()
            if peer.engine_id not in self._peers:
                raise TransferError(f"peer {peer.engine_id} is not connected")
            fault = self._faults.popleft() if self._faults else None
            self.num_posted += 1
        if fault is not None and fault.kind is FailureKind.INJECTED:
            self._complete(handle, TransferState.FAILED, fault.reason, FailureKind.INJECTED)
            return
        target = self._target(peer)
        if target is None:
            self._complete(handle, TransferState.FAILED, "peer is gone", FailureKind.PEER)
            return
        if fault is not None:  # hang until the deadline
            timer = threading.Timer(handle.deadline_s, self._expire, args=(handle,))
            timer.daemon = True
            with self._lock:
                self._hung[id(handle)] = (handle, timer)
            timer.start()
            return
        li = torch.from_numpy(local.astype("int64"))
        ri = torch.from_numpy(remote.astype("int64"))
        if handle.op is TransferOp.WRITE:
            target._regions.index_copy_(0, ri, self._regions.index_select(0, li))
        else:
            self._regions.index_copy_(0, li, target._regions.index_select(0, ri))
        self._complete(handle, TransferState.DONE)
        if post.notif is not None:
            self._send(target, handle.xid, post.notif)

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
        target._deliver([Incoming(self.agent_name, claimed, xid, payload)])

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


__all__ = ["InProcessFabric", "InProcessTransport"]
