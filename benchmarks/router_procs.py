"""The processes of `bench_router_capacity.py`: the router (a checkout's, optionally
under cProfile), the floors, the reference routers; waiting for them and stopping them."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvduplex.cluster import free_port

REPO = Path(__file__).resolve().parent.parent
FLOORS = Path(__file__).with_name("router_floors.py")


_PROFILED = """
import cProfile, runpy, sys, time
sys.argv = sys.argv[1:]
profile = cProfile.Profile(time.thread_time)  # the event loop's CPU time, not waits
profile.enable()
try:
    runpy.run_module(sys.argv[0], run_name="__main__")
except SystemExit:
    pass
finally:
    profile.disable()
    profile.dump_stats({path!r})
"""
"""`python -c` this, then the module and its arguments: the module under cProfile."""


def start_router(
    port: int,
    p_port: int,
    d_port: int,
    cpu: int,
    log: Path,
    profile: str = "",
    repo: Path = REPO,
) -> subprocess.Popen[bytes]:
    """``kvduplex router`` of checkout `repo`, pinned to `cpu`; under cProfile (written to
    `profile`) if given."""
    python = (
        [sys.executable, "-c", _PROFILED.format(path=profile)]
        if profile
        else [sys.executable, "-m"]
    )
    cmd = [*python, "kvduplex", "router", "--model", "tiny", "--port", str(port),
           "--prefill", f"http://127.0.0.1:{p_port}", "--decode", f"http://127.0.0.1:{d_port}",
           "--health-interval-s", "1"]  # fmt: skip
    path = os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.Popen(
        cmd, env=env, cwd=repo, stdout=log.open("wb"), stderr=subprocess.STDOUT,
        preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
    )  # fmt: skip


def start_relay(
    flag: str, p_port: int, d_port: int, cpu: int
) -> tuple[int, subprocess.Popen[bytes]]:
    """A floor (`flag`: one of `router_floors.FLAGS`) over the stub, pinned to `cpu`: its
    port and process."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(FLOORS), flag, str(port), str(p_port), str(d_port)],
        env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO,
        preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
    )  # fmt: skip
    return port, proc


@dataclass(frozen=True)
class Reference:
    """A reference P/D router (``--reference``): ``python -m MODULE.launch_router`` in P/D
    mode."""

    name: str
    """Its side in the results (``NAME_added_p50_ms``, ...)."""
    package: str
    """On PyPI."""
    module: str
    mode_flags: tuple[str, ...]
    """P/D mode, and no log line per request."""
    ready_path: str
    """200 once it has an instance of each role to send to."""


REFERENCES = {
    "sglang": Reference("sglang_router", "sglang-router", "sglang_router",
                        ("--pd-disaggregation", "--log-level", "warn"), "/readiness"),
    "vllm": Reference("vllm_router", "vllm-router", "vllm_router",
                      ("--vllm-pd-disaggregation", "--log-level", "warning"), "/health"),
}  # fmt: skip
"""SGLang's router sends a request to P and D at once, as the push router does; vLLM's
sends it to P (``max_tokens`` 1), then to D with P's ``kv_transfer_params``. Both are
compiled (Rust, tokio, hyper). vLLM's opens its port once its instances answer their
probes, so its ``/health`` says it is ready; SGLang's ``/health`` says only that it
runs (``/readiness`` is 503 until it has instances)."""


def start_reference(
    ref: Reference, python: str, port: int, p_port: int, d_port: int, cpu: int, log: Path
) -> subprocess.Popen[bytes]:
    """Reference router `ref` run by `python` over the stub, pinned to `cpu` (one core:
    tokio starts one worker thread), probing the stub every second as the router does,
    its metrics on a port of its own."""
    cmd = [python, "-m", f"{ref.module}.launch_router", *ref.mode_flags,
           "--host", "127.0.0.1", "--port", str(port),
           "--prefill", f"http://127.0.0.1:{p_port}", "--decode", f"http://127.0.0.1:{d_port}",
           "--policy", "round_robin", "--health-check-interval-secs", "1",
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # fmt: skip
    return subprocess.Popen(
        cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT,
        preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
    )  # fmt: skip


def check_references(kinds: list[str], python: str) -> None:
    """Exit with how to install them if `python` (missing, or not a Python) lacks a
    reference router of `kinds`."""
    for kind in kinds:
        ref = REFERENCES[kind]
        try:
            found = subprocess.run([python, "-c", f"import {ref.module}"], capture_output=True)
            imported = found.returncode == 0
        except OSError:
            imported = False
        if not imported:
            raise SystemExit(
                f"--reference {kind}: {python} cannot import {ref.module}; install it in a "
                f"venv of its own (python -m venv /tmp/refvenv && /tmp/refvenv/bin/pip "
                f"install {ref.package}) and pass --reference-python /tmp/refvenv/bin/python"
            )


async def wait_ready(
    port: int, proc: subprocess.Popen[bytes], timeout_s: float = 60.0, path: str = "/ready"
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the router exited")
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET %s HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n" % path.encode())
            status = await reader.readline()
            writer.close()
            if b" 200 " in status:
                return
        except OSError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError("the router was not ready in time")


async def wait_listening(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.1)
    raise RuntimeError(f"nothing listens on port {port}")


def stop_processes(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each (the routers drain), killed if one takes longer than 15 s."""
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
