"""Two flow-core hazards on prefill's sender, over the in-process transport: a
registration dropped for a job that never came leaves a tombstone (a delayed copy of
it is refused, and so is a job that starts late under its xid), and only a
transfer's own receiver may cancel it.

P and D are stepped in one thread on a fake clock (`tests.unit.flow_sim`)."""

from __future__ import annotations

import pytest
import torch

from kvduplex.kvflow.messages import KVCancel
from kvduplex.kvflow.messages import KVRegister
from kvduplex.kvflow.messages import KVWaiting
from kvduplex.kvflow.messages import ids_digest
from kvduplex.model.loader import LoadedModel
from kvduplex.transport.messages import ControlMessage
from kvduplex.transport.messages import MessageCodec
from tests.unit.flow_common import PROMPT
from tests.unit.flow_common import tiny as tiny  # the module-scoped model fixture
from tests.unit.flow_sim import Sim

CODEC = MessageCodec()


def _from_d(s: Sim, msg: ControlMessage) -> None:
    s.td.send_notif(s.p_peer, CODEC.encode(msg), msg.xid)


def test_a_registration_dropped_for_no_job_leaves_a_tombstone(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D registers ``ghost`` but P's job never starts: P keeps the registration a
    while, then refuses it (D falls back and reuses its blocks). A delayed copy of
    that registration must be refused too, not kept for a job that might still
    come, and a job that does come late under ``ghost`` must not start."""
    s = Sim(tiny, monkeypatch, wait_s=0.3)
    sender = s.pf.sender
    reg = KVRegister("ghost", [1, 2, 3, 4, 5], 0, len(PROMPT), 5.0, 5.0, ids_digest(PROMPT))
    _from_d(s, reg)
    s.run(lambda: sender.tables()["send_early_registrations"] == 1)  # the keeping
    s.run(lambda: sender.tables()["send_early_registrations"] == 0)  # the drop
    refused = sender.stats.num_registrations_refused
    _from_d(s, reg)  # the delayed copy
    s.run(lambda: sender.stats.num_registrations_refused == refused + 1)  # the refusal
    s.step()
    assert sender.tables()["send_early_registrations"] == 0
    with pytest.raises(ValueError):
        sender.expect("ghost", s.d_peer, PROMPT)
    assert sender.num_jobs() == 0


def test_only_the_transfers_receiver_may_cancel_it(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cluster member that is not the job's receiver sends KVCancel for it: P
    ignores it. The receiver's own KVCancel ends the job."""
    s = Sim(tiny, monkeypatch, wait_s=5.0)
    sender = s.pf.sender
    member = s.fabric.endpoint(torch.zeros_like(s.d.kv_pool), s.d.layout)
    s.tp.connect(member.local_metadata())  # P handshook with it: a cluster member
    to_p = member.connect(s.tp.local_metadata())
    sender.expect("victim", s.d_peer, PROMPT)
    assert sender.num_jobs() == 1
    cancel = KVCancel("victim", "not yours")
    member.send_notif(to_p, CODEC.encode(cancel), cancel.xid)
    _from_d(s, KVWaiting("victim"))  # D's, delivered after the member's cancel
    s.run(lambda: sender.stats.num_waiting_received == 1)  # D's KVWaiting
    s.step()
    assert sender.num_jobs() == 1, "a stranger's cancel ended the job"
    _from_d(s, KVCancel("victim", "gave up"))
    s.run(lambda: sender.num_jobs() == 0)  # the receiver's cancel
    s.assert_clean()
    member.close()
