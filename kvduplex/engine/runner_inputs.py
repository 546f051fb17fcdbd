"""One step's model inputs, built with array operations into buffers reused across steps.

From the step's sequences and the runner's block tables (`block_table.py`)::

    seqs      A: 5 new tokens at 0..4   B: 1 token at 37   C: 3 tokens at 16..18
    flat      A0 A1 A2 A3 A4 B0 C0 C1 C2
    positions  0  1  2  3  4 37 16 17 18
    slots     table[row, pos // block_size] * block_size + pos % block_size
    logits    rows of the last new token of each seq with needs_logits

Token ids, positions and slots are written into one staging array that grows
but is never reallocated per step (pinned on CUDA, then copied to the device
without blocking); everything per token is a vectorised numpy expression, so
the cost outside the forward does not grow with Python loops over tokens.
By default every decode of the step reads the pool in place where its blocks
form ranges of at least `IN_PLACE_MIN_RANGE_TOKENS` (in any order); its other
blocks are copied, rows grouped by length (`PagedDecodes`, `_paged_decodes`).
On the ``copy`` path decode sequences are grouped by context length for
attention (see `group_by_length`); a group of one sequence whose blocks fill at
most `IN_PLACE_MAX_RANGES` ranges of consecutive ids in the pool, in any order
(one more per `IN_PLACE_TOKENS_PER_RANGE` of context), is marked to be read in
place (`pool_runs`).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.engine.block_table import BlockTables
from kvduplex.model.attention import AttentionContext
from kvduplex.model.attention import DecodeGroup
from kvduplex.model.attention import PoolRuns
from kvduplex.model.attention import PrefillSpan
from kvduplex.model.cpu_decode import KernelDecodes
from kvduplex.model.cpu_decode import PagedDecodeKernel
from kvduplex.model.cpu_prefill import PrefillKernel
from kvduplex.model.dtypes import dtype_from_name
from kvduplex.model.flex_decode import FlexDecode
from kvduplex.model.paged_decode import GatheredRows
from kvduplex.model.paged_decode import PagedDecodes


@dataclass
class SeqInput:
    """One sequence's share of a step."""

    token_ids: list[int]
    """The new tokens to compute this step (at least one)."""
    start_pos: int
    """Position of token_ids[0], i.e. tokens of this sequence already in the KV cache."""
    block_table: list[int] | None
    """Block ids covering positions [0, start_pos + len(token_ids)), for this call only;
    None: the runner's table of `request_id`, kept across steps."""
    needs_logits: bool
    """Return the logits of the last new token."""
    request_id: str | None = None
    """Whose table the runner holds (with ``block_table=None``)."""


@dataclass(frozen=True)
class StepBatch:
    """The tensors of one forward."""

    input_ids: torch.Tensor  # (num_tokens,)
    positions: torch.Tensor  # (num_tokens,)
    logits_index: torch.Tensor  # (num_logits,)
    ctx: AttentionContext


class InputBuilder:
    """Builds `StepBatch`es for one runner (engine thread only)."""

    def __init__(
        self,
        layout: KVCacheLayout,
        device: torch.device,
        flex: FlexDecode | None = None,
        paged: bool = False,
        kernel: PagedDecodeKernel | None = None,
    ) -> None:
        """With `kernel`, all decodes go to it with their block tables (`KernelDecodes`);
        else with `flex`, decodes attend in place through it; else with `paged`, all decodes
        read the pool in place where their blocks form long ranges (`PagedDecodes`); else
        in groups whose blocks are copied (`DecodeGroup`)."""
        self.block_size = layout.block_size
        self.flex = flex
        self.paged = paged
        self.kernel = kernel
        self.prefill_kernel: PrefillKernel | None = None
        """Every prefill span attends through this CPU kernel (None: SDPA); the runner sets it."""
        self._min_range_blocks = max(1, -(-IN_PLACE_MIN_RANGE_TOKENS // layout.block_size))
        self.device = device
        self._pin = device.type == "cuda"
        self._max_ranges = IN_PLACE_MAX_RANGES if device.type == "cpu" else 1
        self._kv_dtype = dtype_from_name(layout.dtype)
        self._per_block = 2 * layout.block_size * layout.num_kv_heads * layout.head_dim
        self._kv_shape = (layout.block_size, layout.num_kv_heads, layout.head_dim)
        self._stage = torch.empty((3, 0), dtype=torch.int64)  # ids, positions, slots
        self._stage_np: npt.NDArray[np.int64] = self._stage.numpy()
        # Scratch for one layer's decode K/V, reused by every layer and step; grows, never shrinks.
        self._decode_kv = torch.empty(0, dtype=self._kv_dtype, device=device)

    def build(self, seqs: Sequence[SeqInput], keys: Sequence[Hashable], tables: BlockTables) -> StepBatch:
        """The batch of `seqs`, whose tables are ``tables`` rows of `keys`.

        Raises ValueError for a sequence without new tokens, a negative start or a
        table too short for its positions.
        """
        bs = self.block_size
        n = len(seqs)
        lens = np.fromiter((len(s.token_ids) for s in seqs), np.int64, n)
        starts = np.fromiter((s.start_pos for s in seqs), np.int64, n)
        bad = np.flatnonzero((lens == 0) | (starts < 0))
        if bad.size:
            raise ValueError(f"seq {bad[0]}: needs >= 1 new token and start_pos >= 0")
        rows = np.fromiter((tables.row_of(k) for k in keys), np.int64, n)
        ends = starts + lens
        num_blocks = tables.num_blocks[rows]
        short = np.flatnonzero(num_blocks * bs < ends)
        if short.size:
            i = short[0]
            raise ValueError(
                f"seq {i}: block table of {num_blocks[i]} blocks cannot hold {ends[i]} tokens"
            )
        total = int(lens.sum())
        stage = self._staging(total)
        ids, pos, slots = stage[0, :total], stage[1, :total], stage[2, :total]
        first = np.cumsum(lens) - lens  # flat index of each seq's first new token
        if total == n:  # decodes only: one token per seq
            ids[:] = [s.token_ids[0] for s in seqs]
            pos[:] = starts
            token_rows = rows
        else:
            ids[:] = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in seqs), np.int64, total)
            pos[:] = np.arange(total) + np.repeat(starts - first, lens)
            token_rows = np.repeat(rows, lens)
        np.multiply(tables.table[token_rows, pos // bs], bs, out=slots)
        slots += pos % bs
        needs = np.fromiter((s.needs_logits for s in seqs), np.bool_, n)
        logits_index = (first + lens - 1)[needs]

        staged = self._to_device(self._stage[:, :total])
        prefills = [
            PrefillSpan(
                int(first[i]), int(lens[i]), int(starts[i]),
                self._tensor(tables.table[rows[i], : -(-int(ends[i]) // bs)]),
            )
            for i in np.flatnonzero(lens > 1)
        ]  # fmt: skip
        decodes = np.flatnonzero(lens == 1)
        groups: list[DecodeGroup] = []
        flex_batch = None
        paged = None
        kernel_batch = None
        scratch_blocks = 0
        if decodes.size and self.kernel is not None:
            width = -(-int(ends[decodes].max()) // bs)
            kernel_batch = KernelDecodes(
                token_index=self._tensor(first[decodes]),
                tables=self._tensor(tables.table[rows[decodes], :width]),
                lens=self._tensor(ends[decodes]),
                all_tokens=total == n,
            )
        elif decodes.size and self.flex is not None:
            width = -(-int(ends[decodes].max()) // bs)
            flex_batch = self.flex.batch(
                self._tensor(first[decodes]), tables.table[rows[decodes], :width], ends[decodes]
            )
        elif decodes.size and self.paged:
            paged = self._paged_decodes(decodes, first, ends, rows, tables)
            scratch_blocks = max((g.block_index.shape[0] for g in paged.gathered), default=0)
        elif decodes.size:
            groups = self._decode_groups(decodes, first, ends, rows, tables)
            scratch_blocks = max((g.block_index.shape[0] for g in groups if g.in_place is None), default=0)
        ctx = AttentionContext(
            slot_mapping=staged[2],
            block_size=bs,
            prefills=prefills,
            decode_groups=groups,
            decode_kv=self._decode_kv_view(scratch_blocks),
            flex=self.flex,
            flex_batch=flex_batch,
            paged=paged,
            kernel=self.kernel if kernel_batch is not None else None,
            kernel_batch=kernel_batch,
            prefill_kernel=self.prefill_kernel if prefills else None,
        )
        return StepBatch(
            input_ids=staged[0], positions=staged[1], logits_index=self._tensor(logits_index), ctx=ctx
        )

    def _decode_groups(
        self,
        decodes: npt.NDArray[np.intp],
        first: npt.NDArray[np.int64],
        ends: npt.NDArray[np.int64],
        rows: npt.NDArray[np.int64],
        tables: BlockTables,
    ) -> list[DecodeGroup]:
        bs = self.block_size
        ctx_lens = ends[decodes]
        members_of = (
            [list(range(decodes.size))]
            if decodes.size == 1
            else group_by_length(ctx_lens.tolist(), bs)
        )
        groups = []
        for members in members_of:
            m = decodes[members]
            width = -(-int(ends[m].max()) // bs)
            block_index = tables.table[rows[m], :width].reshape(-1)
            runs = None
            if m.size == 1:
                limit = max(1, min(self._max_ranges, int(ends[m[0]]) // IN_PLACE_TOKENS_PER_RANGE))
                runs = pool_runs(block_index, bs, limit)
            groups.append(
                DecodeGroup(
                    token_index=self._tensor(first[m]),
                    block_index=self._tensor(block_index),
                    context_lens=self._tensor(ends[m]),
                    width_blocks=width,
                    in_place=None if runs is None else PoolRuns(runs[0], self._tensor(runs[1])),
                )
            )
        return groups

    def _paged_decodes(
        self,
        decodes: npt.NDArray[np.intp],
        first: npt.NDArray[np.int64],
        ends: npt.NDArray[np.int64],
        rows: npt.NDArray[np.int64],
        tables: BlockTables,
    ) -> PagedDecodes:
        """Split each decode's blocks into long ranges (read in place) and the rest (copied,
        grouped by length); see `PagedDecodes`."""
        bs = self.block_size
        offsets = np.arange(bs)
        ranges: list[tuple[int, int, int]] = []
        range_visible: list[npt.NDArray[np.bool_]] = []
        rest_of: list[npt.NDArray[np.int64]] = []  # per decode: logical indices of its copied blocks
        part_seq: list[int] = []
        for seq, i in enumerate(decodes):
            end = int(ends[i])
            ids = tables.table[rows[i], : -(-end // bs)]
            order = np.argsort(ids, kind="stable")
            sorted_ids = ids[order]
            steps = np.diff(sorted_ids)
            if (steps == 0).any():  # a block twice: copy them all
                rest_of.append(np.arange(ids.size))
                continue
            starts = np.concatenate(([0], np.flatnonzero(steps != 1) + 1))
            sizes = np.diff(np.concatenate((starts, [ids.size])))
            is_long = sizes >= self._min_range_blocks
            for a, m in zip(starts[is_long].tolist(), sizes[is_long].tolist(), strict=True):
                ranges.append((int(first[i]), int(sorted_ids[a]), m))
                part_seq.append(seq)
                range_visible.append((order[a:a + m, None] * bs + offsets).reshape(-1) < end)
            short = np.repeat(~is_long, sizes)  # per sorted block
            rest_of.append(np.sort(order[short]))
        gathered: list[GatheredRows] = []
        with_rest = [seq for seq, rest in enumerate(rest_of) if rest.size]
        if with_rest:
            lens = [int(rest_of[seq].size) * bs for seq in with_rest]
            for members in group_by_length(lens, bs):
                seqs = [with_rest[j] for j in members]
                width = max(rest_of[seq].size for seq in seqs)
                logical = np.full((len(seqs), width), -1, np.int64)
                for r, seq in enumerate(seqs):
                    logical[r, : rest_of[seq].size] = rest_of[seq]
                seq_rows = rows[decodes[seqs]]
                block_index = np.where(
                    logical >= 0, tables.table[seq_rows[:, None], np.maximum(logical, 0)], 0
                )
                positions = (logical[:, :, None] * bs + offsets).reshape(len(seqs), -1)
                visible = (logical.repeat(bs, axis=1) >= 0) & (positions < ends[decodes[seqs]][:, None])
                gathered.append(
                    GatheredRows(
                        rows=self._tensor(np.asarray(seqs, np.int64)),
                        row_tokens=self._tensor(first[decodes[seqs]]),
                        block_index=self._tensor(block_index.reshape(-1)),
                        visible=self._to_device(torch.from_numpy(visible)),
                        width_blocks=width,
                    )
                )
                part_seq.extend(seqs)
        visible_all = np.concatenate(range_visible) if range_visible else np.zeros(0, np.bool_)
        return PagedDecodes(
            token_index=self._tensor(first[decodes]),
            ranges=tuple(ranges),
            range_visible=self._to_device(torch.from_numpy(visible_all)),
            gathered=tuple(gathered),
            part_seq=self._tensor(np.asarray(part_seq, np.int64)),
            part_tokens=self._tensor(first[decodes[part_seq]]),
            single_part=len(part_seq) == decodes.size,
        )

    def _staging(self, num_tokens: int) -> npt.NDArray[np.int64]:
        if self._stage.shape[1] < num_tokens:
            capacity = max(num_tokens, 2 * self._stage.shape[1], 256)
            self._stage = torch.empty((3, capacity), dtype=torch.int64, pin_memory=self._pin)
            self._stage_np = self._stage.numpy()
        return self._stage_np

    def _tensor(self, arr: npt.NDArray[np.int64]) -> torch.Tensor:
        return self._to_device(torch.from_numpy(np.ascontiguousarray(arr)))

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=self._pin)

    def _decode_kv_view(self, num_blocks: int) -> torch.Tensor:
        """A view ``(2, num_blocks, block_size, num_kv_heads, head_dim)`` of the decode K/V scratch."""
        if self._decode_kv.numel() < num_blocks * self._per_block:
            capacity = max(num_blocks, 2 * self._decode_kv.numel() // self._per_block)
            self._decode_kv = torch.empty(
                capacity * self._per_block, dtype=self._kv_dtype, device=self.device
            )
        return self._decode_kv[: num_blocks * self._per_block].view(2, num_blocks, *self._kv_shape)


IN_PLACE_MIN_RANGE_TOKENS = 256
"""`PagedDecodes`: a range of consecutive blocks at least this long (in tokens) is read in
place (one SDPA call); shorter ones are copied with the sequence's other short ones."""
IN_PLACE_MAX_RANGES = 4
"""Most ranges a lone decode is read in place from on CPU (one SDPA each, merged); more
are copied. On other devices only one range: the merge uses a CPU kernel."""
IN_PLACE_TOKENS_PER_RANGE = 512
"""Context a lone decode needs per range beyond the first to be read in place: below it,
an SDPA call per range costs more than the copy saves (`bench_decode_attention.py
--zero-copy`)."""


def pool_runs(
    block_ids: npt.NDArray[np.int64], block_size: int, max_ranges: int
) -> tuple[tuple[tuple[int, int], ...], npt.NDArray[np.int64]] | None:
    """The ranges of consecutive ids that `block_ids` fill, in any order, and the token
    position each slot of them holds (see `PoolRuns`); None for more than `max_ranges`
    ranges or an id that appears twice.

    ::

        block_ids 6 7 8 4 5 | 12    ranges (4, 5) (12, 1)
        positions of the slots of 4, 5, 6, 7, 8, 12: blocks 3, 4, 0, 1, 2, 5 of the sequence
    """
    order = np.argsort(block_ids, kind="stable")
    ids = block_ids[order]
    steps = np.diff(ids)
    if (steps == 0).any():
        return None
    breaks = np.flatnonzero(steps != 1) + 1
    if breaks.size >= max_ranges:
        return None
    starts = np.concatenate(([0], breaks))
    sizes = np.diff(np.concatenate((starts, [ids.size])))
    ranges = tuple((int(ids[a]), int(n)) for a, n in zip(starts, sizes, strict=True))
    positions = (order[:, None] * block_size + np.arange(block_size)).reshape(-1)
    return ranges, positions


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
        width = -(-sorted_lens[j - 1] // block_size) * block_size
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


__all__ = ["GROUP_COST_TOKENS", "IN_PLACE_MAX_RANGES", "IN_PLACE_MIN_RANGE_TOKENS", "IN_PLACE_TOKENS_PER_RANGE", "InputBuilder", "SeqInput", "StepBatch", "group_by_length", "pool_runs"]
