"""Presets and the loader: shapes, determinism, identity, dtype/device rules, folder errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.common.presets import PRESETS
from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.model.decoder import DecoderForCausalLM
from kvduplex.model.loader import count_parameters
from kvduplex.model.loader import load_model
from kvduplex.model.loader import resolve_dtype

CHECKSUM = (
    "import torch, hashlib;"
    "from kvduplex.common.engine_config import ModelLoadConfig;"
    "from kvduplex.model.loader import load_model;"
    "m = load_model(ModelLoadConfig(model='tiny', seed=7)).model;"
    "h = hashlib.sha256();"
    "[h.update(p.detach().numpy().tobytes()) for p in m.parameters()];"
    "print(h.hexdigest())"
)


def _params_on_meta(name: str) -> int:
    return count_parameters(DecoderForCausalLM(PRESETS[name], device="meta"))


def test_preset_shapes() -> None:
    small = PRESETS["small"]
    assert (small.hidden_size, small.intermediate_size, small.num_layers) == (576, 1536, 30)
    assert (small.num_heads, small.num_kv_heads, small.head_dim, small.vocab_size) == (9, 3, 64, 49152)
    assert small.tie_word_embeddings and small.architecture == "llama"
    assert 130e6 < _params_on_meta("small") < 140e6
    heavy = PRESETS["kv-heavy"]
    assert (heavy.num_layers, heavy.num_heads, heavy.num_kv_heads, heavy.head_dim) == (16, 16, 16, 128)
    # KV per token (bf16) is ~4x small's although the model is smaller
    assert heavy.kv_bytes_per_token(2) > 4 * small.kv_bytes_per_token(2)
    assert _params_on_meta("kv-heavy") < _params_on_meta("small")
    assert _params_on_meta("tiny") * 4 < 4 * 2**20
    for cfg in PRESETS.values():
        assert cfg.bos_token_id == ByteTokenizer.BOS_ID and cfg.eos_token_ids == ByteTokenizer.EOS_IDS


def test_preset_load_is_deterministic_and_identity_tracks_what_matters() -> None:
    a = load_model(ModelLoadConfig(model="tiny", seed=7))
    b = load_model(ModelLoadConfig(model="tiny", seed=7, served_model_name="other"))
    c = load_model(ModelLoadConfig(model="tiny", seed=8))
    d = load_model(ModelLoadConfig(model="tiny", seed=7, dtype="bfloat16"))
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert a.identity == b.identity and len(a.identity) == 32
    assert len({a.identity, c.identity, d.identity}) == 3
    assert (a.name, b.name) == ("tiny", "other")
    assert a.dtype == torch.float32 and d.dtype == torch.bfloat16
    assert d.model.embed_tokens.weight.dtype == torch.bfloat16
    assert a.device == torch.device("cpu") and not a.model.training
    assert isinstance(a.tokenizer, ByteTokenizer)
    std = a.model.layers[0].self_attn.qkv_proj.weight.std().item()
    assert 0.015 < std < 0.025


def test_preset_weights_are_the_same_in_another_process() -> None:
    here = load_model(ModelLoadConfig(model="tiny", seed=7)).model
    import hashlib

    h = hashlib.sha256()
    for p in here.parameters():
        h.update(p.detach().numpy().tobytes())
    out = subprocess.run([sys.executable, "-c", CHECKSUM], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == h.hexdigest()


def test_dtype_rules_and_threads() -> None:
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    before = torch.get_num_threads()
    try:
        load_model(ModelLoadConfig(model="tiny", num_threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither a preset"):
        load_model(ModelLoadConfig(model=str(tmp_path / "nope")))
    with pytest.raises(ValueError, match=r"config\.json"):
        load_model(ModelLoadConfig(model=str(tmp_path)))
    hf_cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 50}
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        load_model(ModelLoadConfig(model=str(tmp_path)))
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(50, 32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing weights"):
        load_model(ModelLoadConfig(model=str(tmp_path)))
    save_file({"model.embed_tokens.weight": torch.zeros(51, 32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="shape"):
        load_model(ModelLoadConfig(model=str(tmp_path)))
    save_file({"model.bogus.weight": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="matches no parameter"):
        load_model(ModelLoadConfig(model=str(tmp_path)))
