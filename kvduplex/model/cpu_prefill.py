"""Prefill attention on CPU by a small compiled kernel (`csrc/prefill_cpu.c`): a chunk's
new tokens attend to their sequence's keys read in place through its block table, the
chunk's own keys included (written to the pool before attention), causally and within a
sliding window where the layer has one.

Design note. Torch's CPU flash SDPA ran a 4k causal prefill of a 64-dim head at 75
GFLOP/s on a Zen 4 core (55 at 1k), against 108-113 for the same model's matmuls; it also
wants K/V head-major, so every chunk copied its K/V (and a continued chunk its cached
context, then merged two calls by log-sum-exp). This kernel is one pass per chunk, fresh
or continued, with no copy: query rows of one KV head (its grouped query heads together)
in tiles, key tiles read from the pool, online softmax, everything laid out with query
rows along the vector lanes so that no step needs a horizontal reduction (see the C
file). Figures in docs/hot_path.md.

With more torch threads than one, a chunk's (KV head, query tile) units are split over as
many threads, in runs of about equal work (a causal tile's work grows with its position).

The kernel is C, compiled at first use for this CPU (`cpu_build.py`), once per head size
and query heads per KV head. No compiler, or a failed build: `load_kernel` returns None
(logged) and prefill stays on SDPA (`prefill_attention.py`). ``--prefill-attention auto``
takes it on CPUs with AVX-512 only, where it was measured (elsewhere its 16-float vectors
are two registers and its micro-tiles would spill); ``kernel`` forces it anywhere.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import subprocess
from pathlib import Path

import torch

from kvduplex.model.cpu_build import CSRC
from kvduplex.model.cpu_build import Shares
from kvduplex.model.cpu_build import build_library

logger = logging.getLogger(__name__)

SOURCE = CSRC / "prefill_cpu.c"
MAX_HEAD_DIM = 256
MAX_GROUP = 8
"""Bounds of the kernel's tiles on the stack (query, output and score tiles of one head)."""


def supports(
    head_dim: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype, device: torch.device
) -> bool:
    """Whether the kernel applies to this model and pool at all (before building it)."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and head_dim % 8 == 0
        and head_dim <= MAX_HEAD_DIM
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
    )


class PrefillKernel:
    """The compiled kernel for one head size and group (query heads per KV head)."""

    def __init__(self, library: Path, head_dim: int, group: int) -> None:
        self.head_dim = head_dim
        self.group = group
        lib = ctypes.CDLL(str(library))
        self._fn = lib.kvd_prefill_f32
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, i64, i64, ptr, i64, ptr]
        self._fn.restype = ctypes.c_int
        lib.kvd_prefill_tile_tokens.restype = i64
        lib.kvd_prefill_key_tile.restype = i64
        lib.kvd_prefill_tile_floats.restype = i64
        self.tile_tokens = int(lib.kvd_prefill_tile_tokens())
        self.key_tile = int(lib.kvd_prefill_key_tile())
        self.tile_floats = int(lib.kvd_prefill_tile_floats())
        self._shares = Shares("prefill")

    def attend(
        self,
        q: torch.Tensor,  # (q_len, num_heads, head_dim), each token's heads contiguous
        layer_pool: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim), contiguous
        block_table: torch.Tensor,  # (blocks of the sequence,) int64, contiguous
        start_pos: int,
        scale: float,
        window: int | None,
        out: torch.Tensor,  # (q_len, num_heads, head_dim), each token's heads contiguous; written
    ) -> None:
        """Attention of the chunk's tokens at ``start_pos ..`` over the sequence's keys in
        `layer_pool` (its own K/V already written there); a sliding `window` sees its last
        `window` keys."""
        self._check(q, layer_pool, block_table, start_pos, window, out)
        _, _, block_size, kv_heads, dim = layer_pool.shape
        q_len = q.shape[0]
        tiles = -(-q_len // self.tile_tokens)
        bounds = work_ranges(kv_heads, tiles, self.tile_tokens, start_pos, window, torch.get_num_threads())
        # per share, its tiles, then the keys of one KV head packed for the scores (1 MiB per
        # 4,096 keys of a 64-dim head); per call, as one kernel serves every engine of the
        # process; rows a multiple of 16 floats, so each stays 64-byte aligned
        floats = self.tile_floats + dim * (start_pos + q_len + self.key_tile)
        scratch = torch.empty(len(bounds), -(-floats // 16) * 16, dtype=torch.float32)

        def run(share: int) -> None:
            lo, hi = bounds[share]
            status = self._fn(
                q.data_ptr(), q.stride(0), layer_pool[0].data_ptr(), layer_pool[1].data_ptr(),
                block_table.data_ptr(), start_pos, q_len, kv_heads, block_size, window or 0, scale,
                lo, hi, out.data_ptr(), out.stride(0), scratch[share].data_ptr(),
            )  # fmt: skip
            assert status == 0, "the kernel refused a unit range work_ranges made"

        self._shares.run(run, range(len(bounds)))

    def _check(
        self,
        q: torch.Tensor,
        layer_pool: torch.Tensor,
        block_table: torch.Tensor,
        start_pos: int,
        window: int | None,
        out: torch.Tensor,
    ) -> None:
        """ValueError for anything the kernel cannot read or write safely."""
        _, _, block_size, kv_heads, dim = layer_pool.shape
        q_len, heads = q.shape[0], q.shape[1]
        if not layer_pool.is_contiguous() or layer_pool.dtype != torch.float32:
            raise ValueError("the CPU prefill kernel needs a contiguous float32 pool")
        for t in (q, out, layer_pool, block_table):
            if t.device.type != "cpu":
                raise ValueError(f"the CPU prefill kernel reads CPU tensors, not {t.device}")
        if dim != self.head_dim or q.shape[2] != dim or heads != kv_heads * self.group or out.shape != q.shape:
            raise ValueError(
                f"this CPU prefill kernel is built for head size {self.head_dim} and {self.group} query "
                f"heads per KV head, not {dim} and {heads} / {kv_heads}"
            )
        for name, t in (("queries", q), ("output", out)):
            if t.dtype != torch.float32 or t.stride(2) != 1 or t.stride(1) != dim:
                raise ValueError(f"the CPU prefill kernel needs float32 {name} with each token's heads contiguous")
        if start_pos < 0 or (window is not None and window < 1):
            raise ValueError(f"start_pos must be >= 0 and window None or >= 1, got {start_pos} and {window}")
        if block_table.dtype != torch.int64 or not block_table.is_contiguous():
            raise ValueError("the CPU prefill kernel needs a contiguous int64 block table")
        if block_table.shape[0] * block_size < start_pos + q_len:
            raise ValueError(f"a block table of {block_table.shape[0]} blocks cannot hold {start_pos + q_len} tokens")
        used = block_table[: -(-(start_pos + q_len) // block_size)]
        if q_len and (int(used.min()) < 0 or int(used.max()) >= layer_pool.shape[1]):
            raise ValueError(f"block ids outside the pool's {layer_pool.shape[1]} blocks")


def work_ranges(
    kv_heads: int, tiles: int, tile_tokens: int, start_pos: int, window: int | None, threads: int
) -> list[tuple[int, int]]:
    """A chunk's units (``head * tiles + tile``) split into at most `threads` runs of about
    equal work, each ``(first unit, end unit)``. A tile's work is the keys its last token
    sees (all before it and its own, or `window`)."""
    units = kv_heads * tiles
    if threads <= 1 or units <= 1:
        return [(0, units)]
    costs = [
        min(start_pos + (t + 1) * tile_tokens, window) if window else start_pos + (t + 1) * tile_tokens
        for t in range(tiles)
    ]
    total, bounds, seen = kv_heads * sum(costs), [0], 0
    for u in range(units - 1):
        seen += costs[u % tiles]
        if seen * threads >= total * len(bounds) and len(bounds) < threads:
            bounds.append(u + 1)
    bounds.append(units)
    return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]


@functools.cache
def load_kernel(head_dim: int, group: int) -> PrefillKernel | None:
    """The kernel for `head_dim` and `group`, built now if not cached; None (logged once)
    when it cannot be built here."""
    try:
        library = build_library(SOURCE, {"KVD_HEAD_DIM": head_dim, "KVD_GROUP": group})
        return PrefillKernel(library, head_dim, group)
    except (OSError, RuntimeError, ValueError, AttributeError, subprocess.SubprocessError) as exc:
        logger.warning("CPU prefill kernel unavailable (%s); prefill attention stays on SDPA", exc)
        return None
