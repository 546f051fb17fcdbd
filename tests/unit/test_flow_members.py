"""A cluster member meddling in a push that is not its own, before prefill's job
begins: its KVCancel binds only itself (the push to D goes on, the member's own later
registration is refused), and its registration of the same xid displaces nobody's (the
job takes its own receiver's). Stepped in one thread (`tests.unit.flow_sim`)."""

from __future__ import annotations

import pytest
import torch

from kvduplex.kvflow.messages import KVCancel
from kvduplex.kvflow.messages import KVRegister
from kvduplex.kvflow.messages import ids_digest
from kvduplex.kvflow.send_early import EarlyRegistrations
from kvduplex.kvflow.send_early import Registration
from kvduplex.kvflow.send_early import Tombstones
from kvduplex.model.loader import LoadedModel
from kvduplex.transport.messages import ControlMessage
from kvduplex.transport.messages import MessageCodec
from tests.unit.flow_common import PROMPT
from tests.unit.flow_common import _reference
from tests.unit.flow_common import tiny as tiny  # the module-scoped model fixture
from tests.unit.flow_sim import Sim

CODEC = MessageCodec()


class _Member:
    """A third engine that P handshook with (a cluster member, not the push's D)."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.ep = sim.fabric.endpoint(torch.zeros_like(sim.d.kv_pool), sim.d.layout)
        sim.tp.connect(self.ep.local_metadata())
        self.to_p = self.ep.connect(sim.tp.local_metadata())

    def tell_p(self, msg: ControlMessage) -> None:
        """Send ``msg`` to P and have P's engine thread apply it (between steps)."""
        self.ep.send_notif(self.to_p, CODEC.encode(msg), msg.xid)
        _apply_on_p(self.sim)


def _apply_on_p(sim: Sim) -> None:
    sim.deliver()
    sim.pf.connector.get_finished()


def _d_registers_first(sim: Sim, xid: str) -> None:
    """D admits its request and registers before P's job exists (P keeps it early)."""
    sim.push_decode(xid)
    sim.d.step()
    _apply_on_p(sim)
    assert xid in sim.pf.sender._early


def test_a_members_cancel_before_the_job_does_not_stop_the_push(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = Sim(tiny, monkeypatch)
    member = _Member(sim)
    member.tell_p(KVCancel("x1", "not mine"))
    sim.push("x1")  # P's job to D begins: the member's cancel does not bind it
    sim.run(lambda: sim.finished("d-x1"))
    assert sim.outputs["d-x1"] == _reference(tiny)
    assert sim.df.push.stats.num_received == 1 and sim.df.push.stats.num_fallbacks == 0
    refused = sim.pf.sender.stats.num_registrations_refused
    member.tell_p(KVRegister("x2", [1, 2, 3, 4, 5], 0, len(PROMPT), 5.0, 5.0, ids_digest(PROMPT)))
    member.tell_p(KVCancel("x3", "mine"))
    member.tell_p(KVRegister("x3", [1, 2, 3, 4, 5], 0, len(PROMPT), 5.0, 5.0, ids_digest(PROMPT)))
    assert sim.pf.sender.stats.num_registrations_refused == refused + 1, (
        "the member's registration of the xid it cancelled is refused"
    )
    assert "x2" in sim.pf.sender._early and "x3" not in sim.pf.sender._early
    sim.assert_clean()


def test_a_members_cancel_leaves_ds_early_registration(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = Sim(tiny, monkeypatch)
    member = _Member(sim)
    _d_registers_first(sim, "x1")
    member.tell_p(KVCancel("x1", "not mine"))
    assert "x1" in sim.pf.sender._early
    sim.push_prefill("x1")
    sim.run(lambda: sim.finished("d-x1"))
    assert sim.outputs["d-x1"] == _reference(tiny)
    assert sim.df.push.stats.num_fallbacks == 0
    sim.assert_clean()


@pytest.mark.parametrize("member_first", [False, True])
def test_a_members_registration_displaces_nobodys(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, member_first: bool
) -> None:
    """D and the member both register ``x1`` before P's job begins, in either order:
    the job takes D's (D decodes from P's KV, no fallback, no wait for a deadline) and
    refuses the member's."""
    sim = Sim(tiny, monkeypatch)
    member = _Member(sim)
    forged = KVRegister("x1", [1, 2, 3, 4, 5], 0, len(PROMPT), 5.0, 5.0, ids_digest(PROMPT))
    if member_first:
        member.tell_p(forged)
    _d_registers_first(sim, "x1")
    if not member_first:
        member.tell_p(forged)
    refused = sim.pf.sender.stats.num_registrations_refused
    sim.push_prefill("x1")
    assert sim.pf.sender.stats.num_registrations_refused == refused + 1
    sim.run(lambda: sim.finished("d-x1"))
    assert sim.outputs["d-x1"] == _reference(tiny)
    assert sim.df.push.stats.num_received == 1 and sim.df.push.stats.num_fallbacks == 0
    assert sim.clock.now - 1000.0 < 1.0, "nothing waited for a deadline (5 s)"
    sim.assert_clean()


def _reg(xid: str, sender: str) -> Registration:
    return Registration(KVRegister(xid, [1], 0, 4, 5.0, 5.0, ids_digest(range(4))), sender, 0.0)


def test_early_registrations_are_kept_per_sender() -> None:
    early = EarlyRegistrations()
    early.keep(_reg("x", "d"), until=10.0)
    early.keep(_reg("x", "m"), until=5.0)
    early.keep(_reg("x", "d"), until=12.0)  # d's copy replaces only d's
    assert len(early) == 2 and "x" in early
    assert [r.sender for r in early.drop("x", "m")] == ["m"]
    early.keep(_reg("x", "m"), until=5.0)
    assert [r.sender for r in early.expire(6.0)] == ["m"]
    assert [r.sender for r in early.take("x", first="d")] == ["d"]
    assert len(early) == 0 and "x" not in early


def test_a_tombstone_binds_whoever_cancelled() -> None:
    stones = Tombstones()
    stones.add("x", "m", until=10.0)
    assert stones.refuses("x", "m") and not stones.refuses("x", "d")
    stones.add("x", "d", until=5.0)
    assert stones.refuses("x", "d") and stones.refuses("x", "m")
    stones.add("y", None, until=5.0)  # this instance's own cancel binds anyone
    assert stones.refuses("y", "anyone")
    stones.expire(7.0)
    assert "y" not in stones and stones.refuses("x", "d"), "x's is kept to its latest end"
    stones.expire(11.0)
    assert len(stones) == 0
