"""The CPU decode kernel (`model/cpu_decode.py`): its attention against SDPA over the same
keys gathered through the block table, for scattered, shared and partly filled blocks,
GQA groups, head sizes, sliding windows and a step mixing decodes with a prefill; and
the engine's tokens with ``--decode-attention kernel`` against ``paged``."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from kvduplex.cli.main import parse_args
from kvduplex.common.engine_config import EngineConfig
from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.common.presets import preset_config
from kvduplex.common.sampling import SamplingParams
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.kv_cache import allocate_kv_pool
from kvduplex.engine.request import Request
from kvduplex.engine.runner import ModelRunner
from kvduplex.engine.runner import kv_layout_for
from kvduplex.engine.runner_inputs import SeqInput
from kvduplex.model import cpu_decode
from kvduplex.model.cpu_decode import KernelDecodes
from kvduplex.model.decoder import DecoderForCausalLM
from kvduplex.model.loader import init_random_weights

pytestmark = pytest.mark.skipif(
    cpu_decode.load_kernel(32, 2) is None, reason="the CPU decode kernel cannot be built here"
)


def _reference(
    q: torch.Tensor, layer_pool: torch.Tensor, tables: list[list[int]], lens: list[int], window: int | None
) -> torch.Tensor:
    """SDPA over each sequence's keys gathered through its table: (num_seqs, heads, dim)."""
    kv_heads, dim = layer_pool.shape[-2:]
    outs = []
    for s, (table, end) in enumerate(zip(tables, lens, strict=True)):
        first = 0 if window is None else max(0, end - window)
        ids = torch.tensor(table, dtype=torch.int64)
        k = layer_pool[0].index_select(0, ids).reshape(-1, kv_heads, dim)[first:end].transpose(0, 1)
        v = layer_pool[1].index_select(0, ids).reshape(-1, kv_heads, dim)[first:end].transpose(0, 1)
        group = q.shape[1] // kv_heads
        qs = q[s].view(kv_heads, group, dim)
        o = torch.nn.functional.scaled_dot_product_attention(qs, k, v, scale=1 / math.sqrt(dim))
        outs.append(o.reshape(-1, dim))
    return torch.stack(outs)


@pytest.mark.parametrize(
    ("head_dim", "kv_heads", "group", "window"),
    [(32, 2, 2, None), (64, 3, 3, None), (128, 2, 1, None), (64, 4, 2, 37), (16, 1, 8, None)],
)
def test_the_kernel_matches_sdpa_over_the_gathered_blocks(
    head_dim: int, kv_heads: int, group: int, window: int | None
) -> None:
    rng = random.Random(head_dim * 7 + group)
    torch.manual_seed(head_dim + group)
    bs, num_blocks = 16, 64
    layer_pool = torch.randn(2, num_blocks, bs, kv_heads, head_dim)
    lens = [1, 15, 16, 17, 200, 333]
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    tables, taken = [], 0
    for end in lens:
        need = -(-end // bs)
        if end == 200:  # a prefix shared with the previous sequence, then its own blocks
            table = tables[-1][:1] + blocks[taken:taken + need - 1]
            taken += need - 1
        else:
            table = blocks[taken:taken + need]
            taken += need
        tables.append(table)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    # a step with a prefill of 3 tokens before the decodes: q rows are gathered by token index
    q = torch.randn(3 + len(lens), kv_heads * group, head_dim)
    token_index = torch.arange(3, 3 + len(lens))
    batch = KernelDecodes(token_index, padded, torch.tensor(lens), all_tokens=False)
    out = torch.full_like(q, float("nan"))
    kernel = cpu_decode.load_kernel(head_dim, group)
    assert kernel is not None
    kernel.attend(q, layer_pool, batch, 1 / math.sqrt(head_dim), window, out)
    expected = _reference(q[3:], layer_pool, tables, lens, window)
    torch.testing.assert_close(out[3:], expected, atol=1e-5, rtol=1e-4)
    assert out[:3].isnan().all(), "rows of other tokens are left alone"
    # decodes only: written straight into the output
    alone = torch.empty(len(lens), kv_heads * group, head_dim)
    kernel.attend(q[3:].clone(), layer_pool, KernelDecodes(torch.arange(len(lens)), padded, torch.tensor(lens), all_tokens=True),
                  1 / math.sqrt(head_dim), window, alone)  # fmt: skip
    torch.testing.assert_close(alone, expected, atol=1e-5, rtol=1e-4)


def test_the_kernel_refuses_what_it_cannot_read() -> None:
    kernel = cpu_decode.load_kernel(32, 2)
    assert kernel is not None
    pool = torch.randn(2, 4, 16, 2, 32, dtype=torch.float64)
    batch = KernelDecodes(torch.arange(1), torch.zeros(1, 1, dtype=torch.int64), torch.tensor([3]), True)
    with pytest.raises(ValueError, match="float32"):
        kernel.attend(torch.randn(1, 4, 32, dtype=torch.float64), pool, batch, 0.1, None, torch.empty(1, 4, 32))
    assert not cpu_decode.supports(30, 4, 2, torch.float32, torch.device("cpu"))
    assert not cpu_decode.supports(32, 4, 2, torch.bfloat16, torch.device("cpu"))


def _config(flag: str) -> EngineConfig:
    argv = ["serve", "--model", "tiny", "--seed", "5", "--num-blocks", "96", "--decode-attention", flag]
    return parse_args([*argv, "--max-num-batched-tokens", "512"]).engine_config()


def test_kernel_and_paged_engines_pick_the_same_tokens() -> None:
    """Concurrent greedy requests (their decode blocks interleave in the pool) through two
    engines that differ only in ``--decode-attention``: the same tokens."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (300, 45, 270, 130)]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tokens = {}
    for flag in ("kernel", "paged"):
        engine = LLMEngine(_config(flag))
        assert engine.runner.decode_attention == flag
        for i, prompt in enumerate(prompts):
            engine.add_request(Request(f"r{i}", prompt, greedy))
        got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id].extend(out.new_token_ids)
        tokens[flag] = got
    assert tokens["kernel"] == tokens["paged"]
    assert all(len(t) == 24 for t in tokens["kernel"].values())


def test_a_windowed_model_decodes_the_same_tokens_with_the_kernel_as_with_copy() -> None:
    """Sliding-window layers (window 8, tiny blocks of 4): the kernel starts each decode
    at its window, as the copy path's mask does."""
    cfg = dataclasses.replace(
        preset_config("tiny"), architecture="mistral", sliding_window=8, sliding_layers=(0, 2)
    )
    layout = kv_layout_for(cfg, 4, 64, "float32")
    model = DecoderForCausalLM(cfg)
    init_random_weights(model, 7)
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (30, 11, 21)]
    tokens = {}
    for path in ("kernel", "copy"):
        runner = ModelRunner(model, cfg, allocate_kv_pool(layout), layout, "cpu", path)
        assert runner.decode_attention == path
        tokens[path] = _greedy_with_runner(runner, prompts, steps=12)
    assert tokens["kernel"] == tokens["copy"]


def _greedy_with_runner(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Prefill each prompt, then `steps` greedy decodes of all of them together."""
    bs = runner.block_size
    out: list[list[int]] = [[] for _ in prompts]
    next_block = 0
    for i, prompt in enumerate(prompts):
        need = -(-(len(prompt) + steps) // bs)
        runner.update_table(f"s{i}", list(range(next_block, next_block + need)), replace=True)
        next_block += need
        logits = runner.execute([SeqInput(prompt, 0, None, True, request_id=f"s{i}")])
        out[i].append(int(logits[-1].argmax()))
    for _ in range(steps - 1):
        seqs = [SeqInput([o[-1]], len(p) + len(o) - 1, None, True, request_id=f"s{i}") for i, (p, o) in enumerate(zip(prompts, out, strict=True))]
        logits = runner.execute(seqs)
        for i in range(len(prompts)):
            out[i].append(int(logits[i].argmax()))
    return out


def test_auto_takes_the_kernel_only_with_one_torch_thread() -> None:
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert LLMEngine(_config("auto")).runner.decode_attention == "kernel"
        torch.set_num_threads(2)
        assert LLMEngine(_config("auto")).runner.decode_attention == "paged"
    finally:
        torch.set_num_threads(threads)


def test_the_kernel_flag_is_refused_where_it_cannot_run() -> None:
    cfg = EngineConfig(model=ModelLoadConfig(model="tiny", dtype="bfloat16", decode_attention="kernel"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="decode attention 'kernel' needs a float32 pool"):
        LLMEngine(cfg)


def test_work_is_split_by_sequence_or_by_kv_head() -> None:
    assert cpu_decode.work_items([10, 10, 10], 4, 1) == [(0, 3, 0, 4)]
    assert cpu_decode.work_items([100, 10, 10, 80], 4, 2) == [(0, 1, 0, 4), (1, 4, 0, 4)]
    assert cpu_decode.work_items([10, 10, 10, 10], 4, 4) == [(i, i + 1, 0, 4) for i in range(4)]
    assert cpu_decode.work_items([500], 4, 2) == [(0, 1, 0, 2), (0, 1, 2, 4)]
    assert cpu_decode.work_items([500, 7], 3, 4) == [(0, 1, 0, 1), (0, 1, 1, 3), (1, 2, 0, 1), (1, 2, 1, 3)]
    assert cpu_decode.work_items([500], 1, 8) == [(0, 1, 0, 1)]
    for widths, heads, threads in (([3, 90, 1, 1, 40], 4, 3), ([8] * 9, 2, 4), ([60, 2], 8, 16)):
        covered = sorted((s, h) for lo, hi, a, b in cpu_decode.work_items(widths, heads, threads)
                         for s in range(lo, hi) for h in range(a, b))  # fmt: skip
        assert covered == [(s, h) for s in range(len(widths)) for h in range(heads)]


@pytest.mark.parametrize("num_seqs", [1, 3, 8])
def test_threads_split_the_work_and_give_the_same_output(num_seqs: int) -> None:
    torch.manual_seed(num_seqs)
    kv_heads, group, dim, bs = 4, 2, 64, 16
    layer_pool = torch.randn(2, 240, bs, kv_heads, dim)
    lens = torch.tensor([37 + 61 * i for i in range(num_seqs)])  # up to 464 tokens: 29 blocks
    tables = torch.randperm(240)[: num_seqs * 30].view(num_seqs, 30).contiguous()
    q = torch.randn(num_seqs, kv_heads * group, dim)
    batch = KernelDecodes(torch.arange(num_seqs), tables, lens, all_tokens=True)
    kernel = cpu_decode.load_kernel(dim, group)
    assert kernel is not None
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            out = torch.empty_like(q)
            kernel.attend(q, layer_pool, batch, 0.125, None, out)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    expected = _reference(q, layer_pool, tables.tolist(), lens.tolist(), None)
    torch.testing.assert_close(outs[0], expected, atol=1e-5, rtol=1e-4)
