"""Router replicas and DNS discovery with real processes.

Two prefill and two decode instances, each set on its own loopback addresses
(127.0.0.2 and 127.0.0.3) with one port per role, as a headless Service's pods
are; a colocated reference on 127.0.0.1; a DNS server for tests (`StaticDns`).

* Two routers that share nothing, one given the instances by URL and one by DNS
  names, serve a session's turns in turn: each turn reaches the instances that the
  session's id ranks first, and from the second turn on prefill's cache holds the
  history with the answers decode returned to it.
* A router whose decode name gains an address sends the sessions that rank the new
  instance first to it; when an address leaves the answer, no request reaches it
  any more, and its sessions' next turns are answered exactly on the other.

Which instance served a request is read from its finished-request counter; the
requests run one at a time so that each moves one prefill and one decode counter.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from kvduplex.cluster import LocalCluster
from kvduplex.cluster import free_port
from kvduplex.router import rendezvous
from tests.integration.conftest import assert_pool_clean
from tests.integration.conftest import complete_turn
from tests.integration.conftest import metric
from tests.integration.conftest import wait_until
from tests.skips import skip_module_without_nixl
from tests.support.static_dns import StaticDns

pytestmark = pytest.mark.integration

skip_module_without_nixl()

BS = 8
HOSTS = ("127.0.0.2", "127.0.0.3")
_SERVE = ["serve", "--model", "tiny", "--num-blocks", "256", "--block-size", str(BS),
          "--log-level", "warning"]  # fmt: skip


def _port_free_on(hosts: tuple[str, ...]) -> int:
    """A port free on every one of `hosts` right now."""
    for _ in range(50):
        port = free_port(hosts[0])
        try:
            for host in hosts[1:]:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind((host, port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no port free on all of {hosts}")


@dataclass
class Fleet:
    cluster: LocalCluster
    dns: StaticDns
    prefill: list[str]
    decode: list[str]
    reference: str
    prefill_port: int
    decode_port: int

    def router(self, name: str, *args: str) -> str:
        """A push router with the duplex return, and `args` (its instances)."""
        argv = ["router", "--model", "tiny", "--mode", "push", "--return-mode", "push",
                "--dns-server", self.dns.address, "--dns-interval-s", "0.2", *args]  # fmt: skip
        url = self.cluster.start(name, argv, free_port()).url
        self.cluster.wait_healthy(timeout_s=60)
        wait_until(lambda: httpx.get(url + "/ready").status_code == 200, 30, f"{name} ready")
        return url

    def served(self) -> dict[str, float]:
        return {u: metric(u, "kvduplex_requests_finished_total") for u in self.instances}

    @property
    def instances(self) -> list[str]:
        return [*self.prefill, *self.decode]


@pytest.fixture(scope="module")
def fleet(cluster: LocalCluster) -> Iterator[Fleet]:
    p_port, d_port = _port_free_on(HOSTS), _port_free_on(HOSTS)
    ps = [cluster.start(f"prefill-{h}", [*_SERVE, "--role", "prefill"], p_port, host=h)
          for h in HOSTS]  # fmt: skip
    ds = [cluster.start(f"decode-{h}", [*_SERVE, "--role", "decode"], d_port, host=h)
          for h in HOSTS]  # fmt: skip
    ref = cluster.start("reference", [*_SERVE, "--role", "both"], free_port())
    with StaticDns() as dns:
        cluster.wait_healthy(timeout_s=180)
        yield Fleet(cluster, dns, [p.url for p in ps], [d.url for d in ds], ref.url,
                    p_port, d_port)  # fmt: skip


@pytest.fixture(autouse=True)
def clean_pools(fleet: Fleet) -> Iterator[None]:
    yield
    for url in [*fleet.instances, fleet.reference]:
        assert_pool_clean(url)


def _returns_settled(fleet: Fleet, num_offered: int) -> bool:
    """The decode instances offered `num_offered` returns in all, and each has ended."""
    stats = [httpx.get(d + "/internal/kv/return/stats", timeout=10).json() for d in fleet.decode]
    offered = sum(s["num_offered"] for s in stats)
    ended = sum(s["num_done"] + s["num_failed"] + s["num_declined"] for s in stats)
    return offered >= num_offered and ended == offered


def _moved(before: dict[str, float], after: dict[str, float]) -> set[str]:
    return {url for url in before if after[url] != before[url]}


def test_replicas_that_share_nothing_keep_a_sessions_turns_where_its_history_is(
    fleet: Fleet,
) -> None:
    fleet.dns.set("prefill.kv.test", list(HOSTS))
    fleet.dns.set("decode.kv.test", list(HOSTS))
    routers = [
        fleet.router("router-urls", "--prefill", *fleet.prefill, "--decode", *fleet.decode[::-1]),
        fleet.router("router-dns", "--prefill-dns", f"prefill.kv.test:{fleet.prefill_port}",
                     "--decode-dns", f"decode.kv.test:{fleet.decode_port}"),
    ]  # fmt: skip
    rng = random.Random(7)
    num_offered = sum(
        httpx.get(d + "/internal/kv/return/stats", timeout=10).json()["num_offered"]
        for d in fleet.decode
    )
    for session in ("ana", "ben", "cleo"):
        want_p = rendezvous.rank(session, fleet.prefill, str)[0]
        want_d = rendezvous.rank(session, fleet.decode, str)[0]
        history = [rng.randrange(1, 250) for _ in range(40 + rng.randrange(30))]
        # The previous prompt, and its answer but the last token, up to a full block: in
        # prefill's cache whichever router served the previous turn.
        returned = 0
        for turn in range(4):
            before = fleet.served()
            got, cached = complete_turn(routers[turn % 2], history, session)
            assert _moved(before, fleet.served()) == {want_p, want_d}, (session, turn)
            want, _ = complete_turn(fleet.reference, history, f"ref-{session}")
            assert got == want, (session, turn)
            assert cached >= returned, (session, turn, cached, returned)
            num_offered += 1
            wait_until(lambda n=num_offered: _returns_settled(fleet, n), 30, "the return")
            returned = (len(history) + len(got) - 1) // BS * BS
            history = [*history, *got, *(rng.randrange(1, 250) for _ in range(10))]


def _decode_urls(router: str) -> set[str]:
    instances = httpx.get(router + "/health", timeout=10).json()["instances"]
    return {i["url"] for i in instances if i["role"] == "decode"}


def test_decode_instances_join_and_leave_as_the_dns_answer_changes(fleet: Fleet) -> None:
    """1. one decode address: every session's turn goes there; 2. a second appears: the
    sessions that rank it first go to it, the others stay; 3. the first leaves: every
    turn goes to the second, answered exactly (the moved sessions recompute there)."""
    d0, d1 = fleet.decode
    fleet.dns.set("prefill.join.test", [HOSTS[0]])
    fleet.dns.set("decode.join.test", [HOSTS[0]])
    router = fleet.router(
        "router-join", "--prefill-dns", f"prefill.join.test:{fleet.prefill_port}",
        "--decode-dns", f"decode.join.test:{fleet.decode_port}",
    )  # fmt: skip
    # Three sessions that rank each instance first (the ports, and so the ranks, vary).
    candidates = [f"join-{i}" for i in range(200)]
    first = {s: rendezvous.rank(s, [d0, d1], str)[0] for s in candidates}
    sessions = [s for d in (d0, d1) for s in [c for c in candidates if first[c] == d][:3]]
    ranks_d1 = {s for s in sessions if first[s] == d1}
    assert len(sessions) == 6 and len(ranks_d1) == 3, "both instances get sessions"
    rng = random.Random(11)
    histories = {s: [rng.randrange(1, 250) for _ in range(30)] for s in sessions}

    def turn(s: str) -> str:
        """One turn of session `s`, checked against the reference; the decode it reached."""
        before = fleet.served()
        got, _ = complete_turn(router, histories[s], s)
        want, _ = complete_turn(fleet.reference, histories[s], f"ref-{s}")
        assert got == want, s
        (decode,) = _moved(before, fleet.served()) & {d0, d1}
        histories[s] = [*histories[s], *got, *(rng.randrange(1, 250) for _ in range(5))]
        return decode

    assert _decode_urls(router) == {d0}  # 1.
    assert {turn(s) for s in sessions} == {d0}
    fleet.dns.set("decode.join.test", list(HOSTS))  # 2.
    wait_until(lambda: _decode_urls(router) == {d0, d1}, 20, "d1 to join")
    assert {s for s in sessions if turn(s) == d1} == ranks_d1
    fleet.dns.set("decode.join.test", [HOSTS[1]])  # 3.
    wait_until(lambda: _decode_urls(router) == {d1}, 20, "d0 to leave")
    before = metric(d0, "kvduplex_requests_finished_total")
    assert {turn(s) for s in sessions} == {d1}
    assert metric(d0, "kvduplex_requests_finished_total") == before
