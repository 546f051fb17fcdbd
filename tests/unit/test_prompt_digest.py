"""Every transfer names the token ids it is for: a registration, a pull and a return
registration whose ids are not those of the KV on the other side are refused, on the
stepper (`tests.unit.flow_sim`). Two prompts of one length (A on decode, B on prefill)
must never leave B's KV under A's prefix-cache keys: the receiver computes its own
prompt, and a later request over the same prefix answers as on a fresh instance."""

from __future__ import annotations

import pytest

from kvduplex.engine.block_pool import BlockHash
from kvduplex.engine.block_pool import compute_block_hashes
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.request import Request
from kvduplex.kvflow.messages import KVOffer
from kvduplex.kvflow.messages import ids_digest
from kvduplex.model.loader import LoadedModel
from tests.unit.flow_common import BS
from tests.unit.flow_common import GREEDY
from tests.unit.flow_common import PROMPT
from tests.unit.flow_common import _reference
from tests.unit.flow_common import tiny as tiny  # the module-scoped model fixture
from tests.unit.flow_sim import Sim
from tests.unit.test_flow_sim import ANSWER

A = PROMPT
"""Decode's prompt (18 tokens: 4 full blocks and a partial one)."""
B = list(range(30, 30 + len(PROMPT)))
"""Prefill's prompt: as long as A, other ids."""
MORE = [7, 8, 9]


def test_ids_digest_is_stable_and_tells_equal_lengths_apart() -> None:
    assert ids_digest(A) == ids_digest(list(A)) == ids_digest(tuple(A))
    assert len(ids_digest(A)) == 16
    assert ids_digest(A) != ids_digest(B)
    assert ids_digest([1, 2]) != ids_digest([2, 1])
    assert ids_digest([]) != ids_digest([0])


def _later_request_answers_as_fresh(
    sim: Sim, engine: LLMEngine, tiny: LoadedModel, prompt: list[int], num_hit: int
) -> None:
    """A local request over `prompt` on `engine` hits `num_hit` cached tokens and answers
    what an engine that never exchanged KV answers."""
    later = [*prompt, *MORE]
    engine.add_request(Request("later", later, GREEDY))
    sim.run(lambda: sim.finished("later"))
    assert sim.last["later"].num_cached_tokens == num_hit
    assert sim.outputs["later"] == _reference(tiny, later)


def test_a_push_registration_for_another_prompt_is_refused(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1. P computes B under xid x while D registers for A (same length); 2. P refuses
    the registration (counted), D computes A itself and answers A; 3. D's cache holds
    A's own KV: a later request over A answers as a fresh D."""
    sim = Sim(tiny, monkeypatch)
    sim.push_prefill("x", B)  # 1.
    sim.push_decode("x", A)
    sim.run(lambda: sim.finished("d-x"))
    assert sim.outputs["d-x"] == _reference(tiny, A)  # 2.
    assert sim.pf.sender.stats.num_prompt_mismatches == 1
    assert sim.df.push.stats.num_received == 0 and sim.df.push.stats.num_fallbacks == 1
    sim.settle()
    _later_request_answers_as_fresh(sim, sim.d, tiny, A, 4 * BS)  # 3.
    sim.assert_clean()


def test_a_pull_of_another_prompt_reads_nothing(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1. P holds B's blocks under xid pl; D's request for A (same length) is given them;
    2. D reads nothing (counted), computes A, and P's lease is released; 3. a later request
    over A on D answers as a fresh D."""
    sim = Sim(tiny, monkeypatch)
    sim.pull("pl", B)  # 1.
    sim.run(lambda: sim.finished("pl"))
    sim.pull_decode("pl", A)
    sim.run(lambda: sim.finished("d-pl"))
    assert sim.outputs["d-pl"] == _reference(tiny, A)  # 2.
    stats = sim.df.pull.stats
    assert stats.num_prompt_mismatches == 1 and stats.num_pulled_blocks == 0
    assert sim.released == [("http://p", "pl")]
    sim.settle()
    _later_request_answers_as_fresh(sim, sim.d, tiny, A, 4 * BS)  # 3.
    sim.assert_clean()


def test_a_return_registered_for_other_tokens_is_refused(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1. D finishes a turn and offers P its answer's blocks; on the way the offer is
    swapped for one of other tokens of the same length (keys recomputed, so P takes it);
    2. D refuses P's registration for those tokens (counted): nothing lands, P caches
    nothing under the other tokens' keys; 3. a later request over them on P answers as
    a fresh P."""
    sim = Sim(tiny, monkeypatch)
    held = sim.intercept(sim.tp, KVOffer)
    sim.push("t1", A, ANSWER, session="s1")  # 1.
    sim.run(lambda: bool(held))
    (offer, sender), = held
    assert offer.parent_key is not None
    other = [60 + i for i in range(len(offer.token_ids))]
    parent = BlockHash(offer.parent_key)
    keys = compute_block_hashes(other, BS, sim.p.kv_manager.identity, parent)
    swapped = KVOffer(offer.xid, offer.session_id, [bytes(k) for k in keys], other, offer.parent_key)
    sim.pf.inbox.heard(swapped, sender)
    sim.settle()
    assert sim.df.offerer.stats.num_failed == 1 and sim.df.offerer.stats.num_done == 0  # 2.
    assert sim.df.sender.stats.num_prompt_mismatches == 1
    assert sim.pf.acceptor.stats.num_received_blocks == 0
    prefix = A[: len(A) // BS * BS]
    assert sim.p.kv_manager.num_cached_prefix(keys) == 0
    _later_request_answers_as_fresh(sim, sim.p, tiny, prefix + other, len(prefix))  # 3.
    sim.assert_clean()
