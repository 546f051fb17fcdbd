"""A continued prefill (a chunk after cached tokens) against SDPA with an offset causal mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvduplex.model.attention import AttentionContext
from kvduplex.model.attention import PrefillSpan
from kvduplex.model.attention import paged_attention
from kvduplex.model.attention import write_kv

HEAD_DIM = 32


def _masked_reference(
    q: torch.Tensor,  # (q_len, heads, dim)
    k_all: torch.Tensor,  # (context, kv_heads, dim)
    v_all: torch.Tensor,
    start_pos: int,
    scale: float,
) -> torch.Tensor:  # (q_len, heads, dim)
    q_len, context = q.shape[0], k_all.shape[0]
    qpos = torch.arange(start_pos, start_pos + q_len)[:, None]
    kpos = torch.arange(context)[None, :]
    mask = torch.zeros(q_len, context).masked_fill(kpos > qpos, float("-inf"))
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k_all.transpose(0, 1)[None], v_all.transpose(0, 1)[None],
        attn_mask=mask, scale=scale, enable_gqa=True,
    )  # fmt: skip
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("start_pos,q_len", [(1, 2), (7, 5), (16, 16), (45, 30)])
@pytest.mark.parametrize("consecutive", [False, True], ids=["scattered", "consecutive"])
def test_continued_prefill_matches_the_masked_sdpa(
    heads: int, kv_heads: int, block_size: int, start_pos: int, q_len: int, consecutive: bool
) -> None:
    gen = torch.Generator().manual_seed(start_pos * 100 + q_len)
    context = start_pos + q_len
    num_blocks = -(-context // block_size)
    pool = torch.randn(2, num_blocks + 6, block_size, kv_heads, HEAD_DIM, generator=gen)
    table = torch.randperm(num_blocks + 6, generator=gen)[:num_blocks]  # scattered, any order
    if consecutive:  # read in place from the pool
        table = torch.arange(3, 3 + num_blocks)
    k_all = torch.randn(context, kv_heads, HEAD_DIM, generator=gen)
    v_all = torch.randn(context, kv_heads, HEAD_DIM, generator=gen)
    pos = torch.arange(context)
    write_kv(pool, k_all, v_all, table[pos // block_size] * block_size + pos % block_size)
    q = torch.randn(q_len, heads, HEAD_DIM, generator=gen)
    new = slice(start_pos, context)
    ctx = AttentionContext(
        slot_mapping=(table[pos[new] // block_size] * block_size + pos[new] % block_size),
        block_size=block_size,
        prefills=[PrefillSpan(0, q_len, start_pos, table)],
        decode_groups=[],
        decode_kv=torch.empty(0),
    )
    scale = HEAD_DIM**-0.5
    got = paged_attention(q, k_all[new], v_all[new], pool, ctx, scale, window=None)
    want = _masked_reference(q, k_all, v_all, start_pos, scale)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
