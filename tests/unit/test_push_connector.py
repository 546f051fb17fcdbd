"""The push flow (`KVSender` on P, `PushDecode` + `KVReceiver` on D) over the in-process
transport, in every order of events.

Two engines (P and D) with the flows of their roles, wired as an instance wires
them, stepped in one thread on a fake clock (`tests.unit.flow_sim`); P writes layer
by layer into D's registered blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvduplex.common.sampling import SamplingParams
from kvduplex.engine.request import Request
from kvduplex.kvflow.messages import KVCancel
from kvduplex.kvflow.messages import KVRegister
from kvduplex.kvflow.push_prefill import PushPlan
from kvduplex.model.loader import LoadedModel
from tests.unit.flow_common import FIRST
from tests.unit.flow_common import PROMPT
from tests.unit.flow_common import Starved
from tests.unit.flow_common import _reference
from tests.unit.flow_common import tiny as tiny  # the module-scoped model fixture
from tests.unit.flow_sim import Sim


def _answered(s: Sim, xid: str) -> bool:
    """Both P's prefill and D's request of push ``xid`` finished."""
    return s.finished(xid) and s.finished(f"d-{xid}")


def _layers_take_time(s: Sim, layer_s: float = 0.001) -> None:
    """Each layer of P's forward takes ``layer_s`` on the sim's clock (as compute does)."""
    orig = s.pf.sender.layer_hook

    def timed_hook(plan: PushPlan) -> Callable[[int], None] | None:
        hook = orig(plan)

        def on_layer_done(layer: int) -> None:
            s.clock.now += layer_s
            if hook is not None:
                hook(layer)

        return on_layer_done

    s.pf.sender.layer_hook = timed_hook  # type: ignore[method-assign]


def test_concurrent_push_matches_local(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """D's registration reaches P just before P's prefill starts: P streams the prompt
    layer by layer, and its WRITEs take time (each layer's compute does)."""
    s = Sim(tiny, monkeypatch)
    _layers_take_time(s)
    s.push_decode("x1")
    s.run(lambda: "x1" in s.pf.sender._early)
    s.push_prefill("x1")
    s.run(lambda: _answered(s, "x1"))
    expected = _reference(tiny)
    assert s.outputs["d-x1"] == expected and s.outputs["x1"] == expected[:1]
    push = s.df.push
    assert push.stats.num_received == 1 and push.stats.num_fallbacks == 0
    assert push.stats.num_received_blocks == 5
    s.assert_clean()
    assert s.pf.sender.stats.num_done == 1 and s.pf.sender.stats.transfer_s > 0


def test_chunked_prefill_pushes_each_chunk_layer_by_layer(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch, p_budget=6)  # 18 tokens in chunks of 6: blocks finish mid-chunk
    s.push_decode("xc")  # registration first, so that every chunk streams
    s.run(lambda: s.df.receiver.num_waiting() == 1 and "xc" in s.pf.sender._early)
    s.push_prefill("xc")
    s.run(lambda: _answered(s, "xc"))
    assert s.outputs["d-xc"] == _reference(tiny)
    num_layers = s.p.layout.num_layers
    assert s.pf.sender.stats.num_writes == 3 * num_layers  # one WRITE per layer per chunk
    s.assert_clean()


def test_registration_after_prefill_finished(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch)
    s.push_prefill("late")
    s.run(lambda: s.finished("late"))
    assert s.outputs["late"] == _reference(tiny)[:1]
    assert s.in_use(s.p) == 5  # held for the push
    s.push_decode("late")
    s.run(lambda: s.finished("d-late"))
    assert s.outputs["d-late"] == _reference(tiny)
    assert s.pf.sender.stats.num_writes == 1  # everything at once
    s.assert_clean()


def test_registration_before_prefill_arrives(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch)
    s.push_decode("early")
    s.run(lambda: "early" in s.pf.sender._early)  # the early registration
    s.push_prefill("early")
    s.run(lambda: _answered(s, "early"))
    assert s.outputs["d-early"] == _reference(tiny)
    s.assert_clean()


def test_decode_prefix_hit_is_not_pushed(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    s = Sim(tiny, monkeypatch)
    s.push("h1", PROMPT)
    s.run(lambda: _answered(s, "h1"))
    longer = [*PROMPT, 30, 31, 32, 33, 34, 35]  # 24 tokens: 6 blocks, D has 4 of them
    s.push("h2", longer)
    s.run(lambda: _answered(s, "h2"))
    assert s.outputs["d-h2"] == _reference(tiny, longer)
    assert s.df.push.stats.num_skipped_blocks == 4
    assert s.df.push.stats.num_received_blocks == 5 + 2
    s.assert_clean()


def test_failed_write_makes_decode_compute_locally(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch)
    s.tp.fail_next("link down")
    s.push("xf")
    s.run(lambda: _answered(s, "xf"))
    assert s.outputs["d-xf"] == _reference(tiny)
    assert s.df.push.stats.num_fallbacks == 1 and s.pf.sender.stats.num_failed == 1
    s.assert_clean()


def test_prefill_that_never_comes_falls_back_and_quarantine_ends(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch, wait_s=0.2)
    s.push_decode("ghost")
    s.run(lambda: s.finished("d-ghost"))
    assert s.outputs["d-ghost"] == _reference(tiny)
    assert s.df.push.stats.num_fallbacks == 1
    s.assert_clean()  # registered blocks come back after the quarantine
    assert s.df.receiver.num_waiting() == 0


def test_cancelled_push_is_refused_when_prefill_arrives_later(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch)
    assert not s.pf.sender.cancel("gone", "router")
    with pytest.raises(ValueError, match="cancelled"):
        s.push_prefill("gone")
    assert s.p.scheduler.get_request("gone") is None, "refused before it was added"
    s.assert_clean()


def test_aborted_decode_keeps_registered_blocks_until_prefill_is_done(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch)
    s.push_decode("ab")
    s.run(lambda: s.df.receiver.num_waiting() == 1)  # registered
    s.ad.abort("d-ab")  # the client leaves
    # D told P (KVCancel); P, which never began, confirms that nothing was written,
    # and only then does D let its registered blocks go.
    s.run(lambda: s.pf.sender.tables()["send_cancelled_tombstones"] == 1)  # P hears it
    s.assert_clean()
    with pytest.raises(ValueError, match="cancelled by its receiver"):
        s.push_prefill("ab")  # P refuses the prefill D gave up
    assert s.df.push.stats.num_received == 0 and s.df.receiver.stats.num_late == 1


def test_registration_mid_forward_writes_finished_layers_then_streams(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch)
    held = s.intercept(s.tp, KVRegister)
    orig = s.pf.sender.layer_hook

    def late_hook(plan: PushPlan) -> Callable[[int], None] | None:
        hook = orig(plan)

        def on_layer_done(layer: int) -> None:
            if layer == 0 and held:  # the registration lands while layer 1 is computed
                msg, sender = held.pop()
                assert isinstance(msg, KVRegister)
                s.pf.inbox.heard(msg, sender)  # as the pump does
            if hook is not None:
                hook(layer)

        return on_layer_done

    s.pf.sender.layer_hook = late_hook  # type: ignore[method-assign]
    s.push_decode("mid")
    s.run(lambda: bool(held))  # the registration, held back
    s.push_prefill("mid")
    s.run(lambda: _answered(s, "mid"))
    assert s.outputs["d-mid"] == _reference(tiny)
    # Layer 0 in one WRITE when the registration landed, then one per remaining layer.
    assert s.pf.sender.stats.num_writes == s.p.layout.num_layers
    s.assert_clean()


def test_seeded_sampling_continues_where_prefill_stopped(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)
    s.push("seeded", PROMPT, seeded, p_params=first)
    s.run(lambda: _answered(s, "seeded"))
    expected = _reference(tiny, params=seeded)
    assert s.outputs["seeded"] == expected[:1] and s.outputs["d-seeded"] == expected
    s.assert_clean()


def test_prefill_queued_longer_than_the_wait_keeps_decode_waiting(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P holds the registered job but its engine is busy elsewhere for over D's wait:
    its heartbeats restart D's wait, and D gets the pushed KV instead of recomputing."""
    s = Sim(tiny, monkeypatch, wait_s=0.3)
    s.push_decode("q")
    s.run(lambda: "q" in s.pf.sender._early)  # the registration
    gate = Starved(s.p)  # P's engine is busy: its prefill is not scheduled meanwhile
    s.push_prefill("q")  # its job applies the early registration
    # Four heartbeats at 0.1 s intervals: D's original 0.3 s wait is over.
    s.run(lambda: s.df.receiver.stats.num_alive_received >= 4)
    assert s.clock.now - 1000.0 > 0.3
    gate.end()
    s.run(lambda: _answered(s, "q"))
    assert s.outputs["d-q"] == _reference(tiny)
    assert s.df.push.stats.num_fallbacks == 0 and s.df.push.stats.num_received == 1
    assert s.pf.sender.stats.num_alive_sent >= 4 and s.pf.sender.stats.num_done == 1
    s.assert_clean()


def test_decode_queued_longer_than_the_wait_keeps_prefill_holding(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D's request waits for admission for over P's wait for the registration: D's
    heartbeats keep P holding the computed KV, then P pushes it."""
    s = Sim(tiny, monkeypatch, wait_s=0.3)
    gate = Starved(s.d)  # D's engine is busy: nothing is admitted
    s.push("dq")
    s.run(lambda: s.finished("dq"))
    assert s.outputs["dq"] == _reference(tiny)[:1]
    s.run(lambda: s.pf.sender.stats.num_waiting_received >= 4)  # D's heartbeats
    assert s.clock.now - 1000.0 > 0.3
    assert s.in_use(s.p) == 5  # still held for the push
    gate.end()
    s.run(lambda: s.finished("d-dq"))
    assert s.outputs["d-dq"] == _reference(tiny)
    assert s.df.push.stats.num_fallbacks == 0 and s.pf.sender.stats.num_failed == 0
    s.assert_clean()


def test_decode_request_gone_before_admission_stops_its_heartbeats(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch, wait_s=0.3)
    gate = Starved(s.d)
    s.push_decode("orphan")
    assert s.df.push.owns("orphan")  # the spec
    s.step()  # queued: not admitted
    s.ad.abort("d-orphan")  # the client leaves
    gate.end()
    s.run(lambda: not s.df.push.owns("orphan"))  # the orphaned spec is dropped
    assert not s.df.push._spec_waiting_at  # nothing left to send heartbeats for
    s.assert_clean()


def test_cached_tokens_are_prefills_prefix_hits(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch)
    s.p.add_request(Request("warm", PROMPT, FIRST))  # P caches PROMPT's blocks
    s.run(lambda: s.finished("warm"))
    s.push_decode("c1")
    s.push_prefill("c1")
    s.run(lambda: _answered(s, "c1"))
    last = s.last["d-c1"]
    assert last.num_cached_tokens == 16 and last.num_local_cached_tokens == 0
    s.assert_clean()


def test_unanswered_heartbeats_do_not_extend_prefills_deadline(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D gave up (and its KVCancel is lost): it does not acknowledge P's heartbeats,
    so P's deadline stays D's, and P writes nothing into the blocks D let go of."""
    s = Sim(tiny, monkeypatch, wait_s=0.3)
    lost = s.intercept(s.tp, KVCancel)  # the cancel never arrives
    sender = s.pf.sender
    s.push_decode("u")
    s.run(lambda: "u" in sender._early)  # the registration
    gate = Starved(s.p)  # P's engine is busy: its prefill is not scheduled meanwhile
    s.push_prefill("u")
    s.run(lambda: s.df.receiver.stats.num_alive_received >= 1)  # a beat
    job = sender._jobs["u"]
    assert s.df.push.cancel("u", "test")
    sent = sender.stats.num_alive_sent
    # Unanswered beats, until P's own deadline (D's) ends the job.
    s.run(lambda: sender.stats.num_alive_sent >= sent + 3 or job.ended)
    assert job.expires_at < s.clock.now
    assert lost, "D's cancel was sent (and lost)"
    gate.end()
    s.run(lambda: _answered(s, "u"))
    assert s.outputs["d-u"] == _reference(tiny)  # computed on D
    assert sender.stats.num_writes == 0 and sender.stats.num_failed == 1
    assert s.df.push.stats.num_fallbacks == 1
    s.assert_clean()
