"""What the duplex return costs decode, and what push costs one long request (not a test).

One deployment (`kvduplex.bench.agentic_modes.start_deployment`): a colocated instance and
P pinned to one core, D to the other, one torch thread each; a push router and a push
router with ``--return-mode push`` (push+duplex) over the same P and D.

**Equal load.** For each concurrency C: C token-id sessions of ``--turns`` turns, every
turn a burst of the C sessions' next requests started together (the next burst when all
answered). Answer lengths differ per session (seeded, the same list for both modes), so
the returns of the sessions that finish first run while the others still decode: the
return's work lands on D's decode steps. Both modes get the same number of sessions,
turns, prompt lengths and answer lengths, in bursts interleaved push, push+duplex,
push+duplex, push, ...; their token ids differ (no mode reuses another's cached KV).
Reported per mode: client TPOT p50/p90 over all requests, the mean number of that burst's
requests decoding at once over each request's decode (equal load means equal here), and
the KV that went back to P.

**One long request.** A ``--long-prompt``-token prompt (fresh random ids) through the push
router, then to the colocated instance, alternating, ``--long-rounds`` times: TPOT each.
The colocated instance decodes on P's core, D on the other: same compute per core.

    .venv/bin/python benchmarks/bench_return_cost.py                      # small preset
    .venv/bin/python benchmarks/bench_return_cost.py --model results/llama-50m --kv-cache-mb 1024
    .venv/bin/python benchmarks/bench_return_cost.py --quick              # smoke run on tiny

Writes results/return-cost-<model>[-<tag>].json (every request's figures) and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import md_table
from benchmarks.common import write_results
from kvduplex.bench.agentic_modes import modes_named
from kvduplex.bench.agentic_modes import start_deployment
from kvduplex.bench.client import RequestResult
from kvduplex.bench.client import percentile
from kvduplex.bench.client import stream_request
from kvduplex.bench.kvmetrics import Instance
from kvduplex.bench.kvmetrics import kv_moved
from kvduplex.bench.kvmetrics import settle
from kvduplex.bench.kvmetrics import snapshot
from kvduplex.cluster import LocalCluster

PUSH, DUPLEX, COLOCATED = "push", "push+duplex", "colocated"
IDS = (3, 250)
"""Prompt token ids are drawn from this range: ordinary ids of every preset's byte tokenizer,
and inside any HF model's vocabulary."""


@dataclass
class Timed:
    """One request of a run: what the client saw, and when it was sent (perf_counter)."""

    mode: str
    part: str
    """``load`` (a burst of sessions) or ``long`` (the single long request)."""
    concurrency: int
    round: int
    turn: int
    sent: float
    result: RequestResult
    decodes_at_once: float = 0.0
    """Time-weighted mean of the burst's requests decoding during this one's decode."""


def decodes_at_once(burst: list[Timed]) -> None:
    """Fill each request's time-weighted mean of the burst's requests decoding during its
    own decode (first token to last; itself included)."""
    spans = [(t.sent + t.result.ttft_s, t.sent + t.result.e2e_s) for t in burst if t.result.ok]
    for t in burst:
        if not t.result.ok:
            continue
        start, end = t.sent + t.result.ttft_s, t.sent + t.result.e2e_s
        if end <= start:
            t.decodes_at_once = 1.0
            continue
        overlap = sum(max(0.0, min(end, e) - max(start, s)) for s, e in spans)
        t.decodes_at_once = overlap / (end - start)


async def timed_request(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: list[int],
    max_tokens: int,
    session: str,
) -> tuple[float, RequestResult]:
    """One streamed greedy completion; `session` names its conversation as the routers read it
    (``prompt_cache_key`` and ``X-Session-Id``, as `kvduplex.bench.conversation` sends them)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "prompt_cache_key": session}  # fmt: skip
    sent = time.perf_counter()
    return sent, await stream_request(
        client, url, "/v1/completions", body, {"X-Session-Id": session}
    )


@dataclass
class Plan:
    """The equal-load workload: the same shape for every mode."""

    system_tokens: int
    turn_tokens: int
    answer_tokens: list[int]
    """Per session (the same list for every mode and turn)."""
    turns: int


async def run_sessions(
    client: httpx.AsyncClient,
    url: str,
    mode: str,
    model: str,
    plan: Plan,
    rng: random.Random,
    rnd: int,
) -> list[Timed]:
    """The plan's sessions through `url`, turn by turn, each turn one burst."""
    histories = [
        [rng.randrange(*IDS) for _ in range(plan.system_tokens)] for _ in plan.answer_tokens
    ]
    out: list[Timed] = []
    for turn in range(plan.turns):
        for h in histories:
            h += [rng.randrange(*IDS) for _ in range(plan.turn_tokens)]
        got = await asyncio.gather(
            *(
                timed_request(client, url, model, h, n, f"{mode}-c{len(histories)}-r{rnd}-s{i}")
                for i, (h, n) in enumerate(zip(histories, plan.answer_tokens, strict=True))
            )
        )
        burst = [Timed(mode, "load", len(histories), rnd, turn, sent, r) for sent, r in got]
        decodes_at_once(burst)
        out += burst
        for h, (_, r) in zip(histories, got, strict=True):
            if not r.ok:
                raise RuntimeError(f"{mode} turn {turn} failed: {r.error}")
            h += r.token_ids
    return out


async def measure(
    args: argparse.Namespace, fronts: dict[str, str], instances: list[Instance]
) -> dict[str, Any]:
    rng = random.Random(args.seed)
    timeout = httpx.Timeout(1800.0, connect=10.0)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    records: list[Timed] = []
    kv: dict[str, dict[str, Any]] = {}
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        for mode, url in fronts.items():  # warm-up: handshakes, first allocations
            prompt = [rng.randrange(*IDS) for _ in range(64)]
            _, r = await timed_request(client, url, args.model, prompt, 4, f"warm-{mode}")
            if not r.ok:
                raise RuntimeError(f"warm-up on {mode} failed: {r.error}")
        answers = random.Random(args.seed + 1)
        order = 0
        for conc in args.concurrency:
            plan = Plan(args.system_tokens, args.turn_tokens,
                        [answers.randint(*args.answer_tokens) for _ in range(conc)], args.turns)  # fmt: skip
            for rnd in range(args.rounds):
                for mode in (PUSH, DUPLEX) if order % 2 == 0 else (DUPLEX, PUSH):
                    before = await asyncio.to_thread(snapshot, instances)
                    got = await run_sessions(client, fronts[mode], mode, args.model, plan, rng, rnd)
                    after = await asyncio.to_thread(settle, instances)
                    moved = kv_moved(instances, before, after)
                    cell = kv.setdefault(
                        f"{mode}@{conc}", {"p_to_d_bytes": 0.0, "d_to_p_bytes": 0.0}
                    )
                    cell["p_to_d_bytes"] += moved.p_to_d_bytes or 0.0
                    cell["d_to_p_bytes"] += moved.d_to_p_bytes or 0.0
                    records += got
                    tpots = [t.result.tpot_s * 1e3 for t in got if t.result.ok]
                    print(f"load C={conc} round {rnd} {mode}: TPOT p50 {percentile(tpots, 50):.1f} ms, "
                          f"D->P {(moved.d_to_p_bytes or 0) / 2**20:.1f} MiB", flush=True)  # fmt: skip
                    order += 1
        for rnd in range(args.long_rounds):
            for mode in (PUSH, COLOCATED) if rnd % 2 == 0 else (COLOCATED, PUSH):
                prompt = [rng.randrange(*IDS) for _ in range(args.long_prompt)]
                sent, r = await timed_request(
                    client,
                    fronts[mode],
                    args.model,
                    prompt,
                    args.long_max_tokens,
                    f"long-{mode}-{rnd}",
                )
                records.append(Timed(mode, "long", 1, rnd, 0, sent, r, 1.0))
                print(f"long round {rnd} {mode}: TTFT {r.ttft_s * 1e3:.0f} ms, TPOT {r.tpot_s * 1e3:.1f} ms "
                      f"{r.error}", flush=True)  # fmt: skip
    return {"records": records, "kv": kv}


def at_load_ratio(push: list[Timed], duplex: list[Timed]) -> float | None:
    """push+duplex's mean TPOT over push's at push+duplex's load: a line TPOT = a + b * decodes
    fitted to push's requests, read at push+duplex's mean decodes at once (as
    `kvduplex.bench.agentic_floors` does); None when push's loads spread too little to fit."""
    xs = np.array([t.decodes_at_once for t in push if t.result.ok])
    ys = np.array([t.result.tpot_s for t in push if t.result.ok])
    dup = [t for t in duplex if t.result.ok]
    if len(xs) < 3 or np.ptp(xs) < 0.5 or not dup:
        return None
    slope, intercept = np.polyfit(xs, ys, 1)
    at = intercept + slope * float(np.mean([t.decodes_at_once for t in dup]))
    return float(np.mean([t.result.tpot_s for t in dup]) / at) if at > 0 else None


def _tpot_after_gap(r: RequestResult) -> float:
    """Mean gap between tokens from the second on: `tpot_s` without the first gap (which
    in push holds the handoff from prefill's first token to decode's second)."""
    n = len(r.token_ids)
    return (r.e2e_s - r.ttft_s - r.first_gap_s) / (n - 2) if n > 2 else r.tpot_s


def summarize(
    records: list[Timed], kv: dict[str, Any], args: argparse.Namespace
) -> tuple[list[dict[str, Any]], str]:
    rows: list[dict[str, Any]] = []
    for part, conc, mode in dict.fromkeys((t.part, t.concurrency, t.mode) for t in records):
        cell = [t for t in records if (t.part, t.concurrency, t.mode) == (part, conc, mode)]
        ok = [t for t in cell if t.result.ok]
        tpot = [t.result.tpot_s * 1e3 for t in ok]
        rows.append({
            "part": part, "concurrency": conc, "mode": mode, "n": len(ok), "errors": len(cell) - len(ok),
            "tpot_p50_ms": percentile(tpot, 50), "tpot_p90_ms": percentile(tpot, 90),
            "ttft_p50_ms": percentile([t.result.ttft_s * 1e3 for t in ok], 50),
            "first_gap_p50_ms": percentile([t.result.first_gap_s * 1e3 for t in ok], 50),
            "tpot_after_gap_p50_ms": percentile([_tpot_after_gap(t.result) * 1e3 for t in ok], 50),
            "decodes_at_once": sum(t.decodes_at_once for t in ok) / max(len(ok), 1),
            "d_to_p_MiB": kv.get(f"{mode}@{conc}", {}).get("d_to_p_bytes", 0.0) / 2**20 if part == "load" else None,
        })  # fmt: skip
    by = {(r["part"], r["concurrency"], r["mode"]): r for r in rows}
    lines = []
    for conc in args.concurrency:
        push, duplex = by.get(("load", conc, PUSH)), by.get(("load", conc, DUPLEX))
        if push and duplex:
            fit = at_load_ratio(*([t for t in records if (t.part, t.concurrency, t.mode) == ("load", conc, m)]
                                  for m in (PUSH, DUPLEX)))  # fmt: skip
            lines.append([f"equal load, C={conc}", f"{push['tpot_p50_ms']:.1f}", f"{duplex['tpot_p50_ms']:.1f}",
                          f"**{duplex['tpot_p50_ms'] / push['tpot_p50_ms']:.3f}**",
                          "-" if fit is None else f"{fit:.3f}",
                          f"{push['decodes_at_once']:.2f} / {duplex['decodes_at_once']:.2f}",
                          f"{push['d_to_p_MiB']:.1f} / {duplex['d_to_p_MiB']:.1f}", f"{push['n']} / {duplex['n']}"])  # fmt: skip
    push, colo = by.get(("long", 1, PUSH)), by.get(("long", 1, COLOCATED))
    if push and colo:
        lines.append([f"one {args.long_prompt}-token prompt", f"{push['tpot_p50_ms']:.1f}",
                      f"colocated {colo['tpot_p50_ms']:.1f}", f"**{push['tpot_p50_ms'] / colo['tpot_p50_ms']:.3f}** (push / colocated)", "-",
                      "1 / 1", "-", f"{push['n']} / {colo['n']}"])  # fmt: skip
        lines.append([f"the same, tokens 2 on (first gap {push['first_gap_p50_ms']:.1f} / "
                      f"{colo['first_gap_p50_ms']:.1f} ms)", f"{push['tpot_after_gap_p50_ms']:.1f}",
                      f"colocated {colo['tpot_after_gap_p50_ms']:.1f}",
                      f"**{push['tpot_after_gap_p50_ms'] / colo['tpot_after_gap_p50_ms']:.3f}**", "-",
                      "1 / 1", "-", f"{push['n']} / {colo['n']}"])  # fmt: skip
    header = ["case", "push TPOT p50 ms", "push+duplex (or colocated) TPOT p50 ms", "ratio (p50)",
              "push+duplex / push's TPOT line at push+duplex's load (means)",
              "decodes at once push / other", "D->P MiB push / push+duplex", "requests"]  # fmt: skip
    detail = md_table(list(rows[0]), [list(r.values()) for r in rows]) if rows else ""
    text = (
        f"The return's cost on decode, `{args.model}`; {args.pinned}. Equal load: C sessions x "
        f"{args.turns} turns, system {args.system_tokens} tokens, {args.turn_tokens} new tokens "
        f"a turn, answers {args.answer_tokens[0]}-{args.answer_tokens[1]} tokens (per session, same "
        f"for both modes), {args.rounds} run(s) per mode, interleaved. One long request: "
        f"{args.long_max_tokens} tokens, {args.long_rounds} per mode, alternating.\n\n"
        + md_table(header, lines)
        + "\n\n"
        + detail
    )
    return rows, text


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="small", help="preset or HF folder")
    ap.add_argument("--kv-cache-mb", type=int, default=1024, help="per instance")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[4, 8], help="sessions per burst")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--turn-tokens", type=int, default=128, help="new prompt tokens every turn")
    ap.add_argument("--answer-tokens", type=int, nargs=2, default=[32, 96], metavar=("MIN", "MAX"))
    ap.add_argument("--rounds", type=int, default=3, help="runs of the sessions per mode and C")
    ap.add_argument("--long-prompt", type=int, default=2000)
    ap.add_argument("--long-max-tokens", type=int, default=64)
    ap.add_argument("--long-rounds", type=int, default=6, help="long requests per mode")
    ap.add_argument("--front-on-p", action="store_true",
                    help="routers and this client on P's core, so D has its core to itself")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run, seconds (on tiny unless --model names another)",
    )
    args = ap.parse_args()
    if args.quick:
        args.model = "tiny" if args.model == "small" else args.model  # a given --model stays
        args.kv_cache_mb, args.concurrency, args.turns = 64, [3], 2
        args.system_tokens, args.turn_tokens, args.answer_tokens = 64, 32, [20, 40]
        args.rounds, args.long_prompt, args.long_max_tokens, args.long_rounds = 1, 300, 8, 1
    return args


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the cluster
    args = parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="return-cost-"))
    with LocalCluster(log_dir=log_dir, env={"OMP_NUM_THREADS": "1"}) as cluster:
        dep = start_deployment(cluster, modes_named([COLOCATED, PUSH, DUPLEX]), model=args.model,
                               kv_cache_mb=args.kv_cache_mb, echo=lambda s: print(s, flush=True),
                               routers_on_p=args.front_on_p)  # fmt: skip
        if dep.skipped:
            raise RuntimeError(f"modes skipped: {dep.skipped}")
        args.pinned = dep.pinned
        if args.front_on_p:
            p_cpu = min(os.sched_getaffinity(0))
            os.sched_setaffinity(0, {p_cpu})
            args.pinned += f"; client on cpu {p_cpu}"
        print(f"{args.pinned}; logs in {log_dir}", flush=True)
        instances = list(dict.fromkeys(dep.instances[PUSH]))
        got = asyncio.run(measure(args, dep.fronts, instances))
    rows, table = summarize(got["records"], got["kv"], args)
    data = {
        "args": vars(args), "log_dir": str(log_dir), "rows": rows, "kv": got["kv"],
        "records": [{**asdict(t), "result": {k: v for k, v in asdict(t.result).items() if k not in ("text", "token_ids")}}
                    for t in got["records"]],
    }  # fmt: skip
    name = "return-cost-" + Path(args.model).name + (f"-{args.tag}" if args.tag else "")
    name += "-quick" if args.quick else ""
    path = write_results(name, data, table)
    print(table)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
