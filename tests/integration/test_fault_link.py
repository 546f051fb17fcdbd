"""The link between P and D cut, on real processes: P in its own network namespace.

P runs behind a veth pair shaped to 40 Mbit/s (`NetnsHost`), so a long
prompt's KV takes a while to cross and the cut lands while WRITEs are on the
wire. Cutting the link (the root end set down) partitions P from D and from
the router, for longer than every deadline; D's wait runs out, it computes the
prompts itself and answers exactly. The blocks P was writing into stay
quarantined on D for as long as P cannot confirm that nothing of its WRITEs
can land (D asks again every quarantine period). Once the link is back, the
next request's KV is pushed again, over a fresh connection, P answers D's
asking, and both pools are clean. Skipped where namespaces cannot be made (not root, no
iproute2, a container that forbids it).
"""

from __future__ import annotations

import itertools
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvduplex.bench.netns import NetnsHost
from kvduplex.cluster import Process
from kvduplex.cluster import free_port
from tests.integration.conftest import kv_stats
from tests.integration.conftest import p_across_link
from tests.integration.faults import D_FLAGS
from tests.integration.faults import HEALTH_INTERVAL_S
from tests.integration.faults import P_FLAGS
from tests.integration.faults import REQUEST_BOUND_S
from tests.integration.faults import SERVE
from tests.integration.faults import Outcome
from tests.integration.faults import Tally
from tests.integration.faults import Victim
from tests.integration.faults import blocks_left
from tests.integration.faults import body
from tests.integration.faults import open_tally
from tests.integration.faults import poll
from tests.integration.faults import prompt_ids
from tests.integration.faults import reference_tokens
from tests.integration.faults import stats
from tests.integration.faults import wait_router_sees
from tests.integration.faults import write_bytes
from tests.skips import skip_module_without_nixl

pytestmark = pytest.mark.integration

skip_module_without_nixl()

RATE_MBIT = 40
FAULT = f"P-D link cut ({RATE_MBIT} Mbit/s veth set down)"
PUSH_STATS = "/internal/kv/push/stats"


@dataclass
class Split:
    link: NetnsHost
    p: Process
    d: Process
    router: str
    reference: str

    def set_link(self, up: bool) -> None:
        state = "up" if up else "down"
        subprocess.run(["ip", "link", "set", self.link.outer.dev, state], check=True)


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Split]:
    logs = Path(tmp_path_factory.mktemp("link-logs"))
    with p_across_link(
        logs, SERVE, P_FLAGS, D_FLAGS, ["--role", "both", *D_FLAGS[2:]], rate_mbit=RATE_MBIT
    ) as on:
        cluster, p, d = on.cluster, on.p, on.d
        args = [
            "router",
            "--mode",
            "push",
            "--model",
            "tiny",
            "--prefill",
            p.url,
            "--decode",
            d.url,
            "--health-interval-s",
            str(HEALTH_INTERVAL_S),
            "--return-mode",
            "none",
        ]
        router = cluster.start("router", args, free_port())
        cluster.wait_healthy(timeout_s=60)
        s = Split(on.link, p, d, router.url, on.reference.url)
        try:
            yield s
        finally:
            s.set_link(up=True)


@pytest.fixture(scope="module")
def tally(request: pytest.FixtureRequest) -> Iterator[Tally]:
    title = "The P-D link cut (tests/integration/test_fault_link.py)"
    yield from open_tally(request, title, "link-counts")


@pytest.fixture(scope="module")
def salts() -> Iterator[int]:
    return itertools.count(9000)


def _pushed(s: Split, salt: int, tries: int = 1) -> int:
    """Requests until one's KV is pushed (not recomputed), each answered exactly; how many
    were recomputed first (a connection whose TCP is still retransmitting after the cut
    delays the registration past D's wait)."""
    for attempt in range(tries):
        before = stats(s.d.url, PUSH_STATS)
        v = Victim(s.router, body(prompt_ids(40, salt * 10 + attempt), 6)).start()
        v.done.wait(REQUEST_BOUND_S)
        assert v.outcome(reference_tokens(s.reference, v.body)) is Outcome.COMPLETED, v.error
        if stats(s.d.url, PUSH_STATS)["num_received"] == before["num_received"] + 1:
            return attempt
    raise AssertionError(f"no request was pushed in {tries} tries after the link came back")


@pytest.mark.parametrize("trial", range(2))
def test_link_cut_mid_write_costs_time_not_tokens(
    split: Split, tally: Tally, salts: Iterator[int], trial: int
) -> None:
    _pushed(split, next(salts))  # the link works
    decoding = Victim(split.router, body(prompt_ids(24, next(salts)), 1200, stream=True)).start()
    poll(lambda: len(decoding.tokens) >= 3, "a request decoding on D")
    written = write_bytes(split.p.url)
    writing = Victim(split.router, body(prompt_ids(1600, next(salts)), 4)).start()
    poll(lambda: write_bytes(split.p.url) > written, "P's WRITEs crossing the link")
    queued = Victim(split.router, body(prompt_ids(300, next(salts)), 4)).start()
    poll(lambda: kv_stats(split.p.url)["num_waiting"] == 1, "a request queued on P")
    asks = stats(split.d.url, PUSH_STATS)["num_quarantine_asks"]
    split.set_link(up=False)
    moments = {decoding: "mid-decode", writing: "mid-WRITE (KV on the wire)",
               queued: "queued on P (before admission)"}  # fmt: skip
    try:
        for v in moments:
            v.done.wait(REQUEST_BOUND_S)
        for v, moment in moments.items():
            outcome = v.outcome(reference_tokens(split.reference, v.body))
            tally.add(FAULT, moment, outcome, v.elapsed_s)
            assert outcome is Outcome.COMPLETED, (moment, v.error)
        # D alone, while the link is still down: blocks P was writing into could still
        # be written (a one-sided WRITE needs nothing of D), so D holds them past its
        # quarantine and asks P again, for as long as P cannot answer.
        held = kv_stats(split.d.url)["num_in_use"]
        if held:
            poll(lambda: stats(split.d.url, PUSH_STATS)["num_quarantine_asks"] > asks,
                 "D to ask P again about its quarantine")  # fmt: skip
            assert kv_stats(split.d.url)["num_in_use"] > 0, "held while unconfirmed"
    finally:
        split.set_link(up=True)
    # The router's probes of P crossed the cut link too: wait until it takes P back.
    wait_router_sees(split.router, split.p.url, "prefill", healthy=True)
    # A request reconnects P to D (P tore its endpoint down); D's next asking then gets
    # P's answer, and the quarantined blocks go back.
    num_recomputed = _pushed(split, next(salts), tries=5)
    leaked = sum(blocks_left(proc.url) for proc in (split.p, split.d))
    for moment in moments.values():
        tally.leaked(FAULT, moment, leaked)
    assert leaked == 0
    tally.note(FAULT, "mid-WRITE (KV on the wire)", f"{held} blocks held on D while the link was down")
    tally.note(
        FAULT, "mid-WRITE (KV on the wire)", f"{num_recomputed} recomputed after the link came back"
    )
