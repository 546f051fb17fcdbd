"""``--return-mode pull`` on decode: a turn described for prefill's READ stays pinned
while the READ may run, retained turns are bounded in blocks, and a duplex offer is
bounded too (clients name the sessions that pin or fill these pools)."""

from __future__ import annotations

import pytest

from kvduplex.common.sampling import SamplingParams
from kvduplex.engine.block_pool import compute_block_hashes
from kvduplex.engine.request import Request
from kvduplex.kvflow.messages import KVOffer
from kvduplex.kvflow.return_pull import RetainSpec
from kvduplex.model.loader import LoadedModel
from tests.unit.flow_common import BS
from tests.unit.flow_common import PROMPT
from tests.unit.flow_common import tiny as tiny  # the module-scoped model fixture
from tests.unit.flow_sim import Sim

ANSWER = SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True)  # 18 + 11: 7 blocks


def _turn(s: Sim, rid: str, session: str, prompt: list[int] = PROMPT) -> None:
    """A turn of ``session`` computed on D alone, retained there when it finishes."""
    s.d.add_request(Request(rid, prompt, ANSWER, hold_blocks_on_finish=True,
                            connector_meta=RetainSpec(session)))  # fmt: skip
    s.run(lambda: s.finished(rid))


def _refs(s: Sim, blocks: list[int]) -> list[int]:
    return [s.d.block_pool.ref_count(b) for b in blocks]


def test_a_described_turn_stays_pinned_after_its_session_moves_on(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch)
    _turn(s, "t1", "s1")
    info = s.df.retainer.describe("s1")
    assert info is not None
    blocks = info["block_ids"]
    assert all(r == 2 for r in _refs(s, blocks)), "held by the turn and pinned for the READ"
    _turn(s, "t2", "s1", PROMPT[::-1])  # the next turn lets the first one go ...
    assert all(r == 1 for r in _refs(s, blocks)), "... but a READ may still be under way"
    r = s.df.retainer
    assert r.num_pinned() == 1
    s.run(lambda: r.num_pinned() == 0)  # the pin's time passes (on the sim's clock)
    assert all(r == 0 for r in _refs(s, blocks))
    assert s.clock.now - 1000.0 >= r.pin_s, "not before the pin's time"


def test_retained_turns_are_bounded_in_blocks(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch)
    s.df.retainer.max_blocks = 10  # room for one 7-block turn
    _turn(s, "u1", "sa")
    _turn(s, "u2", "sb", PROMPT[::-1])
    assert s.df.retainer.num_retained() == 1, "the oldest turn was let go"
    assert s.df.retainer.describe("sa") is None
    assert s.df.retainer.describe("sb") is not None


def test_pools_bound_what_clients_can_pin_by_default(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch)  # 64-block pools
    assert s.df.retainer.max_blocks == 16
    assert s.pf.acceptor.max_blocks_per_offer == 16


def test_offers_beyond_the_blocks_returns_may_hold_together_are_declined(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch)
    acc = s.pf.acceptor
    assert acc.max_blocks_in_flight == 16
    tokens = list(range(100, 100 + 2 * BS))
    keys = compute_block_hashes(tokens, BS, s.p.kv_manager.identity)
    offer = KVOffer("busy1", "s", [bytes(k) for k in keys], tokens)
    acc.num_blocks_in_flight = 15  # accepted offers still landing hold 15 blocks
    acc.accept(offer, s.td.engine_id)
    assert acc.stats.num_refused == 1 and acc.stats.num_accepted == 0
    assert s.pf.receiver.num_waiting() == 0
    acc.num_blocks_in_flight = 0
    s.assert_clean()
