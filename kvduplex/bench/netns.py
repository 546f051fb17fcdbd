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

A `NetnsHost`'s namespace reaches only the root namespace: its /24 is its own, and
the root namespace does not forward (many hosts that reach each other, for the
multi-host benchmark: `benchmarks/netns_lan.py`).

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2 (`ip`; `tc` to shape);
`netns_unavailable_reason()` says why not, for tests to skip with.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

SUBNET_PREFIX = "10.200"
"""Every namespace's /24 is ``SUBNET_PREFIX.<x>.0/24``."""
_LINK_UP_TIMEOUT_S = 5.0


class NetnsError(RuntimeError):
    """An `ip`/`tc` command failed; the message holds the command and its stderr."""


def run_command(cmd: list[str]) -> str:
    """Run an `ip`/`tc` command; its stdout, or NetnsError with its stderr."""
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
    packet; latency 10 ms bounds the queue (the payload rates it gives are in
    docs/transfer.md).
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
        x = free_subnet(pid)
        self.name = f"kvd-{pid}-{x}"
        self.outer = LinkEnd(None, f"{SUBNET_PREFIX}.{x}.1", f"kv{pid}x{x}o")
        self.inner = LinkEnd(self.name, f"{SUBNET_PREFIX}.{x}.2", f"kv{pid}x{x}i")
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
        run_command(["ip", "netns", "add", ns])
        self._has_netns = True
        veth_pair = ["type", "veth", "peer", "name", inner.dev, "netns", ns]
        run_command(["ip", "link", "add", outer.dev, *veth_pair])
        self._has_veth = True
        run_command(["ip", "addr", "add", f"{outer.ip}/24", "dev", outer.dev])
        run_command(["ip", "-n", ns, "addr", "add", f"{inner.ip}/24", "dev", inner.dev])
        run_command(["ip", "-n", ns, "link", "set", "lo", "up"])
        run_command(["ip", "-n", ns, "link", "set", inner.dev, "up"])
        run_command(["ip", "link", "set", outer.dev, "up"])
        if self.rate_mbit is not None:
            shaping = tbf_args(self.rate_mbit)
            run_command(["tc", "qdisc", "add", "dev", outer.dev, "root", *shaping])
            run_command(
                [*inner.exec_prefix(), "tc", "qdisc", "add", "dev", inner.dev, "root", *shaping]
            )
        wait_link_up(self.outer.dev)
        rate = "unshaped" if self.rate_mbit is None else f"{self.rate_mbit} Mbit/s"
        logger.info("netns %s up: %s <-> %s, %s", ns, outer, inner, rate)

    def close(self) -> None:
        """Remove what `__enter__` made: the veth pair (one end's deletion deletes both)
        and the namespace. Never touches a namespace or device of that name it did not create.
        """
        if self._has_veth:
            self._has_veth = False
            with contextlib.suppress(NetnsError):
                run_command(["ip", "link", "del", self.outer.dev])
        if self._has_netns:
            self._has_netns = False
            with contextlib.suppress(NetnsError):
                run_command(["ip", "netns", "del", self.name])
            logger.info("netns %s removed", self.name)


def wait_link_up(dev: str) -> None:
    """Wait until `dev` (in the root namespace) has its carrier (``LOWER_UP``)."""
    deadline = time.monotonic() + _LINK_UP_TIMEOUT_S
    while "LOWER_UP" not in run_command(["ip", "-o", "link", "show", "dev", dev]):
        if time.monotonic() > deadline:
            raise NetnsError(f"{dev} not up after {_LINK_UP_TIMEOUT_S}s")
        time.sleep(0.01)  # the kernel brings the link up on its own; nothing to wait on


def free_subnet(pid: int) -> int:
    """A third octet x such that 10.200.x.0/24 is not configured in the root namespace."""
    in_use = run_command(["ip", "-4", "-o", "addr", "show"])
    start = pid % 254
    for i in range(254):
        x = (start + i) % 254 + 1
        if f" {SUBNET_PREFIX}.{x}." not in in_use:
            return x
    raise NetnsError(f"all {SUBNET_PREFIX}.x.0/24 subnets are in use; remove stale kvd-* netns")
