"""Hosts on one machine: every instance and router in its own network namespace, found by DNS.

A `Fleet` puts each process on a host of a `NetnsLan` (one subnet on a bridge), as
a cluster's pods are, and serves the DNS names that the routers discover the
instances by, as a headless Service does::

      root namespace: bridge 10.200.x.1 ── DNS server (StaticDns, port 53xxx)
      │                                 └─ the client; a colocated reference on 127.0.0.1
      ├── prefill-0  10.200.x.2:PORT ─┐
      ├── prefill-1  10.200.x.3:PORT  ├─ "prefill.kvd.test": A records of the published ones
      ├── decode-0   10.200.x.4:PORT ─┐
      ├── decode-1   10.200.x.5:PORT  ├─ "decode.kvd.test"
      ├── router-0   10.200.x.6:PORT     --prefill-dns prefill.kvd.test:PORT
      └── router-1   10.200.x.7:PORT     --decode-dns decode.kvd.test:PORT --dns-server 10.200.x.1:53xxx

Every host serves on the same port (a namespace has its own ports, as a pod
has). Prefill and decode move KV with UCX over TCP on their host's interface
only (`LinkEnd.ucx_env`): between namespaces of one machine, UCX's
shared-memory transports would still work and bypass the network.

A host's name is in its role's DNS answer while it is *published*: `publish`
after it is healthy, `unpublish` when it stops being ready (a drain), as
Kubernetes' endpoints controller adds and drops a ready pod's address. Routers
are not published: clients are given their URLs.

Leaving the `with` block stops every process (SIGTERM, then SIGKILL after a grace
period), then the DNS server, then removes the hosts and the bridge, on an error
or KeyboardInterrupt too.
"""

from __future__ import annotations

import contextlib
import enum
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from benchmarks.netns_lan import NetnsLan
from kvduplex.bench.netns import LinkEnd
from kvduplex.cluster import LocalCluster
from kvduplex.cluster import Process
from kvduplex.cluster import free_port
from tests.support.static_dns import StaticDns


class HostRole(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    ROUTER = "router"


DNS_NAMES = {HostRole.PREFILL: "prefill.kvd.test", HostRole.DECODE: "decode.kvd.test"}
"""The DNS name of each instance role's published hosts."""


@dataclass(frozen=True)
class FleetConfig:
    """What every host of a fleet runs."""

    model: str = "tiny"
    """Built-in preset (or local HF folder) of every instance, router and the reference."""
    num_blocks: int = 2048
    """KV blocks of each instance's pool."""
    block_size: int = 16
    """Tokens per KV block."""
    port: int = 8000
    """The port every host serves on."""
    dns_interval_s: float = 1.0
    """The routers' ``--dns-interval-s``."""
    health_interval_s: float = 1.0
    """The routers' ``--health-interval-s``."""
    drain_timeout_s: float = 60.0
    """The instances' ``--drain-timeout-s``."""
    log_level: str = "info"
    """Of every process (``info`` logs each instance's drain)."""

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.dns_interval_s <= 0 or self.health_interval_s <= 0:
            raise ValueError("dns_interval_s and health_interval_s must be > 0")


@dataclass
class Host:
    """One process on its own host."""

    label: str
    """e.g. ``prefill-0``: the process's name and its namespace's suffix."""
    role: HostRole
    end: LinkEnd
    """Its namespace, address and interface."""
    proc: Process

    @property
    def url(self) -> str:
        return self.proc.url


class Fleet:
    """A LAN of hosts, the DNS server the routers ask, and the processes; a context manager.

    `start_instance` and `start_router` add a host and start its process without
    waiting; `wait_healthy` waits. Nothing is published until `publish`.
    """

    def __init__(self, config: FleetConfig, log_dir: Path) -> None:
        self.config = config
        self.log_dir = log_dir
        self.hosts: dict[str, Host] = {}
        self._stack = contextlib.ExitStack()
        self._published: dict[HostRole, list[Host]] = {role: [] for role in DNS_NAMES}
        self.lan: NetnsLan
        self.dns: StaticDns
        self.cluster: LocalCluster

    def __enter__(self) -> Fleet:
        with contextlib.ExitStack() as stack:
            self.lan = stack.enter_context(NetnsLan())
            self.dns = stack.enter_context(StaticDns(host=self.lan.bridge.ip))
            self.cluster = stack.enter_context(
                LocalCluster(log_dir=self.log_dir, env={"OMP_NUM_THREADS": "1"})
            )
            for role, name in DNS_NAMES.items():
                self.dns.set(name, [])
                self._published[role] = []
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _serve_args(self, role: str) -> list[str]:
        c = self.config
        return ["serve", "--model", c.model, "--role", role, "--num-blocks", str(c.num_blocks),
                "--block-size", str(c.block_size), "--drain-timeout-s", str(c.drain_timeout_s),
                "--log-level", c.log_level]  # fmt: skip

    def start_instance(self, role: HostRole, label: str) -> Host:
        """A prefill or decode instance on a new host (not waited for, not published)."""
        if role is HostRole.ROUTER:
            raise ValueError("start_instance starts prefill and decode instances; use start_router")
        return self._start(label, role, self._serve_args(role.value))

    def start_router(self, label: str) -> Host:
        """A push router with the duplex return on a new host, discovering both roles by
        DNS (not waited for)."""
        c = self.config
        args = ["router", "--model", c.model, "--mode", "push", "--return-mode", "push",
                "--prefill-dns", f"{DNS_NAMES[HostRole.PREFILL]}:{c.port}",
                "--decode-dns", f"{DNS_NAMES[HostRole.DECODE]}:{c.port}",
                "--dns-server", self.dns.address, "--dns-interval-s", str(c.dns_interval_s),
                "--health-interval-s", str(c.health_interval_s),
                "--drain-timeout-s", str(c.drain_timeout_s), "--log-level", c.log_level]  # fmt: skip
        return self._start(label, HostRole.ROUTER, args)

    def _start(self, label: str, role: HostRole, args: list[str]) -> Host:
        if label in self.hosts:
            raise ValueError(f"a host named {label!r} exists already")
        end = self.lan.add_host(label)
        proc = self.cluster.start(
            label, args, self.config.port, netns=end.netns, host=end.ip, env=end.ucx_env()
        )
        host = Host(label, role, end, proc)
        self.hosts[label] = host
        return host

    def start_reference(self) -> Process:
        """A colocated instance (role both) in the root namespace on 127.0.0.1: the answers
        every routed request must match (same preset and seed, greedy)."""
        return self.cluster.start("reference", self._serve_args("both"), free_port())

    def wait_healthy(self, procs: list[Process], timeout_s: float = 300.0) -> None:
        self.cluster.wait_healthy(timeout_s=timeout_s, procs=procs)

    def published(self, role: HostRole) -> list[Host]:
        """The hosts in `role`'s DNS answer now."""
        return list(self._published[role])

    def publish(self, host: Host) -> None:
        """Add `host`'s address to its role's DNS name."""
        if host not in self._published[host.role]:
            self._published[host.role].append(host)
        self._set_records(host.role)

    def unpublish(self, host: Host) -> None:
        """Drop `host`'s address from its role's DNS name."""
        if host in self._published[host.role]:
            self._published[host.role].remove(host)
        self._set_records(host.role)

    def _set_records(self, role: HostRole) -> None:
        self.dns.set(DNS_NAMES[role], [h.end.ip for h in self._published[role]])

    def signal(self, host: Host, sig: signal.Signals) -> None:
        """Send `sig` to `host`'s process (``ip netns exec`` execs it: its pid is the
        process's own)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(host.proc.popen.pid, sig)
