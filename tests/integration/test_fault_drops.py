"""Control messages that never arrive, on real processes.

Each case starts P and D with one message type dropped on arrival at one of
them (`tests.support.faults.DropMessages`, the filter of the notification pump
of an instance started by the test launcher), as if the network had lost every
such message: a registration, a
KVDone, heartbeats, a return offer. The waits' deadlines (2 s here) end every
one: each answer still matches the colocated instance, a return is simply not
cached, and both pools end consistent and empty of request blocks.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvduplex.cluster import LocalCluster
from tests.integration.faults import REQUEST_BOUND_S
from tests.integration.faults import Outcome
from tests.integration.faults import Rig
from tests.integration.faults import Tally
from tests.integration.faults import Victim
from tests.integration.faults import blocks_left
from tests.integration.faults import body
from tests.integration.faults import duplex_turn
from tests.integration.faults import open_tally
from tests.integration.faults import prompt_ids
from tests.integration.faults import reference_tokens
from tests.integration.faults import start_rig
from tests.integration.faults import stats
from tests.skips import skip_module_without_nixl
from tests.support.faults import Faults

pytestmark = pytest.mark.integration

skip_module_without_nixl()

PUSH_STATS = "/internal/kv/push/stats"
RETURN_STATS = "/internal/kv/return/stats"


@dataclass(frozen=True)
class Drop:
    message: str
    at: str
    """P or D: where it is dropped on arrival."""
    flow: str
    """push (requests through the router) or return (duplex turns driven directly)."""
    what: str

    @property
    def label(self) -> str:
        return f"{self.message} dropped at {self.at} ({self.what})"


DROPS = [
    Drop("kv_register", "P", "push", "D's registration of a push"),
    Drop("kv_done", "D", "push", "P's KVDone of a push"),
    Drop("kv_alive", "D", "push", "P's heartbeats while its queue outlasts D's wait"),
    Drop("kv_offer", "P", "return", "D's offer of a finished turn"),
    Drop("kv_register", "D", "return", "P's registration of a return"),
    Drop("kv_done", "P", "return", "D's KVDone of a return"),
]


@pytest.fixture(scope="module")
def tally(request: pytest.FixtureRequest) -> Iterator[Tally]:
    title = "Control messages dropped on arrival (tests/integration/test_fault_drops.py)"
    yield from open_tally(request, title, "drop-counts")


@pytest.fixture(scope="module")
def salts() -> Iterator[int]:
    return itertools.count(5000)


@pytest.fixture(params=DROPS, ids=lambda d: f"{d.message}-at-{d.at}")
def dropping(
    request: pytest.FixtureRequest, cluster: LocalCluster, reference: str
) -> Iterator[tuple[Drop, Rig]]:
    drop: Drop = request.param
    faults = Faults(drop_messages=frozenset({drop.message}))
    rig = start_rig(
        cluster, reference, f"drop-{drop.message}-{drop.at}",
        p_faults=faults if drop.at == "P" else None, d_faults=faults if drop.at == "D" else None,
    )  # fmt: skip
    try:
        yield drop, rig
    finally:
        rig.stop()


def _push_requests(rig: Rig, drop: Drop, salts: Iterator[int]) -> dict[Victim, str]:
    """Requests through the router, at once. With heartbeats dropped, P's queue (one at a
    time, 4 tokens a step) must outlast D's 2 s wait: long prompts, all together."""
    lengths = [1500, 1500, 1500, 1500] if drop.message == "kv_alive" else [20, 77, 300]
    victims = {
        Victim(rig.url, body(prompt_ids(n, next(salts)), 6, stream=i == 0)).start(): f"{n}-token prompt"
        for i, n in enumerate(lengths)
    }  # fmt: skip
    return victims


def test_lost_message_costs_time_never_tokens_or_blocks(
    dropping: tuple[Drop, Rig], tally: Tally, salts: Iterator[int]
) -> None:
    drop, rig = dropping
    d_push = stats(rig.d.url, PUSH_STATS)
    if drop.flow == "push":
        victims = _push_requests(rig, drop, salts)
        moment = "every push request"
    else:
        salt = next(salts)
        history = prompt_ids(60, salt)
        first = duplex_turn(rig, history, f"s{salt}", 40)
        assert first.outcome(reference_tokens(rig.reference, first.body)) is Outcome.COMPLETED
        moment = "the next turn after a return"
        victims = {
            duplex_turn(rig, [*history, *first.tokens, *prompt_ids(7, salt)], f"s{salt}", 8): moment
        }
    for v in victims:
        v.done.wait(REQUEST_BOUND_S)
    for v in victims:
        outcome = v.outcome(reference_tokens(rig.reference, v.body))
        tally.add(drop.label, moment, outcome, v.elapsed_s)
        assert outcome is Outcome.COMPLETED, (drop, v.error)
    if drop.flow == "push":  # D computed some prompts itself (all, unless heartbeats)
        d_after = stats(rig.d.url, PUSH_STATS)
        num_fallbacks = d_after["num_fallbacks"] - d_push["num_fallbacks"]
        tally.note(
            drop.label, moment, f"D computed the prompt itself in {num_fallbacks} of {len(victims)}"
        )
        assert num_fallbacks == (len(victims) if drop.message != "kv_alive" else num_fallbacks)
        assert num_fallbacks > 0
    leaked = sum(blocks_left(proc.url) for proc in (rig.p, rig.d))  # every wait has ended
    tally.leaked(drop.label, moment, leaked)
    assert leaked == 0
    if drop.flow == "return":  # no return reached P's prefix cache
        p_ret, d_ret = stats(rig.p.url, RETURN_STATS), stats(rig.d.url, RETURN_STATS)
        assert p_ret["num_received_blocks"] == 0
        assert d_ret["num_offered"] == 2 and d_ret["num_done"] + d_ret["num_failed"] == 2
        tally.note(
            drop.label, moment, f"2 turns returned: {d_ret['num_done']} written by D, "
            f"{d_ret['num_failed']} failed on D, {p_ret['num_accepted']} accepted by P, 0 cached on P",
        )  # fmt: skip
