"""NixlTransport: the `Transport` over one NIXL agent (UCX backend).

Design note. One agent per instance registers the whole pool once (DRAM, or
VRAM for a CUDA pool) and prepares the local descriptor list of every
(layer, K|V, block) region once. `connect` loads a peer's agent metadata and
prepares the peer's region list once; a transfer is then two index arrays.

NIXL's own progress thread is off: its UCX backend waits on the worker's
event fd only with a non-zero delay, which NIXL's Python API fixes at 0 (a
busy loop on a core), and NIXL exposes no event to wait on for
notifications. Our progress thread drives the agent instead, and backs off
when nothing happens::

    loop:  post queued transfers      ─► NIXL make + post (FIFO)
           check in-flight transfers  ─► DONE / ERR ─► release handle, finish
           expire past-deadline ones  ─► release (cancel) handle, FAILED
           drain notifications        ─► check the delivering agent, queue for
                                          poll_notifs() (Transport._deliver)
           sleep: poll_interval_s while anything is in flight, a peer's large
                  transfer targets us (XFER_BEGIN..END), or recently active;
                  otherwise back off, doubling, to idle_poll_interval_s while
                  warm (any post, notification sent or received, or forward
                  in the last warm_s), then to deep_idle_poll_interval_s.
                  A post, a sent notification or the start of a forward wakes
                  it at once. While the engine runs a forward
                  (`set_compute_busy`), the intervals become
                  busy_poll_interval_s and busy_idle_poll_interval_s: a pass
                  costs tens of microseconds of the core the forward needs
                  (on CPU), and what the engine does with a notification waits
                  for its next layer anyway.

A pass costs ~30 us of CPU: a millisecond's polling kept an idle instance at
3-8% of a core, deep idle at ~0.1% (docs/hot_path.md). Every exchange starts
with a local action (a registration, a forward, an offer), so replies find
the thread warm; only a message out of the blue after warm_s of silence
waits up to one deep-idle interval.

Posting. Over shared memory (UCX cma) NIXL copies the data inside its post
call, so a post costs as long as the copy. A transfer larger than
``inline_post_max_bytes`` is therefore queued and posted by the progress
thread (NIXL releases the GIL meanwhile): the caller pays only the index
computation. Smaller ones post inline when nothing is queued, which keeps the
latency of small transfers low. Transfers are posted in call order either way.

Software-emulated transports (TCP RMA) progress only while the *target* polls,
hence the XFER_BEGIN/XFER_END hints around large transfers. UCX transport
selection passes through the environment (UCX_TLS, UCX_NET_DEVICES...), read
when the agent is created; see docs/transfer.md.

All agent calls are serialised by one lock (the UCX worker runs in serialised
mode). The progress thread never raises: errors are logged and turn the
transfer FAILED.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import msgspec
import torch

from kvduplex.common.fingerprint import ModelFingerprint
from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.model.dtypes import dtype_from_name
from kvduplex.transport.base import Incoming
from kvduplex.transport.base import Post
from kvduplex.transport.base import Transport
from kvduplex.transport.base import check_compatible
from kvduplex.transport.messages import Envelope
from kvduplex.transport.messages import EnvelopeKind
from kvduplex.transport.messages import HandshakeInfo
from kvduplex.transport.messages import LayoutInfo
from kvduplex.transport.messages import decode_envelope
from kvduplex.transport.messages import encode_envelope
from kvduplex.transport.metrics import TransferMetrics
from kvduplex.transport.nixl_agent import NixlAgent
from kvduplex.transport.nixl_agent import nixl_available
from kvduplex.transport.nixl_agent import region_descs
from kvduplex.transport.nixl_xfers import Job
from kvduplex.transport.nixl_xfers import XferTable
from kvduplex.transport.protocol import FailureKind
from kvduplex.transport.protocol import PeerHandle
from kvduplex.transport.protocol import PeerUnavailableError
from kvduplex.transport.protocol import TransferError
from kvduplex.transport.protocol import TransferHandle
from kvduplex.transport.protocol import TransferState

logger = logging.getLogger(__name__)


@dataclass
class _Peer:
    handle: PeerHandle
    dlist: Any
    """Prepared remote descriptor list."""


@dataclass
class _Progress:
    """State owned by the progress thread."""

    remote_hints: dict[tuple[str, str], float] = field(default_factory=dict)
    """(sender agent, xid) -> monotonic expiry of peers' large transfers targeting us."""
    last_active: float = 0.0
    idle_wait: float = 0.0
    num_passes: int = 0
    """Passes so far (idle cost: tests and measurements)."""


class NixlTransport(Transport):
    """`Transport` over NIXL. Construct once per instance; `close` on shutdown."""

    def __init__(
        self,
        pool: torch.Tensor,  # (L, 2, NB, BS, H, D)
        layout: KVCacheLayout,
        *,
        engine_id: str | None = None,
        default_deadline_s: float = 10.0,
        metrics: TransferMetrics | None = None,
        backend_params: dict[str, str] | None = None,
        poll_interval_s: float = 100e-6,
        idle_poll_interval_s: float = 1e-3,
        linger_s: float = 0.05,
        busy_poll_interval_s: float = 1e-3,
        busy_idle_poll_interval_s: float = 10e-3,
        warm_s: float = 5.0,
        deep_idle_poll_interval_s: float = 50e-3,
        hint_min_bytes: int = 1 << 20,
        inline_post_max_bytes: int = 256 << 10,
        fingerprint: ModelFingerprint | None = None,
    ) -> None:
        """Register ``pool`` (whose shape and dtype must match ``layout``) with a new agent.

        ``backend_params`` go to NIXL's UCX backend (e.g. ``ucx_devices``);
        ``hint_min_bytes`` is the size from which a transfer asks its target to
        poll fast while it runs; ``inline_post_max_bytes`` the size up to
        which the caller's thread posts; ``warm_s`` how long after the last
        activity polling stays at ``idle_poll_interval_s`` at most before backing
        off to ``deep_idle_poll_interval_s`` (see the module docstring);
        ``fingerprint`` what the instance serves (see `Transport`).
        """
        super().__init__(
            layout, engine_id or uuid.uuid4().hex, default_deadline_s, metrics, fingerprint
        )
        if tuple(pool.shape) != layout.shape or pool.dtype != dtype_from_name(layout.dtype):
            raise ValueError(
                f"pool of shape {tuple(pool.shape)} and dtype {pool.dtype} does not match "
                f"layout {layout.shape} {layout.dtype}; allocate it with allocate_kv_pool(layout)"
            )
        if not pool.is_contiguous():
            raise ValueError("the KV pool must be contiguous")
        self._pool = pool
        self.poll_interval_s = poll_interval_s
        self.idle_poll_interval_s = idle_poll_interval_s
        self.linger_s = linger_s
        self.busy_poll_interval_s = busy_poll_interval_s
        self.busy_idle_poll_interval_s = busy_idle_poll_interval_s
        self.warm_s = warm_s
        self.deep_idle_poll_interval_s = deep_idle_poll_interval_s
        self._compute_busy = False
        self.hint_min_bytes = hint_min_bytes
        mem_type = "DRAM" if pool.device.type == "cpu" else "VRAM"
        device_id = 0 if pool.device.type == "cpu" else int(pool.device.index or 0)
        base = int(pool.data_ptr())
        num_regions = layout.num_layers * 2 * layout.num_blocks

        self._peers: dict[str, _Peer] = {}
        self._not_torn_down: dict[str, _Peer] = {}
        """Disconnected peers whose endpoint NIXL refused to remove: transfers of ours to
        them may still land, so they settle only once a later teardown succeeds."""
        self._wake = threading.Event()
        self._conn_lock = threading.RLock()
        """Held across a whole connect or disconnect: one never interleaves with the other."""
        self._stop = threading.Event()

        self._agent = NixlAgent(f"kvduplex-{self.engine_id}", backend_params)
        self._agent.register(base, layout.total_bytes, mem_type, device_id)
        descs = region_descs(base, num_regions, layout.block_bytes, device_id)
        self._local_dlist = self._agent.prep_dlist("NIXL_INIT_AGENT", descs, mem_type)
        self._xfers = XferTable(
            self._agent, self._local_dlist, self._complete, self._settle, self._wake.set,
            inline_post_max_bytes,
        )  # fmt: skip
        self._metadata = HandshakeInfo(
            engine_id=self.engine_id,
            agent_name=self._agent.name,
            agent_metadata=self._agent.metadata(),
            layout=LayoutInfo.from_layout(layout),
            base_address=base,
            mem_type=mem_type,
            device_id=device_id,
            transport="nixl",
            fingerprint=fingerprint,
        )
        self._progress = _Progress(last_active=time.monotonic(), idle_wait=poll_interval_s)
        self._thread = threading.Thread(
            target=self._run_progress, name=f"kv-progress-{self.engine_id[:8]}", daemon=True
        )
        self._thread.start()
        logger.info(
            "NIXL transport %s: %d regions of %d bytes (%s), %.1f MiB registered",
            self.engine_id, num_regions, layout.block_bytes, mem_type, layout.total_bytes / 2**20,
        )  # fmt: skip

    # -- connection -------------------------------------------------------

    def local_metadata(self) -> HandshakeInfo:
        return self._metadata

    def connect(self, info: HandshakeInfo) -> PeerHandle:
        peer_layout = check_compatible(
            self._layout, self.engine_id, info, "nixl", self.fingerprint
        )
        with self._conn_lock:  # a connect never interleaves with a disconnect
            return self._connect(info, peer_layout)

    def _connect(self, info: HandshakeInfo, peer_layout: KVCacheLayout) -> PeerHandle:
        with self._lock:
            self._ensure_open()
            existing = self._peers.get(info.engine_id)
            if existing is not None:
                return existing.handle
        num_regions = peer_layout.num_layers * 2 * peer_layout.num_blocks
        descs = region_descs(
            info.base_address, num_regions, peer_layout.block_bytes, info.device_id
        )
        try:
            name = self._agent.add_peer(info.agent_metadata)
            dlist = self._agent.prep_dlist(name, descs, info.mem_type)
        except Exception as exc:
            raise TransferError(f"cannot load NIXL peer {info.engine_id}: {exc}") from exc
        handle = PeerHandle(engine_id=info.engine_id, agent_name=name, layout=peer_layout)
        with self._lock:
            self._peers[info.engine_id] = _Peer(handle=handle, dlist=dlist)
        self._peer_connected(handle)
        logger.info("connected to peer %s (%d regions)", info.engine_id, num_regions)
        return handle

    def is_connected(self, engine_id: str) -> bool:
        with self._lock:
            return engine_id in self._peers

    def num_peers(self) -> int:
        with self._lock:
            return len(self._peers) + len(self._not_torn_down)

    def disconnect(self, peer: PeerHandle) -> None:
        with self._conn_lock:
            with self._lock:
                p = self._peers.pop(peer.engine_id, None)
            num = self._xfers.fail(peer.engine_id, "peer disconnected", FailureKind.DISCONNECTED)
            if p is not None:
                self._peer_disconnected(p.handle)
                logger.info("disconnected from peer %s (%d transfers failed)", peer.engine_id, num)
            refused = self._not_torn_down.pop(peer.engine_id, None)
            p = p or refused  # else try again a teardown NIXL refused before
            if p is not None and not self._agent.try_remove_peer(p.handle.agent_name, p.dlist):
                # The endpoint may still be up: what was posted to it may still land, so
                # its blocks stay referenced until a later disconnect removes it.
                self._not_torn_down[peer.engine_id] = p
                logger.warning("endpoint to %s not torn down: its transfers stay unsettled "
                               "until a later disconnect removes it", peer.engine_id)  # fmt: skip
                return
            # The endpoint is gone: a transfer of ours to it cannot land any more.
            self._xfers.settle_peer(peer.engine_id, "peer endpoint torn down")

    # -- transfers ----------------------------------------------------------

    def _post(self, post: Post) -> None:
        peer, handle = post.peer, post.handle
        with self._lock:
            self._ensure_open()
            p = self._peers.get(peer.engine_id)
        if p is None:
            raise TransferError(f"peer {peer.engine_id} is not connected")
        if post.local.size == 0:
            self._complete(handle, TransferState.DONE)
            return
        msg = b""
        if post.notif is not None:
            msg = encode_envelope(
                Envelope(EnvelopeKind.USER, self.engine_id, handle.xid, post.notif)
            )
        hints = None
        if handle.num_bytes >= self.hint_min_bytes:
            hints = (
                self._hint(EnvelopeKind.XFER_BEGIN, handle),
                self._hint(EnvelopeKind.XFER_END, handle),
            )
        self._xfers.submit(Job(
            handle, peer.engine_id, p.handle.agent_name, p.dlist, post.local, post.remote, msg,
            hints,
        ))  # fmt: skip

    def send_notif(self, peer: PeerHandle, payload: bytes, xid: str | None = None) -> None:
        with self._lock:
            self._ensure_open()
            p = self._peers.get(peer.engine_id)
        if p is None:
            raise PeerUnavailableError(f"xid={xid}: peer {peer.engine_id} is not connected")
        msg = encode_envelope(Envelope(EnvelopeKind.USER, self.engine_id, xid, payload))
        try:
            self._agent.send_notif(p.handle.agent_name, msg)
        except Exception as exc:
            self.peer_usage.failed(peer.engine_id, f"notification failed: {exc}")
            raise PeerUnavailableError(
                f"xid={xid}: notification to {peer.engine_id} failed: {exc}"
            ) from exc
        self.metrics.on_notification("sent")
        self.peer_usage.used(peer.engine_id)
        self._touch()
        self._wake.set()

    def _shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5.0)
        self._xfers.fail(None, "transport closed", FailureKind.DISCONNECTED)
        self._xfers.retry_releases(final=True)
        with self._lock:
            peers = list(self._peers.values()) + list(self._not_torn_down.values())
            self._peers.clear()
            self._not_torn_down.clear()
        for p in peers:
            self._agent.try_remove_peer(p.handle.agent_name, p.dlist)
        self._xfers.settle_peer(None, "transport closed")
        self._agent.try_close(self._local_dlist)
        logger.info("NIXL transport %s closed", self.engine_id)

    # -- progress thread ------------------------------------------------------

    def _run_progress(self) -> None:
        pr = self._progress
        while not self._stop.is_set():
            try:
                busy = self._progress_once()
            except Exception:  # never let the thread die
                logger.exception("NIXL progress iteration failed")
                busy = True
            pr.idle_wait = self._next_wait(busy, pr.idle_wait)
            if self._wake.wait(pr.idle_wait):
                self._wake.clear()

    def _next_wait(self, busy: bool, last_wait: float) -> float:
        """Seconds to sleep after a pass (see the module docstring)."""
        if self._compute_busy:
            fast, slow = self.busy_poll_interval_s, self.busy_idle_poll_interval_s
        else:
            fast, slow = self.poll_interval_s, self.idle_poll_interval_s
            quiet_s = time.monotonic() - max(self.last_activity, self._progress.last_active)
            if quiet_s >= self.warm_s:
                slow = max(slow, self.deep_idle_poll_interval_s)
        return fast if busy else min(max(last_wait * 2, fast), slow)

    def set_compute_busy(self, busy: bool) -> None:
        self._compute_busy = busy  # read by the progress thread at its next pass
        self._touch()
        if busy and self._progress.idle_wait > self.busy_idle_poll_interval_s:
            self._wake.set()  # out of deep idle: look for a registration now, then poll busy

    def _progress_once(self) -> bool:
        """One pass; True if fast polling should continue."""
        now = time.monotonic()
        pr = self._progress
        pr.num_passes += 1
        self._xfers.drain_posts()
        checked = self._xfers.check_all()
        received = self._drain_notifs(now)
        self._xfers.retry_releases()
        if pr.remote_hints:
            pr.remote_hints = {k: exp for k, exp in pr.remote_hints.items() if exp > now}
        # Linger (poll fast a while) after traffic that tends to come in runs: transfers
        # that were in flight, notifications. Not after posts that completed inside the
        # call (shared memory): a prefill streaming one WRITE per layer would otherwise
        # keep its own core busy polling between layers.
        if checked or received:
            pr.last_active = now
        return self._xfers.busy or bool(pr.remote_hints) or now - pr.last_active < self.linger_s

    def _hint(self, kind: EnvelopeKind, handle: TransferHandle) -> bytes:
        return encode_envelope(Envelope(kind, self.engine_id, handle.xid, b"", handle.deadline_s))

    def _drain_notifs(self, now: float) -> int:
        try:
            new = self._agent.new_notifs()
        except Exception:
            logger.exception("reading NIXL notifications failed")
            return 0
        out: list[Incoming] = []
        count = 0
        for agent_name, msgs in new.items():
            for raw in msgs:
                count += 1
                try:
                    env = decode_envelope(raw)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    logger.warning("dropping malformed notification from %s: %s", agent_name, exc)
                    continue
                # The delivering agent, not the envelope, says who sent it (`_deliver`).
                key = (agent_name, env.xid or "")
                if env.kind is EnvelopeKind.USER:
                    out.append(Incoming(agent_name, env.sender, env.xid, env.payload))
                    logger.debug("xid=%s notification from agent %s", env.xid, agent_name)
                elif env.kind is EnvelopeKind.XFER_BEGIN:
                    self._progress.remote_hints[key] = now + env.deadline_s
                else:
                    self._progress.remote_hints.pop(key, None)
        if count:
            self._touch()
        if out:
            self._deliver(out)
        return count


__all__ = ["NixlTransport", "nixl_available"]
