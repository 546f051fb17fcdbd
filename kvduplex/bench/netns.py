"""A second "host" on this machine: a network namespace joined to ours by a veth pair.

Used by integration tests and benchmarks that need P↔D traffic to cross a real
network link (UCX over TCP) instead of shared memory, optionally shaped to a rate::

      root namespace (this process)                 namespace kvd-<pid>-<x>
    ┌───────────────────────────────┐  veth pair  ┌──────────────────────────────┐
    │ D, router, test client        │             │ P                            │
    │ kv<pid>x<x>o  10.200.<x>.1/24 │◄═══════════►│ kv<pid>x<x>i  10.200.<x>.2/24│
    └───────────────────────────────┘ tc tbf at   └──────────────────────────────┘
          outer end                   rate_mbit,          inner end
                                      each end

Design note: only one end is a new namespace. The root namespace reaches the
other end's address over the veth's connected route, so the router, the test
client and `LocalCluster.wait_healthy` need nothing special, while everything
between the two ends still crosses the link. `x` starts from the pid and skips
subnets already configured here, so parallel runs do not clash.

UCX settings for a process on either end (`LinkEnd.ucx_env`):

* ``UCX_TLS=tcp``: a network namespace does not separate memory or pids, so
  UCX's shared-memory transports (`cma`, posix) would still work between the
  ends and bypass the link entirely (with UCX's defaults, the pull test's
  READs of 18 blocks, 288 KiB, put 5 KB of HTTP on the veth: cma copied the KV).
* ``UCX_NET_DEVICES=<that end's veth>``: the only interface leading to the
  peer; `lo` in each namespace is a different loopback, and eth0 leads elsewhere.

Many hosts that reach each other: `NetnsLan`, one subnet on a bridge in the root
namespace, a veth per host (see its docstring). A `NetnsHost`'s namespace reaches
only the root namespace: its /24 is its own, and the root namespace does not forward.

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2 (`ip`; `tc` to shape);
`netns_unavailable_reason()` says why not, for tests to skip with.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_SUBNET_PREFIX = "10.200"
_LINK_UP_TIMEOUT_S = 5.0

# Throughput sink run inside the namespace by `measure_link_gbit`: prints its
# port once listening, accepts one connection, then prints "<bytes> <seconds>"
# (from the first byte to EOF).
_SINK = """
import socket, sys, time
s = socket.create_server((sys.argv[1], 0))
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
buf = bytearray(1 << 20)
n = c.recv_into(buf)
t0 = time.perf_counter()
while k := c.recv_into(buf):
    n += k
print(n, time.perf_counter() - t0, flush=True)
"""


class NetnsError(RuntimeError):
    """An `ip`/`tc` command failed; the message holds the command and its stderr."""


def _run(cmd: list[str]) -> str:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise NetnsError(f"cannot run `{cmd[0]}`: {exc}; install iproute2") from exc
    if res.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed: {res.stderr.strip() or res.stdout.strip()}")
    return res.stdout


def netns_unavailable_reason() -> str | None:
    """None when this process can create a namespace with a veth pair, else why not.

    Tries it for real (creates and removes a throwaway `NetnsHost`), so a
    container that forbids it is caught too. Does not check `tc`.
    """
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, not {sys.platform}"
    if os.geteuid() != 0:
        return f"creating network namespaces needs root (running as uid {os.geteuid()})"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not on PATH"
    try:
        with NetnsHost():
            pass
    except NetnsError as exc:
        return f"cannot create a network namespace with a veth pair: {exc}"
    return None


def tbf_args(rate_mbit: float) -> list[str]:
    """``tc qdisc ... root`` arguments shaping a device's egress to `rate_mbit`.

    burst: 1 ms at the rate (1.25 MB at 10 Gbit/s), at least one 64 KiB GSO
    packet; latency 10 ms bounds the queue. Measured with one TCP stream over
    the veth: 9.55 Gbit/s of payload at 10 Gbit/s, 0.95 at 1 Gbit/s.
    """
    if rate_mbit <= 0:
        raise ValueError(f"rate_mbit must be > 0, got {rate_mbit}; pass None for an unshaped link")
    burst_bytes = max(int(rate_mbit * 1e6 / 8 / 1000), 64 * 1024)
    return ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst_bytes), "latency", "10ms"]


@dataclass(frozen=True)
class LinkEnd:
    """One end of the link: where a process runs, its address and its interface."""

    netns: str | None
    """Namespace name, or None for the root namespace."""
    ip: str
    dev: str
    """The veth interface on this end."""

    def exec_prefix(self) -> list[str]:
        """Command prefix that runs a program on this end (empty for the root namespace)."""
        return [] if self.netns is None else ["ip", "netns", "exec", self.netns]

    def ucx_env(self) -> dict[str, str]:
        """Environment for a NIXL process on this end: UCX over TCP on the veth only."""
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": self.dev}


class NetnsHost:
    """A network namespace linked to the root namespace by a veth pair; a context manager.

    `__enter__` creates the namespace, the veth pair (``outer`` end in the root
    namespace, ``inner`` end in the new one) with addresses, brings up lo and
    both ends, applies `tbf_args(rate_mbit)` to both ends if a rate is given,
    and waits for the link to come up. Anything it made is removed again if a
    step fails (raising `NetnsError`). `close()` (also on exit) removes it all;
    calling it again is harmless. Processes still running inside the namespace
    keep it alive after `close()`: stop them first.
    """

    def __init__(self, rate_mbit: float | None = None) -> None:
        if rate_mbit is not None:
            tbf_args(rate_mbit)  # validates
            if shutil.which("tc") is None:
                raise NetnsError("shaping a link needs `tc` (iproute2) on PATH")
        self.rate_mbit = rate_mbit
        pid = os.getpid()
        x = _free_subnet(pid)
        self.name = f"kvd-{pid}-{x}"
        self.outer = LinkEnd(None, f"{_SUBNET_PREFIX}.{x}.1", f"kv{pid}x{x}o")
        self.inner = LinkEnd(self.name, f"{_SUBNET_PREFIX}.{x}.2", f"kv{pid}x{x}i")
        self._has_netns = False
        self._has_veth = False

    def __enter__(self) -> NetnsHost:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        ns, outer, inner = self.name, self.outer, self.inner
        _run(["ip", "netns", "add", ns])
        self._has_netns = True
        veth_pair = ["type", "veth", "peer", "name", inner.dev, "netns", ns]
        _run(["ip", "link", "add", outer.dev, *veth_pair])
        self._has_veth = True
        _run(["ip", "addr", "add", f"{outer.ip}/24", "dev", outer.dev])
        _run(["ip", "-n", ns, "addr", "add", f"{inner.ip}/24", "dev", inner.dev])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        _run(["ip", "-n", ns, "link", "set", inner.dev, "up"])
        _run(["ip", "link", "set", outer.dev, "up"])
        if self.rate_mbit is not None:
            shaping = tbf_args(self.rate_mbit)
            _run(["tc", "qdisc", "add", "dev", outer.dev, "root", *shaping])
            _run([*inner.exec_prefix(), "tc", "qdisc", "add", "dev", inner.dev, "root", *shaping])
        _wait_link_up(self.outer.dev)
        rate = "unshaped" if self.rate_mbit is None else f"{self.rate_mbit} Mbit/s"
        logger.info("netns %s up: %s <-> %s, %s", ns, outer, inner, rate)

    def close(self) -> None:
        """Remove what `__enter__` made: the veth pair (one end's deletion deletes both)
        and the namespace. Never touches a namespace or device of that name it did not create.
        """
        if self._has_veth:
            self._has_veth = False
            with contextlib.suppress(NetnsError):
                _run(["ip", "link", "del", self.outer.dev])
        if self._has_netns:
            self._has_netns = False
            with contextlib.suppress(NetnsError):
                _run(["ip", "netns", "del", self.name])
            logger.info("netns %s removed", self.name)


def _wait_link_up(dev: str) -> None:
    """Wait until `dev` (in the root namespace) has its carrier (``LOWER_UP``)."""
    deadline = time.monotonic() + _LINK_UP_TIMEOUT_S
    while "LOWER_UP" not in _run(["ip", "-o", "link", "show", "dev", dev]):
        if time.monotonic() > deadline:
            raise NetnsError(f"{dev} not up after {_LINK_UP_TIMEOUT_S}s")
        time.sleep(0.01)  # the kernel brings the link up on its own; nothing to wait on


class NetnsLan:
    """Hosts on one subnet, each a network namespace on a bridge; a context manager.

    ::

        root namespace (this process): bridge kvd<x>br, 10.200.<x>.1/24
          │  ports: kvd<x>h2o   kvd<x>h3o   ...      (DNS server, client)
          │            ║ veth      ║ veth
          │  ┌─────────╨──────┐ ┌──╨─────────────┐
          │  │ kvd<x>h2i      │ │ kvd<x>h3i      │   one namespace per host,
          │  │ 10.200.<x>.2/24│ │ 10.200.<x>.3/24│   kvd-<pid>-<x>-<label>
          │  └────────────────┘ └────────────────┘

    Design note: the hosts share one layer-2 segment, so they reach each other
    directly and the root namespace reaches them over the bridge's connected
    route: nothing is routed and no forwarding setting of this machine changes.
    Where bridged traffic passes iptables (``br_netfilter``), the ``FORWARD``
    chain must accept it.

    `__enter__` creates the bridge, with the subnet's first address, and brings it
    up; `add_host` adds a host; `close()` (also on exit) removes every host's
    veth pair and namespace, then the bridge. As for `NetnsHost`, stop the
    processes running in the hosts first.
    """

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._x = _free_subnet(self._pid)
        self.bridge = LinkEnd(None, f"{_SUBNET_PREFIX}.{self._x}.1", f"kvd{self._x}br")
        """The root namespace's end: reach it from a host at `bridge.ip`."""
        self.hosts: list[LinkEnd] = []
        """The hosts' ends, in the order they were added."""
        self._outer_devs: list[str] = []
        """The bridge's end of each host's veth pair."""
        self._has_bridge = False

    def __enter__(self) -> NetnsLan:
        try:
            _run(["ip", "link", "add", "name", self.bridge.dev, "type", "bridge"])
            self._has_bridge = True
            _run(["ip", "addr", "add", f"{self.bridge.ip}/24", "dev", self.bridge.dev])
            _run(["ip", "link", "set", self.bridge.dev, "up"])
        except BaseException:
            self.close()
            raise
        logger.info("bridge %s up: %s/24", self.bridge.dev, self.bridge.ip)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_host(self, label: str) -> LinkEnd:
        """A new host on the subnet, named ``kvd-<pid>-<x>-<label>``; its end (namespace,
        address, interface). Raises `NetnsError` on failure; `close` removes what it made."""
        if not self._has_bridge:
            raise NetnsError("add_host needs the LAN entered (use it as a context manager)")
        n = len(self.hosts) + 2
        if n > 254:
            raise NetnsError(f"a LAN holds at most 253 hosts; {label!r} is one more")
        host = LinkEnd(f"kvd-{self._pid}-{self._x}-{label}", f"{_SUBNET_PREFIX}.{self._x}.{n}",
                       f"kvd{self._x}h{n}i")  # fmt: skip
        outer = f"kvd{self._x}h{n}o"
        ns = host.netns
        assert ns is not None
        _run(["ip", "netns", "add", ns])
        self.hosts.append(host)  # from here on, `close` removes it
        self._outer_devs.append(outer)
        _run(["ip", "link", "add", outer, "type", "veth", "peer", "name", host.dev, "netns", ns])
        _run(["ip", "link", "set", outer, "master", self.bridge.dev])
        _run(["ip", "-n", ns, "addr", "add", f"{host.ip}/24", "dev", host.dev])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        _run(["ip", "-n", ns, "link", "set", host.dev, "up"])
        _run(["ip", "link", "set", outer, "up"])
        _wait_link_up(outer)
        logger.info("host %s on %s: %s", ns, self.bridge.dev, host.ip)
        return host

    def close(self) -> None:
        """Remove each host's veth pair (one end's deletion deletes both) and namespace,
        then the bridge. Calling it again is harmless."""
        while self.hosts:
            ns, outer = self.hosts.pop().netns, self._outer_devs.pop()
            assert ns is not None
            with contextlib.suppress(NetnsError):
                _run(["ip", "link", "del", outer])
            with contextlib.suppress(NetnsError):
                _run(["ip", "netns", "del", ns])
        if self._has_bridge:
            self._has_bridge = False
            with contextlib.suppress(NetnsError):
                _run(["ip", "link", "del", self.bridge.dev])
            logger.info("bridge %s removed", self.bridge.dev)


def _free_subnet(pid: int) -> int:
    """A third octet x such that 10.200.x.0/24 is not configured in the root namespace."""
    in_use = _run(["ip", "-4", "-o", "addr", "show"])
    start = pid % 254
    for i in range(254):
        x = (start + i) % 254 + 1
        if f" {_SUBNET_PREFIX}.{x}." not in in_use:
            return x
    raise NetnsError(f"all {_SUBNET_PREFIX}.x.0/24 subnets are in use; remove stale kvd-* netns")


def measure_link_gbit(host: NetnsHost, num_mib: int = 1000, timeout_s: float = 60.0) -> float:
    """Payload throughput of one TCP stream from the outer to the inner end, in Gbit/s.

    Runs a sink in the namespace and sends `num_mib` MiB to it from this
    process. A measurement for benchmarks and manual checks, not for tests.
    """
    cmd = [*host.inner.exec_prefix(), sys.executable, "-c", _SINK, host.inner.ip]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as sink:
        try:
            assert sink.stdout is not None
            port = int(sink.stdout.readline())
            chunk = b"\0" * (1 << 20)
            with socket.create_connection((host.inner.ip, port), timeout=timeout_s) as conn:
                for _ in range(num_mib):
                    conn.sendall(chunk)
            num_bytes, seconds = sink.stdout.readline().split()
            sink.wait(timeout_s)
        finally:
            if sink.poll() is None:
                sink.kill()
    return int(num_bytes) * 8 / float(seconds) / 1e9
