"""Instances discovered by DNS: every address of a name is an instance of one role.

``--prefill-dns NAME:PORT`` and ``--decode-dns NAME:PORT`` name a set of instances
the way a Kubernetes headless Service does: one A (or AAAA) record per ready pod.
The router resolves each name at start and every ``--dns-interval-s`` after
(`run_discovery`, a task of the app's lifespan), and compares the answer with the
instances it found there before::

    answer   {a, b, d}        instances before  {a, b, c}
    joins    d: GET http://d:PORT/health; its role must be the set's (prefill or
             decode), and with a cluster secret d must prove it holds the secret as
             that role (`admission`, before any credential is sent to it): then it
             joins the pool, with the engine id its /health names; else it is refused
             (logged once, counted) and asked again next round (a failed proof: after
             a backoff)
    leaves   c: no new work (`BackendPool.remove`); its sessions move at their next
             turn (the rendezvous rank of a named session skips it; a recognised one
             goes where a new one would); its calls in flight end as they would have,
             and it is probed until they have (one gone silent is marked down, which
             ends them); if it comes back meanwhile, it rejoins as the same backend

An address that does not answer its /health (or whose /health fails in any way) is
asked again next round. A name that does not exist or has no address (NXDOMAIN, no
answer) has no instances; a DNS failure (timeout, no server answered), or any error
while a name's instances are updated, keeps them as they were, logged; rounds go on
until cancelled.
Instances given by URL (``--prefill``, ``--decode``) are never removed, and an
address that is one of them is not added twice. An address that leaves the answer
is forgotten by the admission too, once no call to it is in flight: if it comes
back, it proves itself again.

Resolution never blocks the event loop: `DnsResolver` asks over asyncio
(dnspython), the system's servers (/etc/resolv.conf, its search domains
included for a name without a final dot; /etc/hosts is not read) or
``--dns-server``. Give names fully qualified (``name.namespace.svc.cluster.local.``):
a short name goes through the search domains, where another domain may answer
first. Tests inject any `Resolve` function.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Awaitable
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field

import dns.asyncresolver
import dns.exception
import dns.resolver

from kvduplex.common.challenge import Refusal
from kvduplex.common.config import Role
from kvduplex.common.config import host_and_port
from kvduplex.router.admission import Admission
from kvduplex.router.backends import Backend
from kvduplex.router.backends import BackendPool
from kvduplex.router.client import CallError
from kvduplex.router.client import InstanceClient
from kvduplex.router.config import RouterConfig
from kvduplex.router.health import note_health
from kvduplex.router.policy import RoutingPolicy

logger = logging.getLogger(__name__)

Resolve = Callable[[str], Awaitable[set[str]]]
"""A name's addresses (IPv4 and IPv6, as text); raises `ResolveFailed` when the answer is
not known (the instances then stay as they were). An empty set: the name has none."""


class ResolveFailed(Exception):
    """A name could not be resolved this round (no DNS server answered in time)."""


class DnsResolver:
    """`Resolve` over DNS: a name's A and AAAA records, asked over asyncio (dnspython)."""

    def __init__(self, server: str = "", timeout_s: float = 2.0) -> None:
        """`server`: IP or IP:PORT of the DNS server to ask (empty: the system's, from
        /etc/resolv.conf, whose search domains complete a short name)."""
        try:
            self._resolver = dns.asyncresolver.Resolver(configure=not server)
        except dns.resolver.NoResolverConfiguration as exc:
            raise ValueError(
                f"cannot read the system's DNS servers ({exc}): give --dns-server"
            ) from None
        if server:
            host, port = host_and_port(server, "dns_server", default_port=53)
            self._resolver.nameservers = [host]
            self._resolver.port = port
        self._resolver.lifetime = timeout_s

    async def __call__(self, name: str) -> set[str]:
        records = await asyncio.gather(self._records(name, "A"), self._records(name, "AAAA"))
        return {address for found in records for address in found}

    async def _records(self, name: str, rdtype: str) -> set[str]:
        try:
            answer = await self._resolver.resolve(name, rdtype, search=True)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return set()
        except dns.exception.DNSException as exc:
            raise ResolveFailed(f"{rdtype} {name}: {exc}") from exc
        return {rdata.to_text() for rdata in answer}


def instance_url(address: str, port: int) -> str:
    """The URL of the instance at `address` (IPv6 in brackets) and `port`."""
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return f"http://{host}:{port}"


@dataclass
class DnsSet:
    """The instances of one role that a DNS name gives."""

    role: Role
    pool: BackendPool
    name: str
    port: int
    members: set[str] = field(default_factory=set)
    """URLs of the instances discovery added to the pool (and may remove)."""
    refused: set[str] = field(default_factory=set)
    """URLs whose /health named another role (logged once, asked again each round)."""
    answer: set[str] = field(default_factory=set)
    """URLs of the last answer."""
    gone: set[str] = field(default_factory=set)
    """URLs gone from the answer that the admission has not forgotten yet."""


@dataclass
class Discovery:
    """Keeps the pools' instances as their DNS names say (see the module docstring)."""

    sets: list[DnsSet]
    resolve: Resolve
    client: InstanceClient
    """For the /health of addresses that appear (asked without credentials)."""
    timeout_s: float
    """Deadline of one such /health."""
    num_rounds: int = 0
    """Rounds done; the router is not ready before the first."""
    admission: Admission | None = None
    """The proofs of the cluster secret (None: none asked, and refusals not counted)."""

    @classmethod
    def try_from_config(
        cls,
        config: RouterConfig,
        policy: RoutingPolicy,
        client: InstanceClient,
        timeout_s: float,
        resolve: Resolve | None = None,
        admission: Admission | None = None,
    ) -> Discovery | None:
        """Discovery of ``--prefill-dns`` and ``--decode-dns``; None if neither is given.
        `timeout_s`: the deadline of a new address's /health; `resolve` replaces DNS
        (tests); `admission`: the proofs a new address must give before it joins."""
        sets = []
        for role, pool, target in (
            (Role.PREFILL, policy.prefill, config.prefill_dns),
            (Role.DECODE, policy.decode, config.decode_dns),
        ):
            if target:
                name, port = host_and_port(target, f"{role.value}_dns")
                sets.append(DnsSet(role, pool, name, port))
        if not sets:
            return None
        if resolve is None:
            resolve = DnsResolver(config.dns_server, timeout_s=config.health_timeout_s)
        if admission is None or not admission.is_active:
            logger.warning(
                "no cluster secret: every address that DNS names for %s is taken for an "
                "instance, and sent the API key; set KVDUPLEX_CLUSTER_SECRET or "
                "--cluster-secret-file on every instance and router",
                " and ".join(s.name for s in sets),
            )  # fmt: skip
        return cls(sets, resolve, client, timeout_s, admission=admission)

    async def run_round(self) -> None:
        """Resolve every name once and update its pool. A name whose update fails
        unexpectedly is logged and keeps its instances as they were (as on a DNS failure);
        the others are updated, and the round counts."""
        results = await asyncio.gather(
            *(self._refresh(s) for s in self.sets), return_exceptions=True
        )
        for s, result in zip(self.sets, results, strict=True):
            if isinstance(result, Exception):
                logger.error(
                    "%s DNS %s: the round failed; its %d instances stay as they were",
                    s.role.value, s.name, len(s.members), exc_info=result,
                )  # fmt: skip
        self.num_rounds += 1

    async def _refresh(self, s: DnsSet) -> None:
        try:
            addresses = await self.resolve(s.name)
        except ResolveFailed as exc:
            logger.warning(
                "%s DNS %s: %s; its %d instances stay", s.role.value, s.name, exc, len(s.members)
            )
            return
        urls = {instance_url(address, s.port) for address in addresses}
        s.gone = (s.gone | (s.answer - urls)) - urls
        s.answer = urls
        for url in sorted(s.members - urls):
            s.pool.remove(url)
            s.members.discard(url)
            logger.warning(
                "%s instance %s left DNS %s: no new work for it", s.role.value, url, s.name
            )
        self._forget_gone(s)
        s.refused &= urls
        new = [url for url in sorted(urls - s.members) if s.pool.by_url(url) is None]
        await asyncio.gather(*(self._try_admit(s, url) for url in new))

    def _forget_gone(self, s: DnsSet) -> None:
        """The admission forgets the addresses gone from the answer (their proof, their
        refusals: one that comes back proves itself again), once no call is in flight to
        them (until then the calls that follow up on those, a cancel say, may go on)."""
        for url in sorted(s.gone):
            if s.pool.try_leaving(url) is None:
                if self.admission is not None:
                    self.admission.forget(url)
                s.gone.discard(url)

    async def _try_admit(self, s: DnsSet, url: str) -> None:
        """Add the instance at `url` to `s`'s pool if its /health answers with `s`'s role and
        it proves the cluster secret as that role (with a secret)."""
        try:
            resp = await self.client.get(url + "/health", self.timeout_s)
            body = resp.json() if resp.status_code == 200 else None
        except (CallError, ValueError) as exc:
            logger.info("%s DNS %s: %s not added yet: /health %r", s.role.value, s.name, url, exc)
            return
        except Exception as exc:  # not the transport's: still an address not added yet
            logger.warning(
                "%s DNS %s: %s not added yet: /health %r",
                s.role.value, s.name, url, exc, exc_info=True,
            )  # fmt: skip
            return
        if body is None:
            logger.info(
                "%s DNS %s: %s not added yet: /health HTTP %d",
                s.role.value, s.name, url, resp.status_code,
            )  # fmt: skip
            return
        role = body.get("role") if isinstance(body, dict) else None
        if role != s.role.value:
            if url not in s.refused:
                logger.warning(
                    "%s DNS %s: %s is not used: its /health says role %r, not %s",
                    s.role.value, s.name, url, role, s.role.value,
                )  # fmt: skip
            s.refused.add(url)
            if self.admission is not None:
                self.admission.count(s.role.value, Refusal.ROLE)
            return
        if self.admission is not None:
            why = await self.admission.try_admit(url, s.role.value, (s.role.value,))
            if why is not None:
                logger.info("%s DNS %s: %s not added: %s", s.role.value, s.name, url, why)
                return
        leaving = s.pool.try_leaving(url)
        b = leaving or Backend(url)
        note_health(b, resp)
        s.pool.add(b)
        s.members.add(url)
        s.refused.discard(url)
        logger.warning(
            "%s instance %s %s from DNS %s (engine %s)",
            s.role.value, url, "joined" if leaving is None else "rejoined (calls in flight)",
            s.name, b.engine_id,
        )  # fmt: skip


async def run_discovery(discovery: Discovery, interval_s: float) -> None:
    """Discovery rounds every `interval_s` (the first at once) until cancelled. A round
    that fails unexpectedly is logged and leaves the instances as they were."""
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        try:
            await discovery.run_round()
        except Exception:
            logger.exception("DNS discovery round failed; the instances stay as they were")
        await asyncio.sleep(max(0.0, interval_s - (loop.time() - started)))
