"""The CPU prefill kernel (`model/cpu_prefill.py`): its attention against float64 SDPA over
the same keys gathered through the block table, for fresh and continued chunks, scattered
and shared blocks, GQA groups, head sizes, sliding windows, chunk lengths around its tiles
and threads; and an engine's tokens with ``--prefill-attention kernel`` against ``sdpa``
under chunked prefill, a prefix-cache hit and a windowed model."""

from __future__ import annotations

import dataclasses
import math
import random
import subprocess
import sys

import pytest
import torch

from kvduplex.cli.main import parse_args
from kvduplex.common.engine_config import EngineConfig
from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.common.engine_config import PrefillAttention
from kvduplex.common.presets import preset_config
from kvduplex.common.sampling import SamplingParams
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.kv_cache import allocate_kv_pool
from kvduplex.engine.request import Request
from kvduplex.engine.runner import ModelRunner
from kvduplex.engine.runner import kv_layout_for
from kvduplex.engine.runner_inputs import SeqInput
from kvduplex.model import cpu_prefill
from kvduplex.model.cpu_build import has_avx512
from kvduplex.model.decoder import DecoderForCausalLM
from kvduplex.model.loader import init_random_weights

pytestmark = pytest.mark.skipif(
    cpu_prefill.load_kernel(32, 2) is None, reason="the CPU prefill kernel cannot be built here"
)


def _reference(
    q: torch.Tensor,  # (q_len, heads, dim)
    layer_pool: torch.Tensor,
    table: torch.Tensor,
    start_pos: int,
    window: int | None,
) -> torch.Tensor:  # (q_len, heads, dim), float64
    """Float64 SDPA of the chunk over the sequence's keys gathered through its table."""
    kv_heads, dim = layer_pool.shape[-2:]
    end = start_pos + q.shape[0]
    k = layer_pool[0].index_select(0, table).reshape(-1, kv_heads, dim)[:end].transpose(0, 1).double()
    v = layer_pool[1].index_select(0, table).reshape(-1, kv_heads, dim)[:end].transpose(0, 1).double()
    qpos = torch.arange(start_pos, end)[:, None]
    kpos = torch.arange(end)[None, :]
    seen = kpos <= qpos
    if window is not None:
        seen &= kpos > qpos - window
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).double()[None], k[None], v[None], attn_mask=seen, scale=1 / math.sqrt(dim), enable_gqa=True
    )
    return o[0].transpose(0, 1)


def _chunk(
    kv_heads: int, group: int, dim: int, start_pos: int, q_len: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pool with the sequence's blocks scattered through it, its table, and the chunk's
    queries as a view into a wider fused projection (each token's heads contiguous)."""
    torch.manual_seed(seed)
    bs = 16
    need = -(-(start_pos + q_len) // bs)
    pool = torch.randn(2, need + 9, bs, kv_heads, dim)
    table = torch.randperm(need + 9)[:need].contiguous()
    fused = torch.randn(q_len, (kv_heads * group + 2 * kv_heads) * dim)
    q = fused[:, : kv_heads * group * dim].view(q_len, kv_heads * group, dim)
    return pool, table, q


@pytest.mark.parametrize(
    ("dim", "kv_heads", "group", "start_pos", "q_len", "window"),
    [
        (64, 4, 2, 0, 1, None),  # one token
        (64, 4, 2, 0, 7, None),  # less than a tile
        (64, 4, 2, 0, 333, None),  # fresh, tiles and key tiles partly filled
        (64, 4, 2, 250, 97, None),  # continued
        (32, 2, 1, 40, 65, None),  # no grouping
        (128, 2, 4, 0, 150, None),
        (16, 1, 8, 100, 50, None),
        (64, 3, 3, 17, 70, None),
        (64, 4, 2, 0, 300, 37),  # sliding window inside the chunk
        (64, 4, 2, 500, 80, 100),  # window starting in the cached part
        (64, 2, 2, 20, 40, 4096),  # a window wider than the context
    ],
)
def test_the_kernel_matches_float64_sdpa_over_the_gathered_blocks(
    dim: int, kv_heads: int, group: int, start_pos: int, q_len: int, window: int | None
) -> None:
    pool, table, q = _chunk(kv_heads, group, dim, start_pos, q_len, seed=dim + group + start_pos + q_len)
    kernel = cpu_prefill.load_kernel(dim, group)
    assert kernel is not None
    # the output is a view into a wider buffer: only its rows are written
    buf = torch.full((q_len + 2, kv_heads * group, dim), float("nan"))
    kernel.attend(q, pool, table, start_pos, 1 / math.sqrt(dim), window, buf[1:-1])
    expected = _reference(q, pool, table, start_pos, window)
    torch.testing.assert_close(buf[1:-1].double(), expected, atol=2e-6, rtol=1e-5)
    assert buf[0].isnan().all() and buf[-1].isnan().all()


def test_large_scores_neither_overflow_nor_lose_the_maximum() -> None:
    """Scores in the hundreds, the largest in a later key tile than the first: the online
    softmax rescales what it summed before."""
    pool, table, q = _chunk(2, 2, 64, 200, 40, seed=1)
    pool[0, :, :, :, :] *= 0.1
    pool[0].view(-1, 2, 64)[table[10] * 16 + 3] = q[0, 0] * 8  # key 163 scores ~ 8|q|^2 / 8
    q *= 3
    kernel = cpu_prefill.load_kernel(64, 2)
    assert kernel is not None
    out = torch.empty_like(q)
    kernel.attend(q, pool, table, 200, 1 / 8, None, out)
    torch.testing.assert_close(out.double(), _reference(q, pool, table, 200, None), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("start_pos", "q_len", "window"), [(0, 700, None), (900, 300, None), (0, 500, 64), (700, 400, 300)]
)
def test_threads_split_the_work_and_give_the_same_output(start_pos: int, q_len: int, window: int | None) -> None:
    pool, table, q = _chunk(4, 2, 64, start_pos, q_len, seed=q_len)
    kernel = cpu_prefill.load_kernel(64, 2)
    assert kernel is not None
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out = torch.empty_like(q)
            kernel.attend(q, pool, table, start_pos, 0.125, window, out)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_work_is_split_in_runs_of_about_equal_keys() -> None:
    assert cpu_prefill.work_ranges(4, 10, 32, 0, None, 1) == [(0, 40)]
    assert cpu_prefill.work_ranges(1, 1, 32, 0, None, 4) == [(0, 1)]
    # causal: a head's later tiles see more keys, so the first run holds more tiles
    two = cpu_prefill.work_ranges(1, 8, 32, 0, None, 2)
    assert two[0][0] == 0 and two[-1][1] == 8 and two[0][1] > 4
    for heads, tiles, start, window, threads in ((4, 10, 0, None, 3), (2, 64, 4096, None, 8), (8, 3, 0, 40, 16)):
        ranges = cpu_prefill.work_ranges(heads, tiles, 32, start, window, threads)
        assert len(ranges) <= threads
        covered = [u for lo, hi in ranges for u in range(lo, hi)]
        assert covered == list(range(heads * tiles))


def test_positions_past_float32s_exact_integers_stay_causal() -> None:
    """Tokens at positions around 2**24 (where float32 stops telling neighbours apart), a
    window of 16: each sees exactly its last 16 keys. The table repeats 8 blocks."""
    bs, start, q_len, window = 16, 2**24 - 8, 20, 16
    torch.manual_seed(3)
    pool = torch.randn(2, 8, bs, 2, 32)
    table = torch.arange(-(-(start + q_len) // bs)) % 8
    q = torch.randn(q_len, 4, 32)
    kernel = cpu_prefill.load_kernel(32, 2)
    assert kernel is not None
    out = torch.empty_like(q)
    kernel.attend(q, pool, table, start, 32**-0.5, window, out)
    for t in range(q_len):
        pos = start + t
        keys = torch.arange(pos - window + 1, pos + 1)
        k = pool[0][table[keys // bs], keys % bs].double()  # (16, kv_heads, dim)
        v = pool[1][table[keys // bs], keys % bs].double()
        for h in range(4):
            w = torch.softmax(k[:, h // 2] @ q[t, h].double() * 32**-0.5, 0)
            torch.testing.assert_close(out[t, h].double(), w @ v[:, h // 2], atol=2e-6, rtol=1e-5)


def test_a_nan_score_comes_through_as_sdpa_gives_it() -> None:
    pool, table, q = _chunk(2, 2, 64, 100, 30, seed=5)
    pool[0].view(-1, 2, 64)[table[3] * 16 + 5, 1, 7] = float("nan")  # key 53 of KV head 1
    kernel = cpu_prefill.load_kernel(64, 2)
    assert kernel is not None
    out = torch.empty_like(q)
    kernel.attend(q, pool, table, 100, 0.125, None, out)
    assert out[:, 2:].isnan().all(), "every row of KV head 1 sees key 53"
    assert not out[:, :2].isnan().any()


def test_the_largest_tiles_run_on_a_small_thread_stack() -> None:
    """Head size 256, group 8: the tiles live in the call's scratch, not on the stack (a
    256 KiB thread stack held them once they were; musl's default is 128 KiB)."""
    code = (
        "import threading, torch; from kvduplex.model import cpu_prefill\n"
        "k = cpu_prefill.load_kernel(256, 8); assert k is not None\n"
        "pool = torch.randn(2, 4, 16, 1, 256); q = torch.randn(40, 8, 256); out = torch.empty_like(q)\n"
        "threading.stack_size(128 * 1024)\n"
        "t = threading.Thread(target=k.attend, args=(q, pool, torch.arange(4), 10, 0.06, None, out)); t.start(); t.join()\n"
        "assert not out.isnan().any()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_kernel_refuses_what_it_cannot_read() -> None:
    kernel = cpu_prefill.load_kernel(32, 2)
    assert kernel is not None
    pool = torch.randn(2, 4, 16, 2, 32)
    table = torch.arange(4)
    q = torch.randn(10, 4, 32)
    with pytest.raises(ValueError, match="float32 pool"):
        kernel.attend(q, pool.double(), table, 0, 0.1, None, torch.empty_like(q))
    with pytest.raises(ValueError, match="heads contiguous"):
        kernel.attend(q.transpose(1, 2).contiguous().transpose(1, 2), pool, table, 0, 0.1, None, torch.empty_like(q))
    with pytest.raises(ValueError, match="head size 32 and 2 query heads per KV head"):
        kernel.attend(torch.randn(10, 6, 32), pool, table, 0, 0.1, None, torch.empty(10, 6, 32))
    with pytest.raises(ValueError, match="int64 block table"):
        kernel.attend(q, pool, table.int(), 0, 0.1, None, torch.empty_like(q))
    with pytest.raises(ValueError, match="cannot hold 70 tokens"):
        kernel.attend(q, pool, table, 60, 0.1, None, torch.empty_like(q))
    with pytest.raises(ValueError, match="outside the pool's 4 blocks"):
        kernel.attend(q, pool, torch.tensor([99, 1, 2, 3]), 0, 0.1, None, torch.empty_like(q))
    with pytest.raises(ValueError, match="window None or >= 1"):
        kernel.attend(q, pool, table, 0, 0.1, 0, torch.empty_like(q))
    with pytest.raises(ValueError, match="start_pos must be >= 0"):
        kernel.attend(q, pool, table, -5, 0.1, None, torch.empty_like(q))
    narrow = torch.randn(10, 4, 32)[:, :, :16]  # head size 16 in a 32-wide buffer
    with pytest.raises(ValueError, match="head size 32"):
        kernel.attend(narrow, pool, table, 0, 0.1, None, torch.empty(10, 4, 32)[:, :, :16])
    with pytest.raises(ValueError, match="reads CPU tensors, not meta"):
        kernel.attend(q, pool, table.to("meta"), 0, 0.1, None, torch.empty_like(q))
    assert not cpu_prefill.supports(30, 4, 2, torch.float32, torch.device("cpu"))
    assert not cpu_prefill.supports(32, 4, 2, torch.bfloat16, torch.device("cpu"))
    assert not cpu_prefill.supports(32, 32, 2, torch.float32, torch.device("cpu"))  # group 16
    assert not cpu_prefill.supports(32, 4, 2, torch.float32, torch.device("meta"))


def _config(flag: str, budget: int) -> EngineConfig:
    argv = ["serve", "--model", "tiny", "--seed", "5", "--num-blocks", "96", "--prefill-attention", flag]
    return parse_args([*argv, "--max-num-batched-tokens", str(budget)]).engine_config()


def test_kernel_and_sdpa_engines_pick_the_same_tokens() -> None:
    """Prompts longer than the token budget (continued chunks), one sharing another's
    prefix (a prefix-cache hit), decodes running beside prefills: the same tokens through
    two engines that differ only in ``--prefill-attention``."""
    rng = random.Random(4)
    base = [rng.randrange(3, 250) for _ in range(300)]
    prompts = [base, [rng.randrange(3, 250) for _ in range(45)], base[:200] + [7, 8, 9] * 30, base[:64]]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    tokens = {}
    for flag in ("kernel", "sdpa"):
        engine = LLMEngine(_config(flag, 128))
        assert engine.runner.prefill_attention == flag
        got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        engine.add_request(Request("r0", prompts[0], greedy))
        while engine.has_unfinished():  # the first prompt's blocks are cached before the others come
            for out in engine.step():
                got[out.request_id].extend(out.new_token_ids)
        for i, prompt in enumerate(prompts[1:], start=1):
            engine.add_request(Request(f"r{i}", prompt, greedy))
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id].extend(out.new_token_ids)
        tokens[flag] = got
    assert tokens["kernel"] == tokens["sdpa"]
    assert all(len(t) == 16 for t in tokens["kernel"].values())


def test_a_windowed_model_prefills_the_same_tokens_with_the_kernel_as_with_sdpa() -> None:
    """Sliding-window layers (window 8, blocks of 4), prompts longer than the window."""
    cfg = dataclasses.replace(
        preset_config("tiny"), architecture="mistral", sliding_window=8, sliding_layers=(0, 2)
    )
    layout = kv_layout_for(cfg, 4, 64, "float32")
    model = DecoderForCausalLM(cfg)
    init_random_weights(model, 7)
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (30, 11, 21)]
    logits = {}
    for path in ("kernel", "sdpa"):
        runner = ModelRunner(model, cfg, allocate_kv_pool(layout), layout, "cpu", prefill_attention=path)
        assert runner.prefill_attention == path
        got = []
        for i, prompt in enumerate(prompts):
            runner.update_table(f"s{i}", list(range(i * 10, i * 10 + 10)), replace=True)
            got.append(runner.execute([SeqInput(prompt, 0, None, True, request_id=f"s{i}")])[-1])
        logits[path] = torch.stack(got)
    torch.testing.assert_close(logits["kernel"], logits["sdpa"], atol=1e-4, rtol=1e-4)
    assert torch.equal(logits["kernel"].argmax(-1), logits["sdpa"].argmax(-1))


def test_auto_takes_the_kernel_on_avx512_and_the_kernel_flag_is_refused_where_it_cannot_run() -> None:
    assert LLMEngine(_config("auto", 512)).runner.prefill_attention == ("kernel" if has_avx512() else "sdpa")
    cfg = EngineConfig(model=ModelLoadConfig(model="tiny", dtype="bfloat16", prefill_attention=PrefillAttention.KERNEL))
    with pytest.raises(ValueError, match="prefill attention 'kernel' needs a float32 pool"):
        LLMEngine(cfg)
    auto = EngineConfig(model=ModelLoadConfig(model="tiny", dtype="bfloat16"))
    assert LLMEngine(auto).runner.prefill_attention == "sdpa"
    with pytest.raises(SystemExit):
        parse_args(["serve", "--prefill-attention", "flash"])
