"""`kvduplex` command line: serve, router, up, bench.

Each command's flags, environment variables and config file come from its settings
model (`kvduplex.cli.settings`, the benchmarks' in `kvduplex.bench`), read by
`kvduplex.common.settings.load_settings`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvduplex.cli.settings import RouterSettings
from kvduplex.cli.settings import ServeSettings
from kvduplex.cli.settings import UpSettings
from kvduplex.cli.settings import parsing_flags
from kvduplex.common.config import API_KEY_VAR
from kvduplex.common.config import CLUSTER_SECRET_VAR
from kvduplex.common.config import Environment
from kvduplex.common.config import ReturnMode
from kvduplex.common.config import Role
from kvduplex.common.engine_config import KVTierKind
from kvduplex.common.settings import ProcessSettings
from kvduplex.common.settings import load_settings

if TYPE_CHECKING:
    from kvduplex.cluster import LocalCluster
    from kvduplex.instance.server import InstanceParts

logger = logging.getLogger("kvduplex")

PORT_LINK_VAR = "KVDUPLEX_PORT"
"""What a Kubernetes Service named ``kvduplex`` injects (``tcp://IP:PORT``): never read."""

COMMANDS = {
    "serve": "serve one instance (OpenAI API)",
    "router": "route OpenAI requests to prefill and decode instances",
    "up": "start prefill, decode and a router locally on a built-in model; run a session",
    "bench": "benchmarks on local instances or an endpoint: single-turn serving (colocated / "
    "pull / push TTFT, TPOT) or multi-turn agentic sessions (--workload agentic)",
}


def setup_logging(level: str) -> None:
    env = Environment.read()
    logging.basicConfig(
        level=(env.log_level or level).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def require_transport(role: Role) -> None:
    """A prefill or decode instance moves KV over NIXL: refuse to start without it (a
    ValueError, exit 2), before the model loads. A colocated instance needs none."""
    if role is Role.BOTH:
        return
    from kvduplex.transport.nixl_agent import nixl_available

    if not nixl_available():
        raise ValueError(
            f"--role {role.value} needs NIXL, the KV transport between instances, and it "
            "cannot be imported here: install it (pip install 'kvduplex[nixl]', the package "
            "nixl-cu12), or serve prefill and decode in one instance with --role both"
        )


def run_serve(args: ServeSettings, parts: InstanceParts | None = None) -> None:
    """``kvduplex serve``: check the transport, build and serve the instance (with `parts`,
    its seams; none in service), exit with the server's code. ValueError for a config
    error."""
    from kvduplex.instance.server import serve

    server = args.server_config()
    require_transport(server.role)
    if args.kv_tier is KVTierKind.STORE:
        from kvduplex.common.kv_store import mooncake_import_problem

        problem = mooncake_import_problem()
        if problem is not None:
            raise ValueError(f"--kv-tier store: {problem}")
    code = serve(args.engine_config(), server, Environment.read(), parts)
    # Every part was closed in order by `serve` (engine, flows, pump, transport). The
    # interpreter's own teardown is skipped: after a clean drain, native transport
    # objects have crashed in it under load (SIGSEGV at exit, the work already done).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _cmd_router(args: RouterSettings) -> None:
    from kvduplex.router.app import serve_router

    code = serve_router(args.router_config())
    if code:
        sys.exit(code)


def _cmd_up(args: UpSettings) -> None:
    from kvduplex.cluster import LocalCluster
    from kvduplex.cluster import free_port
    from kvduplex.common.guard import new_cluster_secret

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvduplex-up-"))
    # One fresh secret per cluster, in every process's environment: the internal
    # routes answer only the cluster's own members.
    # No API key on the local demo cluster, even if this shell sets one.
    secret_env = {CLUSTER_SECRET_VAR: new_cluster_secret(), API_KEY_VAR: ""}
    with LocalCluster(log_dir=log_dir, env=secret_env) as cluster:
        serve_args = ["serve", "--model", args.model]
        if args.dtype:
            serve_args += ["--dtype", args.dtype]
        if args.kv_store:
            serve_args += _start_kv_store(cluster, args)
        front_port = args.port or free_port()
        instances: dict[str, str] = {}
        parsing = parsing_flags(args.parsing)
        if args.mode == "colocated":
            proc = cluster.start("instance", [*serve_args, "--role", "both", *parsing], front_port)
            front = proc.url
        else:
            p = cluster.start("prefill", [*serve_args, "--role", "prefill"], free_port())
            d = cluster.start("decode", [*serve_args, "--role", "decode"], free_port())
            instances = {"prefill": p.url, "decode": d.url}
        print(f"starting {args.model} ({args.mode}; logs in {log_dir}) ...", flush=True)
        cluster.wait_healthy(timeout_s=args.start_timeout)
        routers: dict[str, str] = {}
        if args.mode != "colocated":
            router_args = ["router", "--mode", args.mode, "--model", args.model]
            router_args += ["--prefill", instances["prefill"], "--decode", instances["decode"]]
            router_args += args.router_flags()
            router_args += parsing  # the router parses routed answers
            front = cluster.start("router", router_args, front_port).url
            return_mode = args.return_mode
            routers[_router_name(args.mode, return_mode)] = front
            if args.mode == "push" and args.demo_turns > 0:
                # The demo runs through push with and without the duplex return, over the
                # same instances: the front door, and a second router for the other.
                other = ReturnMode.NONE if return_mode is ReturnMode.PUSH else ReturnMode.PUSH
                extra = [*router_args, "--return-mode", other.value]
                url = cluster.start("router-" + other.value, extra, free_port()).url
                routers[_router_name(args.mode, other)] = url
            # Ready, not only up: a router gives its instances work once they proved
            # the cluster secret to its first probes.
            cluster.wait_healthy(timeout_s=args.start_timeout, path="/ready")
            print(f"prefill {instances['prefill']}, decode {instances['decode']}", flush=True)
        print(f"ready: OpenAI API at {front}/v1", flush=True)
        if args.demo_turns > 0 and not _demo(args, front, routers, instances):
            sys.exit(1)
        if args.demo_turns > 0 and not args.keep_serving:
            return
        print("serving; press Ctrl-C to stop", flush=True)
        try:
            while all(proc.is_alive() for proc in cluster.processes):
                time.sleep(0.5)  # supervising: stop everything if one process dies
        except KeyboardInterrupt:
            print("\nstopping ...", flush=True)
        dead = [proc.name for proc in cluster.processes if not proc.is_alive()]
        if dead:
            print(f"{', '.join(dead)} exited; stopping the rest (logs in {log_dir})", flush=True)
            sys.exit(1)


def _start_kv_store(cluster: LocalCluster, args: UpSettings) -> list[str]:
    """Start the local Mooncake store; the flags that put an instance's tier on it."""
    from kvduplex.cluster import start_kv_store
    from kvduplex.common.kv_store import mooncake_import_problem

    problem = mooncake_import_problem()
    if problem is not None:
        raise ValueError(f"--kv-store: {problem}")
    store = start_kv_store(cluster, args.kv_store_gib, timeout_s=args.start_timeout)
    print(f"KV store: Mooncake master {store.master_address}, {args.kv_store_gib:g} GiB", flush=True)
    return store.serve_flags()


def _router_name(mode: str, return_mode: ReturnMode) -> str:
    if return_mode is ReturnMode.NONE:
        return mode
    return f"{mode}+duplex" if return_mode is ReturnMode.PUSH else f"{mode}+return-pull"


DEMO_LATER_TURN = 2
"""The demo's ratio is over turns from this one (0-based): turn 0 is cold, and turn 1's
push prompt already hits the previous prompt on prefill."""


def _demo(
    args: UpSettings, front: str, routers: dict[str, str], instances: dict[str, str]
) -> bool:
    """Run the demo session through each router (or the colocated instance) and print
    per-turn figures side by side, with what moved each way, and push+duplex / push TTFT
    over the later turns; False if a turn failed."""
    from kvduplex.bench.report import format_kv_report
    from kvduplex.bench.report import kv_snapshot
    from kvduplex.bench.session import format_session
    from kvduplex.bench.session import format_side_by_side
    from kvduplex.bench.session import later_turns_ttft_ratio
    from kvduplex.bench.session import run_token_session

    runs = {}
    for i, (name, url) in enumerate((routers or {args.mode: front}).items()):
        before = kv_snapshot(instances) if instances else None
        results = asyncio.run(
            run_token_session(
                url, args.model, num_turns=args.demo_turns, max_tokens=args.demo_max_tokens,
                first_turn_chars=args.demo_first_turn_tokens,
                turn_chars=args.demo_turn_tokens, think_s=args.demo_think_s,
                seed=args.seed + i, session_id=f"demo-{name}",
            )
        )  # fmt: skip
        runs[name] = results
        if len(routers) <= 1:
            print(format_session(results), flush=True)
        if instances:
            print(f"{name}:\n{format_kv_report(instances, since=before)}", flush=True)
        if not all(t.result.ok for t in results):
            return False
    if len(runs) > 1:
        print(format_side_by_side(runs), flush=True)
    ratio = None
    if "push" in runs and "push+duplex" in runs:
        ratio = later_turns_ttft_ratio(runs, "push+duplex", "push", DEMO_LATER_TURN)
    if ratio is not None:
        duplex_ms, push_ms, r = ratio[0] * 1e3, ratio[1] * 1e3, ratio[2]
        print(
            f"TTFT p50 over turns >= {DEMO_LATER_TURN}: push+duplex {duplex_ms:.0f} ms, "
            f"push {push_ms:.0f} ms: push+duplex / push = {r:.2f} (one session each, "
            f"{args.model}; docs/benchmarks.md has the measured workload)",
            flush=True,
        )
    return True


def bench_workload_of(argv: list[str]) -> str | None:
    """The ``--workload`` of a ``bench`` command line (its flags depend on it; default
    serving); None for another command (``serve``, ``router``, ``up``: they import no
    benchmark code)."""
    if not argv or argv[0] != "bench":
        return None
    args = argv[1:]
    for i, arg in enumerate(args):
        if arg == "--workload" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--workload="):
            return arg.split("=", 1)[1]
    return "serving"


def _cmd_bench(args: ProcessSettings) -> None:
    from kvduplex.bench import agentic_cli
    from kvduplex.bench import serving

    if isinstance(args, agentic_cli.AgenticBenchSettings):
        agentic_cli.main(args)
    elif isinstance(args, serving.ServingBenchSettings):
        serving.main(args)
    else:
        raise AssertionError(f"no benchmark for {type(args).__name__}")


def settings_class(argv: list[str]) -> type[ProcessSettings]:
    """The settings model of the command `argv` names (``bench``: of its workload)."""
    command = argv[0]
    if command == "serve":
        return ServeSettings
    if command == "router":
        return RouterSettings
    if command == "up":
        return UpSettings
    if bench_workload_of(argv) == "agentic":
        from kvduplex.bench.agentic_cli import AgenticBenchSettings

        return AgenticBenchSettings
    from kvduplex.bench.serving import ServingBenchSettings

    return ServingBenchSettings


def usage() -> str:
    """``kvduplex --help``: the commands."""
    lines = [f"usage: kvduplex {{{','.join(COMMANDS)}}} ...", "", "commands:"]
    lines += [f"  {name:8} {text}" for name, text in COMMANDS.items()]
    lines += ["", "Each command's flags: kvduplex COMMAND --help"]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> ProcessSettings:
    """The settings of the command `argv` names, flag > environment > ``--config`` file
    > default. Raises `ConfigError` (a ValueError) for a bad setting; ``--help`` and a
    malformed command line exit (0 and 2)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        sys.exit(0 if argv else 2)
    if argv[0] not in COMMANDS:
        print(f"{usage()}\nkvduplex: error: unknown command {argv[0]!r}", file=sys.stderr)
        sys.exit(2)
    return load_settings(settings_class(argv), argv[1:])


def log_effective_config(settings: ProcessSettings) -> None:
    """One line with every setting, secrets redacted: at INFO, or at the configured level
    when that is higher (so that it always shows), WARNING at most."""
    level = min(max(logging.INFO, logger.getEffectiveLevel()), logging.WARNING)
    text = json.dumps(settings.effective_config, sort_keys=True, default=str)
    logger.log(level, "%s effective config: %s", settings.command, text)


def _run(settings: ProcessSettings) -> None:
    match settings:
        case ServeSettings():
            run_serve(settings)
        case RouterSettings():
            _cmd_router(settings)
        case UpSettings():
            _cmd_up(settings)
        case _:
            _cmd_bench(settings)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        settings = parse_args(argv)
    except ValueError as exc:  # config errors: say what to change, no traceback
        print(f"kvduplex: error: {exc}", file=sys.stderr)
        sys.exit(2)
    if settings.command in ("up", "bench"):
        # SIGTERM unwinds like Ctrl-C, so the local cluster stops what it started.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    setup_logging(str(getattr(settings, "log_level", "info")))
    if settings.command != "bench":
        log_effective_config(settings)
    if os.environ.get(PORT_LINK_VAR, "").isdigit() and settings.command != "bench":
        logger.warning(
            "%s is set but not read (a Kubernetes service link sets it): give --port or "
            "port in --config", PORT_LINK_VAR,
        )  # fmt: skip
    try:
        _run(settings)
    except ValueError as exc:  # config errors: say what to change, no traceback
        print(f"kvduplex: error: {exc}", file=sys.stderr)
        sys.exit(2)
