"""Prefill attention on SDPA: a prompt's first chunk, and a continued chunk. On CPU in
float32 the compiled kernel (`cpu_prefill.py`) is the default; this is the path with
``--prefill-attention sdpa``, in other dtypes, and where the kernel cannot be built.

Design note. The CPU flash kernel (`_scaled_dot_product_flash_attention_for_cpu`) reads
grouped query heads' shared K/V head in place, skips the blocks above the diagonal of a
causal call, and returns its log-sum-exp. Its cost depends on layout: K and V are given
head-major and contiguous (one copy each, cheaper than what strided reads cost the
kernel); the query stays the token-major view the projection gives, because the kernel
writes its output in the query's layout and the output projection reads token-major.
A continued chunk is two calls over disjoint keys merged by log-sum-exp (see
`continued_prefill`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _head_major(x: torch.Tensor) -> torch.Tensor:
    """``(tokens, heads, dim)`` -> ``(heads, tokens, dim)``, contiguous.

    CPU flash SDPA runs faster on head-major K/V than on the token-major views the
    projection and the pool give, by more than the copy costs (docs/benchmarks.md).
    """
    return x.transpose(0, 1).contiguous()


def fresh_prefill(
    q: torch.Tensor,  # (q_len, num_heads, head_dim)
    k: torch.Tensor,  # (q_len, num_kv_heads, head_dim)
    v: torch.Tensor,  # (q_len, num_kv_heads, head_dim)
    mask: torch.Tensor | None,  # (q_len, q_len) additive, or None for plain causal
    scale: float,
) -> torch.Tensor:  # (1, num_heads, q_len, head_dim)
    """A prompt's first chunk over its own K/V: causal, or under `mask` (a sliding window).

    Grouped query heads read their shared K/V head in place (no expansion).
    """
    qs, ks, vs = q.transpose(0, 1)[None], _head_major(k)[None], _head_major(v)[None]
    # With a batch dim (4-D inputs) CPU SDPA takes the flash kernel; 3-D falls back to the math path.
    return F.scaled_dot_product_attention(
        qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def continued_prefill(
    q: torch.Tensor,  # (q_len, num_heads, head_dim)
    k_new: torch.Tensor,  # (q_len, num_kv_heads, head_dim)
    v_new: torch.Tensor,  # (q_len, num_kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    block_table: torch.Tensor,  # (num_blocks_of_seq,) int64
    start_pos: int,
    scale: float,
    out: torch.Tensor,  # (1, num_heads, q_len, head_dim), written
) -> None:
    """A chunk after `start_pos` cached tokens (blocks `block_table`), as two flash SDPAs merged by log-sum-exp.

    ::

        keys     [ 0 ........ start_pos | start_pos ...... context_len ]
                   cached: every query     this chunk's own K/V: causal
                   sees all of it, no mask (the kernel skips the blocks above
                                            the diagonal)

    One SDPA over the whole context would need a ``(q_len, context_len)`` additive mask
    (built, then read in every layer) and computes every masked block. The cached part is
    copied from the pool, head-major (read in place when its blocks are consecutive); the
    chunk's own K/V come as computed. Grouped query heads read their shared K/V head in
    place. Attention is a sum over keys, so the two partial outputs merge exactly, up to
    rounding, by their log-sum-exps.
    """
    num_blocks = -(-start_pos // k_cache.shape[1])
    table = block_table[:num_blocks]
    k_old = _gather_head_major(k_cache, table, start_pos)  # (kv_heads, start_pos, dim)
    v_old = _gather_head_major(v_cache, table, start_pos)
    qs = q.transpose(0, 1)[None]  # (1, num_heads, q_len, head_dim)
    k_own, v_own = _head_major(k_new)[None], _head_major(v_new)[None]  # (1, kv_heads, q_len, dim)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o_old, lse_old = flash(qs, k_old[None], v_old[None], 0.0, False, scale=scale)[:2]
    o_own, lse_own = flash(qs, k_own, v_own, 0.0, True, scale=scale)[:2]
    # (1, heads, q_len, dim) and (1, heads, q_len): weight of each part = exp(lse_part - lse_all)
    w_old = torch.sigmoid(lse_old - lse_own)[..., None]
    torch.lerp(o_own, o_old, w_old.to(o_own.dtype), out=out)


def _is_consecutive(block_table: torch.Tensor) -> bool:
    """Whether the block ids run ``b, b+1, b+2, ...`` (a prompt allocated from a fresh pool)."""
    n = int(block_table.shape[0])
    if n < 2:
        return True
    return int(block_table[-1]) - int(block_table[0]) == n - 1 and bool((block_table.diff() == 1).all())


def _gather_head_major(
    cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    block_table: torch.Tensor,  # (num_blocks_of_seq,)
    context_len: int,
) -> torch.Tensor:  # (num_kv_heads, context_len, head_dim), contiguous
    """The first `context_len` tokens' K or V of a sequence, one copy out of the pool."""
    heads, dim = cache.shape[-2:]
    if _is_consecutive(block_table):
        first = int(block_table[0])
        flat = cache[first:first + block_table.shape[0]].view(-1, heads, dim)
    else:
        flat = cache.index_select(0, block_table).view(-1, heads, dim)
    return _head_major(flat[:context_len])
