"""Rotary position embeddings, numerically identical to transformers'.

Design note: cos/sin are computed per step from the positions of the step's
tokens (``positions[:, None] * inv_freq`` in float32, like transformers), not
read from a precomputed table, so there is no max-length cache to size and the
result is bit-for-bit what transformers computes. The cost is one small
elementwise op per step, shared by all layers.

Layout is the "rotate half" convention of Llama checkpoints: the first half of
a head is paired with the second half.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvduplex.common.model_config import DecoderConfig


def inverse_frequencies(config: DecoderConfig) -> torch.Tensor:
    """RoPE inverse frequencies ``(head_dim // 2,)`` float32 for the config's rope type."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)  # (head_dim // 2,)
    params = config.rope_params
    if config.rope_type == "linear":
        return inv_freq / params["factor"]
    if config.rope_type == "llama3":
        return _llama3_scale(inv_freq, params)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, params: dict[str, float]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, a smooth ramp between."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Holds the inverse frequencies; `cos_sin` turns positions into rotation tables."""

    inv_freq: torch.Tensor

    def __init__(self, config: DecoderConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        freqs = inverse_frequencies(config)
        self.register_buffer("inv_freq", freqs if device is None else freqs.to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``(num_tokens, 1, head_dim)`` in `dtype` for `positions` ``(num_tokens,)``.

        The trailing singleton broadcasts over heads of ``(num_tokens, heads, head_dim)``.
        """
        freqs = positions[:, None].to(torch.float32) * self.inv_freq.to(torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)  # (num_tokens, head_dim)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` ``(num_tokens, heads, head_dim)`` by the tables from `RotaryEmbedding.cos_sin`.

    transformers computes ``x * cos + cat(-x2, x1) * sin``; both halves of the tables are
    equal, so per half that is ``x1 * cos - x2 * sin`` and ``x2 * cos + x1 * sin``, the
    same roundings (negation is exact), bit for bit. Computed in place over ``x * cos``,
    without the concatenated copy and its temporaries.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    sin_half = sin[..., :half]
    out = x * cos  # (num_tokens, heads, head_dim)
    out[..., :half].sub_(x2 * sin_half)
    out[..., half:].add_(x1 * sin_half)
    return out
