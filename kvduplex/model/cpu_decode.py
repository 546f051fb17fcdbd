"""Decode attention on CPU by a small compiled kernel that walks each sequence's block
table (`csrc/paged_decode_cpu.c`): every decode of a step reads its K/V in place, once,
whatever the pool's fragmentation; no ranges, copies, masks or merges.

Design note. On one core, attention under load is bound by reading K/V. SDPA's flash
kernel called per range of consecutive blocks (`paged_decode.py`) reads it well below the
core's streaming rate; this kernel reads nearer it, whatever the blocks' order (figures in
docs/hot_path.md): two passes (scores, then the weighted sum of V) walking the tokens in table order, all KV heads
of a token being one contiguous run, with the next block prefetched. With more torch
threads than one, a step's decodes are split over as many threads (`work_items`: by
sequence, or by KV head when there are fewer sequences than threads), each calling the
kernel on its share.

The kernel is C, compiled at first use for this CPU (`cpu_build.py`), once per head size
and query heads per KV head; loaded with `ctypes`, which releases the GIL during the call. No
compiler, or a failed build: `load_kernel` returns None (logged with the compiler's
error) and the runner keeps ``paged`` (``copy`` for sliding-window models).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from kvduplex.model.cpu_build import CSRC
from kvduplex.model.cpu_build import Shares
from kvduplex.model.cpu_build import build_library

logger = logging.getLogger(__name__)

SOURCE = CSRC / "paged_decode_cpu.c"
LANES = 16
"""The kernel's vector width in floats: head sizes must be a multiple of it."""
MAX_HEADS = 1024


@dataclass(frozen=True)
class KernelDecodes:
    """This step's decodes for the kernel: their tokens, block tables and key ranges."""

    token_index: torch.Tensor  # (num_seqs,) int64
    """Flattened-batch index of each decode's new token."""
    tables: torch.Tensor  # (num_seqs, width) int64, contiguous
    """Each decode's block table, cut to the longest decode's blocks."""
    lens: torch.Tensor  # (num_seqs,) int64
    """Keys each decode sees, its new token included (its position + 1)."""
    all_tokens: bool
    """Every token of the step is one of these decodes, in order (q needs no gather)."""


def supports(
    head_dim: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype, device: torch.device
) -> bool:
    """Whether the kernel applies to this model and pool at all (before building it)."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and head_dim % LANES == 0
        and num_heads % num_kv_heads == 0
        and num_heads <= MAX_HEADS
    )


class PagedDecodeKernel:
    """The compiled kernel for one head size and group (query heads per KV head)."""

    def __init__(self, library: Path, head_dim: int, group: int) -> None:
        self.head_dim = head_dim
        self.group = group
        self._fn = ctypes.CDLL(str(library)).kvd_paged_decode_f32
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, ptr, ptr]
        self._fn.restype = ctypes.c_int
        self._shares = Shares("decode")

    def attend(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
        layer_pool: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim), contiguous
        batch: KernelDecodes,
        scale: float,
        window: int | None,
        out: torch.Tensor,  # (num_tokens, num_heads, head_dim), written at the decode tokens
    ) -> None:
        """Attention of every decode of `batch` over `layer_pool`, in place (a sliding
        `window` sees its last `window` keys). With more than one torch thread, the work is
        split over that many threads by sequence, or by KV head when there are fewer
        sequences than threads (`work_items`)."""
        _, _, block_size, kv_heads, dim = layer_pool.shape
        if not layer_pool.is_contiguous() or q.dtype != torch.float32 or layer_pool.dtype != torch.float32:
            raise ValueError("the CPU decode kernel needs a contiguous float32 pool and queries")
        n = batch.lens.shape[0]
        heads = q.shape[1]
        if dim != self.head_dim or heads != kv_heads * self.group or heads > MAX_HEADS:
            raise ValueError(
                f"this CPU decode kernel is built for head size {self.head_dim} and {self.group} query "
                f"heads per KV head (at most {MAX_HEADS} heads), not {dim} and {heads} / {kv_heads}"
            )
        for t in (batch.tables, batch.lens, batch.token_index):
            if t.dtype != torch.int64 or not t.is_contiguous():
                raise ValueError("the CPU decode kernel needs contiguous int64 tables, lens and token indices")
        qd = (q if batch.all_tokens else q.index_select(0, batch.token_index)).contiguous()
        starts = (batch.lens - window).clamp_(min=0) if window is not None else torch.zeros_like(batch.lens)
        widths = (batch.lens - starts).tolist()
        res = out if batch.all_tokens and out.is_contiguous() else torch.empty((n, heads, dim), dtype=q.dtype)
        stride = batch.tables.shape[1]
        row = heads * dim * 4  # bytes of one sequence's q or output rows

        def run(item: tuple[int, int, int, int]) -> None:
            lo, hi, head_lo, head_hi = item
            scores = torch.empty(heads * max(widths[lo:hi]), dtype=torch.float32)
            status = self._fn(
                qd.data_ptr() + lo * row, layer_pool[0].data_ptr(), layer_pool[1].data_ptr(),
                batch.tables.data_ptr() + lo * stride * 8, stride, starts.data_ptr() + lo * 8,
                batch.lens.data_ptr() + lo * 8, hi - lo, kv_heads, head_lo, head_hi, block_size, scale,
                scores.data_ptr(), res.data_ptr() + lo * row,
            )  # fmt: skip
            assert status == 0, "the kernel refused a head range work_items made"

        self._shares.run(run, work_items(widths, kv_heads, torch.get_num_threads()))
        if res is not out:
            out.index_copy_(0, batch.token_index, res)


def work_items(widths: list[int], kv_heads: int, threads: int) -> list[tuple[int, int, int, int]]:
    """A step's decodes split for `threads` threads: ``(first seq, end seq, first KV head,
    end KV head)`` each. With at least as many sequences as threads, runs of sequences with
    about equal keys each; with fewer, each sequence's KV heads in about equal parts."""
    n = len(widths)
    if threads <= 1 or n == 0:
        return [(0, n, 0, kv_heads)]
    if n >= threads:
        total, bounds, seen = sum(widths), [0], 0
        for i, w in enumerate(widths[:-1]):
            seen += w
            if seen * threads >= total * len(bounds) and len(bounds) < threads:
                bounds.append(i + 1)
        bounds.append(n)
        return [(a, b, 0, kv_heads) for a, b in itertools.pairwise(bounds) if b > a]
    parts = min(kv_heads, max(1, threads // n))  # at most `threads` items
    return [
        (s, s + 1, kv_heads * j // parts, kv_heads * (j + 1) // parts)
        for s in range(n)
        for j in range(parts)
        if kv_heads * (j + 1) // parts > kv_heads * j // parts
    ]


@functools.cache
def load_kernel(head_dim: int, group: int) -> PagedDecodeKernel | None:
    """The kernel for `head_dim` and `group`, built now if not cached; None (logged once)
    when it cannot be built here."""
    try:
        return PagedDecodeKernel(
            build_library(SOURCE, {"KVD_HEAD_DIM": head_dim, "KVD_GROUP": group}), head_dim, group
        )
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as exc:
        logger.warning("CPU decode kernel unavailable (%s); decode attention stays on SDPA", exc)
        return None
