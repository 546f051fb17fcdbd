"""Start and stop local kvduplex processes (instances, router), on 127.0.0.1 by default.

Used by `kvduplex up`, the benchmarks and the integration tests. Every process
started here is stopped by `LocalCluster.stop()` (also on context exit): first
SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path

import httpx

logger = logging.getLogger(__name__)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free right now on `host`, below the kernel's ephemeral range.

    Ports the kernel hands out (``bind(0)``, outgoing connections, UCX's own
    listeners) come from the ephemeral range; a port picked there can be taken
    by one of those before the process it is meant for binds it.
    """
    low, _ = _ephemeral_range()
    for _ in range(100):
        port = random.randint(min(10000, low - 1), low - 1)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Process:
    name: str
    url: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""


@dataclass
class LocalCluster:
    """A set of local processes; `start_*` launch, `stop` ends them all."""

    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    processes: list[Process] = field(default_factory=list)

    def start(
        self,
        name: str,
        args: list[str],
        port: int,
        *,
        cpus: list[int] | None = None,
        netns: str | None = None,
        host: str = "127.0.0.1",
        env: dict[str, str] | None = None,
        module: str = "kvduplex",
    ) -> Process:
        """Run ``python -m <module> <args> --host <host> --port <port>`` in the background.

        `host` is the address the process listens on and is reached at
        (`Process.url`); a ``--host`` in `args` is overridden by it. `cpus` pins
        the process (taskset); `netns` runs it inside that network namespace
        (``ip netns exec``, see `kvduplex.bench.netns`), where `host` must be
        one of the namespace's addresses reachable from here. `env` adds
        variables for this process only, over the cluster's `env`. The process
        leads its own session, so `stop_process`/`kill_process` end its whole
        process group, in a namespace too (``ip netns exec`` execs the command).
        `module` (default: kvduplex's command line) is the module run; another one must
        accept `args` followed by ``--host`` and ``--port``, and stop on SIGTERM.
        """
        cmd = [sys.executable, "-m", module, *args, "--host", host, "--port", str(port)]
        if cpus:
            cmd = ["taskset", "-c", ",".join(map(str, cpus)), *cmd]
        if netns is not None:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        return self.start_command(name, cmd, f"http://{host}:{port}", env=env)

    def start_command(
        self, name: str, cmd: list[str], url: str, *, env: dict[str, str] | None = None
    ) -> Process:
        """Run `cmd` in the background as `name`, leading its own session (stopped like the
        others); `url` is where it answers ``GET /health``."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        proc_env = {**os.environ, **self.env, **(env or {})}
        with open(log_path, "wb") as log:
            popen = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=proc_env, start_new_session=True
            )
        proc = Process(name=name, url=url, popen=popen, log_path=log_path)
        self.processes.append(proc)
        logger.info("started %s (pid %d): %s", name, popen.pid, " ".join(cmd))
        return proc

    def wait_healthy(
        self, timeout_s: float = 120.0, procs: list[Process] | None = None, path: str = "/health"
    ) -> None:
        """Block until every process (or each of `procs`) answers GET `path` with 200
        (``/ready``: until it can serve, e.g. a router whose instances proved themselves).

        Raises RuntimeError with the log tail of a process that exited or
        stayed unhealthy past the deadline.
        """
        deadline = time.monotonic() + timeout_s
        pending = list(self.processes if procs is None else procs)
        with httpx.Client(timeout=2.0) as client:
            while pending:
                proc = pending[0]
                if not proc.is_alive():
                    raise RuntimeError(f"{proc.name} exited during start-up:\n{proc.log_tail()}")
                try:
                    if client.get(proc.url + path).status_code == 200:
                        pending.pop(0)
                        continue
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{proc.name} not healthy after {timeout_s}s:\n{proc.log_tail()}"
                    )
                time.sleep(0.1)  # polling a process we do not control; not test synchronisation

    def stop_process(self, proc: Process, grace_s: float = 10.0) -> None:
        if proc.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.popen.pid, signal.SIGTERM)
            try:
                proc.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.popen.pid, signal.SIGKILL)
                proc.popen.wait()
        if proc in self.processes:
            self.processes.remove(proc)

    def kill_process(self, proc: Process) -> None:
        """SIGKILL at once (failure tests)."""
        if proc.is_alive():
            os.killpg(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait()

    def stop(self) -> None:
        for proc in reversed(list(self.processes)):
            self.stop_process(proc)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class LocalKVStore:
    """A Mooncake store started by `start_kv_store`: its master and one storage node."""

    master: Process
    storage: Process
    master_address: str
    """HOST:PORT of the master's RPC (``--kv-store-master``)."""
    metadata_url: str
    """The master's HTTP metadata server (``--kv-store-metadata-url``)."""

    def serve_flags(self) -> list[str]:
        """The flags that put a ``kvduplex serve`` instance's tier on this store."""
        return [
            "--kv-tier", "store", "--kv-store-master", self.master_address,
            "--kv-store-metadata-url", self.metadata_url,
        ]  # fmt: skip


def start_kv_store(
    cluster: LocalCluster, gib: float, host: str = "127.0.0.1", timeout_s: float = 60.0
) -> LocalKVStore:
    """Start a Mooncake master and a storage node holding `gib` GiB on `host`, and wait
    until the node's memory is mounted in the store (the master lists its segment).
    FileNotFoundError saying what to install if Mooncake is not installed."""
    from kvduplex.common.kv_store import master_command
    from kvduplex.common.kv_store import storage_node_command

    rpc_port, metadata_port, metrics_port = free_port(host), free_port(host), free_port(host)
    master_cmd = master_command(host, rpc_port, metadata_port, metrics_port)
    master = cluster.start_command("kv-store-master", master_cmd, f"http://{host}:{metrics_port}")
    cluster.wait_healthy(timeout_s, [master])
    address, metadata_url = f"{host}:{rpc_port}", f"http://{host}:{metadata_port}/metadata"
    node_port, node_http_port = free_port(host), free_port(host)
    node_cmd = storage_node_command(address, metadata_url, host, node_port, node_http_port, gib)
    storage = cluster.start_command("kv-store-node", node_cmd, f"http://{host}:{node_http_port}")
    cluster.wait_healthy(timeout_s, [storage])
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while not client.get(master.url + "/get_all_segments").text.strip():
            if time.monotonic() > deadline or not storage.is_alive():
                raise RuntimeError(f"the KV store's node did not join:\n{storage.log_tail()}")
            time.sleep(0.1)  # polling a process we do not control; not test synchronisation
    return LocalKVStore(master, storage, address, metadata_url)
