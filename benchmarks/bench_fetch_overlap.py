"""The fetch plan's READ on prefill, whole before the prefill against layer by layer
under it (not a test).

A PREFILL_FETCH turn on P: decode holds the history, P does not. Per mode, P's TTFT
(the request's add to its first token), in one process, P's engine stepped here:

* ``read-then-prefill``: the READ of every layer as one transfer (`RetainedReader`, the
  path before the layer-wise load), then the prefill of the new tokens;
* ``layerwise``: the prefill starts at once, one READ per layer, each layer's attention
  waits for its own (`PrefixLoads`);
* ``cached``: the history already in P's prefix cache (the compute floor).

Compute is real (the model's forward on this CPU); the link is modelled: the in-process
fabric ends a READ after its bytes at ``--link-gbps``, the layer READs one after the
other (a serial link), on real timers; it copies the bytes at the post, on the engine
thread (a NIC's copy would cost the CPU nothing: here both modes pay it before compute). Modes interleave per repetition; P is a fresh
engine each time (same model), so nothing is cached from the run before.

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python benchmarks/bench_fetch_overlap.py
    ... --model small --history 1024 --new 64 --link-gbps 1,4 --reps 3

``--source tier``: the history is in P's own file KV tier instead (every block stored
there from a reference engine's pool, persisted; ``--cold`` drops it from the page
cache too), and nothing is modelled: the reads, CRCs and copies are real, on a loader
thread beside the forward. Per mode:

* ``promote-then-prefill``: the tier hit promoted whole at the prefix lookup
  (``kv_tier_overlap_blocks 0``), then the prefill of the new tokens;
* ``layerwise``: the prefill starts at once, the loader reads the history layer by
  layer, each layer's attention waits for its own (`TierLoads`);
* ``cached``: the history already in P's prefix cache (the compute floor).

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python benchmarks/bench_fetch_overlap.py \
        --source tier --model small --history 1024 --new 64 --reps 3

Writes results/<name>.json and .md (default name bench_fetch_overlap, with ``_tier``
for the tier source) and prints the table.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import md_table
from benchmarks.common import write_results
from kvduplex.common.engine_config import CacheConfig
from kvduplex.common.engine_config import EngineConfig
from kvduplex.common.engine_config import KVTierKind
from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.common.engine_config import SchedulerConfig
from kvduplex.common.sampling import SamplingParams
from kvduplex.engine.block_pool import compute_block_hashes
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.request import Request
from kvduplex.kvflow.connectors import FlowTiming
from kvduplex.kvflow.connectors import PrefillFlows
from kvduplex.kvflow.connectors import prefill_flows
from kvduplex.kvflow.prefix_load import PrefixLoadSpec
from kvduplex.model.loader import LoadedModel
from kvduplex.model.loader import load_model
from kvduplex.transport.notify import NotificationPump
from kvduplex.transport.protocol import PeerHandle
from tests.support.fake_transport import InProcessFabric
from tests.support.fake_transport import InProcessTransport
from tests.unit.flow_sim import SteppedEngine

FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
MODES = ("read-then-prefill", "layerwise", "cached")
TIER_MODES = ("promote-then-prefill", "layerwise", "cached")


class Rig:
    """D (holding the history) and a fresh P on one in-process fabric."""

    def __init__(self, loaded: LoadedModel, args: argparse.Namespace, d: LLMEngine,
                 td: InProcessTransport, fabric: InProcessFabric, n: int) -> None:  # fmt: skip
        self.p = _engine(loaded, args)
        self.tp = fabric.endpoint(self.p.kv_pool, self.p.layout, engine_id=f"p{n}")
        self.d_peer: PeerHandle = self.tp.connect(td.local_metadata())
        timing = FlowTiming(wait_s=30.0, transfer_timeout_s=30.0, quarantine_s=1.0)
        self.front = SteppedEngine(self.p)
        self.flows: PrefillFlows = prefill_flows(
            self.tp, self.front, NotificationPump(self.tp), timing,
            {td.engine_id: self.d_peer}.get,
        )  # fmt: skip
        self.d = d

    def first_token(self, req: Request) -> tuple[int, float]:
        """Step P until ``req``'s first token: (token, seconds from its add)."""
        t0 = time.perf_counter()
        self.p.add_request(req)
        while True:
            for out in self.p.step():
                if out.request_id == req.request_id and out.new_token_ids:
                    return out.new_token_ids[0], time.perf_counter() - t0

    def wait(self, done: Future[int]) -> int:
        """The engine thread between steps while a READ runs: it waits for its wake-up
        (an inbox event), then drains the inbox, as the engine loop does."""
        while not done.done():
            self.front._wake.wait(1.0)
            self.front._wake.clear()
            self.flows.inbox.drain()
        return done.result()

    def close(self) -> None:
        self.tp.close()


def _engine(loaded: LoadedModel, args: argparse.Namespace) -> LLMEngine:
    blocks = 2 * (args.history + args.new) // args.block_size + 8
    cfg = EngineConfig(
        cache=CacheConfig(block_size=args.block_size, num_blocks=blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=max(2048, args.history + args.new)),
    )
    return LLMEngine(cfg, loaded=loaded)


def _read_bytes_per_layer(p: LLMEngine, num_blocks: int) -> int:
    layout = p.layout
    return layout.total_bytes // layout.num_blocks // layout.num_layers * num_blocks


def run_one(mode: str, rig: Rig, prompt: list[int], history: int, gbps: float) -> dict[str, Any]:
    p, bs = rig.p, rig.p.layout.block_size
    keys = compute_block_hashes(prompt[:history], bs, p.kv_manager.identity)
    remote = rig.d.kv_manager.cached_prefix(keys)
    assert len(remote) == len(keys), "decode holds the history"
    keys_hex = [bytes(k).hex() for k in keys]
    layer_s = _read_bytes_per_layer(p, len(keys)) / (gbps * 1e9)
    num_layers = p.layout.num_layers
    t0 = time.perf_counter()
    if mode == "cached":
        warm = Request("warm", prompt[: history + 1], FIRST)
        rig.first_token(warm)
        token, ttft = rig.first_token(Request("x", prompt, FIRST))
        return {"ttft_ms": ttft * 1e3, "read_ms": 0.0, "waited_ms": 0.0, "token": token}
    if mode == "read-then-prefill":
        rig.tp.slow_next(layer_s * num_layers, copy_at_post=True)  # every layer in one transfer
        done = rig.flows.reader.start(rig.d_peer, "x-read", remote, keys_hex, prompt[:history])
        num_blocks = rig.wait(done)
        read_s = time.perf_counter() - t0
        assert num_blocks == len(keys)
        token, prefill_s = rig.first_token(Request("x", prompt, FIRST))
        return {"ttft_ms": (read_s + prefill_s) * 1e3, "read_ms": read_s * 1e3,
                "waited_ms": read_s * 1e3, "token": token}  # fmt: skip
    for layer in range(num_layers):  # one after the other over the link
        rig.tp.slow_next(layer_s * (layer + 1), copy_at_post=True)
    spec = PrefixLoadSpec(rig.d_peer, remote, keys_hex, None, lambda: None)
    token, ttft = rig.first_token(Request("x", prompt, FIRST, connector_meta=spec))
    load = rig.flows.loads.last
    assert load is not None and spec.done.result() == history, "loaded whole"
    landed = [t for t in load.landed_at if t is not None]
    read_s = max(landed) - load.posted_at
    return {"ttft_ms": (time.perf_counter() - t0) * 1e3, "read_ms": read_s * 1e3, "token": token,
            "waited_ms": load.waited_s * 1e3, "ttft_engine_ms": ttft * 1e3}  # fmt: skip


def _first_token(p: LLMEngine, req: Request) -> tuple[int, float]:
    """Step `p` until ``req``'s first token: (token, seconds from its add)."""
    t0 = time.perf_counter()
    p.add_request(req)
    while True:
        for out in p.step():
            if out.request_id == req.request_id and out.new_token_ids:
                return out.new_token_ids[0], time.perf_counter() - t0


def run_tier(
    mode: str, loaded: LoadedModel, args: argparse.Namespace, d: LLMEngine, prompt: list[int],
    directory: str,
) -> dict[str, Any]:  # fmt: skip
    """One turn whose history is in a fresh P's file tier (or, ``cached``, its pool)."""
    bs, history = args.block_size, args.history
    blocks = 2 * (history + args.new) // bs + 8
    cfg = EngineConfig(
        cache=CacheConfig(
            block_size=bs, num_blocks=blocks, kv_tier=KVTierKind.FILE,
            kv_tier_blocks=history // bs + 8, kv_tier_path=directory,
            kv_tier_overlap_blocks=0 if mode == "promote-then-prefill" else 4,
        ),
        scheduler=SchedulerConfig(max_num_batched_tokens=max(2048, history + args.new)),
    )  # fmt: skip
    p = LLMEngine(cfg, loaded=loaded)
    link = p.kv_tier
    assert link is not None
    try:
        # Every mode's P has run one forward before (a fresh engine's first is slower).
        _first_token(p, Request("warmup", prompt[history : history + args.new], FIRST))
        if mode == "cached":
            _first_token(p, Request("warm", prompt[: history + 1], FIRST))
            token, ttft = _first_token(p, Request("x", prompt, FIRST))
            return {"ttft_ms": ttft * 1e3, "read_ms": 0.0, "waited_ms": 0.0, "token": token}
        keys = compute_block_hashes(prompt[:history], bs, p.kv_manager.identity)
        held = d.kv_manager.cached_prefix(keys)
        assert len(held) == len(keys), "the reference engine holds the history"
        for key, block_id in zip(keys, held, strict=True):
            link.tier.store(key, d.kv_pool[:, :, block_id])
        link.tier.flush()
        if args.cold:
            fd = link.tier.fileno()  # type: ignore[attr-defined]
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        promoted_s = 0.0
        promote = link.promote

        def timed_promote(*a: Any, **kw: Any) -> int:
            nonlocal promoted_s
            t = time.perf_counter()
            n = promote(*a, **kw)
            promoted_s += time.perf_counter() - t
            return n

        link.promote = timed_promote  # type: ignore[method-assign]
        token, ttft = _first_token(p, Request("x", prompt, FIRST))
        stats = link.tier.stats
        assert stats.num_loaded_blocks == len(keys) and stats.num_corrupt_blocks == 0
        if mode == "promote-then-prefill":
            return {"ttft_ms": ttft * 1e3, "read_ms": promoted_s * 1e3,
                    "waited_ms": promoted_s * 1e3, "token": token}  # fmt: skip
        assert p.tier_loads is not None and p.tier_loads.last is not None
        job = p.tier_loads.last
        read_s = job.layer_done_at[-1] - job.started_at
        return {"ttft_ms": ttft * 1e3, "read_ms": read_s * 1e3,
                "waited_ms": job.loads[0].waited_s * 1e3, "token": token}  # fmt: skip
    finally:
        link.close()


def main_tier(args: argparse.Namespace, loaded: LoadedModel, prompt: list[int]) -> None:
    """The ``tier`` source: one table, the three modes of `TIER_MODES`."""
    d = _engine(loaded, args)
    _first_token(d, Request("turn1", prompt[: args.history + 1], FIRST))
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in TIER_MODES}
    with tempfile.TemporaryDirectory(prefix="bench-tier-", dir=args.tier_path or None) as tmp:
        for rep in range(args.reps + 1):  # the first round warms up, not counted
            for mode in TIER_MODES:
                result = run_tier(mode, loaded, args, d, prompt, tmp)
                if rep > 0:
                    runs[mode].append(result)
    tokens = {r["token"] for rs in runs.values() for r in rs}
    assert len(tokens) == 1, f"modes disagree on the first token: {tokens}"
    base = statistics.median(r["ttft_ms"] for r in runs["promote-then-prefill"])
    rows, summary = [], {}
    for mode in TIER_MODES:
        rs = runs[mode]
        ttft = statistics.median(r["ttft_ms"] for r in rs)
        read = statistics.median(r["read_ms"] for r in rs)
        waited = statistics.median(r["waited_ms"] for r in rs)
        summary[mode] = {"ttft_ms": ttft, "read_ms": read, "waited_ms": waited}
        rows.append([mode, f"{read:.0f}", f"{waited:.0f}", f"{ttft - waited:.0f}",
                     f"{ttft:.0f}", f"{ttft / base:.2f}"])  # fmt: skip
    header = ["mode", "tier read ms", "TTFT waiting for it ms", "compute ms", "TTFT ms",
              "vs promote-then-prefill"]  # fmt: skip
    table = md_table(header, rows)
    per_block = d.layout.bytes_per_block
    notes = (f"model {args.model}, history {args.history} tokens in the file tier "
             f"({per_block * (args.history // args.block_size) / 2**20:.1f} MiB of KV, "
             f"{'dropped from' if args.cold else 'in'} the page cache), {args.new} new tokens, "
             f"{args.reps} reps (p50 of each column), torch threads {torch.get_num_threads()}; "
             "tier read: the promotion at the lookup, or the loader's start to its last "
             "layer; compute: TTFT less the wait")  # fmt: skip
    name = args.name or "bench_fetch_overlap_tier"
    results = {"args": vars(args), "runs": runs, "summary": summary}
    write_results(name, results, table + "\n\n" + notes)
    print(table)
    print(notes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--history", type=int, default=1024, help="history tokens decode holds")
    ap.add_argument("--new", type=int, default=64, help="the turn's new tokens")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--link-gbps", default="1,4", help="modelled link rates (GB/s), comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="", help="results file name (default: per source)")
    ap.add_argument(
        "--source", choices=("fetch", "tier"), default="fetch",
        help="where the history is: decode's pool (fetch) or P's file tier",
    )  # fmt: skip
    ap.add_argument("--cold", action="store_true", help="tier: drop the file from the page cache")
    ap.add_argument("--tier-path", default="", help="tier: the tier file's directory")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    loaded = load_model(ModelLoadConfig(model=args.model, seed=args.seed))
    vocab = loaded.config.vocab_size
    prompt = [rng.randrange(1, vocab) for _ in range(args.history + args.new)]
    if args.source == "tier":
        main_tier(args, loaded, prompt)
        return
    args.name = args.name or "bench_fetch_overlap"
    fabric = InProcessFabric()
    d = _engine(loaded, args)
    td = fabric.endpoint(d.kv_pool, d.layout, engine_id="d")
    d.add_request(Request("turn1", prompt[: args.history + 1], FIRST))
    while d.has_unfinished():
        d.step()
    rates = [float(x) for x in args.link_gbps.split(",")]
    runs: dict[str, list[dict[str, Any]]] = {f"{m}@{g:g}": [] for g in rates for m in MODES}
    n = 0
    for rep in range(args.reps + 1):  # the first round warms up, not counted
        for gbps in rates:
            for mode in MODES:
                n += 1
                rig = Rig(loaded, args, d, td, fabric, n)
                try:
                    result = run_one(mode, rig, prompt, args.history, gbps)
                finally:
                    rig.close()
                if rep > 0:
                    runs[f"{mode}@{gbps:g}"].append(result)
    tokens = {r["token"] for rs in runs.values() for r in rs}
    assert len(tokens) == 1, f"modes disagree on the first token: {tokens}"
    rows, summary = [], {}
    for gbps in rates:
        base = statistics.median(r["ttft_ms"] for r in runs[f"read-then-prefill@{gbps:g}"])
        for mode in MODES:
            rs = runs[f"{mode}@{gbps:g}"]
            ttft = statistics.median(r["ttft_ms"] for r in rs)
            read = statistics.median(r["read_ms"] for r in rs)
            waited = statistics.median(r["waited_ms"] for r in rs)
            compute = ttft - waited
            summary[f"{mode}@{gbps:g}"] = {"ttft_ms": ttft, "read_ms": read, "waited_ms": waited}
            rows.append([
                f"{gbps:g}", mode, f"{read:.0f}", f"{waited:.0f}", f"{compute:.0f}", f"{ttft:.0f}",
                f"{ttft / base:.2f}",
            ])  # fmt: skip
    header = [
        "link GB/s", "mode", "READ ms", "TTFT waiting for it ms", "compute ms", "TTFT ms",
        "vs read-then-prefill",
    ]  # fmt: skip
    table = md_table(header, rows)
    bs = args.block_size
    per_layer = _read_bytes_per_layer(d, args.history // bs)
    notes = (f"model {args.model}, history {args.history} tokens "
             f"({per_layer * d.layout.num_layers / 2**20:.1f} MiB of KV), {args.new} new tokens, "
             f"{args.reps} reps (p50 of each column), torch threads {torch.get_num_threads()}; "
             "READ: posted to its last layer landed (read-then-prefill: to the engine's seeing "
             "it); compute: TTFT less the wait")  # fmt: skip
    write_results(args.name, {"args": vars(args), "runs": runs, "summary": summary}, table + "\n\n" + notes)
    print(table)
    print(notes)


if __name__ == "__main__":
    main()
