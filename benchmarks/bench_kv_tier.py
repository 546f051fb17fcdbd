"""The KV tier's store and load rates against a plain copy, on this machine (not a test).

Blocks of a preset's layout (every layer's K and V of one block, as the pool holds them)
are stored into a `HostTier` and a `FileTier`, then loaded back in a shuffled order, with
the checksum every load verifies. The reference is one `torch.Tensor.copy_` of the same
bytes (memcpy). What a tier hit must beat is recompute: the bytes a tier moves per token
against the seconds a prefill spends per token (``--prefill-s-per-token``, measured by the
engine benchmarks), so the break-even rate is bytes per token / prefill seconds per token.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_kv_tier.py --model small --blocks 512

Prints a Markdown table and writes results/kv-tier.json.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.common.presets import PRESETS
from kvduplex.engine.block_pool import hash_block
from kvduplex.engine.kv_tier import HostTier
from kvduplex.engine.kv_tier import SlotTier
from kvduplex.engine.kv_tier_file import FileTier

RESULTS = Path("results")


def _layout(model: str, block_size: int) -> KVCacheLayout:
    cfg = PRESETS[model]
    return KVCacheLayout(
        num_layers=cfg.num_layers, num_blocks=1, block_size=block_size,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
    )  # fmt: skip


def _rates(tier: SlotTier, blocks: torch.Tensor, seed: int) -> tuple[float, float]:
    """GB/s storing every block, then loading them back in a shuffled order."""
    keys = [hash_block(None, [i], b"bench") for i in range(blocks.shape[0])]
    nbytes = blocks[0].numel() * blocks.element_size()
    t0 = time.perf_counter()
    for key, block in zip(keys, blocks, strict=True):
        tier.store(key, block)
    tier.flush()
    stored = time.perf_counter() - t0
    order = list(range(len(keys)))
    random.Random(seed).shuffle(order)
    out = torch.empty_like(blocks[0])
    t0 = time.perf_counter()
    for i in order:
        assert tier.load(keys[i], out)
    loaded = time.perf_counter() - t0
    return len(keys) * nbytes / stored / 1e9, len(keys) * nbytes / loaded / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="small")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--prefill-s-per-token", type=float, default=0.004,
                    help="this machine's prefill cost per token (the bench cost model's)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    layout = _layout(args.model, args.block_size)
    n, _, _, bs, heads, dim = layout.shape
    blocks = torch.randn(
        args.blocks, n, 2, bs, heads, dim
    )  # (blocks, layers, K|V, tokens, heads, dim)
    nbytes = blocks[0].numel() * blocks.element_size()
    dst = torch.empty_like(blocks)
    dst.copy_(blocks)  # warm
    t0 = time.perf_counter()
    dst.copy_(blocks)
    memcpy = blocks.numel() * blocks.element_size() / (time.perf_counter() - t0) / 1e9
    rows = {"memcpy": (memcpy, memcpy)}
    rows["host tier"] = _rates(HostTier(layout, b"bench", args.blocks), blocks, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        tier = FileTier(layout, b"bench", args.blocks, tmp)
        rows["file tier"] = _rates(tier, blocks, args.seed)
        tier.close()
    per_token = nbytes / args.block_size
    breakeven = per_token / args.prefill_s_per_token / 1e9
    print(f"{args.model}: {per_token / 1024:.1f} KiB of KV a token, {nbytes / 2**20:.2f} MiB a "
          f"block; {args.blocks} blocks")  # fmt: skip
    print("| path | store GB/s | load GB/s | load / break-even |")
    print("|---|---|---|---|")
    for name, (store, load) in rows.items():
        print(f"| {name} | {store:.2f} | {load:.2f} | {load / breakeven:.0f}x |")
    print(f"break-even against recompute at {args.prefill_s_per_token * 1e3:.1f} ms a token: "
          f"{breakeven * 1e3:.1f} MB/s")  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    out = {"args": vars(args), "bytes_per_token": per_token, "breakeven_gbps": breakeven,
           "rates_gbps": {k: {"store": s, "load": ld} for k, (s, ld) in rows.items()}}  # fmt: skip
    (RESULTS / "kv-tier.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
