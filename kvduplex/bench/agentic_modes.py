"""The modes of the multi-turn benchmark and the local processes that serve them.

One deployment serves every mode, so that modes can run interleaved without
restarts:

    colocated            one instance (role both), reached directly   cpu A
    P1, P2               prefill instances                            cpu A
    D                    decode instance                              cpu B
    one router per PD mode over P1 (and P2 for the 2P+1D modes) and D (unpinned)

Modes share P and D; the benchmark keeps them from sharing cached KV by
giving every mode its own session texts (see `kvduplex.bench.workload`).
A mode named ``<mode>@<MiB>[+file|+host][+lru]`` (``push+duplex@256+file``) gets
prefill instances of its own with that pool (and KV tier, and LRU eviction instead
of the session-aware default), on P's core: pool sizes run side by side in one
run, against the same decode.
Router flags a mode needs that the router does not know (``--return-mode``,
``--short-append-tokens``, when the router predates them) skip that mode,
with the reason recorded; flags that only restate a router default are
dropped instead.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from dataclasses import replace

from kvduplex.bench.kvmetrics import Instance
from kvduplex.cluster import LocalCluster
from kvduplex.cluster import Process
from kvduplex.cluster import free_port


@dataclass(frozen=True)
class PrefillPool:
    """A prefill pool a mode asks for by name: ``@<MiB>[+file|+host][+lru]``."""

    kv_cache_mb: int
    kv_tier: str = "none"
    eviction: str = "session"

    @classmethod
    def parse(cls, text: str) -> PrefillPool:
        mb, *extras = text.split("+")
        tiers = [e for e in extras if e in ("file", "host")]
        evictions = [e for e in extras if e == "lru"]
        if (
            not mb.isdigit()
            or int(mb) <= 0
            or len(tiers) > 1
            or len(tiers) + len(evictions) < len(extras)
        ):
            raise ValueError(f"a prefill pool is <MiB>[+file|+host][+lru], got {text!r}")
        return cls(int(mb), tiers[0] if tiers else "none", "lru" if evictions else "session")

    def serve_flags(self) -> list[str]:
        """Flags of a prefill instance with this pool, beside ``--kv-cache-mb``."""
        flags = ["--eviction", self.eviction]
        if self.kv_tier != "none":
            flags += ["--kv-tier", self.kv_tier, "--kv-tier-gib", "2"]
        return flags

    @property
    def label(self) -> str:
        extras = ([self.kv_tier] if self.kv_tier != "none" else []) + (
            [self.eviction] if self.eviction != "session" else []
        )
        return "+".join([str(self.kv_cache_mb), *extras])


@dataclass(frozen=True)
class ModeSpec:
    """How one mode is deployed."""

    name: str
    kv_mode: str | None
    """The router's ``--mode`` (push, pull); None: the colocated instance, no router."""
    router_flags: tuple[str, ...] = ()
    """Extra router flags the mode needs."""
    default_flags: tuple[str, ...] = ()
    """Router flags that restate the router's default: passed only if the router knows them."""
    num_prefill: int = 1
    prefill_pool: PrefillPool | None = None
    """The prefill instances' own pool (a ``@`` suffix of the name); None: the run's."""

    @property
    def disaggregated(self) -> bool:
        return self.kv_mode is not None


MODES: tuple[ModeSpec, ...] = (
    ModeSpec("colocated", None),
    ModeSpec("pull", "pull", default_flags=("--return-mode", "none")),
    ModeSpec("push", "push", default_flags=("--return-mode", "none")),
    ModeSpec("push+return-pull", "push", ("--return-mode", "pull")),
    ModeSpec("push+duplex", "push", ("--return-mode", "push")),
    ModeSpec(
        "push+duplex+short", "push", ("--return-mode", "push", "--short-append-tokens", "256")
    ),
    # Every turn through prefill and every returning turn returned, wherever the KV is
    # (the router's plans off): what the plans are measured against.
    ModeSpec("push-noplan", "push", ("--return-mode", "none", "--no-plan-by-residency")),
    ModeSpec(
        "push+duplex-noplan",
        "push",
        ("--return-mode", "push", "--no-plan-by-residency", "--no-return-only-if-kept"),
    ),
    ModeSpec("2p1d-push", "push", default_flags=("--return-mode", "none"), num_prefill=2),
    ModeSpec("2p1d-push+duplex", "push", ("--return-mode", "push"), num_prefill=2),
)
MODE_NAMES: tuple[str, ...] = tuple(m.name for m in MODES)


def modes_named(names: list[str]) -> list[ModeSpec]:
    """The modes `names` (each ``<mode>`` or ``<mode>@<MiB>[+<tier>]``, see the module)."""
    by_name = {m.name: m for m in MODES}
    unknown = [n for n in names if n.partition("@")[0] not in by_name]
    if unknown:
        raise ValueError(f"unknown modes {unknown}; choose from {list(MODE_NAMES)}")
    out = []
    for n in names:
        base, _, pool = n.partition("@")
        spec = by_name[base]
        if pool:
            if not spec.disaggregated:
                raise ValueError(f"{n}: only a mode with prefill instances takes a pool")
            spec = replace(spec, name=n, prefill_pool=PrefillPool.parse(pool))
        out.append(spec)
    return out


def _flag_names(flags: tuple[str, ...]) -> list[str]:
    return [f for f in flags if f.startswith("--")]


def router_flags_known() -> set[str]:
    """The long options ``kvduplex router --help`` lists."""
    out = subprocess.run(
        [sys.executable, "-m", "kvduplex", "router", "--help"],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    return set(re.findall(r"--[a-z][a-z0-9-]*", out.stdout))


def router_args(spec: ModeSpec, known: set[str]) -> tuple[str, ...] | str:
    """The mode's extra router flags, or why the router cannot serve the mode."""
    missing = [f for f in _flag_names(spec.router_flags) if f not in known]
    if missing:
        return f"the router does not know {', '.join(missing)}"
    extra = spec.router_flags
    if all(f in known for f in _flag_names(spec.default_flags)):
        extra = spec.default_flags + extra
    return extra


def kv_bytes_per_token(model: str) -> int:
    """KV bytes one token takes in a preset's cache (float32, the CPU dtype)."""
    from kvduplex.common.presets import PRESETS

    cfg = PRESETS.get(model)
    if cfg is None:
        raise ValueError(f"{model!r} is not a preset: give the pool size with --kv-cache-mb")
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4


def kv_cache_mb_for(model: str, num_tokens: int, floor_mb: int = 256) -> int:
    """A pool for `num_tokens` tokens with half again as much room (prefix cache, churn)."""
    return max(floor_mb, math.ceil(num_tokens * kv_bytes_per_token(model) * 1.5 / 2**20))


@dataclass
class Deployment:
    """What is running: each mode's front door and the instances it uses."""

    fronts: dict[str, str] = field(default_factory=dict)
    instances: dict[str, list[Instance]] = field(default_factory=dict)
    """mode -> the instances whose /metrics count its KV (P and D; the colocated one)."""
    skipped: dict[str, str] = field(default_factory=dict)
    """mode -> why it does not run."""
    pinned: str = ""


def start_deployment(
    cluster: LocalCluster,
    modes: list[ModeSpec],
    *,
    model: str,
    kv_cache_mb: int,
    echo: Callable[[str], None],
    start_timeout_s: float = 600.0,
    parsing_flags: tuple[str, ...] = (),
    routers_on_p: bool = False,
    prefill_kv_cache_mb: int | None = None,
    decode_flags: tuple[str, ...] = (),
) -> Deployment:
    """Start the instances and routers `modes` need; modes the router cannot serve are skipped.
    `parsing_flags` (tool-call and reasoning parsers) go to the servers that answer clients:
    the routers and the colocated instance. `routers_on_p` pins the routers to P's core
    (else they run anywhere, D's core included). `prefill_kv_cache_mb`: the prefill
    instances' pool, if not `kv_cache_mb`; `decode_flags`: more flags of the decode
    instance (its KV tier, say)."""
    serve = ["serve", "--model", model, "--num-threads", "1", "--kv-cache-mb", str(kv_cache_mb)]
    serve += ["--log-level", "warning", "--kv-wait-timeout-s", "120", "--transfer-timeout-s", "120"]
    serve += ["--pull-lease-s", "300"]
    # A CPU step that prefills a chunk deep into a long context (the coding-agent shape on
    # `long`) takes seconds, beyond the default stall limit: keep it below the KV wait.
    serve += ["--engine-stall-timeout-s", "60"]
    cpus = sorted(os.sched_getaffinity(0))
    p_cpu, d_cpu = [cpus[0]], [cpus[-1]]
    dep = Deployment()
    known = router_flags_known() if any(m.disaggregated for m in modes) else set()
    extra: dict[str, tuple[str, ...]] = {}
    for m in modes:
        got = router_args(m, known) if m.disaggregated else ()
        if isinstance(got, str):
            dep.skipped[m.name] = got
            echo(f"mode {m.name} skipped: {got}")
        else:
            extra[m.name] = got
    run = [m for m in modes if m.name in extra]
    if any(not m.disaggregated for m in run):
        colo_args = [*serve, "--role", "both", *parsing_flags]
        colo = cluster.start("colocated", colo_args, free_port(), cpus=p_cpu)
        dep.fronts["colocated"] = colo.url
        dep.instances["colocated"] = [Instance(colo.url, "both")]
    p_serve = [*serve]
    if prefill_kv_cache_mb:
        p_serve[p_serve.index("--kv-cache-mb") + 1] = str(prefill_kv_cache_mb)
    prefills = _start_prefills(cluster, run, p_serve, p_cpu)
    pools = {pool: len(ps) for pool, ps in prefills.items()}
    decode = None
    if pools:
        decode = cluster.start(
            "decode", [*serve, "--role", "decode", *decode_flags], free_port(), cpus=d_cpu
        )
    cluster.wait_healthy(timeout_s=start_timeout_s)
    for m in run:
        if not m.disaggregated or decode is None:
            continue
        ps = prefills[m.prefill_pool][: m.num_prefill]
        args = [
            "router",
            "--mode",
            str(m.kv_mode),
            "--model",
            model,
            *extra[m.name],
            *parsing_flags,
        ]
        args += ["--prefill", *(p.url for p in ps), "--decode", decode.url]
        router = cluster.start(
            f"router-{_file_name(m.name)}", args, free_port(), cpus=p_cpu if routers_on_p else None
        )
        try:
            cluster.wait_healthy(timeout_s=120)
        except RuntimeError as exc:
            cluster.stop_process(router)
            dep.skipped[m.name] = f"its router did not start: {str(exc)[-300:]}"
            echo(f"mode {m.name} skipped: {dep.skipped[m.name]}")
            continue
        dep.fronts[m.name] = router.url
        dep.instances[m.name] = [Instance(p.url, "prefill") for p in ps]
        dep.instances[m.name].append(Instance(decode.url, "decode"))
    p_desc = "colocated, P1, P2" if max(pools.values(), default=0) > 1 else "colocated and P"
    own = [f"P@{p.label}" for p in pools if p is not None]
    if own:
        p_desc += ", " + ", ".join(own)
    routers = f"routers on cpu {p_cpu[0]}" if routers_on_p else "routers and client unpinned"
    dep.pinned = f"{p_desc} on cpu {p_cpu[0]}, D on cpu {d_cpu[0]}, 1 torch thread each; {routers}"
    return dep


def _start_prefills(
    cluster: LocalCluster, run: list[ModeSpec], serve: list[str], cpus: list[int]
) -> dict[PrefillPool | None, list[Process]]:
    """The prefill instances of each pool `run` asks for: the run's (None) and the modes' own."""
    pools: dict[PrefillPool | None, int] = {}
    for m in run:
        if m.disaggregated:
            pools[m.prefill_pool] = max(pools.get(m.prefill_pool, 0), m.num_prefill)
    prefills = {}
    for pool, count in pools.items():
        args = [*serve, "--role", "prefill"]
        if pool:
            args[args.index("--kv-cache-mb") + 1] = str(pool.kv_cache_mb)
            args += pool.serve_flags()
        tag = f"-{_file_name(pool.label)}" if pool else ""
        prefills[pool] = [
            cluster.start(f"prefill{tag}{i}", args, free_port(), cpus=cpus) for i in range(count)
        ]
    return prefills


def _file_name(mode: str) -> str:
    return re.sub(r"[^a-z0-9-]", "-", mode)
