"""The architecture of one decoder-only model, independent of where its weights come from.

`DecoderConfig` is what the decoder module, the loader, the KV pool and the
prefix-cache identity all read. It is built either by a built-in preset or from
a Hugging Face ``config.json`` (`DecoderConfig.from_hf_config`), which accepts
both the transformers-4 keys (``rope_theta``/``rope_scaling``) and the
transformers-5 key (``rope_parameters``).

Supported families and what distinguishes them:

=========  ==========================================================
llama      plain; optional attention/MLP bias; rope default/linear/llama3
qwen2      q/k/v bias (no o_proj bias); optional sliding window on upper layers
qwen3      per-head RMSNorm on q and k; explicit head_dim; optional sliding window
mistral    sliding window on every layer (a mask; see `sliding_window`)
=========  ==========================================================

Sliding windows are implemented as an attention mask: a query at position p
sees keys at positions in ``(p - sliding_window, p]``, exactly as transformers
does. Blocks that fall out of the window are still kept in the KV cache (no
memory saving), so results are exact for any context length.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
from typing import Any

_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
}
_MODEL_TYPES = frozenset(_ARCHITECTURES.values())
_ROPE_TYPES = frozenset({"default", "linear", "llama3"})
_ACTIVATIONS = frozenset({"silu", "gelu", "gelu_pytorch_tanh"})


@dataclass(frozen=True)
class DecoderConfig:
    """Shape and numerics of a Llama-style decoder (pre-norm, RoPE, gated MLP, GQA)."""

    architecture: str
    """Model family: llama, qwen2, qwen3 or mistral."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the gated MLP."""
    num_layers: int
    """Decoder layers."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA when fewer than num_heads)."""
    head_dim: int
    """Dimension of one attention head."""
    vocab_size: int
    """Rows of the embedding and of the output projection."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: tuple[tuple[str, float], ...] = ()
    """RoPE scaling parameters as sorted (key, value) pairs; empty = plain RoPE.

    Keys: ``rope_type`` is encoded as the `rope_type` field; the rest are
    ``factor`` (linear, llama3) and ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings`` (llama3).
    """
    rope_type: str = "default"
    """default, linear or llama3."""
    max_position_embeddings: int = 4096
    """Longest context the model was built for."""
    tie_word_embeddings: bool = False
    """The output projection reuses the embedding matrix."""
    attention_bias: bool = False
    """q/k/v projections have a bias."""
    attention_output_bias: bool = False
    """o_proj has a bias."""
    mlp_bias: bool = False
    """gate/up/down projections have a bias."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3)."""
    hidden_act: str = "silu"
    """Activation of the gated MLP."""
    sliding_window: int | None = None
    """Attention window of the layers in `sliding_layers`; None = full attention everywhere."""
    sliding_layers: tuple[int, ...] = ()
    """Indices of the layers that use `sliding_window`."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token of the model, if any."""
    eos_token_ids: tuple[int, ...] = field(default=())
    """End-of-sequence tokens of the model (config.json, possibly several)."""

    def __post_init__(self) -> None:
        if self.architecture not in _MODEL_TYPES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {sorted(_MODEL_TYPES)}"
            )
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "vocab_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"DecoderConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_type not in _ROPE_TYPES:
            raise ValueError(
                f"unsupported rope type {self.rope_type!r}; supported: {sorted(_ROPE_TYPES)}"
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {self.hidden_act!r}; supported: {sorted(_ACTIVATIONS)}"
            )
        if (self.sliding_window is None) != (not self.sliding_layers):
            raise ValueError("set sliding_window and sliding_layers together (or neither)")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if any(not 0 <= i < self.num_layers for i in self.sliding_layers):
            raise ValueError(f"sliding_layers must be in [0, {self.num_layers}), got {self.sliding_layers}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_params(self) -> dict[str, float]:
        return dict(self.rope_scaling)

    def window_of(self, layer: int) -> int | None:
        """The attention window of `layer`, or None for full attention."""
        return self.sliding_window if layer in self.sliding_layers else None

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes of K and V of one token over all layers."""
        return 2 * self.num_layers * self.kv_size * itemsize

    def to_json(self) -> str:
        """Canonical JSON (sorted keys): equal configs give equal strings."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> DecoderConfig:
        """Build from the dict of a Hugging Face ``config.json``.

        Raises ValueError naming the unsupported architecture or feature (rope
        types other than default/linear/llama3, partial rotary embeddings,
        unknown activations, mixture-of-experts keys).
        """
        arch = _architecture_of(hf)
        for key in ("num_experts", "num_local_experts", "n_routed_experts"):
            if hf.get(key):
                raise ValueError(f"mixture-of-experts models ({key}={hf[key]}) are not supported")
        if hf.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
        hidden = int(hf["hidden_size"])
        num_heads = int(hf["num_attention_heads"])
        num_layers = int(hf["num_hidden_layers"])
        head_dim = hf.get("head_dim") or hidden // num_heads
        max_pos = int(hf.get("max_position_embeddings", 4096))
        rope_theta, rope_type, rope_scaling = _rope_of(hf, max_pos)
        if arch == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(hf.get("attention_bias", False))
        window, sliding_layers = _sliding_of(hf, arch, num_layers)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (
            () if eos is None else (int(eos),))
        bos = hf.get("bos_token_id")
        return cls(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            vocab_size=int(hf["vocab_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_type=rope_type,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            attention_output_bias=o_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=arch == "qwen3",
            hidden_act=str(hf.get("hidden_act", "silu")),
            sliding_window=window,
            sliding_layers=sliding_layers,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
        )


def _architecture_of(hf: Mapping[str, Any]) -> str:
    archs = hf.get("architectures") or []
    for name in archs:
        if name in _ARCHITECTURES:
            return _ARCHITECTURES[name]
    model_type = hf.get("model_type")
    if not archs and model_type in _MODEL_TYPES:
        return str(model_type)
    raise ValueError(
        f"unsupported model (architectures={archs}, model_type={model_type!r}); "
        f"supported architectures: {sorted(_ARCHITECTURES)}"
    )


def _rope_of(hf: Mapping[str, Any], max_pos: int) -> tuple[float, str, tuple[tuple[str, float], ...]]:
    """(theta, rope type, scaling params) from either config generation."""
    params: dict[str, Any] = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type RoPE parameters are not supported")
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = str(params.pop("rope_type", params.pop("type", "default")))
    params.pop("type", None)
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_scaling type {rope_type!r}; supported: {sorted(_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, rope_type, ()
    needed = ("factor",) if rope_type == "linear" else (
        "factor", "low_freq_factor", "high_freq_factor")
    missing = [k for k in needed if k not in params]
    if missing:
        raise ValueError(f"rope_scaling of type {rope_type} is missing {missing}")
    kept = {k: float(params[k]) for k in needed}
    if rope_type == "llama3":
        original = hf.get("original_max_position_embeddings") or params.get(
            "original_max_position_embeddings", max_pos)
        kept["original_max_position_embeddings"] = float(original)
    return theta, rope_type, tuple(sorted(kept.items()))


def _sliding_of(hf: Mapping[str, Any], arch: str, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """The window and the layers using it, following transformers' per-family rules."""
    window = hf.get("sliding_window")
    if window is None:
        return None, ()
    if arch == "llama":
        return None, ()
    if arch == "mistral":
        layers = tuple(range(num_layers))
    else:
        layer_types = hf.get("layer_types")
        if layer_types is not None:
            if len(layer_types) != num_layers:
                raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
            unknown = set(layer_types) - {"full_attention", "sliding_attention"}
            if unknown:
                raise ValueError(f"unsupported layer types {sorted(unknown)}")
            layers = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
        elif hf.get("use_sliding_window", False):
            first = int(hf.get("max_window_layers", num_layers))
            layers = tuple(range(first, num_layers))
        else:
            layers = ()
        if not hf.get("use_sliding_window", False):
            layers = ()
    if not layers:
        return None, ()
    return int(window), layers
