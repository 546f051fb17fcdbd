"""The model runner over the paged KV pool (tiny preset, CPU)."""

from __future__ import annotations

import pytest
import torch

from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.common.presets import preset_config
from kvduplex.engine import runner_inputs
from kvduplex.engine.kv_cache import allocate_kv_pool
from kvduplex.engine.runner import GROUP_COST_TOKENS
from kvduplex.engine.runner import ModelRunner
from kvduplex.engine.runner import SeqInput
from kvduplex.engine.runner import group_by_length
from kvduplex.engine.runner import kv_layout_for
from kvduplex.engine.runner import num_blocks_for_memory
from kvduplex.model.loader import LoadedModel
from kvduplex.model.loader import load_model

BS = 4
NUM_BLOCKS = 32


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model(ModelLoadConfig(model="tiny", seed=3))


@pytest.fixture
def runner(tiny: LoadedModel) -> ModelRunner:
    layout = kv_layout_for(tiny.config, BS, NUM_BLOCKS, tiny.dtype)
    return ModelRunner(tiny.model, tiny.config, allocate_kv_pool(layout), layout, tiny.device)


def _ids(n: int, offset: int = 0) -> list[int]:
    return [(offset + 37 * i) % 300 for i in range(n)]


def test_layout_and_memory_sizing() -> None:
    cfg = preset_config("tiny")
    layout = kv_layout_for(cfg, 16, 10, torch.bfloat16)
    assert layout == KVCacheLayout(cfg.num_layers, 10, 16, cfg.num_kv_heads, cfg.head_dim, "bfloat16")
    per_block = cfg.num_layers * 2 * 16 * cfg.num_kv_heads * cfg.head_dim * 2
    assert num_blocks_for_memory(cfg, 16, torch.bfloat16, 1) == 2**20 // per_block
    assert num_blocks_for_memory(cfg, 16, "float32", 8) == 8 * 2**20 // (2 * per_block)
    with pytest.raises(ValueError, match="kv_cache_mb"):
        num_blocks_for_memory(preset_config("kv-heavy"), 1024, "float32", 1)


def test_on_layer_done_once_per_layer_after_its_kv_is_written(runner: ModelRunner) -> None:
    pool = runner.kv_pool
    seqs = [SeqInput(_ids(6), 0, [3, 7], True), SeqInput(_ids(1, 5), 4, [9, 2], True)]
    slots = torch.tensor([3 * BS + p for p in range(4)] + [7 * BS + p for p in range(2)] + [2 * BS])
    seen: list[int] = []
    snapshots: dict[int, torch.Tensor] = {}

    def on_layer_done(layer: int) -> None:
        seen.append(layer)
        flat = pool[layer].view(2, -1, *pool.shape[-2:])
        snapshots[layer] = flat[:, slots].clone()
        if layer + 1 < pool.shape[0]:
            later = pool[layer + 1].view(2, -1, *pool.shape[-2:])[:, slots]
            assert not later.any(), "a later layer was written before its hook"

    runner.execute(seqs, on_layer_done=on_layer_done)
    assert seen == list(range(runner.config.num_layers))
    for layer, snap in snapshots.items():
        assert snap.abs().sum(dim=(-1, -2)).gt(0).all(), f"layer {layer}: a slot is still empty"
        final = pool[layer].view(2, -1, *pool.shape[-2:])[:, slots]
        assert torch.equal(snap, final)


def test_mixed_batch_equals_separate_steps(tiny: LoadedModel) -> None:
    def fresh() -> ModelRunner:
        layout = kv_layout_for(tiny.config, BS, NUM_BLOCKS, tiny.dtype)
        return ModelRunner(tiny.model, tiny.config, allocate_kv_pool(layout), layout, tiny.device)

    a, b, c = _ids(9), _ids(5, 1), _ids(14, 2)
    tables = [[0, 1, 2], [5, 4], [10, 11, 12, 13]]
    # separately: a and b fully prefilled, c prefilled up to 10
    sep = fresh()
    sep.execute([SeqInput(a[:8], 0, tables[0], False)])
    sep.execute([SeqInput(b[:4], 0, tables[1], False)])
    sep.execute([SeqInput(c[:10], 0, tables[2], False)])
    ref = [
        sep.execute([SeqInput(a[8:], 8, tables[0], True)])[0],
        sep.execute([SeqInput(b[4:], 4, tables[1], True)])[0],
        sep.execute([SeqInput(c[10:], 10, tables[2], True)])[0],
    ]
    # together: two decodes of different context lengths and a prefill chunk in one step
    mix = fresh()
    mix.execute([SeqInput(a[:8], 0, tables[0], False), SeqInput(b[:4], 0, tables[1], False),
                 SeqInput(c[:10], 0, tables[2], False)])
    out = mix.execute([SeqInput(a[8:], 8, tables[0], True), SeqInput(c[10:], 10, tables[2], True),
                       SeqInput(b[4:], 4, tables[1], True)])
    assert out.shape == (3, tiny.config.vocab_size) and out.dtype == torch.float32
    torch.testing.assert_close(out, torch.stack([ref[0], ref[2], ref[1]]), atol=1e-5, rtol=1e-5)


def test_decodes_of_any_length_batched_equal_each_alone(runner: ModelRunner) -> None:
    # 1. prefill three sequences of different lengths in scattered blocks
    tables = [[9, 2, 30], [5, 17, 6, 11, 0], [25]]
    prompts = [_ids(9), _ids(17, 3), _ids(2, 7)]
    runner.execute([SeqInput(p, 0, t, False) for p, t in zip(prompts, tables, strict=True)])
    steps = [SeqInput([40 + i], len(p), t, True) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))]
    # 2. decode each alone, shortest context first, so the decode K/V scratch grows between steps
    alone = {i: runner.execute([steps[i]])[0] for i in (2, 0, 1)}
    # 3. decode all three in one step (their new K/V land in the same slots again)
    together = runner.execute(steps)
    torch.testing.assert_close(together, torch.stack([alone[0], alone[1], alone[2]]), atol=1e-5, rtol=1e-5)


def test_lone_decode_in_one_block_run_matches_scattered_blocks(runner: ModelRunner, tiny: LoadedModel) -> None:
    """The zero-copy decode (blocks 10..14 viewed in place as one range) picks the tokens that
    scattered blocks (several ranges merged, then copied once there are too many) pick."""
    layout = kv_layout_for(tiny.config, BS, NUM_BLOCKS, tiny.dtype)
    other = ModelRunner(tiny.model, tiny.config, allocate_kv_pool(layout), layout, tiny.device)
    prompt = _ids(11)
    logits: dict[str, list[torch.Tensor]] = {}
    for name, r, table in (("run", runner, [10, 11, 12, 13, 14]), ("scattered", other, [30, 2, 17, 8, 21])):
        # 1. prefill 11 tokens; 2. decode 6 greedy tokens, the fourth block filling and a fifth starting
        cur = int(r.execute([SeqInput(prompt, 0, table, True)])[0].argmax())
        logits[name] = []
        for pos in range(11, 17):
            out = r.execute([SeqInput([cur], pos, table, True)])[0]
            logits[name].append(out)
            cur = int(out.argmax())
    for a, b in zip(logits["run"], logits["scattered"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert int(a.argmax()) == int(b.argmax())


def test_decode_groups_split_where_padding_costs_more_than_a_group() -> None:
    lens = [610, 140, 1000, 130, 600, 150]
    assert group_by_length(lens, 16) == [[3, 1, 5], [4, 0], [2]]
    # lengths within one block of each other share a group, whatever their order
    assert group_by_length([33, 40, 47], 16) == [[0, 1, 2]]
    # padding below the cost of a group never splits
    assert group_by_length([100, 100 + GROUP_COST_TOKENS - 16], 16) == [[0, 1]]
    assert group_by_length([], 16) == []


def test_logits_only_for_rows_that_ask(runner: ModelRunner) -> None:
    out = runner.execute([SeqInput(_ids(3), 0, [0], False), SeqInput(_ids(2), 0, [1], True)])
    assert out.shape == (1, runner.config.vocab_size)
    assert runner.execute([]).shape == (0, runner.config.vocab_size)
    none = runner.execute([SeqInput(_ids(2), 0, [2], False)])
    assert none.shape == (0, runner.config.vocab_size)


def test_shared_prefix_blocks_give_same_logits_as_full_prefill(runner: ModelRunner) -> None:
    prefix, tail = _ids(8), _ids(5, 9)
    full = runner.execute([SeqInput(prefix + tail, 0, [20, 21, 22, 23], True)])[0]
    # another sequence whose first two blocks are the cached prefix, computing only its tail
    runner.execute([SeqInput(prefix, 0, [4, 5], False)])
    hit = runner.execute([SeqInput(tail, 8, [4, 5, 6, 7], True)])[0]
    torch.testing.assert_close(hit, full, atol=1e-5, rtol=1e-5)


def test_rejects_malformed_inputs(runner: ModelRunner) -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        runner.execute([SeqInput(_ids(5), 0, [0], True)])
    with pytest.raises(ValueError, match="block ids"):
        runner.execute([SeqInput(_ids(2), 0, [NUM_BLOCKS], True)])
    with pytest.raises(ValueError, match="new token"):
        runner.execute([SeqInput([], 0, [0], True)])


def test_rejects_pool_that_does_not_fit(tiny: LoadedModel) -> None:
    layout = kv_layout_for(tiny.config, BS, NUM_BLOCKS, tiny.dtype)
    wrong = KVCacheLayout(tiny.config.num_layers, NUM_BLOCKS, BS, 1, tiny.config.head_dim)
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelRunner(tiny.model, tiny.config, allocate_kv_pool(wrong), wrong, tiny.device)
    bf16 = kv_layout_for(tiny.config, BS, NUM_BLOCKS, torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        ModelRunner(tiny.model, tiny.config, allocate_kv_pool(bf16), bf16, tiny.device)
    with pytest.raises(ValueError, match="KV pool is"):
        ModelRunner(tiny.model, tiny.config, torch.zeros(1), layout, tiny.device)


def test_bfloat16_runs_and_tracks_float32(tiny: LoadedModel) -> None:
    lm = load_model(ModelLoadConfig(model="tiny", seed=3, dtype="bfloat16"))
    layout = kv_layout_for(lm.config, BS, NUM_BLOCKS, lm.dtype)
    r16 = ModelRunner(lm.model, lm.config, allocate_kv_pool(layout), layout, lm.device)
    layout32 = kv_layout_for(tiny.config, BS, NUM_BLOCKS, tiny.dtype)
    r32 = ModelRunner(tiny.model, tiny.config, allocate_kv_pool(layout32), layout32, tiny.device)
    seq = [SeqInput(_ids(10), 0, [0, 1, 2], True)]
    out16, out32 = r16.execute(seq), r32.execute(seq)
    # Logits come in the model's dtype: a large vocabulary is not copied to float32.
    assert out16.dtype == torch.bfloat16 and torch.isfinite(out16).all()
    assert (out16.float() - out32).abs().max() < 0.05 * out32.abs().max() + 1e-3


def test_tables_held_across_steps_give_the_one_off_results(runner: ModelRunner, tiny: LoadedModel) -> None:
    prompt = _ids(9)
    layout = kv_layout_for(tiny.config, BS, NUM_BLOCKS, tiny.dtype)
    other = ModelRunner(tiny.model, tiny.config, allocate_kv_pool(layout), layout, tiny.device)
    one_off = [other.execute([SeqInput(prompt, 0, [5, 9, 1], True)])[0]]
    one_off += [other.execute([SeqInput([40 + i], 9 + i, [5, 9, 1, 30], True)])[0] for i in range(4)]
    runner.update_table("r", [5, 9, 1], replace=True)
    held = [runner.execute([SeqInput(prompt, 0, None, True, "r")])[0]]
    for i in range(4):
        if i == 3:  # position 12 starts a fourth block
            runner.update_table("r", [30], replace=False)
        held.append(runner.execute([SeqInput([40 + i], 9 + i, None, True, "r")])[0])
    assert all(torch.equal(a, b) for a, b in zip(held, one_off, strict=True))
    runner.drop_tables(["r"])
    with pytest.raises(ValueError, match="no block table"):
        runner.execute([SeqInput([1], 13, None, True, "r")])
    with pytest.raises(ValueError, match="block ids must be in"):
        runner.update_table("s", [NUM_BLOCKS], replace=True)


@pytest.mark.slow
def test_flex_decode_attention_is_token_exact_with_paged(tiny: LoadedModel) -> None:
    """In-place FlexAttention decodes (compiled on first use) pick the tokens ``paged`` picks."""
    layout = kv_layout_for(tiny.config, BS, NUM_BLOCKS, tiny.dtype)
    runners = {
        name: ModelRunner(tiny.model, tiny.config, allocate_kv_pool(layout), layout, tiny.device,
                          decode_attention=name)
        for name in ("paged", "flex")
    }  # fmt: skip
    assert runners["flex"].decode_attention == "flex"
    prompts = [_ids(5), _ids(13, 3), _ids(9, 7)]
    tables = [[30, 2, 17, 8], [4, 11, 25, 0, 19, 6], [21, 13, 1, 28, 9]]
    tokens: dict[str, list[list[int]]] = {}
    for name, r in runners.items():
        r.execute([SeqInput(p, 0, t, False) for p, t in zip(prompts, tables, strict=True)])
        cur, pos, out = [1, 2, 3], [len(p) for p in prompts], []
        for step in range(8):
            live = range(1) if step < 2 else range(3)  # batch 1 first, then 3 (two compiles)
            seqs = [SeqInput([cur[i]], pos[i], tables[i], True) for i in live]
            picked = r.execute(seqs).argmax(-1).tolist()
            for j, i in enumerate(live):
                cur[i], pos[i] = picked[j], pos[i] + 1
            out.append(picked)
        tokens[name] = out
    assert tokens["flex"] == tokens["paged"]
    with pytest.raises(ValueError, match="decode_attention"):
        ModelRunner(tiny.model, tiny.config, allocate_kv_pool(layout), layout, tiny.device,
                    decode_attention="sdpa-in-place")  # not a path


@pytest.mark.parametrize("min_range_tokens", [2 * BS, 256])
def test_batched_decodes_in_place_pick_the_copy_paths_tokens(
    tiny: LoadedModel, min_range_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``paged`` (every decode read in place where its blocks run, the rest copied) against
    ``copy``: same tokens, close logits, over scattered tables of different lengths."""
    monkeypatch.setattr(runner_inputs, "IN_PLACE_MIN_RANGE_TOKENS", min_range_tokens)
    layout = kv_layout_for(tiny.config, BS, NUM_BLOCKS, tiny.dtype)
    runners = {
        name: ModelRunner(tiny.model, tiny.config, allocate_kv_pool(layout), layout, tiny.device,
                          decode_attention=name)
        for name in ("paged", "copy")
    }  # fmt: skip
    assert runners["paged"].decode_attention == "paged" and runners["copy"].decode_attention == "copy"
    prompts = [_ids(13, 1), _ids(5, 2), _ids(9, 3)]
    # a run, then blocks interleaved with the others' (as concurrent decodes allocate them)
    tables = [[20, 21, 22, 23, 5, 8], [30, 2, 6, 9], [10, 11, 12, 7, 4, 13]]
    logits: dict[str, list[torch.Tensor]] = {}
    for name, r in runners.items():
        r.execute([SeqInput(p, 0, t, False) for p, t in zip(prompts, tables, strict=True)])
        cur, pos, out = [1, 2, 3], [len(p) for p in prompts], []
        for step in range(8):
            live = range(1) if step < 2 else range(3)  # a lone decode first, then three
            seqs = [SeqInput([cur[i]], pos[i], tables[i], True) for i in live]
            # one step with a prompt ahead of the decodes: their tokens are not at 0..n-1
            extra = [SeqInput(_ids(6, 4), 0, [1, 3], True)] if step == 3 else []
            step_logits = r.execute(extra + seqs)
            picked = step_logits.argmax(-1).tolist()[len(extra):]
            for j, i in enumerate(live):
                cur[i], pos[i] = picked[j], pos[i] + 1
            out.append(step_logits)
        logits[name] = out
    for got, want in zip(logits["paged"], logits["copy"], strict=True):
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
