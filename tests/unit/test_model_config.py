"""DecoderConfig.from_hf_config: what each family's config.json turns into, and what is refused."""

from __future__ import annotations

from typing import Any

import pytest

from kvduplex.common.model_config import DecoderConfig
from kvduplex.model.rope import inverse_frequencies

BASE: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
}


def _hf(arch: str, **extra: Any) -> dict[str, Any]:
    return {**BASE, "architectures": [arch], **extra}


def test_llama_transformers4_keys() -> None:
    cfg = DecoderConfig.from_hf_config(_hf(
        "LlamaForCausalLM", rope_theta=500000.0, eos_token_id=[7, 8], bos_token_id=1,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
    ))
    assert cfg.architecture == "llama" and cfg.head_dim == 16 and cfg.num_queries_per_kv == 2
    assert cfg.rope_theta == 500000.0 and cfg.rope_type == "llama3"
    assert cfg.rope_params["original_max_position_embeddings"] == 128
    assert cfg.eos_token_ids == (7, 8) and cfg.bos_token_id == 1
    assert not cfg.attention_bias and not cfg.qk_norm and cfg.sliding_window is None


def test_llama_transformers5_rope_parameters_and_legacy_type_key() -> None:
    new = DecoderConfig.from_hf_config(_hf(
        "LlamaForCausalLM", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}))
    old = DecoderConfig.from_hf_config(_hf(
        "LlamaForCausalLM", rope_theta=1e4, rope_scaling={"type": "linear", "factor": 2.0}))
    assert new == old and new.rope_type == "linear"
    default = DecoderConfig.from_hf_config(_hf("LlamaForCausalLM", rope_theta=1e4))
    assert (inverse_frequencies(new) * 2 - inverse_frequencies(default)).abs().max() < 1e-7
    # llama3 without original_max_position_embeddings falls back to max_position_embeddings
    l3 = DecoderConfig.from_hf_config(_hf("LlamaForCausalLM", rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}))
    assert l3.rope_params["original_max_position_embeddings"] == 512


def test_qwen2_has_qkv_bias_and_window_only_when_enabled() -> None:
    cfg = DecoderConfig.from_hf_config(_hf("Qwen2ForCausalLM", sliding_window=32, use_sliding_window=False))
    assert cfg.attention_bias and not cfg.attention_output_bias
    assert cfg.sliding_window is None
    win = DecoderConfig.from_hf_config(_hf(
        "Qwen2ForCausalLM", sliding_window=32, use_sliding_window=True, max_window_layers=2))
    assert win.sliding_window == 32 and win.sliding_layers == (2, 3)
    assert win.window_of(1) is None and win.window_of(3) == 32


def test_qwen3_qk_norm_and_explicit_head_dim() -> None:
    cfg = DecoderConfig.from_hf_config(_hf("Qwen3ForCausalLM", head_dim=32, tie_word_embeddings=True))
    assert cfg.qk_norm and cfg.head_dim == 32 and cfg.q_size == 128 and cfg.tie_word_embeddings
    assert not cfg.attention_bias


def test_mistral_window_on_every_layer() -> None:
    cfg = DecoderConfig.from_hf_config(_hf("MistralForCausalLM", sliding_window=16, head_dim=None))
    assert cfg.sliding_layers == (0, 1, 2, 3) and cfg.sliding_window == 16 and cfg.head_dim == 16
    full = DecoderConfig.from_hf_config(_hf("MistralForCausalLM", sliding_window=None))
    assert full.sliding_window is None


def test_model_type_without_architectures() -> None:
    cfg = DecoderConfig.from_hf_config({**BASE, "model_type": "qwen3"})
    assert cfg.architecture == "qwen3"


@pytest.mark.parametrize(
    ("hf", "message"),
    [
        (_hf("GPT2LMHeadModel"), "unsupported model"),
        (_hf("LlamaForCausalLM", rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn"),
        (_hf("LlamaForCausalLM", rope_scaling={"rope_type": "linear"}), "missing"),
        (_hf("MistralForCausalLM", num_local_experts=8), "mixture-of-experts"),
        (_hf("LlamaForCausalLM", partial_rotary_factor=0.5), "partial rotary"),
        (_hf("LlamaForCausalLM", num_key_value_heads=3), "multiple of num_kv_heads"),
        (_hf("LlamaForCausalLM", hidden_act="relu2"), "hidden_act"),
    ],
)
def test_unsupported_configs_raise_clear_errors(hf: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DecoderConfig.from_hf_config(hf)


def test_to_json_is_canonical() -> None:
    a = DecoderConfig.from_hf_config(_hf("LlamaForCausalLM"))
    b = DecoderConfig.from_hf_config(dict(reversed(list(_hf("LlamaForCausalLM").items()))))
    assert a.to_json() == b.to_json()
    assert a.kv_bytes_per_token(2) == 2 * 4 * 2 * 16 * 2
