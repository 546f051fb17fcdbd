"""The model runner: one batched forward pass over the paged KV cache per engine step.

The engine hands `ModelRunner.execute` plain per-sequence inputs (`SeqInput`);
the runner flattens them into one batch (prefill chunks and decodes mixed,
see `runner_inputs`), runs the decoder, and returns the logits (in the
model's dtype) of the rows that asked for them. Layer by layer it reports,
through ``on_layer_done``, when that layer's KV for the whole step is in the
pool: the layer-wise KV push hooks in there.

The runner keeps each running request's block table across steps
(`BlockTables`): the engine appends the ids a step adds (`update_table`) and
drops the tables of requests that stopped running (`drop_tables`), so a
decode step moves no tables at all. A `SeqInput` may instead carry a whole
table for one call (tests, one-off forwards).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Iterable

import torch

from kvduplex.common.engine_config import DecodeAttention
from kvduplex.common.engine_config import PrefillAttention
from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.common.model_config import DecoderConfig
from kvduplex.engine.block_table import BlockTables
from kvduplex.engine.runner_inputs import GROUP_COST_TOKENS
from kvduplex.engine.runner_inputs import InputBuilder
from kvduplex.engine.runner_inputs import SeqInput
from kvduplex.engine.runner_inputs import group_by_length
from kvduplex.model import cpu_decode
from kvduplex.model import cpu_prefill
from kvduplex.model.cpu_build import has_avx512
from kvduplex.model.decoder import DecoderForCausalLM
from kvduplex.model.dtypes import dtype_from_name
from kvduplex.model.flex_decode import FlexDecode

logger = logging.getLogger(__name__)


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


class ModelRunner:
    """Runs `model` over `kv_pool`; owned and called by the engine thread only.

    The pool is passed in (allocated by the engine, registered with the
    transport) and written in place. Per request the runner keeps only its
    block table.
    """

    def __init__(
        self,
        model: DecoderForCausalLM,
        config: DecoderConfig,
        kv_pool: torch.Tensor,  # (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        layout: KVCacheLayout,
        device: torch.device | str,
        decode_attention: str = "auto",
        prefill_attention: str = "auto",
    ) -> None:
        """ValueError if the pool does not match `layout`, or `layout` does not fit `config`.

        `decode_attention`: a `DecodeAttention` name (see `set_decode_attention`);
        `prefill_attention`: a `PrefillAttention` name (see `set_prefill_attention`).
        """
        expected = kv_layout_for(config, layout.block_size, layout.num_blocks, layout.dtype)
        if expected != layout:
            raise ValueError(f"KV layout does not fit the model: {expected.incompatibility(layout)}")
        if tuple(kv_pool.shape) != layout.shape or kv_pool.dtype != dtype_from_name(layout.dtype):
            raise ValueError(
                f"KV pool is {tuple(kv_pool.shape)} {kv_pool.dtype}, layout wants "
                f"{layout.shape} {dtype_from_name(layout.dtype)}"
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
        self.tables = BlockTables(layout.num_blocks)
        self.decode_attention = ""
        self.inputs = InputBuilder(layout, self.device)
        self._builders: dict[str, InputBuilder] = {}  # by decode attention path, kept when switching
        self.prefill_attention = ""
        self._prefill_kernel: cpu_prefill.PrefillKernel | None = None
        self.set_decode_attention(decode_attention)
        self.set_prefill_attention(prefill_attention)

    def set_prefill_attention(self, name: str) -> None:
        """Switch the prefill attention path (between steps); ValueError for an unknown name,
        or for ``kernel`` where it does not apply or cannot be built.

        ``kernel``: a compiled CPU kernel reading each chunk's keys in place through its block
        table (`cpu_prefill.py`); ``sdpa``: torch's SDPA over copies (`prefill_attention.py`);
        ``auto``: ``kernel`` on a CPU with AVX-512 where it applies and builds, else ``sdpa``. `prefill_attention`
        holds the path taken.
        """
        try:
            choice = PrefillAttention(name)
        except ValueError:
            choices = ", ".join(m.value for m in PrefillAttention)
            raise ValueError(f"prefill_attention must be one of {choices}, got {name!r}") from None
        kernel = None
        # auto: only where the kernel was measured faster than SDPA, on AVX-512 (its 16-float
        # vectors are one register there; elsewhere two, and its micro-tiles would spill)
        if choice is PrefillAttention.KERNEL or (choice is PrefillAttention.AUTO and has_avx512()):
            cfg = self.config
            if cpu_prefill.supports(cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, self.kv_pool.dtype, self.device):
                kernel = cpu_prefill.load_kernel(cfg.head_dim, cfg.num_heads // cfg.num_kv_heads)
            if kernel is None and choice is PrefillAttention.KERNEL:
                raise ValueError(
                    "prefill attention 'kernel' needs a float32 pool on CPU, a head size that is a "
                    f"multiple of 8 up to {cpu_prefill.MAX_HEAD_DIM}, at most {cpu_prefill.MAX_GROUP} "
                    "query heads per KV head and a C compiler (see the log): use --prefill-attention auto"
                )
        self._prefill_kernel = kernel
        for builder in self._builders.values():
            builder.prefill_kernel = kernel
        self.prefill_attention = (PrefillAttention.KERNEL if kernel is not None else PrefillAttention.SDPA).value

    def set_decode_attention(self, name: str) -> None:
        """Switch the decode attention path (between steps); ValueError for an unknown name,
        or for ``paged`` on a model with sliding-window layers.

        ``paged``: every decode reads the pool in place where its blocks form long ranges,
        the rest copied, partials merged by log-sum-exp (`PagedDecodes`); ``copy``: decodes
        grouped by length, their blocks copied into a scratch buffer, one SDPA per group
        (a lone decode over a few ranges in place), the path before ``paged``; ``flex``:
        one compiled FlexAttention call reading the pool in place; ``kernel``: a compiled
        CPU kernel walking each decode's block table (`cpu_decode.py`; ValueError where it
        does not apply or cannot be built); ``auto`` (or its old name ``sdpa``):
        ``kernel`` where it applies and builds and torch runs one thread (split over two
        threads it did not beat ``paged`` at every batch, hot_path.md section 9), else
        ``paged``, or ``copy`` for a model with
        sliding-window layers (which also use ``copy`` for ``flex``). `decode_attention`
        holds the path taken.
        """
        choice = DecodeAttention.parse(name)
        windowed = any(self.config.window_of(i) is not None for i in range(self.config.num_layers))
        if choice is DecodeAttention.PAGED and windowed:
            raise ValueError(
                "decode attention 'paged' reads whole sequences and this model has sliding-window "
                "layers: use --decode-attention auto or copy"
            )
        kernel = None
        if choice is DecodeAttention.KERNEL:
            kernel = self._decode_kernel()
            if kernel is None:
                raise ValueError(
                    "decode attention 'kernel' needs a float32 pool on CPU, a head size that is a "
                    f"multiple of {cpu_decode.LANES} and a C compiler (see the log): use "
                    "--decode-attention auto"
                )
        elif choice is DecodeAttention.AUTO and torch.get_num_threads() == 1:
            kernel = self._decode_kernel()
            if kernel is not None:
                choice = DecodeAttention.KERNEL
        if choice is DecodeAttention.AUTO:
            choice = DecodeAttention.COPY if windowed else DecodeAttention.PAGED
        elif choice is DecodeAttention.FLEX and windowed:
            logger.warning("sliding-window layers: decode attention copies (flex asked)")
            choice = DecodeAttention.COPY
        path = choice.value
        if path not in self._builders:
            flex = None
            if choice is DecodeAttention.FLEX:
                flex = FlexDecode(self.layout.num_blocks, self.layout.block_size, self.device)
            paged = choice is DecodeAttention.PAGED
            self._builders[path] = InputBuilder(self.layout, self.device, flex, paged=paged, kernel=kernel)
            self._builders[path].prefill_kernel = self._prefill_kernel
        self.decode_attention = path
        self.inputs = self._builders[path]

    def _decode_kernel(self) -> cpu_decode.PagedDecodeKernel | None:
        """The CPU decode kernel for this model and pool; None where it does not apply or
        cannot be built."""
        cfg = self.config
        if not cpu_decode.supports(cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, self.kv_pool.dtype, self.device):
            return None
        return cpu_decode.load_kernel(cfg.head_dim, cfg.num_heads // cfg.num_kv_heads)

    # ---- block tables ----

    def update_table(self, request_id: str, new_block_ids: list[int], replace: bool) -> None:
        """Append `new_block_ids` to the request's table, or start it over with them
        (`replace`). ValueError for ids outside the pool, KeyError when appending to a
        table the runner does not hold."""
        if replace:
            self.tables.set(request_id, new_block_ids)
        else:
            self.tables.extend(request_id, new_block_ids)

    def drop_tables(self, request_ids: Iterable[str]) -> None:
        """Forget the tables of requests that stopped running (unknown ids are ignored)."""
        for rid in request_ids:
            self.tables.drop(rid)

    def has_table(self, request_id: str) -> bool:
        return request_id in self.tables

    # ---- forward ----

    @torch.inference_mode()
    def execute(
        self, seqs: list[SeqInput], on_layer_done: Callable[[int], None] | None = None
    ) -> torch.Tensor:  # (num seqs with needs_logits, vocab_size), the model's dtype
        """Compute one step; write the new tokens' KV into the pool; return the asked-for logits.

        Rows follow the order of `seqs` (only those with needs_logits).
        `on_layer_done(layer)` runs on this thread once per layer, in order,
        right after that layer's K and V for all `seqs` are in the pool (on
        CUDA the stream is synchronised first, so the bytes are really there).
        Raises ValueError for malformed inputs (no tokens, a block table too
        short for the positions, block ids out of the pool, a request whose
        table the runner does not hold).
        """
        if not seqs:
            return torch.empty(0, self.config.vocab_size, dtype=self.kv_pool.dtype, device=self.device)
        keys: list[Hashable] = []
        one_off: list[Hashable] = []
        try:
            for i, seq in enumerate(seqs):
                if seq.block_table is not None:
                    key: Hashable = (None, i)  # never a request id (those are str)
                    self.tables.set(key, seq.block_table)
                    one_off.append(key)
                elif seq.request_id is None or seq.request_id not in self.tables:
                    raise ValueError(f"seq {i}: no block table given and none held for {seq.request_id!r}")
                else:
                    key = seq.request_id
                keys.append(key)
            batch = self.inputs.build(seqs, keys, self.tables)
        finally:
            for key in one_off:
                self.tables.drop(key)
        hook = on_layer_done
        if on_layer_done is not None and self.device.type == "cuda":
            device = self.device

            def hook(layer: int) -> None:
                torch.cuda.current_stream(device).synchronize()
                on_layer_done(layer)

        hidden = self.model(batch.input_ids, batch.positions, self.kv_pool, batch.ctx, hook)
        return self.model.compute_logits(hidden[batch.logits_index])


__all__ = [
    "GROUP_COST_TOKENS",
    "ModelRunner",
    "SeqInput",
    "group_by_length",
    "kv_layout_for",
    "num_blocks_for_memory",
]
