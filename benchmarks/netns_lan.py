"""Hosts on one subnet, each a network namespace on a bridge: the multi-host benchmark's.

Built from `kvduplex.bench.netns` (its `LinkEnd`s, its command runner and its
free-subnet search); needs what it needs (root, iproute2).
"""

from __future__ import annotations

import contextlib
import logging
import os

from kvduplex.bench.netns import SUBNET_PREFIX
from kvduplex.bench.netns import LinkEnd
from kvduplex.bench.netns import NetnsError
from kvduplex.bench.netns import free_subnet
from kvduplex.bench.netns import run_command
from kvduplex.bench.netns import wait_link_up

logger = logging.getLogger(__name__)


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
        self._x = free_subnet(self._pid)
        self.bridge = LinkEnd(None, f"{SUBNET_PREFIX}.{self._x}.1", f"kvd{self._x}br")
        """The root namespace's end: reach it from a host at `bridge.ip`."""
        self.hosts: list[LinkEnd] = []
        """The hosts' ends, in the order they were added."""
        self._outer_devs: list[str] = []
        """The bridge's end of each host's veth pair."""
        self._has_bridge = False

    def __enter__(self) -> NetnsLan:
        try:
            run_command(["ip", "link", "add", "name", self.bridge.dev, "type", "bridge"])
            self._has_bridge = True
            run_command(["ip", "addr", "add", f"{self.bridge.ip}/24", "dev", self.bridge.dev])
            run_command(["ip", "link", "set", self.bridge.dev, "up"])
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
        host = LinkEnd(f"kvd-{self._pid}-{self._x}-{label}", f"{SUBNET_PREFIX}.{self._x}.{n}",
                       f"kvd{self._x}h{n}i")  # fmt: skip
        outer = f"kvd{self._x}h{n}o"
        ns = host.netns
        assert ns is not None
        run_command(["ip", "netns", "add", ns])
        self.hosts.append(host)  # from here on, `close` removes it
        self._outer_devs.append(outer)
        run_command(
            ["ip", "link", "add", outer, "type", "veth", "peer", "name", host.dev, "netns", ns]
        )
        run_command(["ip", "link", "set", outer, "master", self.bridge.dev])
        run_command(["ip", "-n", ns, "addr", "add", f"{host.ip}/24", "dev", host.dev])
        run_command(["ip", "-n", ns, "link", "set", "lo", "up"])
        run_command(["ip", "-n", ns, "link", "set", host.dev, "up"])
        run_command(["ip", "link", "set", outer, "up"])
        wait_link_up(outer)
        logger.info("host %s on %s: %s", ns, self.bridge.dev, host.ip)
        return host

    def close(self) -> None:
        """Remove each host's veth pair (one end's deletion deletes both) and namespace,
        then the bridge. Calling it again is harmless."""
        while self.hosts:
            ns, outer = self.hosts.pop().netns, self._outer_devs.pop()
            assert ns is not None
            with contextlib.suppress(NetnsError):
                run_command(["ip", "link", "del", outer])
            with contextlib.suppress(NetnsError):
                run_command(["ip", "netns", "del", ns])
        if self._has_bridge:
            self._has_bridge = False
            with contextlib.suppress(NetnsError):
                run_command(["ip", "link", "del", self.bridge.dev])
            logger.info("bridge %s removed", self.bridge.dev)
