"""Where one decode step's time goes (not a test).

Runs B requests (default batch 1 and 16) with prompts of `--context` tokens
until every one decodes, then times decode steps part by part with
`time.perf_counter` (module hooks inside the forward, wrapped methods
outside it)::

    engine.step ─┬─ schedule            scheduler.schedule
                 ├─ inputs              runner.execute minus the model: block tables,
                 │                      slot mapping, input tensors, attention metadata
                 ├─ forward ─┬─ embedding, rope tables, norms, attention projections,
                 │           │  attention core (rope, KV write, paged attention), MLP
                 │           ├─ logits (final norm + output head)
                 │           └─ forward glue (residual adds, the layer loop, hook cost)
                 ├─ sample              the sampler
                 ├─ update              scheduler.update (append, cache blocks, stops)
                 ├─ outputs             detokenising, RequestOutput
                 └─ other               the rest of the step (connector hooks, dicts)

Instrumented and plain steps alternate in blocks (A B A B), so the table
also says what the instrumentation itself costs. `--torch-profiler` adds the
number of aten operator calls per step (a count, steadier than times on a
shared machine) and the top operators by self time.

    .venv/bin/python benchmarks/profile_step.py                      # small, batch 1 and 16
    .venv/bin/python benchmarks/profile_step.py --model llama-50m    # HF folder built here
    .venv/bin/python benchmarks/profile_step.py --src /tmp/old-tree  # profile another checkout

Writes results/profile_step[-<tag>].json and .md.
"""

from __future__ import annotations

import argparse
import inspect
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

OUTSIDE = ["schedule", "inputs", "sample", "update", "outputs", "other"]
FORWARD = [
    "embedding", "rope tables", "norms", "attention projections", "attention core", "mlp",
    "logits", "forward glue",
]  # fmt: skip


class PartTimer:
    """Accumulates perf_counter time by part label for the current step."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self._starts: dict[int, float] = {}
        self._handles: list[Any] = []
        self._restore: list[Callable[[], None]] = []

    def wrap(self, obj: Any, name: str, label: str) -> None:
        """Time calls of ``obj.name`` under `label` (an instance attribute shadows the method)."""
        fn = getattr(obj, name)
        current = self.current

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                current[label] += time.perf_counter() - t0

        had_own = name in vars(obj)
        setattr(obj, name, timed)
        self._restore.append(lambda: setattr(obj, name, fn) if had_own else delattr(obj, name))

    def hook(self, module: Any, label: str) -> None:
        """Time `module`'s forward calls under `label`."""
        starts, current = self._starts, self.current

        def pre(mod: Any, _args: Any) -> None:
            starts[id(mod)] = time.perf_counter()

        def post(mod: Any, _args: Any, _out: Any) -> None:
            current[label] += time.perf_counter() - starts.pop(id(mod))

        self._handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        for undo in reversed(self._restore):
            undo()
        self._handles, self._restore = [], []


def instrument(timer: PartTimer, engine: Any) -> None:
    import kvduplex.engine.engine as engine_module

    model = engine.runner.model
    timer.wrap(engine.scheduler, "schedule", "_schedule")
    timer.wrap(engine.scheduler, "update", "_update")
    timer.wrap(engine, "_make_output", "_outputs")
    timer.wrap(engine.runner, "execute", "_execute")
    timer.wrap(model, "forward", "_forward")
    timer.wrap(model, "compute_logits", "_logits")
    timer.wrap(model.rotary, "cos_sin", "_rope")
    sample = engine_module.sample

    def timed_sample(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return sample(*args, **kwargs)
        finally:
            timer.current["_sample"] += time.perf_counter() - t0

    engine_module.sample = timed_sample
    timer._restore.append(lambda: setattr(engine_module, "sample", sample))
    timer.hook(model.embed_tokens, "_embedding")
    for layer in model.layers:
        timer.hook(layer.input_layernorm, "_norms")
        timer.hook(layer.post_attention_layernorm, "_norms")
        timer.hook(layer.self_attn, "_attn")
        timer.hook(layer.self_attn.qkv_proj, "_attn_proj")
        timer.hook(layer.self_attn.o_proj, "_attn_proj")
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            if norm is not None:
                timer.hook(norm, "_qk_norms")
        timer.hook(layer.mlp, "_mlp")


def split_step(raw: dict[str, float], step_s: float) -> dict[str, float]:
    """Seconds per reported part of one step, from the raw (nested) timings."""
    forward, logits = raw["_forward"], raw["_logits"]
    attn_core = raw["_attn"] - raw["_attn_proj"] - raw["_qk_norms"]
    inner = {
        "embedding": raw["_embedding"], "rope tables": raw["_rope"],
        "norms": raw["_norms"] + raw["_qk_norms"], "attention projections": raw["_attn_proj"],
        "attention core": attn_core, "mlp": raw["_mlp"],
    }  # fmt: skip
    parts = dict(inner)
    parts["logits"] = logits
    parts["forward glue"] = forward - sum(inner.values())
    parts["schedule"] = raw["_schedule"]
    parts["inputs"] = raw["_execute"] - forward - logits
    parts["sample"] = raw["_sample"]
    parts["update"] = raw["_update"]
    parts["outputs"] = raw["_outputs"]
    known = raw["_schedule"] + raw["_execute"] + raw["_sample"] + raw["_update"] + raw["_outputs"]
    parts["other"] = step_s - known
    parts["step"] = step_s
    return parts


def make_engine(
    model: str, seed: int, num_threads: int, max_num_seqs: int, decode_attention: str = "",
    dtype: str = "float32", kv_mb: int = 1024,
) -> Any:
    """An engine on CPU (`decode_attention` empty: the checkout's default; ``copy``: the
    runner's copy path, switched after the engine is built)."""
    from kvduplex.common.engine_config import CacheConfig
    from kvduplex.common.engine_config import EngineConfig
    from kvduplex.common.engine_config import ModelLoadConfig
    from kvduplex.common.engine_config import SchedulerConfig
    from kvduplex.engine.engine import LLMEngine

    switch = decode_attention == "copy"
    extra = {"decode_attention": decode_attention} if decode_attention and not switch else {}
    load = ModelLoadConfig(
        model=model, seed=seed, dtype=dtype, device="cpu", num_threads=num_threads, **extra
    )
    cfg = EngineConfig(
        model=load,
        cache=CacheConfig(block_size=16, kv_cache_mb=kv_mb),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048),
    )
    engine = LLMEngine(cfg)
    if switch:
        engine.runner.set_decode_attention("copy")
    return engine


def start_batch(engine: Any, batch: int, context: int, max_tokens: int, seed: int, tag: str) -> None:
    """Add `batch` greedy requests and step until every one of them decodes."""
    from kvduplex.common.sampling import SamplingParams
    from kvduplex.engine.request import Request

    rng = random.Random(seed)
    vocab = engine.loaded.config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    # A checkout from before 2026-12-04 (--src) takes the request's fields, not a Request.
    takes_request = len(inspect.signature(engine.add_request).parameters) == 1
    for i in range(batch):
        ids = [rng.randrange(3, vocab) for _ in range(context)]
        if takes_request:
            engine.add_request(Request(f"{tag}-{i}", ids, params))
        else:
            engine.add_request(f"{tag}-{i}", ids, params)
    while engine.scheduler.num_waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler._running
    ):
        engine.step()


def finish(engine: Any) -> None:
    while engine.has_unfinished():
        engine.step()


@contextmanager
def instrumented(engine: Any) -> Iterator[PartTimer]:
    timer = PartTimer()
    instrument(timer, engine)
    try:
        yield timer
    finally:
        timer.remove()


def profile_batch(engine: Any, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    reps, block = args.reps, args.block
    profile_steps = 3 if args.torch_profiler else 0
    # the first requests decode while the later ones still prefill (chunks of 2,048 tokens)
    prefill_steps = -(-batch * args.context // 2048) + 1
    max_tokens = args.warmup + 2 * reps * block + profile_steps + prefill_steps + 4
    start_batch(engine, batch, args.context, max_tokens, args.seed + batch, f"b{batch}")
    for _ in range(args.warmup):
        engine.step()
    plain: list[float] = []
    steps: list[dict[str, float]] = []
    for _ in range(reps):  # A B A B: plain block, instrumented block
        for _ in range(block):
            t0 = time.perf_counter()
            engine.step()
            plain.append(time.perf_counter() - t0)
        with instrumented(engine) as timer:
            for _ in range(block):
                timer.current.clear()
                t0 = time.perf_counter()
                engine.step()
                steps.append(split_step(defaultdict(float, timer.current), time.perf_counter() - t0))
    result: dict[str, Any] = {
        "batch": batch,
        "plain_step_ms": [s * 1e3 for s in plain],
        "parts_ms": {k: [s[k] * 1e3 for s in steps] for k in steps[0]},
    }
    if args.torch_profiler:
        result["ops"] = op_counts(engine, profile_steps)
    finish(engine)
    return result


def op_counts(engine: Any, num_steps: int) -> dict[str, Any]:
    """aten calls per step and the top operators by self CPU time, under torch.profiler."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            engine.step()
    events = prof.key_averages()
    aten = [e for e in events if e.key.startswith("aten::")]
    top = sorted(aten, key=lambda e: -e.self_cpu_time_total)[:10]
    return {
        "aten_calls_per_step": sum(e.count for e in aten) / num_steps,
        "top": [
            {"op": e.key, "calls_per_step": e.count / num_steps,
             "self_ms_per_step": e.self_cpu_time_total / 1e3 / num_steps}
            for e in top
        ],
    }  # fmt: skip


def summarize(result: dict[str, Any]) -> dict[str, float]:
    """Median ms per part, and the shares that matter."""
    med = {k: statistics.median(v) for k, v in result["parts_ms"].items()}
    step = med["step"]
    outside = sum(med[k] for k in OUTSIDE)
    return {
        **med,
        "outside_forward_ms": outside,
        "outside_share": outside / step,
        "plain_step_ms": statistics.median(result["plain_step_ms"]),
        "instrumentation_cost": step / statistics.median(result["plain_step_ms"]) - 1,
    }


def table(results: list[dict[str, Any]]) -> str:
    from benchmarks.common import md_table

    sums = [summarize(r) for r in results]
    header = ["part"] + [f"batch {r['batch']} ms" for r in results] + [f"batch {r['batch']} %" for r in results]
    rows = []
    for part in [*OUTSIDE, *FORWARD]:
        rows.append(
            [part]
            + [f"{s[part]:.3f}" for s in sums]
            + [f"{100 * s[part] / s['step']:.1f}" for s in sums]
        )
    rows.append(["**outside the forward**"] + [f"{s['outside_forward_ms']:.2f}" for s in sums]
                + [f"{100 * s['outside_share']:.1f}" for s in sums])
    rows.append(["step (instrumented)"] + [f"{s['step']:.2f}" for s in sums] + ["100"] * len(sums))
    rows.append(["step (plain, interleaved)"] + [f"{s['plain_step_ms']:.2f}" for s in sums]
                + [f"{100 * s['plain_step_ms'] / s['step']:.1f}" for s in sums])
    text = md_table(header, rows)
    for r in results:
        if "ops" in r:
            ops = r["ops"]
            text += (f"\n\nbatch {r['batch']}: {ops['aten_calls_per_step']:.0f} aten calls per step; "
                     "top by self time: " + ", ".join(
                         f"{o['op'].removeprefix('aten::')} {o['self_ms_per_step']:.2f} ms "
                         f"({o['calls_per_step']:.0f}x)" for o in ops["top"][:6]))
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", help="a preset, an HF folder, or llama-50m (built here)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=512, help="prompt tokens of each request")
    ap.add_argument("--reps", type=int, default=4, help="instrumented/plain block pairs")
    ap.add_argument("--block", type=int, default=5, help="steps per block")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cpus", default="0", help="cpus to pin to, e.g. 0 or 0,1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--decode-attention", default="", help="auto, paged, copy or flex (default: the checkout's; sdpa in checkouts before paged)")
    ap.add_argument("--kv-mb", type=int, default=1024, help="KV pool MiB: must hold every batch's context")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--torch-profiler", action="store_true")
    ap.add_argument("--src", default="", help="import kvduplex from this checkout instead")
    ap.add_argument("--tag", default="", help="suffix of the result files")
    args = ap.parse_args()
    from benchmarks.common import pin
    from benchmarks.common import write_results
    from benchmarks.llama_folder import build_llama_folder

    if args.src:  # after this checkout's benchmark helpers, before any kvduplex import
        sys.path.insert(0, str(Path(args.src).resolve()))

    pinned = pin({int(c) for c in args.cpus.split(",")}, args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model == "llama-50m":
            model = str(build_llama_folder(Path(tmp) / "llama-50m", args.seed))
        engine = make_engine(
            model, args.seed, args.threads, max(args.batches), args.decode_attention, args.dtype,
            args.kv_mb,
        )
        results = [profile_batch(engine, b, args) for b in args.batches]
    import kvduplex

    attention = getattr(engine.runner, "decode_attention", "sdpa")
    text = (f"Decode step of `{args.model}` {args.dtype}, {attention} decode attention, "
            f"context {args.context}+, median ms per step "
            f"over {args.reps * args.block} instrumented steps ({pinned}; kvduplex from "
            f"{Path(kvduplex.__file__).parent.parent})\n\n" + table(results))
    name = "profile_step" + (f"-{args.tag}" if args.tag else "")
    write_results(name, {"args": vars(args), "pinned": pinned, "results": results,
                         "summary": [summarize(r) for r in results]}, text)
    print(text)


if __name__ == "__main__":
    main()
