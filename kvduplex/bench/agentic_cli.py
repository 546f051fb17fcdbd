"""The multi-turn agentic benchmark's command line (``kvduplex bench --workload agentic``,
``benchmarks/bench_agentic.py``).

Without ``--url`` it starts a local deployment of a preset (see
`kvduplex.bench.agentic_modes`) and runs the modes interleaved; with ``--url``
it runs the same workload against that one OpenAI-compatible endpoint.
Either way it writes results/<name>.json (every request's figures, the
plan, KV counters, command line, commit, machine), .md and .png.

    kvduplex bench --workload agentic                        # every mode, small preset
    kvduplex bench --workload agentic --quick                # smoke run on tiny
    kvduplex bench --workload agentic --url http://127.0.0.1:8000 --shapes reasoning
    kvduplex bench --workload agentic --model long --shapes coding_agent --length-scale 0.1 \
        --kv-cache-mb 128 --oversubscription 2     # sessions whose KV is 2x P's pool
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import asdict
from dataclasses import replace
from pathlib import Path
from typing import Any
from typing import ClassVar
from typing import Literal

from kvduplex.bench import agentic_by_turn as by_turn
from kvduplex.bench import agentic_floors as floors
from kvduplex.bench import agentic_report as report
from kvduplex.bench.agentic import check_tools_accepted
from kvduplex.bench.agentic import served_models
from kvduplex.bench.agentic_matrix import COSTS
from kvduplex.bench.agentic_matrix import Endpoint
from kvduplex.bench.agentic_matrix import Runs
from kvduplex.bench.agentic_matrix import estimate_total_s
from kvduplex.bench.agentic_matrix import fit_to_budget
from kvduplex.bench.agentic_matrix import run_interleaved
from kvduplex.bench.agentic_modes import MODE_NAMES
from kvduplex.bench.agentic_modes import ModeSpec
from kvduplex.bench.agentic_modes import kv_bytes_per_token
from kvduplex.bench.agentic_modes import kv_cache_mb_for
from kvduplex.bench.agentic_modes import modes_named
from kvduplex.bench.agentic_modes import start_deployment
from kvduplex.bench.agentic_sizing import endpoint_pool_tokens
from kvduplex.bench.agentic_sizing import max_session_tokens
from kvduplex.bench.agentic_sizing import oversubscribe
from kvduplex.bench.agentic_sizing import pool_tokens_for_mb
from kvduplex.bench.agentic_sizing import session_tokens
from kvduplex.bench.conversation import AGENT_SERVER_FLAGS
from kvduplex.bench.conversation import PromptForm
from kvduplex.bench.kvmetrics import Instance
from kvduplex.bench.kvmetrics import instance_role
from kvduplex.bench.results import provenance
from kvduplex.bench.results import write_results
from kvduplex.bench.workload import Shape
from kvduplex.bench.workload import WorkloadConfig
from kvduplex.bench.workload import describe
from kvduplex.bench.workload import max_turns
from kvduplex.bench.workload import plan_sessions
from kvduplex.bench.workload import shape_named
from kvduplex.bench.workload import system_tokens_of
from kvduplex.cluster import LocalCluster
from kvduplex.common.engine_config import CacheConfig
from kvduplex.common.presets import PRESETS
from kvduplex.common.settings import ProcessSettings
from kvduplex.common.settings import StrList

_WORKLOAD = WorkloadConfig()


def _echo(line: str) -> None:
    print(line, flush=True)


class AgenticBenchSettings(ProcessSettings):
    """Multi-turn agentic benchmark: sessions of turns with think time between them, over
    every KV mode on local instances, or against one OpenAI-compatible endpoint (--url)."""

    command: ClassVar[str] = "bench"
    reads_environment: ClassVar[bool] = False

    workload: Literal["agentic"] = "agentic"
    """serving (single-turn) or agentic (multi-turn sessions); each takes its own flags."""
    shapes: str = "agentic,reasoning"
    """agentic, reasoning, coding_agent, or several (commas)."""
    sessions: int = _WORKLOAD.num_sessions
    """Concurrent sessions."""
    oversubscription: float = 0.0
    """Instead of --sessions: as many sessions as make their KV (the system prompt once,
    each session's history at its last turn) this many times what prefill's pool holds,
    e.g. 1, 2 or 4 (0: --sessions)."""
    pool_tokens: int = 0
    """--oversubscription with --url: the prefill pool's size in tokens (0: read from the
    first prefill or colocated instance of --metrics-url, else the endpoint's /metrics)."""
    turns: int = _WORKLOAD.num_turns
    """Turns per session (coding_agent draws 20-40 per session unless given)."""
    system_tokens: int = _WORKLOAD.system_tokens
    """Shared system prompt, in tokens (coding_agent draws 8k-16k unless given)."""
    think_min: float = _WORKLOAD.think_time_s[0]
    """Shortest think time before a turn, in seconds (coding_agent: 2, unless given)."""
    think_max: float = _WORKLOAD.think_time_s[1]
    """Longest think time before a turn, in seconds (coding_agent: 30, unless given)."""
    length_scale: float = 1.0
    """Scales inputs and answers (and a shape's own system prompt range)."""
    form: PromptForm = PromptForm.TOKENS
    """Token-id prompts (/v1/completions), chat messages, or an agent's chat (forced tool
    calls sent back as received, free answers sent back without their reasoning; the
    local modes' servers run --reasoning-parser deepseek_r1)."""
    chat_plain: bool = False
    """Chat without tools (assistant text, user messages)."""
    repetitions: int = 1
    """Runs of the workload per mode."""
    seed: int = _WORKLOAD.seed
    """Seed of the workload."""
    quick: bool = False
    """Smoke run: tiny preset, 2 sessions x 3 turns, short lengths, no think time."""
    progress: bool = True
    """A progress bar (--no-progress: none)."""
    warmup: bool = True
    """A warm-up session per mode (--no-warmup: skip it)."""
    url: str = ""
    """Run against this OpenAI-compatible endpoint."""
    model: str = ""
    """Preset of the local modes (default small); with --url the served model (default:
    the first of /v1/models)."""
    label: str = "endpoint"
    """The endpoint's name in the report (--url)."""
    endpoint_kind: Literal["auto", "disaggregated", "colocated"] = "auto"
    """auto: disaggregated if /health says role router."""
    metrics_url: StrList = ()
    """Instances whose /metrics count KV bytes (commas, or the flag repeated; --url)."""
    modes: str = ",".join(n for n in MODE_NAMES if not n.endswith("-noplan"))
    """Local modes to run (also push-noplan and push+duplex-noplan: the router's plans off)."""
    kv_cache_mb: int = 0
    """Per instance; 0 sizes it from the workload (with --oversubscription: the instances'
    default pool)."""
    prefill_kv_cache_mb: int = 0
    """The prefill instances' pool alone (0: --kv-cache-mb): a prefill pool smaller than
    the sessions' KV, decode's holding it all."""
    budget_min: float = 45.0
    """Scale the local run down to fit this many minutes (estimate)."""
    fit: bool = True
    """Scale the local run to --budget-min (--no-fit: run the lengths as given)."""
    log_dir: str = ""
    """Process logs (empty: a temp dir)."""
    results_dir: str = "results"
    """Where results/<name>.json, .md and .png go."""
    name: str = ""
    """results/<name>.json (default agentic-<model|label>)."""
    log_level: str = "warning"
    """Python log level."""


def workload_configs(args: AgenticBenchSettings) -> list[WorkloadConfig]:
    """One config per shape, from the flags (``--quick`` overrides them). A shape's own
    ranges (turns, think time, system prompt) give way to the flags given for them."""
    sessions, turns, system = args.sessions, args.turns, args.system_tokens
    think, scale = (args.think_min, args.think_max), args.length_scale
    given = set(args.model_fields_set)
    if args.quick:
        sessions, turns, system, think, scale = 2, 3, 128, (0.0, 0.0), 0.1
        given |= {"turns", "system_tokens", "think_min"}
    configs = []
    for name in args.shapes.split(","):
        if not name.strip():
            continue
        shape = _flags_over_shape(shape_named(name.strip()).scaled(scale, scale, scale), given)
        drawn = system_tokens_of(shape, args.seed)
        configs.append(WorkloadConfig(
            shape=shape, num_sessions=sessions, num_turns=turns,
            system_tokens=system if drawn is None else drawn, think_time_s=think, seed=args.seed,
        ))  # fmt: skip
    return configs


def _flags_over_shape(shape: Shape, given: set[str]) -> Shape:
    """`shape` without the ranges whose flags were given (the workload's values then hold)."""
    if "turns" in given:
        shape = replace(shape, turns=None)
    if given & {"think_min", "think_max"}:
        shape = replace(shape, think_s=None)
    if "system_tokens" in given:
        shape = replace(shape, system_tokens=None)
    return shape


def _fit_local(args: AgenticBenchSettings, model: str, num_modes: int,
               configs: list[WorkloadConfig], notes: list[str]) -> list[WorkloadConfig]:  # fmt: skip
    """`configs` scaled to ``--budget-min`` (unless ``--no-fit``/``--quick``); notes say how."""
    cost = COSTS.get(model)
    if cost is None:
        return configs
    if args.fit and not args.quick:
        configs, est, scaled = fit_to_budget(
            configs, num_modes, args.repetitions, cost, args.budget_min * 60
        )
        notes += [f"scaled to fit ~{args.budget_min:g} min: {line}" for line in scaled]
    else:
        est = estimate_total_s(configs, num_modes, args.repetitions, cost)
    notes.append(f"estimated {est / 60:.0f} min (rough cost model: {cost})")
    return configs


def _run_local(args: AgenticBenchSettings, model: str, modes: list[ModeSpec],
               configs: list[WorkloadConfig], notes: list[str], meta: dict[str, Any],
               kv_mb: int) -> tuple[Runs, dict[str, bool]]:  # fmt: skip
    """Start the local deployment (pools of `kv_mb` MiB; 0: sized from the workload), run
    `modes` interleaved, stop it; (runs, disaggregated per mode)."""
    # every session of the largest shape at its last turn
    in_flight = max(sum(session_tokens(c)) for c in configs)
    kv_mb = kv_mb or kv_cache_mb_for(model, in_flight)
    p_kv_mb = args.prefill_kv_cache_mb or kv_mb
    pools = f"{kv_mb} MiB per instance" if p_kv_mb == kv_mb else f"{kv_mb} MiB, prefill {p_kv_mb} MiB"
    notes.append(f"model {model}, KV pool {pools}")
    for n in notes:
        _echo(n)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvduplex-agentic-"))
    with LocalCluster(log_dir=log_dir, env={"OMP_NUM_THREADS": "1"}) as cluster:
        parsing = AGENT_SERVER_FLAGS if args.form is PromptForm.AGENT else ()
        dep = start_deployment(
            cluster, modes, model=model, kv_cache_mb=kv_mb, echo=_echo, parsing_flags=parsing,
            prefill_kv_cache_mb=p_kv_mb,
        )  # fmt: skip
        endpoints = [
            Endpoint(m.name, dep.fronts[m.name], m.disaggregated, tuple(dep.instances[m.name]))
            for m in modes
            if m.name in dep.fronts
        ]
        if not endpoints:
            raise RuntimeError(f"no mode could start: {dep.skipped}")
        _echo(f"modes {[e.mode for e in endpoints]}; {dep.pinned}; logs in {log_dir}")
        notes.append(dep.pinned)
        notes += [f"mode {m} skipped: {why}" for m, why in dep.skipped.items()]
        meta.update(model=model, kv_cache_mb=kv_mb, skipped=dep.skipped, log_dir=str(log_dir),
                    fronts=dep.fronts)  # fmt: skip
        models = asyncio.run(served_models(endpoints[0].url))
        _check_context(configs, models, model, args.form)
        if _sends_tools(args):
            _require_tools(endpoints[0].url, model)
        runs = run_interleaved(
            endpoints, configs, model=model, repetitions=args.repetitions,
            form=args.form, chat_plain=args.chat_plain, warmup=args.warmup,
            progress=args.progress, echo=_echo,
        )  # fmt: skip
    return runs, {e.mode: e.disaggregated for e in endpoints}


def _check_context(
    configs: list[WorkloadConfig], models: list[dict[str, Any]], model: str, form: PromptForm
) -> None:
    """Refuse a workload whose longest session outgrows the model's context (if it says)."""
    limit = next((m.get("max_model_len") for m in models if m.get("id") == model), None)
    if not isinstance(limit, int):
        return
    # chat templates add a few tokens per message; the token-id form adds none
    overhead = 16 * 2 * max(max_turns(c) for c in configs) if form.is_chat else 0
    need = max(max_session_tokens(c) for c in configs) + overhead
    if need > limit:
        raise ValueError(
            f"the longest session needs up to {need} tokens of context, more than {model}'s "
            f"max_model_len {limit}; lower --turns, --length-scale or --system-tokens"
        )


def _sends_tools(args: AgenticBenchSettings) -> bool:
    return args.form is PromptForm.AGENT or (args.form is PromptForm.CHAT and not args.chat_plain)


def _require_tools(url: str, model: str) -> None:
    refusal = asyncio.run(check_tools_accepted(url, model))
    if refusal is not None:
        raise ValueError(f"{url} refuses chat requests with tools ({refusal}); rerun with --chat-plain")


def _run_url(args: AgenticBenchSettings, configs: list[WorkloadConfig], notes: list[str],
             meta: dict[str, Any]) -> tuple[Runs, dict[str, bool]]:  # fmt: skip
    url = args.url.rstrip("/")
    models = asyncio.run(served_models(url))
    model = args.model or str(models[0]["id"])
    _check_context(configs, models, model, args.form)
    if args.endpoint_kind == "auto":
        disaggregated = instance_role(url) == "router"
    else:
        disaggregated = args.endpoint_kind == "disaggregated"
    instances = tuple(Instance(u.rstrip("/"), instance_role(u)) for u in args.metrics_url)
    kind = "disaggregated" if disaggregated else "colocated"
    notes.append(f"endpoint {url} ({kind}), model {model}")
    meta.update(model=model, url=url, metrics_instances=[asdict(i) for i in instances])
    if _sends_tools(args):
        _require_tools(url, model)
    runs = run_interleaved(
        [Endpoint(args.label, url, disaggregated, instances)], configs, model=model,
        repetitions=args.repetitions, form=args.form, chat_plain=args.chat_plain,
        warmup=args.warmup, progress=args.progress, echo=_echo,
    )  # fmt: skip
    return runs, {args.label: disaggregated}


def _record(r: Any) -> dict[str, Any]:
    d = asdict(r)
    d["result"] = {k: v for k, v in d["result"].items() if k not in ("text", "token_ids")}
    return d


def main(args: AgenticBenchSettings) -> dict[str, Any]:
    """Run the benchmark the flags describe; write and print its report."""
    prov = provenance()
    configs = workload_configs(args)
    notes: list[str] = []
    meta: dict[str, Any] = {}
    if args.url:
        if args.oversubscription:
            pool = endpoint_pool_tokens(args.pool_tokens, args.url, args.metrics_url)
            configs = oversubscribe(configs, args.oversubscription, pool, notes)
        runs, disagg = _run_url(args, configs, notes, meta)
    else:
        model = args.model or ("tiny" if args.quick else "small")
        modes = modes_named([m.strip() for m in args.modes.split(",") if m.strip()])
        configs = _fit_local(args, model, len(modes), configs, notes)
        kv_mb = args.kv_cache_mb
        if args.oversubscription:
            kv_mb = kv_mb or CacheConfig().kv_cache_mb
            p_mb = args.prefill_kv_cache_mb or kv_mb  # sized against prefill's pool
            pool = pool_tokens_for_mb(p_mb, kv_bytes_per_token(model), CacheConfig().block_size)
            configs = oversubscribe(configs, args.oversubscription, pool, notes)
        runs, disagg = _run_local(args, model, modes, configs, notes, meta, kv_mb)
    notes.insert(0, _workload_note(configs, args))
    turns = report.per_turn(runs.records, disagg)
    summ = report.summary(runs.records, disagg)
    ratio = report.ratios(summ)
    bounds: list[report.BlockBound] = []
    if not args.url and meta["model"] in PRESETS:
        block_size = CacheConfig().block_size
        bytes_per_block = kv_bytes_per_token(meta["model"]) * block_size
        bounds = report.block_bounds(runs.records, bytes_per_block, block_size)
    engine = floors.engine_times(runs.records, runs.runs)
    load = floors.decode_loads(runs.records)
    sources = by_turn.source_rows(runs.records, runs.runs)
    sections = by_turn.source_lines(sources) + by_turn.by_turn_lines(turns)
    table = report.markdown(turns, summ, ratio, runs.kv, notes, bounds,
                            floors.floor_lines(engine, load), sections)
    name = args.name or "agentic-" + (args.label if args.url else meta["model"])
    name += "-quick" if args.quick and not args.name else ""
    result = {
        "provenance": prov,
        "options": args.model_dump(mode="json"),
        "workloads": [asdict(c) for c in configs],
        "plans": {c.shape.name: [asdict(p) for p in plan_sessions(c)] for c in configs},
        "notes": notes, "meta": meta, "disaggregated": disagg,
        "per_turn": [asdict(s) for s in turns], "summary": [asdict(s) for s in summ],
        "ratios": ratio, "kv": runs.kv, "runs": runs.runs,
        "block_bounds": [asdict(b) for b in bounds], "engine_times": [asdict(e) for e in engine],
        "engine_ratios": floors.engine_ratios(engine),
        "decode_loads": [asdict(x) for x in load], "load_ratios": floors.load_ratios(load),
        "prompt_sources": [asdict(x) for x in sources],
        "records": [_record(r) for r in runs.records],
    }  # fmt: skip
    directory = Path(args.results_dir)
    path = write_results(directory, name, result, table)
    png = report.plot_ttft(turns, directory / f"{name}.png")
    _echo(table)
    for line in report.ratio_lines(ratio):
        _echo(line)
    plot = str(png) if png else "no plot (pip install 'kvduplex[bench]')"
    _echo(f"wrote {path}, {path.with_suffix('.md')}, {plot}")
    return result


def _workload_note(configs: list[WorkloadConfig], args: AgenticBenchSettings) -> str:
    return (
        f"{args.form.value} form{' (plain chat)' if args.chat_plain else ''}, seed "
        f"{configs[0].seed}, {args.repetitions} repetition(s); "
        + "; ".join(describe(c) for c in configs)
    )
