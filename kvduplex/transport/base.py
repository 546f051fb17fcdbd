"""Shared machinery of the transports: region indices, validation, completion.

Both transports turn a transfer request into two equal-length int32 arrays of
region indices (local and remote) and hand them to ``_post``. The blocks×layers
form expands with numpy in layer-major, K-before-V, block order, which is also
pool memory order, so runs of consecutive blocks are contiguous in memory::

    layers [l0, l1] × kinds [K, V] × blocks [b0, b1, b2]
    → (l0,K,b0) (l0,K,b1) (l0,K,b2) (l0,V,b0) ... (l1,V,b2)
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvduplex.engine.kv_cache import KVCacheLayout, KVKind
from kvduplex.transport.messages import HANDSHAKE_VERSION, HandshakeInfo
from kvduplex.transport.metrics import TransferMetrics
from kvduplex.transport.protocol import (
    ALL_KINDS,
    FailureKind,
    IncompatibleLayoutError,
    PeerHandle,
    Region,
    TransferHandle,
    TransferOp,
    TransferState,
)

logger = logging.getLogger(__name__)

IndexArray = npt.NDArray[np.int32]


def _as_index_array(
    values: Sequence[int] | npt.NDArray[np.integer], what: str
) -> npt.NDArray[np.int64]:
    arr = np.asarray(values, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a flat sequence of ints, got shape {arr.shape}")
    return arr


def _check_range(arr: npt.NDArray[np.int64], limit: int, what: str) -> None:
    # One reduction: negative values wrap to huge unsigned ones.
    if arr.size and int(arr.view(np.uint64).max()) >= limit:
        bad = arr[(arr < 0) | (arr >= limit)][0]
        raise ValueError(f"{what} {int(bad)} out of range [0, {limit})")


class RegionIndexer:
    """Expands ``layers × kinds × blocks`` to region indices of one layout.

    Keeps the row offsets per (layers, kinds) selection, so a transfer costs a
    few numpy operations on its block list. Not thread-safe for writers of the
    cache, but a lost cache entry is only recomputed.
    """

    _MAX_CACHED = 256

    def __init__(self, layout: KVCacheLayout) -> None:
        self.layout = layout
        self._rows: dict[tuple[tuple[int, ...] | None, tuple[int, ...]], npt.NDArray[np.int64]] = {}

    def rows(
        self, layers: Sequence[int] | npt.NDArray[np.integer] | None, kinds: Sequence[KVKind]
    ) -> npt.NDArray[np.int64]:
        """Offset of block 0 of each selected (layer, kind), shape (layers * kinds, 1)."""
        key = (
            None if layers is None else tuple(int(x) for x in layers),
            tuple(int(k) for k in kinds),
        )
        rows = self._rows.get(key)
        if rows is None:
            lay = (
                np.arange(self.layout.num_layers, dtype=np.int64)
                if layers is None
                else _as_index_array(layers, "layers")
            )
            _check_range(lay, self.layout.num_layers, "layer")
            kv = np.asarray(key[1], dtype=np.int64)
            _check_range(kv, 2, "kind")
            rows = ((lay[:, None] * 2 + kv[None, :]) * self.layout.num_blocks).reshape(-1, 1)
            if len(self._rows) >= self._MAX_CACHED:
                self._rows.clear()
            self._rows[key] = rows
        return rows

    def __call__(
        self,
        blocks: Sequence[int] | npt.NDArray[np.integer],
        layers: Sequence[int] | npt.NDArray[np.integer] | None = None,
        kinds: Sequence[KVKind] = ALL_KINDS,
    ) -> IndexArray:
        """Region indices; ValueError naming the offending value if one is out of range."""
        b = _as_index_array(blocks, "blocks")
        _check_range(b, self.layout.num_blocks, "block id")
        return (self.rows(layers, kinds) + b).reshape(-1).astype(np.int32)  # (layers*kinds*blocks,)


def block_region_indices(
    layout: KVCacheLayout,
    blocks: Sequence[int] | npt.NDArray[np.integer],
    layers: Sequence[int] | npt.NDArray[np.integer] | None = None,
    kinds: Sequence[KVKind] = ALL_KINDS,
) -> IndexArray:
    """Region indices of ``layers × kinds × blocks`` in ``layout``'s pool, in that order.

    Raises ValueError naming the offending value if a block or layer is out of range.
    """
    return RegionIndexer(layout)(blocks, layers, kinds)


def region_indices(layout: KVCacheLayout, regions: Sequence[Region]) -> IndexArray:
    """Region indices of arbitrary regions; ValueError if any is out of range."""
    out = np.empty(len(regions), dtype=np.int64)
    for i, r in enumerate(regions):
        if not (0 <= r.layer < layout.num_layers and 0 <= r.block < layout.num_blocks):
            raise ValueError(f"region {r} out of range for layout {layout}")
        out[i] = layout.region_index(r.layer, r.kv, r.block)
    return out.astype(np.int32)


def check_compatible(
    layout: KVCacheLayout, engine_id: str, info: HandshakeInfo, expected_transport: str
) -> KVCacheLayout:
    """The peer's layout if ``info`` describes a pool we can exchange blocks with.

    Raises IncompatibleLayoutError saying what differs and what to change.
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


class TransportBase(abc.ABC):
    """Implements the request side of the `Transport` Protocol over ``_post``.

    Subclasses post index arrays and later finish the handle through
    ``_complete``, which records metrics and logs the lifecycle.
    """

    def __init__(
        self,
        layout: KVCacheLayout,
        engine_id: str,
        default_deadline_s: float,
        metrics: TransferMetrics | None,
    ) -> None:
        if default_deadline_s <= 0:
            raise ValueError(f"default_deadline_s must be > 0, got {default_deadline_s}")
        if layout.num_layers * 2 * layout.num_blocks >= 2**31:
            raise ValueError("the pool has more than 2**31 regions; use larger blocks")
        self._layout = layout
        self._block_bytes = layout.block_bytes
        self._indexers: dict[KVCacheLayout, RegionIndexer] = {layout: RegionIndexer(layout)}
        self._engine_id = engine_id
        self.default_deadline_s = default_deadline_s
        self.metrics = metrics if metrics is not None else TransferMetrics.default()
        self._last_activity = time.monotonic()

    @property
    def layout(self) -> KVCacheLayout:
        return self._layout

    @property
    def last_activity(self) -> float:
        return self._last_activity

    def _touch(self) -> None:
        """Record activity now (a post, a notification sent or received)."""
        self._last_activity = time.monotonic()

    @property
    def engine_id(self) -> str:
        return self._engine_id

    # -- request side -------------------------------------------------------

    def write(
        self,
        peer: PeerHandle,
        xid: str,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        layers: Sequence[int] | None = None,
        kinds: Sequence[KVKind] = ALL_KINDS,
        notif: bytes | None = None,
        deadline_s: float | None = None,
    ) -> TransferHandle:
        local, remote = self._block_indices(peer, local_blocks, remote_blocks, layers, kinds)
        return self._submit(TransferOp.WRITE, peer, xid, local, remote, notif, deadline_s)

    def read(
        self,
        peer: PeerHandle,
        xid: str,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        layers: Sequence[int] | None = None,
        kinds: Sequence[KVKind] = ALL_KINDS,
        deadline_s: float | None = None,
    ) -> TransferHandle:
        local, remote = self._block_indices(peer, local_blocks, remote_blocks, layers, kinds)
        return self._submit(TransferOp.READ, peer, xid, local, remote, None, deadline_s)

    def write_regions(
        self,
        peer: PeerHandle,
        xid: str,
        local: Sequence[Region],
        remote: Sequence[Region],
        notif: bytes | None = None,
        deadline_s: float | None = None,
    ) -> TransferHandle:
        li, ri = self._region_pair(peer, local, remote)
        return self._submit(TransferOp.WRITE, peer, xid, li, ri, notif, deadline_s)

    def read_regions(
        self,
        peer: PeerHandle,
        xid: str,
        local: Sequence[Region],
        remote: Sequence[Region],
        deadline_s: float | None = None,
    ) -> TransferHandle:
        li, ri = self._region_pair(peer, local, remote)
        return self._submit(TransferOp.READ, peer, xid, li, ri, None, deadline_s)

    def set_compute_busy(self, busy: bool) -> None:  # noqa: B027 - optional for transports
        """The instance's engine starts (True) or ends (False) a forward on this CPU.

        A transport that polls in the background may poll less meanwhile, so
        that it does not take the core the forward runs on. No-op by default.
        """

    def state(self, handle: TransferHandle) -> TransferState:
        return handle.state

    # -- helpers --------------------------------------------------------------

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
        t0 = time.perf_counter()
        try:
            self._post(op, peer, handle, local, remote, notif)
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
    ) -> None:
        """Finish ``handle`` once, with metrics and a lifecycle log line."""
        if not handle.finish(state, reason, failure):
            return
        if state is TransferState.DONE:
            self.metrics.on_done(handle)
            logger.debug(
                "xid=%s %s done: %d bytes in %.3f ms",
                handle.xid, handle.op.value, handle.num_bytes, (handle.duration_s or 0.0) * 1e3,
            )  # fmt: skip
        else:
            self.metrics.on_failed(handle.op, failure or FailureKind.PEER)
            logger.warning(
                "xid=%s %s to %s failed: %s",
                handle.xid,
                handle.op.value,
                handle.peer_engine_id,
                reason,
            )

    @abc.abstractmethod
    def _post(
        self,
        op: TransferOp,
        peer: PeerHandle,
        handle: TransferHandle,
        local: IndexArray,
        remote: IndexArray,
        notif: bytes | None,
    ) -> None:
        """Start moving ``local[i]`` <-> ``remote[i]``; finish ``handle`` now or later.

        May raise: the caller turns the exception into a FAILED handle.
        """
