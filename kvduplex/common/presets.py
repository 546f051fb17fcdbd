"""Built-in models that need no files: real architectures, seeded random weights.

=========  ===================================================================
tiny       4 layers, hidden 128, 4 heads / 2 KV heads: a few MB, for tests
small      shaped like SmolLM-135M (30 layers, hidden 576, 9 heads / 3 KV heads)
kv-heavy   16 layers of full MHA with 16 heads x 128 but hidden 512: KV bytes
           per token are large relative to compute (transfer benchmarks)
long       shaped like Llama-3.2-1B at half its depth and a quarter of its width
           (8 layers, hidden 512, 8 heads / 2 KV heads of 64, llama3 RoPE scaled
           from 8k to 128k positions): long agentic contexts on CPU
=========  ===================================================================

All use the built-in byte tokenizer, so their bos/eos ids are its special ids.
This module is plain data, torch-free: the router reads which tokenizer a preset
uses from it. Their weights are drawn by `loader.init_random_weights`.
"""

from __future__ import annotations

from kvduplex.common.model_config import DecoderConfig
from kvduplex.common.tokenizer import ByteTokenizer

_LLAMA3_ROPE: tuple[tuple[str, float], ...] = (
    ("factor", 32.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
    ("original_max_position_embeddings", 8192.0),
)  # fmt: skip
"""Llama 3.2's RoPE scaling: trained at 8k positions, stretched 32x."""


def _preset(**kwargs: object) -> DecoderConfig:
    return DecoderConfig(
        architecture="llama",
        bos_token_id=ByteTokenizer.BOS_ID,
        eos_token_ids=ByteTokenizer.EOS_IDS,
        **kwargs,  # type: ignore[arg-type]
    )


PRESETS: dict[str, DecoderConfig] = {
    "tiny": _preset(
        hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=32, vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=True,
    ),
    "small": _preset(
        hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
        head_dim=64, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    "kv-heavy": _preset(
        hidden_size=512, intermediate_size=1024, num_layers=16, num_heads=16, num_kv_heads=16,
        head_dim=128, vocab_size=32768, max_position_embeddings=8192, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    "long": _preset(
        hidden_size=512, intermediate_size=2048, num_layers=8, num_heads=8, num_kv_heads=2,
        head_dim=64, vocab_size=32768, max_position_embeddings=131072, rope_theta=500000.0,
        rope_type="llama3", rope_scaling=_LLAMA3_ROPE, rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
}


def preset_config(name: str) -> DecoderConfig:
    """The config of preset `name`; ValueError listing the presets otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
