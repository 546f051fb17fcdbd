"""Two pools that wait on each other: a finished push that decode has not registered
gives its blocks back when prefill's pool is short.

Prefill and decode take two requests each in opposite orders, each pool holding one
of them at a time. Prefill computes A, which then waits for decode's registration,
holding its blocks; decode holds R's blocks for prefill's push, which waits for
prefill's pool. Before, only the transfers' deadlines (seconds to minutes) ended
the wait; now prefill gives A up when R finds no blocks, and decode computes A
itself from prefill's first token.
"""

from __future__ import annotations

import pytest

from kvduplex.engine.request import Request
from kvduplex.kvflow.messages import KVFailed
from kvduplex.model.loader import LoadedModel
from tests.unit.flow_common import FIRST
from tests.unit.flow_common import GREEDY
from tests.unit.flow_common import _reference
from tests.unit.flow_common import tiny as tiny  # the module-scoped model fixture
from tests.unit.flow_sim import Sim

WAIT_S = 60.0
A = [(7 * i) % 200 + 1 for i in range(160)]  # 40 of a pool's 64 blocks
R = [(11 * i) % 200 + 3 for i in range(160)]


@pytest.fixture
def sim(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> Sim:
    return Sim(tiny, monkeypatch, wait_s=WAIT_S, transfer_timeout_s=WAIT_S)


def test_pools_waiting_on_each_other_resolve_before_any_deadline(
    tiny: LoadedModel, sim: Sim
) -> None:
    sim.push_prefill("a", A)
    sim.push_prefill("r", R)
    sim.push_decode("r", R)  # decode admits R first: A waits there for room
    sim.push_decode("a", A)
    sim.run(lambda: sim.finished("d-a") and sim.finished("d-r"), max_s=WAIT_S / 10)
    assert sim.outputs["d-a"] == _reference(tiny, A, GREEDY)
    assert sim.outputs["d-r"] == _reference(tiny, R, GREEDY)
    assert sim.pf.sender.stats.num_reclaimed == 1  # A, given up for R's blocks
    assert sim.pf.sender.stats.num_done == 1  # R pushed
    assert sim.df.push.stats.num_fallbacks == 1  # A computed on decode
    sim.assert_clean()


def test_decode_continues_from_the_first_token_prefill_sampled(tiny: LoadedModel, sim: Sim) -> None:
    """The client may hold prefill's first token: decode's own prefill of the prompt
    must continue from it, not sample its own."""
    told: list[KVFailed] = []
    original = sim.df.push._ended_before_admission

    def spy(msg: object, sender: str) -> bool:
        taken = original(msg, sender)  # type: ignore[arg-type]
        if taken and isinstance(msg, KVFailed):
            told.append(msg)
        return taken

    sim.df.receiver.on_unexpected_end = spy
    forced = _reference(tiny, A, GREEDY)[1]  # not the greedy first token
    sim.pf.sender.expect("a", sim.d_peer, A)
    a = Request("a", A, FIRST, hold_blocks_on_finish=True)
    a.forced_first_token = forced  # as if prefill had sampled it
    sim.p.add_request(a)
    sim.push_prefill("r0", R)
    sim.push_decode("r0", R)
    sim.push_decode("a", A)
    sim.run(lambda: sim.finished("d-a") and sim.finished("d-r0"), max_s=WAIT_S / 10)
    assert [m.first_token for m in told] == [forced]
    assert sim.outputs["d-a"][0] == forced
    sim.assert_clean()
