"""Run a multi-turn workload on several endpoints interleaved, and size it to a time budget.

Order: for each shape, for each repetition, every mode once, the order
rotated by one per repetition (A B C, B C A, ...), after a warm-up session per
mode. Modes run one at a time (they share cores); within a run all sessions
are concurrent. Every mode gets the same plan (lengths, think times); the
words differ per mode and repetition so no run hits another's prefix cache.
Around each run the instances' KV counters are read, after they settle, and
the prompt tokens by source (see `kvduplex.bench.prompt_sources`) from the
instances and the front door.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from kvduplex.bench.agentic import RunTarget
from kvduplex.bench.agentic import TurnRecord
from kvduplex.bench.agentic import run_workload
from kvduplex.bench.agentic_report import SUMMARY_MIN_TURN
from kvduplex.bench.conversation import PromptForm
from kvduplex.bench.kvmetrics import Instance
from kvduplex.bench.kvmetrics import KVMoved
from kvduplex.bench.kvmetrics import kv_moved
from kvduplex.bench.kvmetrics import return_records
from kvduplex.bench.kvmetrics import settle
from kvduplex.bench.prompt_sources import Samples
from kvduplex.bench.prompt_sources import sources_by_role
from kvduplex.bench.prompt_sources import try_scrape
from kvduplex.bench.workload import Shape
from kvduplex.bench.workload import WorkloadConfig
from kvduplex.bench.workload import plan_sessions


@dataclass(frozen=True)
class Endpoint:
    """One mode's front door and the instances that count its KV."""

    mode: str
    url: str
    disaggregated: bool
    instances: tuple[Instance, ...] = ()


@dataclass
class Runs:
    """Everything the runs produced."""

    records: list[TurnRecord] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)
    """One entry per (shape, repetition, mode): wall seconds and KV counter deltas."""
    kv: dict[str, dict[str, float | None]] = field(default_factory=dict)
    """'mode / shape' -> bytes P->D and D->P summed over its runs (None: not counted)."""


def _warmup_config(config: WorkloadConfig) -> WorkloadConfig:
    # Same system prompt (same seed, length and kind), one short two-turn session.
    shape = Shape("warmup", (32, 32), (8, 8), tools_in_system=config.shape.tools_in_system)
    return replace(config, shape=shape, num_sessions=1, num_turns=2, think_time_s=(0.0, 0.0))


def _warmup_configs(configs: list[WorkloadConfig]) -> list[WorkloadConfig]:
    """One warm-up per distinct system prompt of `configs`."""
    by_prompt: dict[tuple[int, int, bool], WorkloadConfig] = {}
    for c in configs:
        by_prompt.setdefault((c.seed, c.system_tokens, c.shape.tools_in_system), c)
    return [_warmup_config(c) for c in by_prompt.values()]


def _add(a: float | None, b: float | None) -> float | None:
    return b if a is None else a + (b or 0.0)


def run_interleaved(
    endpoints: list[Endpoint],
    configs: list[WorkloadConfig],
    *,
    model: str,
    repetitions: int = 1,
    form: PromptForm = PromptForm.TOKENS,
    chat_plain: bool = False,
    warmup: bool = True,
    progress: bool = True,
    echo: Callable[[str], None],
) -> Runs:
    """Run each config (shape) on every endpoint, interleaved as the module says."""
    out = Runs()

    def target(ep: Endpoint) -> RunTarget:
        return RunTarget(url=ep.url, model=model, mode=ep.mode, form=form, chat_plain=chat_plain)

    if warmup:
        for ep, (i, warm) in itertools.product(endpoints, enumerate(_warmup_configs(configs))):
            salt = f"warmup-{ep.mode}" + (f"-{i}" if i else "")  # a session id per warm-up
            recs, _ = asyncio.run(run_workload(target(ep), warm, salt=salt, progress=False))
            failed = [r.result.error for r in recs if not r.result.ok]
            if failed:
                raise RuntimeError(f"warm-up on {ep.mode} ({ep.url}) failed: {failed[0]}")
        echo(f"warmed up {[ep.mode for ep in endpoints]}")
    for config in configs:
        shape = config.shape.name
        for rep in range(repetitions):
            k = rep % len(endpoints)
            for ep in endpoints[k:] + endpoints[:k]:
                before = settle(list(ep.instances)) if ep.instances else {}
                before.update(_front_snapshot(ep))
                recs, wall = asyncio.run(
                    run_workload(target(ep), config, salt=f"{ep.mode}-r{rep}", repetition=rep,
                                 progress=progress)
                )  # fmt: skip
                moved = KVMoved()
                after: dict[str, Samples] = {}
                if ep.instances:
                    after = settle(list(ep.instances))
                    moved = kv_moved(list(ep.instances), before, after)
                    attach_returns(recs, return_records(list(ep.instances)))
                after.update(_front_snapshot(ep))
                out.records.extend(recs)
                out.runs.append({
                    "mode": ep.mode, "shape": shape, "repetition": rep, "wall_s": wall,
                    "p_to_d_bytes": moved.p_to_d_bytes, "d_to_p_bytes": moved.d_to_p_bytes,
                    "counters": moved.per_instance, "engine_ttft_s": moved.engine_ttft_s,
                    "engine_ttft_count": moved.engine_ttft_count,
                    "sources": sources_by_role(_roles(ep), before, after),
                })  # fmt: skip
                kv = out.kv.setdefault(f"{ep.mode} / {shape}", {"p_to_d_bytes": None, "d_to_p_bytes": None})
                kv["p_to_d_bytes"] = _add(kv["p_to_d_bytes"], moved.p_to_d_bytes)
                kv["d_to_p_bytes"] = _add(kv["d_to_p_bytes"], moved.d_to_p_bytes)
                echo(_run_line(ep.mode, shape, rep, recs, wall))
    return out


def _roles(ep: Endpoint) -> dict[str, str]:
    """url -> role of the servers whose /metrics say where prompts came from: the instances,
    and the front door where it is none of them (a router, or an endpoint given alone)."""
    roles = {i.url: i.role for i in ep.instances}
    if ep.url not in roles:
        roles[ep.url] = "router" if ep.disaggregated else "server"
    return roles


def _front_snapshot(ep: Endpoint) -> dict[str, Samples]:
    """The front door's /metrics where it is not one of the instances (none if unreadable)."""
    if any(i.url == ep.url for i in ep.instances):
        return {}
    return {ep.url: try_scrape(ep.url)}


def attach_returns(recs: list[TurnRecord], by_request: dict[str, dict[str, Any]]) -> None:
    """Each record's duplex return, from decode's records by response id (if it has one)."""
    for r in recs:
        got = by_request.get(r.result.response_id)
        if got is not None:
            r.returned_blocks = int(got["num_sent_blocks"])
            r.returned_bytes = int(got["num_sent_bytes"])


def _run_line(mode: str, shape: str, rep: int, recs: list[TurnRecord], wall: float) -> str:
    ok = [r for r in recs if r.result.ok]
    late = sorted(r.result.ttft_s for r in ok if r.turn >= SUMMARY_MIN_TURN)
    med = f"{late[len(late) // 2] * 1e3:.0f} ms" if late else "n/a"
    line = f"  {shape:9} rep {rep} {mode:18} {len(ok)}/{len(recs)} ok, TTFT (turns >= 3) ~{med}, {wall:.0f} s"
    errors = [r.result.error for r in recs if not r.result.ok]
    return line + (f"; first error: {errors[0][:200]}" if errors else "")


@dataclass(frozen=True)
class CostModel:
    """Rough per-token costs of a preset on one core of the development machine."""

    prefill_s_per_token: float
    decode_s_per_token: float
    """Per output token of one stream, with about six streams decoding at once."""
    start_s: float
    """Starting the deployment (loading every instance)."""


COSTS: Mapping[str, CostModel] = MappingProxyType({
    # From the serving benchmark's runs (docs/benchmarks.md): small prefills ~3.6-4.0 ms/token and
    # decodes at 65-85 ms/token with 1-3 streams; kv-heavy ~3.9-6 ms and 70-180 ms.
    "small": CostModel(prefill_s_per_token=0.004, decode_s_per_token=0.10, start_s=90.0),
    "kv-heavy": CostModel(prefill_s_per_token=0.005, decode_s_per_token=0.12, start_s=90.0),
    "tiny": CostModel(prefill_s_per_token=0.0002, decode_s_per_token=0.005, start_s=20.0),
    # long: a 16k-token prompt in 2k chunks ~0.9 ms/token at its start, ~5 ms/token near 16k
    # (attention); one decode stream at 16k of context ~95 ms/token (docs/benchmarks.md).
    "long": CostModel(prefill_s_per_token=0.002, decode_s_per_token=0.10, start_s=60.0),
})


def estimate_run_s(config: WorkloadConfig, cost: CostModel) -> float:
    """One run of `config` on one mode: the slowest session, each turn prefilling its new
    input and the previous answer (no return), then decoding its answer."""
    longest = 0.0
    for plan in plan_sessions(config):
        total, prev_answer = 0.0, 0
        for turn in plan.turns:
            total += turn.think_s + (turn.input_tokens + prev_answer) * cost.prefill_s_per_token
            total += turn.answer_tokens * cost.decode_s_per_token
            prev_answer = turn.answer_tokens
        longest = max(longest, total)
    return longest


def estimate_total_s(
    configs: list[WorkloadConfig], num_modes: int, repetitions: int, cost: CostModel
) -> float:
    runs = sum(estimate_run_s(c, cost) for c in configs) * num_modes * repetitions
    warmups = _warmup_configs(configs)
    prompts = sum(w.system_tokens + 64 for w in warmups)
    warmup = num_modes * prompts * cost.prefill_s_per_token + num_modes * 2 * len(warmups)
    return cost.start_s + runs + warmup


_LADDER: tuple[tuple[float, int], ...] = (
    (1.0, 0), (0.75, 0), (0.5, 0), (0.5, 2), (0.375, 2), (0.25, 2), (0.25, 3),
)  # fmt: skip
"""(answer length scale, turns dropped), tried in order until the estimate fits."""


def fit_to_budget(
    configs: list[WorkloadConfig], num_modes: int, repetitions: int, cost: CostModel,
    budget_s: float,
) -> tuple[list[WorkloadConfig], float, list[str]]:
    """The first step of the ladder whose estimate fits `budget_s`: (configs, estimate, notes).

    Notes say what was scaled; the last step is taken if none fits.
    """
    min_turns = SUMMARY_MIN_TURN + 2
    best: tuple[list[WorkloadConfig], float, list[str]] | None = None
    for answer_scale, drop in _LADDER:
        scaled = [_drop_turns(replace(c, shape=c.shape.scaled(answer_scale=answer_scale)),
                              drop, min_turns) for c in configs]  # fmt: skip
        est = estimate_total_s(scaled, num_modes, repetitions, cost)
        notes = []
        if answer_scale != 1.0:
            notes += [f"answers x{answer_scale:g}: " + ", ".join(
                f"{c.shape.name} {c.shape.answer_tokens[0]}-{c.shape.answer_tokens[1]} tokens"
                for c in scaled)]  # fmt: skip
        if drop and _turns_text(scaled[0]) != _turns_text(configs[0]):
            notes.append(f"turns {_turns_text(configs[0])} -> {_turns_text(scaled[0])}")
        best = (scaled, est, notes)
        if est <= budget_s:
            break
    assert best is not None
    return best


def _drop_turns(config: WorkloadConfig, drop: int, min_turns: int) -> WorkloadConfig:
    """`config` with `drop` turns fewer per session (a drawn range: both ends), never fewer
    than `min_turns`."""
    if not drop:
        return config
    turns = config.shape.turns
    if turns is None:
        return replace(config, num_turns=max(min_turns, config.num_turns - drop))
    lo, hi = (max(min_turns, n - drop) for n in turns)
    return replace(config, shape=replace(config.shape, turns=(lo, hi)))


def _turns_text(config: WorkloadConfig) -> str:
    turns = config.shape.turns
    return str(config.num_turns) if turns is None else f"{turns[0]}-{turns[1]}"
