"""The model runner: one batched forward pass over the paged KV cache per engine step.

The engine hands `ModelRunner.execute` plain per-sequence inputs (`SeqInput`);
the runner flattens them into one batch (prefill chunks and decodes mixed),
derives positions and slot mappings, runs the decoder, and returns the
float32 logits of the rows that asked for them. Layer by layer it reports,
through ``on_layer_done``, when that layer's KV for the whole step is in the
pool: the layer-wise KV push hooks in there.

::

    seqs      A: 5 new tokens at 0..4   B: 1 token at 37   C: 3 tokens at 16..18
    flat      A0 A1 A2 A3 A4 B0 C0 C1 C2
    positions  0  1  2  3  4 37 16 17 18
    slots     block_table[pos // block_size] * block_size + pos % block_size
    logits    rows of the last new token of each seq with needs_logits
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvduplex.engine.kv_cache import KVCacheLayout, num_blocks_for_tokens
from kvduplex.model.attention import AttentionContext, DecodeGroup, PrefillSpan
from kvduplex.model.config import DecoderConfig
from kvduplex.model.decoder import DecoderForCausalLM

logger = logging.getLogger(__name__)


@dataclass
class SeqInput:
    """One sequence's share of a step."""

    token_ids: list[int]
    """The new tokens to compute this step (at least one)."""
    start_pos: int
    """Position of token_ids[0], i.e. tokens of this sequence already in the KV cache."""
    block_table: list[int]
    """Block ids covering positions [0, start_pos + len(token_ids))."""
    needs_logits: bool
    """Return the logits of the last new token."""


def _dtype_name(dtype: torch.dtype | str) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def kv_layout_for(
    config: DecoderConfig, block_size: int, num_blocks: int, dtype: torch.dtype | str
) -> KVCacheLayout:
    """The KV pool layout that `config`'s model writes, with the given paging."""
    return KVCacheLayout(
        num_layers=config.num_layers,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        dtype=_dtype_name(dtype),
    )


def num_blocks_for_memory(
    config: DecoderConfig, block_size: int, dtype: torch.dtype | str, mb: int
) -> int:
    """How many blocks fit in `mb` MiB of KV pool; ValueError if not even one."""
    layout = kv_layout_for(config, block_size, 1, dtype)
    per_block = layout.total_bytes  # all layers, K and V, of one block
    num_blocks = (mb * 2**20) // per_block
    if num_blocks < 1:
        raise ValueError(
            f"{mb} MiB holds no KV block of {per_block} bytes; raise kv_cache_mb or lower block_size"
        )
    return int(num_blocks)


@dataclass(frozen=True)
class _Batch:
    input_ids: torch.Tensor  # (num_tokens,)
    positions: torch.Tensor  # (num_tokens,)
    logits_index: torch.Tensor  # (num_logits,)
    ctx: AttentionContext


class ModelRunner:
    """Runs `model` over `kv_pool`; owned and called by the engine thread only.

    The pool is passed in (allocated by the engine, registered with the
    transport) and written in place; the runner keeps no per-sequence state.
    """

    def __init__(
        self,
        model: DecoderForCausalLM,
        config: DecoderConfig,
        kv_pool: torch.Tensor,  # (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        layout: KVCacheLayout,
        device: torch.device | str,
    ) -> None:
        """ValueError if the pool does not match `layout`, or `layout` does not fit `config`."""
        expected = kv_layout_for(config, layout.block_size, layout.num_blocks, layout.dtype)
        if expected != layout:
            raise ValueError(f"KV layout does not fit the model: {expected.incompatibility(layout)}")
        if tuple(kv_pool.shape) != layout.shape or kv_pool.dtype != layout.torch_dtype:
            raise ValueError(
                f"KV pool is {tuple(kv_pool.shape)} {kv_pool.dtype}, layout wants "
                f"{layout.shape} {layout.torch_dtype}"
            )
        param = next(model.parameters())
        if param.dtype != kv_pool.dtype:
            raise ValueError(f"model dtype {param.dtype} differs from KV pool dtype {kv_pool.dtype}")
        self.device = torch.device(device)
        if kv_pool.device != param.device or param.device.type != self.device.type:
            raise ValueError(f"model on {param.device}, pool on {kv_pool.device}, runner on {self.device}")
        self.model = model
        self.config = config
        self.kv_pool = kv_pool
        self.layout = layout
        self.block_size = layout.block_size
        # Scratch for one layer's decode K/V, reused by every layer and step; grows, never shrinks.
        self._decode_kv_buffer = torch.empty(0, dtype=kv_pool.dtype, device=self.device)

    @torch.inference_mode()
    def execute(
        self, seqs: list[SeqInput], on_layer_done: Callable[[int], None] | None = None
    ) -> torch.Tensor:  # (num seqs with needs_logits, vocab_size) float32
        """Compute one step; write the new tokens' KV into the pool; return the asked-for logits.

        Rows follow the order of `seqs` (only those with needs_logits).
        `on_layer_done(layer)` runs on this thread once per layer, in order,
        right after that layer's K and V for all `seqs` are in the pool (on
        CUDA the stream is synchronised first, so the bytes are really there).
        Raises ValueError for malformed inputs (no tokens, a block table too
        short for the positions, block ids out of the pool).
        """
        if not seqs:
            return torch.empty(0, self.config.vocab_size, dtype=torch.float32, device=self.device)
        batch = self._prepare(seqs)
        hook = on_layer_done
        if on_layer_done is not None and self.device.type == "cuda":
            device = self.device

            def hook(layer: int) -> None:
                torch.cuda.current_stream(device).synchronize()
                on_layer_done(layer)

        hidden = self.model(batch.input_ids, batch.positions, self.kv_pool, batch.ctx, hook)
        return self.model.compute_logits(hidden[batch.logits_index])

    def _decode_kv(self, num_blocks: int) -> torch.Tensor:
        """A view ``(2, num_blocks, block_size, num_kv_heads, head_dim)`` of the decode K/V scratch."""
        _, _, _, bs, heads, dim = self.layout.shape
        per_block = 2 * bs * heads * dim
        if self._decode_kv_buffer.numel() < num_blocks * per_block:
            capacity = max(num_blocks, 2 * self._decode_kv_buffer.numel() // per_block)
            self._decode_kv_buffer = torch.empty(
                capacity * per_block, dtype=self.kv_pool.dtype, device=self.device
            )
        return self._decode_kv_buffer[: num_blocks * per_block].view(2, num_blocks, bs, heads, dim)

    def _prepare(self, seqs: list[SeqInput]) -> _Batch:
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        lens: list[int] = []
        logits_index: list[int] = []
        max_blocks = 0
        for i, seq in enumerate(seqs):
            n = len(seq.token_ids)
            end = seq.start_pos + n
            if n == 0 or seq.start_pos < 0:
                raise ValueError(f"seq {i}: needs >= 1 new token and start_pos >= 0")
            if len(seq.block_table) * bs < end:
                raise ValueError(
                    f"seq {i}: block table of {len(seq.block_table)} blocks cannot hold {end} tokens"
                )
            token_ids.extend(seq.token_ids)
            positions.extend(range(seq.start_pos, end))
            lens.append(n)
            if seq.needs_logits:
                logits_index.append(len(token_ids) - 1)
            max_blocks = max(max_blocks, num_blocks_for_tokens(end, bs))
        tables = torch.tensor(
            [_pad(seq.block_table, max_blocks) for seq in seqs], dtype=torch.int64
        )  # (num_seqs, max_blocks)
        if int(tables.min()) < 0 or int(tables.max()) >= self.layout.num_blocks:
            raise ValueError(f"block ids must be in [0, {self.layout.num_blocks})")
        pos_t = torch.tensor(positions, dtype=torch.int64)  # (num_tokens,)
        seq_index = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(lens))
        slots = tables[seq_index, pos_t // bs] * bs + pos_t % bs  # (num_tokens,)

        dev = self.device
        prefills: list[PrefillSpan] = []
        decode_seqs: list[int] = []
        decode_tokens: list[int] = []
        offset = 0
        for i, seq in enumerate(seqs):
            n = lens[i]
            if n == 1:
                decode_seqs.append(i)
                decode_tokens.append(offset)
            else:
                nb = num_blocks_for_tokens(seq.start_pos + n, bs)
                prefills.append(PrefillSpan(offset, n, seq.start_pos, tables[i, :nb].to(dev)))
            offset += n
        ctx_lens = [seqs[i].start_pos + 1 for i in decode_seqs]
        groups: list[DecodeGroup] = []
        for members in group_by_length(ctx_lens, bs):
            width = num_blocks_for_tokens(max(ctx_lens[j] for j in members), bs)
            rows = [decode_seqs[j] for j in members]
            groups.append(
                DecodeGroup(
                    token_index=torch.tensor([decode_tokens[j] for j in members]).to(dev),
                    block_index=tables[rows, :width].reshape(-1).to(dev),
                    context_lens=torch.tensor([ctx_lens[j] for j in members]).to(dev),
                    width_blocks=width,
                )
            )
        ctx = AttentionContext(
            slot_mapping=slots.to(dev),
            block_size=bs,
            prefills=prefills,
            decode_groups=groups,
            decode_kv=self._decode_kv(max((g.block_index.shape[0] for g in groups), default=0)),
        )
        return _Batch(
            input_ids=torch.tensor(token_ids, dtype=torch.int64).to(dev),
            positions=pos_t.to(dev),
            logits_index=torch.tensor(logits_index, dtype=torch.int64).to(dev),
            ctx=ctx,
        )


GROUP_COST_TOKENS = 256
"""Padding (in tokens, summed over a group's sequences) that one more decode group is worth."""


def group_by_length(context_lens: list[int], block_size: int) -> list[list[int]]:
    """Indices of `context_lens` split into groups of similar length, each in ascending order.

    Minimises the padded tokens (each sequence widened to its group's longest
    context, in whole blocks) plus `GROUP_COST_TOKENS` per group, by dynamic
    programming over the sorted lengths::

        lengths  130 140 150 | 600 610 | 1000      three groups, widths 160, 624, 1008
    """
    order = sorted(range(len(context_lens)), key=lambda i: context_lens[i])
    sorted_lens = [context_lens[i] for i in order]
    prefix = [0]
    for n in sorted_lens:
        prefix.append(prefix[-1] + n)
    best = [0] + [0] * len(order)  # best[j]: cost of grouping the j shortest
    cut = [0] * (len(order) + 1)  # cut[j]: start of the last group in that best split
    for j in range(1, len(order) + 1):
        width = num_blocks_for_tokens(sorted_lens[j - 1], block_size) * block_size
        costs = (
            best[i] + GROUP_COST_TOKENS + width * (j - i) - (prefix[j] - prefix[i]) for i in range(j)
        )
        best[j], cut[j] = min((c, i) for i, c in enumerate(costs))
    groups: list[list[int]] = []
    j = len(order)
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def _pad(block_table: list[int], width: int) -> list[int]:
    """The first `width` entries of `block_table`, padded with block 0 (masked out by attention)."""
    row = block_table[:width]
    return row + [0] * (width - len(row))
