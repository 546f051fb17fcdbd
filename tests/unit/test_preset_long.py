"""The `long` preset against transformers: its config, RoPE at long positions, and a short
prompt run at position 32,000 over 32,000 tokens of cached context.

transformers' Llama gets the preset's own seeded weights (copied through the loader's
name mapping). The cached context is random K/V written into both caches alike (our
paged pool through a block table, transformers' DynamicCache), so that the prompt's
attention over it, and RoPE at those positions, decide the logits.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.common.model_config import DecoderConfig
from kvduplex.common.presets import PRESETS
from kvduplex.engine.kv_cache import allocate_kv_pool
from kvduplex.engine.runner import ModelRunner
from kvduplex.engine.runner import SeqInput
from kvduplex.engine.runner import kv_layout_for
from kvduplex.model.decoder import fused_shard_rows
from kvduplex.model.decoder import hf_weight_target
from kvduplex.model.loader import LoadedModel
from kvduplex.model.loader import load_model
from kvduplex.model.rope import RotaryEmbedding

transformers = pytest.importorskip("transformers")

CONTEXT = 32_000
"""Positions of cached context before the prompt."""
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33]
NEW_TOKENS = 4
BLOCK_SIZE = 16


def _hf_config(cfg: DecoderConfig) -> Any:
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
        rope_scaling={"rope_type": cfg.rope_type, **cfg.rope_params},
        tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=cfg.bos_token_id,
        eos_token_id=list(cfg.eos_token_ids),
    )  # fmt: skip


@pytest.fixture(scope="module")
def ours() -> LoadedModel:
    return load_model(ModelLoadConfig(model="long", seed=0, dtype="float32", device="cpu"))


@pytest.fixture(scope="module")
def hf(ours: LoadedModel) -> Any:
    """transformers' Llama holding the preset's weights."""
    model = transformers.LlamaForCausalLM(_hf_config(ours.config)).eval()
    params = dict(ours.model.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            target = hf_weight_target(name, ours.config)
            assert target is not None, name
            src: torch.Tensor = params[target[0]]
            if target[1] is not None:
                start, end = fused_shard_rows(target[0], target[1], ours.config)
                src = src[start:end]
            param.copy_(src)
    return model


def test_the_preset_is_llama_3_2_shaped_with_128k_positions() -> None:
    cfg = PRESETS["long"]
    assert cfg.architecture == "llama" and cfg.max_position_embeddings == 131072
    assert (cfg.rope_type, cfg.rope_params["factor"]) == ("llama3", 32.0)
    assert cfg.rope_params["original_max_position_embeddings"] == 8192
    assert cfg.num_queries_per_kv == 4 and cfg.head_dim == 64
    assert cfg.kv_bytes_per_token(4) == 8 * 2 * 2 * 64 * 4  # 8 KiB per token in float32
    # the config transformers reads back from the preset's HF form is the preset
    back = DecoderConfig.from_hf_config(_hf_config(cfg).to_dict() | {"architectures": ["LlamaForCausalLM"]})
    assert back == cfg


def test_rope_matches_transformers_up_to_the_last_position() -> None:
    cfg = PRESETS["long"]
    positions = torch.tensor([0, 1, 4095, 8191, 8192, 32000, 32767, 65536, 131071])
    cos, sin = RotaryEmbedding(cfg).cos_sin(positions, torch.float32)  # (n, 1, head_dim)
    hf_rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(_hf_config(cfg))
    x = torch.zeros(1, len(positions), cfg.head_dim)
    ref_cos, ref_sin = hf_rope(x, positions[None, :])  # (1, n, head_dim)
    torch.testing.assert_close(cos[:, 0], ref_cos[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sin[:, 0], ref_sin[0], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_a_short_prompt_at_32k_positions_matches_transformers(ours: LoadedModel, hf: Any) -> None:
    cfg = ours.config
    num_blocks = -(-(CONTEXT + len(PROMPT) + NEW_TOKENS) // BLOCK_SIZE)
    layout = kv_layout_for(cfg, BLOCK_SIZE, num_blocks, ours.dtype)
    runner = ModelRunner(ours.model, cfg, allocate_kv_pool(layout), layout, ours.device)
    table = list(range(num_blocks))
    gen = torch.Generator().manual_seed(5)
    cache = transformers.DynamicCache()
    for layer in range(cfg.num_layers):
        kv = torch.randn(2, cfg.num_kv_heads, CONTEXT, cfg.head_dim, generator=gen)
        cache.update(kv[0][None], kv[1][None], layer)  # (1, heads, CONTEXT, head_dim)
        slots = runner.kv_pool[layer].view(2, num_blocks * BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
        slots[:, :CONTEXT] = kv.transpose(1, 2)  # (2, CONTEXT, heads, head_dim)

    with torch.no_grad():
        positions = torch.arange(CONTEXT, CONTEXT + len(PROMPT))[None, :]
        out = hf(torch.tensor([PROMPT]), position_ids=positions, cache=cache, use_cache=True)
    ref = out.logits[0].float()  # (len(PROMPT), vocab)
    got = runner.execute([SeqInput(list(PROMPT), CONTEXT, table, True)])[0]
    torch.testing.assert_close(got, ref[-1], atol=1e-4, rtol=1e-4)

    expected, tokens = [int(ref[-1].argmax())], [int(got.argmax())]
    pos = CONTEXT + len(PROMPT)
    while len(expected) < NEW_TOKENS:
        with torch.no_grad():
            step = hf(torch.tensor([[expected[-1]]]), position_ids=torch.tensor([[pos]]),
                      cache=cache, use_cache=True)  # fmt: skip
        expected.append(int(step.logits[0, -1].argmax()))
        logits = runner.execute([SeqInput([tokens[-1]], pos, table, True)])[0]
        tokens.append(int(logits.argmax()))
        pos += 1
    assert tokens == expected
