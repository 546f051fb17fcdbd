"""One config-driven decoder for the Llama, Qwen2, Qwen3 and Mistral families.

Pre-norm residual blocks: RMSNorm → attention (fused q/k/v projection,
optional per-head q/k RMSNorm, RoPE, paged KV) → RMSNorm → gated MLP (fused
gate/up projection). Numerics follow transformers: RMSNorm computes in float32
and casts back before the weight; RoPE tables are float32 cast to the model
dtype.

The module holds no KV state: the caller passes the pool and an
`AttentionContext` on every forward, so one model object can serve any number
of pools. Parameter names are ours (fused projections); `hf_weight_target`
maps Hugging Face checkpoint names onto them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvduplex.common.model_config import DecoderConfig
from kvduplex.model.attention import AttentionContext
from kvduplex.model.attention import paged_attention
from kvduplex.model.attention import write_kv
from kvduplex.model.rope import RotaryEmbedding
from kvduplex.model.rope import apply_rotary

_ACT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


_Device = torch.device | str | None


class Linear(nn.Module):
    """``x @ weight.T + bias``; parameters are allocated, not initialised (loaders fill them)."""

    bias: nn.Parameter | None
    packed: torch.Tensor | None
    """The weight packed for oneDNN (`pack_for_onednn`), used for inputs of two or more rows."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: _Device
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        self.packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)

    def store_transposed(self) -> None:
        """Keep the weight's shape ``(out, in)`` but store it column-major, so that
        ``F.linear`` multiplies by a row-major ``(in, out)`` matrix: on CPU, MKL's
        sgemm for a few rows (a decode batch) runs faster that way."""
        if self.weight.is_contiguous():
            self.weight.data = self.weight.data.t().contiguous().t()

    def pack_for_onednn(self) -> None:
        """Also keep the weight packed for oneDNN's matmul (`pack_for_onednn`)."""
        self.packed = pack_for_onednn(self.weight)


def can_pack_for_onednn(weight: torch.Tensor) -> bool:
    """Whether `pack_for_onednn` applies: a float32 CPU matrix and a PyTorch built with oneDNN."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_for_onednn(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ``(out, in)`` reordered into oneDNN's blocked layout for matmuls of a few to
    many rows (a copy: the plain weight stays for single rows).

    Why: on CPU, MKL's sgemm on a plain weight slows down with every row added to a decode
    batch although the weight is read once; oneDNN on a pre-packed weight stays near the
    weight-streaming time but is slower for a single row, where MKL's gemv on the plain
    weight is fastest (figures in docs/hot_path.md). vLLM's CPU backend packs the same way
    (oneDNN with a 32-row hint).
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _ONEDNN_ROWS_HINT)


_ONEDNN_ROWS_HINT = 32
ONEDNN_MAX_ROWS = 64
"""Inputs of up to this many rows (decode batches) go to oneDNN whole; larger ones (prefill
chunks) in tiles (`onednn_linear_tiled`)."""
PREFILL_TILE_ROWS = 256
"""Rows per oneDNN call for a prefill chunk: oneDNN keeps a primitive (and its buffers, which
grow with the rows) per distinct row count, so a chunk of any length is cut into tiles of
this size and a last tile padded to a multiple of `ONEDNN_MAX_ROWS`: a handful of row counts
per weight shape, whatever the prompts' lengths."""


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
) -> torch.Tensor:
    """``x @ weight.T + bias``: on the oneDNN-packed copy for two rows or more when there is
    one (in tiles past `ONEDNN_MAX_ROWS`), else `F.linear` on the plain weight."""
    if packed is None or x.dim() != 2 or x.shape[0] < 2 or torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    if x.shape[0] <= ONEDNN_MAX_ROWS:
        return _onednn_linear(x, packed, bias)
    return onednn_linear_tiled(x, packed, bias)


def _onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def onednn_linear_tiled(
    x: torch.Tensor,  # (num_rows, in_features)
    packed: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:  # (num_rows, out_features)
    """`x` times the packed weight, `PREFILL_TILE_ROWS` rows per oneDNN call::

        rows  |<- 256 ->|<- 256 ->| ... |<- r ->|0 ... 0|   last tile: r rows, zero-padded
                                                          to a multiple of 64 when r > 64

    Each row's result does not depend on the rows beside it; padding rows are dropped.
    """
    num_rows = x.shape[0]
    out: torch.Tensor | None = None  # (num_rows, out_features): one tile's result at a time beside it
    for start in range(0, num_rows, PREFILL_TILE_ROWS):
        tile = x[start : start + PREFILL_TILE_ROWS]
        n = tile.shape[0]
        if n == PREFILL_TILE_ROWS or n <= ONEDNN_MAX_ROWS:
            result = _onednn_linear(tile, packed, bias)
        else:
            padded = x.new_zeros(-(-n // ONEDNN_MAX_ROWS) * ONEDNN_MAX_ROWS, x.shape[1])
            padded[:n] = tile
            result = _onednn_linear(padded, packed, bias)[:n]
        if n == num_rows:
            return result
        if out is None:
            out = result.new_empty(num_rows, result.shape[1])
        out[start : start + n] = result
    assert out is not None
    return out


class Embedding(nn.Module):
    """Token embedding table, allocated uninitialised."""

    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype, device: _Device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim, dtype=dtype, device=device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm as in transformers: normalise in float32, cast back, then scale."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: _Device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        # transformers' ops in its order, the result written over the squares' buffer and
        # scaled in place (the product commutes): one fresh tensor where it allocates three.
        buf = h.pow(2)
        variance = buf.mean(-1, keepdim=True)
        h = torch.mul(h, torch.rsqrt(variance + self.eps), out=buf)
        return h.to(dtype).mul_(self.weight)


class Attention(nn.Module):
    """Self-attention of one layer over the paged KV cache."""

    def __init__(self, config: DecoderConfig, layer: int, dtype: torch.dtype, device: _Device) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.scale = config.head_dim**-0.5
        self.window = config.window_of(layer)
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, config.attention_bias, dtype, device
        )
        self.o_proj = Linear(
            self.q_size, config.hidden_size, config.attention_output_bias, dtype, device
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)

    def forward(
        self,
        x: torch.Tensor,  # (num_tokens, hidden_size)
        cos: torch.Tensor,  # (num_tokens, 1, head_dim)
        sin: torch.Tensor,  # (num_tokens, 1, head_dim)
        layer_pool: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
        ctx: AttentionContext,
        on_kv_written: Callable[[int], None] | None,
    ) -> torch.Tensor:  # (num_tokens, hidden_size)
        n = x.shape[0]
        qkv = self.qkv_proj(x)  # (num_tokens, q_size + 2 * kv_size)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        write_kv(layer_pool, k, v, ctx.slot_mapping)
        if on_kv_written is not None:
            on_kv_written(self.layer)
        o = paged_attention(q, k, v, layer_pool, ctx, self.scale, self.window)
        return self.o_proj(o.reshape(n, self.q_size))


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)) with gate and up fused."""

    def __init__(self, config: DecoderConfig, dtype: torch.dtype, device: _Device) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(
            config.hidden_size, 2 * config.intermediate_size, config.mlp_bias, dtype, device
        )
        self.down_proj = Linear(
            config.intermediate_size, config.hidden_size, config.mlp_bias, dtype, device
        )
        self.act = _ACT[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        if torch.is_grad_enabled() or self.act is not F.silu:
            return self.down_proj(self.act(gate) * up)
        # In place over the projection's output: the same values without two fresh
        # (num_tokens, intermediate) tensors, whose first touch costs more than the math
        # at prefill sizes on CPU.
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig, layer: int, dtype: torch.dtype, device: _Device) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.self_attn = Attention(config, layer, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.mlp = MLP(config, dtype, device)

    def forward(
        self,
        x: torch.Tensor,  # (num_tokens, hidden_size)
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_pool: torch.Tensor,
        ctx: AttentionContext,
        on_kv_written: Callable[[int], None] | None,
    ) -> torch.Tensor:  # (num_tokens, hidden_size)
        # Residual adds in place over the sublayers' fresh outputs (the sum commutes).
        h = self.self_attn(self.input_layernorm(x), cos, sin, layer_pool, ctx, on_kv_written).add_(x)
        return self.mlp(self.post_attention_layernorm(h)).add_(h)


class DecoderForCausalLM(nn.Module):
    """The whole model: embeddings, layers, final norm, output projection.

    Matrices are allocated uninitialised on `device` in `dtype` (norm weights
    are ones); fill them with a loader or `init_random_weights`.
    """

    def __init__(
        self, config: DecoderConfig, dtype: torch.dtype = torch.float32, device: _Device = None
    ) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, dtype, device) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.rotary = RotaryEmbedding(config, device)
        self.lm_head: Linear | None = None
        self.tied_head_packed: torch.Tensor | None = None
        """The tied head (the embedding matrix) packed for oneDNN (`pack_for_onednn`)."""
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype, device)

    def forward(
        self,
        input_ids: torch.Tensor,  # (num_tokens,)
        positions: torch.Tensor,  # (num_tokens,)
        kv_pool: torch.Tensor,  # (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        ctx: AttentionContext,
        on_layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:  # (num_tokens, hidden_size), before the final norm
        """Run all layers; K/V of the new tokens land in `kv_pool` at `ctx.slot_mapping`.

        `on_layer_done(layer)` is called once per layer, in order, as soon as
        that layer's K and V for every token of the batch are in the pool
        (before its attention output is computed).
        """
        h = self.embed_tokens(input_ids)  # (num_tokens, hidden_size)
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, kv_pool[i], ctx, on_layer_done)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``(rows, vocab_size)`` in the model's dtype of hidden states ``(rows, hidden_size)``.

        Callers upcast only what needs it (a sampled row); a large vocabulary's
        logits are not copied to float32 for a greedy pick.
        """
        h = self.norm(hidden)
        if self.lm_head is not None:
            return self.lm_head(h)
        return linear(h, self.embed_tokens.weight, None, self.tied_head_packed)


def hf_weight_target(name: str, config: DecoderConfig) -> tuple[str, int | None] | None:
    """Where a Hugging Face checkpoint tensor goes: (our parameter name, fused shard) or None to skip.

    The shard is the row block of a fused parameter: for ``qkv_proj`` 0/1/2 are
    q/k/v, for ``gate_up_proj`` 0/1 are gate/up; None means the whole tensor.
    Raises ValueError for a name that belongs to no supported parameter.
    """
    if name.startswith("model."):
        name = name[len("model."):]
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name == "lm_head.weight":
        return (None if config.tie_word_embeddings else ("lm_head.weight", None))
    fused = {
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }
    for old, (new, shard) in fused.items():
        if old in name:
            return name.replace(old, new), shard
    return name, None


def fused_shard_rows(param_name: str, shard: int, config: DecoderConfig) -> tuple[int, int]:
    """Row range ``[start, end)`` of `shard` inside fused parameter `param_name`."""
    if ".qkv_proj." in param_name:
        sizes = [config.q_size, config.kv_size, config.kv_size]
    elif ".gate_up_proj." in param_name:
        sizes = [config.intermediate_size, config.intermediate_size]
    else:
        raise ValueError(f"{param_name} is not a fused parameter")
    start = sum(sizes[:shard])
    return start, start + sizes[shard]
