"""`kvduplex` command line: serve, router, up, bench."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import tempfile
import time
from pathlib import Path

from kvduplex.cli.flags import add_dataclass_flags
from kvduplex.cli.flags import dataclass_from_args
from kvduplex.cli.flags import flags_of
from kvduplex.cli.settings import effective_config
from kvduplex.cli.settings import layered
from kvduplex.common.config import API_KEY_VAR
from kvduplex.common.config import CLUSTER_SECRET_VAR
from kvduplex.common.config import CacheConfig
from kvduplex.common.config import EngineConfig
from kvduplex.common.config import Environment
from kvduplex.common.config import ModelLoadConfig
from kvduplex.common.config import ParsingConfig
from kvduplex.common.config import ReturnMode
from kvduplex.common.config import Role
from kvduplex.common.config import RouterConfig
from kvduplex.common.config import SchedulerConfig
from kvduplex.common.config import ServerConfig
from kvduplex.common.config import TransferConfig

logger = logging.getLogger("kvduplex")

_ENGINE_SECTIONS = (ModelLoadConfig, CacheConfig, SchedulerConfig, TransferConfig)
_UP_ROUTER_SKIP = (
    "prefill", "decode", "mode", "model", "host", "port", "log_level", "api_key",
    "cluster_secret_file", "drain_timeout_s", "prefill_dns", "decode_dns", "dns_interval_s",
    "dns_server",
)  # fmt: skip
"""Router flags that `kvduplex up` sets itself (its local demo cluster has no API key);
it passes the others through."""


def _setup_logging(level: str) -> None:
    env = Environment.read()
    logging.basicConfig(
        level=(env.log_level or level).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=dataclass_from_args(ModelLoadConfig, args),
        cache=dataclass_from_args(CacheConfig, args),
        scheduler=dataclass_from_args(SchedulerConfig, args),
        transfer=dataclass_from_args(TransferConfig, args),
    )


def server_config(args: argparse.Namespace) -> ServerConfig:
    """``kvduplex serve``'s server flags, its parsing flags included."""
    return dataclass_from_args(ServerConfig, args, parsing=dataclass_from_args(ParsingConfig, args))


def router_config(args: argparse.Namespace) -> RouterConfig:
    """``kvduplex router``'s flags."""
    prefill, decode = tuple(args.prefill), tuple(args.decode)
    parsing = dataclass_from_args(ParsingConfig, args)
    return dataclass_from_args(RouterConfig, args, prefill=prefill, decode=decode, parsing=parsing)


def parsing_flags(parsing: ParsingConfig) -> list[str]:
    """`parsing` as the flags of a child ``serve`` or ``router``."""
    out: list[str] = []
    if parsing.tool_call_parser:
        out += ["--tool-call-parser", parsing.tool_call_parser]
    if parsing.reasoning_parser:
        out += ["--reasoning-parser", parsing.reasoning_parser]
    if parsing.enable_auto_tool_choice:
        out.append("--enable-auto-tool-choice")
    return out


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


def _cmd_serve(args: argparse.Namespace) -> None:
    from kvduplex.instance.server import serve

    require_transport(server_config(args).role)
    code = serve(_engine_config(args), server_config(args), Environment.read())
    if code:
        sys.exit(code)


def _cmd_router(args: argparse.Namespace) -> None:
    from kvduplex.router.app import serve_router

    code = serve_router(router_config(args))
    if code:
        sys.exit(code)


def _cmd_up(args: argparse.Namespace) -> None:
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
        front_port = args.port or free_port()
        instances: dict[str, str] = {}
        parsing = parsing_flags(dataclass_from_args(ParsingConfig, args))
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
            router_args += flags_of(RouterConfig, args, skip=_UP_ROUTER_SKIP)
            router_args += parsing  # the router parses routed answers
            front = cluster.start("router", router_args, front_port).url
            return_mode = ReturnMode(args.return_mode)
            routers[_router_name(args.mode, return_mode)] = front
            if args.mode == "push" and args.demo_turns > 0:
                # The demo runs through push with and without the duplex return, over the
                # same instances: the front door, and a second router for the other.
                other = ReturnMode.NONE if return_mode is ReturnMode.PUSH else ReturnMode.PUSH
                extra = [*router_args, "--return-mode", other.value]
                url = cluster.start("router-" + other.value, extra, free_port()).url
                routers[_router_name(args.mode, other)] = url
            cluster.wait_healthy(timeout_s=args.start_timeout)
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


def _router_name(mode: str, return_mode: ReturnMode) -> str:
    if return_mode is ReturnMode.NONE:
        return mode
    return f"{mode}+duplex" if return_mode is ReturnMode.PUSH else f"{mode}+return-pull"


DEMO_LATER_TURN = 2
"""The demo's ratio is over turns from this one (0-based): turn 0 is cold, and turn 1's
push prompt already hits the previous prompt on prefill."""


def _demo(
    args: argparse.Namespace, front: str, routers: dict[str, str], instances: dict[str, str]
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


def build_parser(bench_workload: str | None = "serving") -> argparse.ArgumentParser:
    """The whole command line; `bench_workload` picks which workload's flags ``bench`` takes
    (None: none, for another command, which then imports no benchmark code)."""
    parser = argparse.ArgumentParser(prog="kvduplex", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve one instance (OpenAI API)")
    for section in _ENGINE_SECTIONS:
        add_dataclass_flags(serve, section)
    add_dataclass_flags(serve, ServerConfig)
    add_dataclass_flags(serve, ParsingConfig)
    _add_config_flag(serve)
    serve.set_defaults(func=_cmd_serve)

    router = sub.add_parser("router", help="route OpenAI requests to prefill and decode instances")
    router.add_argument("--prefill", nargs="*", default=[], help="prefill instance URLs")
    router.add_argument(
        "--decode", nargs="+", default=[], help="decode instance URLs (at least one)"
    )
    add_dataclass_flags(router, RouterConfig)
    add_dataclass_flags(router, ParsingConfig)
    _add_config_flag(router)
    router.set_defaults(func=_cmd_router)

    up = sub.add_parser(
        "up", help="start prefill, decode and a router locally on a built-in model; run a session"
    )
    up.add_argument(
        "--mode", default="push", choices=["push", "pull", "colocated"],
        help="push (layer-wise, default), pull, or one colocated instance",
    )  # fmt: skip
    up.add_argument("--model", default="small", help="preset or local HF folder (default: small)")
    up.add_argument("--dtype", default="", help="model dtype (default: auto)")
    up.add_argument("--port", type=int, default=0, help="front-door port (default: a free one)")
    up.add_argument(
        "--demo-turns", type=int, default=6, help="turns of the demo session; 0 skips it"
    )
    up.add_argument("--demo-max-tokens", type=int, default=64, help="tokens per answer")
    up.add_argument(
        "--demo-first-turn-tokens", type=int, default=1200,
        help="the first turn's prompt, in tokens of the built-in byte tokenizer",
    )  # fmt: skip
    up.add_argument(
        "--demo-turn-tokens", type=int, default=120, help="each later turn's new input, in tokens"
    )
    up.add_argument(
        "--demo-think-s", type=float, default=1.0,
        help="the client's pause before each later turn (the duplex return lands in it)",
    )  # fmt: skip
    up.add_argument("--seed", type=int, default=0, help="seed of the demo session")
    up.add_argument("--keep-serving", action="store_true", help="keep serving after the demo")
    up.add_argument("--start-timeout", type=float, default=300.0, help="seconds to wait for health")
    up.add_argument("--log-dir", default="", help="where process logs go (default: a temp dir)")
    up.add_argument("--log-level", default="warning")
    add_dataclass_flags(up, RouterConfig, skip=_UP_ROUTER_SKIP)
    add_dataclass_flags(up, ParsingConfig)
    _add_config_flag(up)
    up.set_defaults(func=_cmd_up)

    bench = sub.add_parser(
        "bench",
        help="benchmarks on local instances or an endpoint: single-turn serving (colocated / "
        "pull / push TTFT, TPOT) or multi-turn agentic sessions",
    )
    bench.add_argument(
        "--workload", default="serving", choices=BENCH_WORKLOADS,
        help="serving (single-turn) or agentic (multi-turn sessions); each takes its own "
        "flags: kvduplex bench --workload agentic --help",
    )  # fmt: skip
    if bench_workload == "agentic":
        from kvduplex.bench.agentic_cli import add_arguments as add_agentic_arguments

        add_agentic_arguments(bench)
    elif bench_workload is not None:
        from kvduplex.bench.serving import add_arguments

        add_arguments(bench)
    bench.add_argument("--log-level", default="warning")
    bench.set_defaults(func=_cmd_bench)
    return parser


BENCH_WORKLOADS = ["serving", "agentic"]


def _add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", default="", metavar="FILE",
        help="a YAML (.yaml, .yml) or TOML (.toml) file of settings, one key per flag "
        "(kv_cache_mb: 1024). Every flag is also the environment variable "
        "KVDUPLEX_<FLAG_NAME> (KVDUPLEX_KV_CACHE_MB=1024). A flag given here wins over "
        "the variable, which wins over the file",
    )  # fmt: skip


def bench_workload_of(argv: list[str]) -> str | None:
    """The ``--workload`` of a ``bench`` command line (its flags depend on it); None for
    another command (``serve``, ``router``, ``up``: they import no benchmark code)."""
    if not argv or argv[0] in ("-h", "--help"):
        return "serving"
    if argv[0] != "bench":
        return None
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--workload", default="serving", choices=BENCH_WORKLOADS)
    known, _ = pre.parse_known_args(argv[1:])
    return str(known.workload)


def _cmd_bench(args: argparse.Namespace) -> None:
    if args.workload == "agentic":
        from kvduplex.bench.agentic_cli import main as agentic_main

        agentic_main(args)
        return
    from kvduplex.bench.serving import main as bench_main

    bench_main(args)


LAYERED_COMMANDS = ("serve", "router", "up")
"""Commands whose settings also come from ``KVDUPLEX_*`` and ``--config`` (`settings.py`)."""


def command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The sub-parser of `command` in `build_parser`'s parser."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub: argparse.ArgumentParser = action.choices[command]
            return sub
    raise KeyError(command)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """`argv` parsed, with the settings of `LAYERED_COMMANDS` layered: flag > environment
    > ``--config`` file > default. Raises `ConfigError` (a ValueError) for a bad setting."""
    parser = build_parser(bench_workload_of(argv))
    args = parser.parse_args(argv)
    if args.command in LAYERED_COMMANDS:
        sub = command_parser(parser, args.command)
        args = layered(sub, args, argv[1:])
        args.effective_config = effective_config(args, sub)
    return args


def _log_effective_config(args: argparse.Namespace) -> None:
    """One line with every setting, secrets redacted: at INFO, or at the configured level
    when that is higher (so that it always shows), WARNING at most."""
    level = min(max(logging.INFO, logger.getEffectiveLevel()), logging.WARNING)
    text = json.dumps(args.effective_config, sort_keys=True, default=str)
    logger.log(level, "%s effective config: %s", args.command, text)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
    except ValueError as exc:  # config errors: say what to change, no traceback
        print(f"kvduplex: error: {exc}", file=sys.stderr)
        sys.exit(2)
    if args.command in ("up", "bench"):
        # SIGTERM unwinds like Ctrl-C, so the local cluster stops what it started.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    _setup_logging(getattr(args, "log_level", "info"))
    if args.command in LAYERED_COMMANDS:
        _log_effective_config(args)
    try:
        args.func(args)
    except ValueError as exc:  # config errors: say what to change, no traceback
        print(f"kvduplex: error: {exc}", file=sys.stderr)
        sys.exit(2)
