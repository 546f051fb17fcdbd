"""The paged KV pool's memory: allocated once per instance, resident, in the layout of
`kvduplex.common.kv_layout.KVCacheLayout`."""

from __future__ import annotations

import logging
import mmap
import sys

import torch

from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.model.dtypes import dtype_from_name

logger = logging.getLogger(__name__)


def allocate_kv_pool(layout: KVCacheLayout, device: torch.device | str = "cpu") -> torch.Tensor:
    """Allocate a zeroed pool of ``layout.shape``, every page of it resident.

    On CPU the memory is page-aligned and advised for transparent huge pages,
    which roughly doubles shared-memory transfer throughput, and populated
    here, at startup: the first touch of a page otherwise lands on whatever
    touches it first, a prefill's forward, or a peer's WRITE or this
    instance's READ of a request's blocks, where it costs up to a hundred
    times the copy (on a VM, host memory the guest never used is slowest).
    """
    device = torch.device(device)
    if device.type != "cpu":
        return torch.zeros(layout.shape, dtype=dtype_from_name(layout.dtype), device=device)
    nbytes = layout.total_bytes
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    madv_hugepage = getattr(mmap, "MADV_HUGEPAGE", None)
    if madv_hugepage is not None:
        try:
            buf.madvise(madv_hugepage)
        except OSError:  # pragma: no cover - kernel without THP
            logger.debug("MADV_HUGEPAGE not available for the KV pool")
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
    _populate(buf, flat)
    pool = flat.view(dtype_from_name(layout.dtype)).view(layout.shape)
    # Keep the mapping alive as long as the tensor lives.
    pool._kvduplex_mmap = buf  # type: ignore[attr-defined]
    return pool


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python's mmap module does not name it


def _populate(buf: mmap.mmap, flat: torch.Tensor) -> None:
    """Fault every page of ``buf`` in (the kernel zeroes them), or write zeros."""
    if sys.platform == "linux":
        try:
            buf.madvise(_MADV_POPULATE_WRITE)
            return
        except OSError:  # older kernel: touch the pages ourselves
            pass
    flat.zero_()


def pool_base_address(pool: torch.Tensor) -> int:
    """Address of the pool's first byte (for registering it with a transport)."""
    return int(pool.data_ptr())


__all__ = [
    "allocate_kv_pool",
    "pool_base_address",
]
