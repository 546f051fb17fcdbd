"""Our decoder against transformers on tiny random-weight models of every supported family.

Each family is saved with ``save_pretrained`` (safetensors), loaded through our
loader, and run through our runner over a paged KV pool with a scattered block
table. Checks: logits close at every prompt position, greedy generation
token-exact against ``generate(do_sample=False)`` whether the prompt is
prefilled at once, in chunks, or batched with another sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.engine.kv_cache import allocate_kv_pool
from kvduplex.engine.runner import ModelRunner
from kvduplex.engine.runner import SeqInput
from kvduplex.engine.runner import kv_layout_for
from kvduplex.model import decoder
from kvduplex.model.decoder import Linear
from kvduplex.model.decoder import can_pack_for_onednn
from kvduplex.model.loader import LoadedModel
from kvduplex.model.loader import load_model
from tests.unit.test_tokenizer import write_hf_tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 300
BLOCK_SIZE = 4
NUM_BLOCKS = 48
NEW_TOKENS = 20
PROMPTS = ([5, 17, 42, 101, 7, 250, 33, 9, 64, 128, 3, 77, 200], [11, 12, 13, 14, 15, 16, 17])
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    initializer_range=0.1,
)


def _llama() -> Any:
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, rope_scaling=rope))


def _llama_tied_bias() -> Any:
    cfg = transformers.LlamaConfig(**COMMON, tie_word_embeddings=True, attention_bias=True,
                                   mlp_bias=True, rope_scaling={"rope_type": "linear", "factor": 2.0})
    return transformers.LlamaForCausalLM(cfg)


def _qwen2() -> Any:
    # sliding window on the upper layer only (max_window_layers=1), shorter than the sequences
    cfg = transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=6,
                                   max_window_layers=1, rope_theta=1000.0)
    return transformers.Qwen2ForCausalLM(cfg)


def _qwen3() -> Any:
    cfg = transformers.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True)
    return transformers.Qwen3ForCausalLM(cfg)


def _mistral() -> Any:
    return transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, sliding_window=8))


BUILDERS: dict[str, Callable[[], Any]] = {
    "llama3-rope": _llama,
    "llama-tied-bias": _llama_tied_bias,
    "qwen2-bias-window": _qwen2,
    "qwen3-qknorm-tied": _qwen3,
    "mistral-window": _mistral,
}
SHARDED = {"llama3-rope"}


@dataclass
class Family:
    hf: Any
    ours: LoadedModel
    folder: Path


def _perturb_biases_and_norms(hf: Any) -> None:
    """transformers initialises biases to 0 and norm weights to 1, which would let a
    missing bias or a misplaced norm weight pass; give every one of them noise."""
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    name: str = request.param
    torch.manual_seed(1234)
    hf = BUILDERS[name]().eval()
    _perturb_biases_and_norms(hf)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    folder = tmp_path_factory.mktemp(name)
    hf.save_pretrained(folder, max_shard_size="100KB" if name in SHARDED else "50GB")
    write_hf_tokenizer(folder)
    if name in SHARDED:
        assert (folder / "model.safetensors.index.json").is_file()
    ours = load_model(ModelLoadConfig(model=str(folder), dtype="float32", device="cpu"))
    return Family(hf, ours, folder)


def _runner(lm: LoadedModel) -> ModelRunner:
    layout = kv_layout_for(lm.config, BLOCK_SIZE, NUM_BLOCKS, lm.dtype)
    return ModelRunner(lm.model, lm.config, allocate_kv_pool(layout), layout, lm.device)


def _block_table(seq: int) -> list[int]:
    """Scattered, disjoint blocks per sequence: seq 0 gets odd ids, seq 1 even ids, reversed."""
    return list(range(NUM_BLOCKS - 1 - seq, -1, -2))


def _hf_greedy(hf: Any, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return [int(t) for t in out[0, len(prompt):]]


def _greedy(runner: ModelRunner, prompts: list[list[int]], chunk: int | None) -> list[list[int]]:
    """Greedy decode all prompts together; prefill each in `chunk`-token steps (None = at once)."""
    done = [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    while any(len(o) < NEW_TOKENS for o in outputs):
        seqs, owners = [], []
        for i, prompt in enumerate(prompts):
            if done[i] < len(prompt):
                step = len(prompt) - done[i] if chunk is None else min(chunk, len(prompt) - done[i])
                ids = prompt[done[i]:done[i] + step]
                last = done[i] + step == len(prompt)
            elif len(outputs[i]) < NEW_TOKENS:
                ids, last = outputs[i][-1:], True
            else:
                continue
            seqs.append(SeqInput(ids, done[i], _block_table(i), needs_logits=last))
            owners.append((i, last))
            done[i] += len(ids)
        logits = runner.execute(seqs)
        row = 0
        for i, last in owners:
            if last:
                outputs[i].append(int(logits[row].argmax()))
                row += 1
    return outputs


def test_config_read_from_folder(family: Family) -> None:
    cfg, hf_cfg = family.ours.config, family.hf.config
    assert cfg.num_layers == hf_cfg.num_hidden_layers
    assert cfg.head_dim == getattr(hf_cfg, "head_dim", 16)
    assert cfg.tie_word_embeddings == bool(hf_cfg.tie_word_embeddings)
    assert family.ours.model.lm_head is None if cfg.tie_word_embeddings else family.ours.model.lm_head is not None


def test_logits_match_at_every_position(family: Family) -> None:
    prompt = PROMPTS[0]
    with torch.no_grad():
        ref = family.hf(torch.tensor([prompt])).logits[0].float()  # (len, vocab)
    runner = _runner(family.ours)
    whole = runner.execute([SeqInput(list(prompt), 0, _block_table(0), True)])
    torch.testing.assert_close(whole[0], ref[-1], atol=1e-4, rtol=1e-4)
    # token by token (the decode path) gives the logits of every position
    runner.kv_pool.zero_()
    rows = [runner.execute([SeqInput([t], p, _block_table(0), True)])[0] for p, t in enumerate(prompt)]
    torch.testing.assert_close(torch.stack(rows), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk", [3, 8])
def test_logits_match_after_every_chunk(family: Family, chunk: int) -> None:
    """A prompt prefilled in chunks (each after the first attends to the cached context and
    to itself: on CPU two SDPAs merged by log-sum-exp, or the masked path under a window)
    gives transformers' logits at the end of every chunk."""
    prompt = PROMPTS[0]
    with torch.no_grad():
        ref = family.hf(torch.tensor([prompt])).logits[0].float()  # (len, vocab)
    runner = _runner(family.ours)
    for start in range(0, len(prompt), chunk):
        ids = list(prompt[start:start + chunk])
        got = runner.execute([SeqInput(ids, start, _block_table(0), True)])[0]
        torch.testing.assert_close(got, ref[start + len(ids) - 1], atol=1e-4, rtol=1e-4)


def test_greedy_token_exact(family: Family) -> None:
    expected = [_hf_greedy(family.hf, list(p)) for p in PROMPTS]
    runner = _runner(family.ours)
    for i, prompt in enumerate(PROMPTS):
        runner.kv_pool.zero_()
        assert _greedy(runner, [list(prompt)], chunk=None) == [expected[i]], "prefill at once"
        runner.kv_pool.zero_()
        assert _greedy(runner, [list(prompt)], chunk=5) == [expected[i]], "chunked prefill"
    runner.kv_pool.zero_()
    assert _greedy(runner, [list(p) for p in PROMPTS], chunk=4) == expected, "batch of two"


@pytest.mark.parametrize("tile_rows", [64, 256], ids=["three-tiles", "one-padded-tile"])
def test_logits_match_for_a_prompt_of_several_matmul_tiles(
    family: Family, tile_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt longer than a decode batch: its matmuls run on the oneDNN-packed weights in
    tiles (`decoder.onednn_linear_tiled`): 64 + 64 + 22 rows, or one tile of 150 rows padded
    to 192."""
    if can_pack_for_onednn(torch.empty(2, 2)):
        assert all(m.packed is not None for m in family.ours.model.modules() if isinstance(m, Linear))
    monkeypatch.setattr(decoder, "PREFILL_TILE_ROWS", tile_rows)
    prompt = [(i * 37 + 11) % VOCAB for i in range(150)]
    with torch.no_grad():
        ref = family.hf(torch.tensor([prompt])).logits[0].float()  # (len, vocab)
    runner = _runner(family.ours)
    table = list(range(NUM_BLOCKS - 1, -1, -1))  # 192 tokens' room, scattered
    got = runner.execute([SeqInput(prompt, 0, table, True)])[0]
    torch.testing.assert_close(got, ref[-1], atol=1e-4, rtol=1e-4)
