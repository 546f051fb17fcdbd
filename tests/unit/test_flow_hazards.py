"""Two flow-core hazards on prefill's sender, over the in-process transport: a
registration dropped for a job that never came leaves a tombstone (a delayed copy of
it is refused, and so is a job that starts late under its xid), and only a
transfer's own receiver may cancel it."""

from __future__ import annotations

import pytest
import torch

from kvduplex.kvflow.messages import KVCancel
from kvduplex.kvflow.messages import KVRegister
from kvduplex.kvflow.messages import KVWaiting
from kvduplex.model.loader import LoadedModel
from kvduplex.transport.messages import ControlMessage
from kvduplex.transport.messages import MessageCodec
from tests.unit.flow_pair import PROMPT
from tests.unit.flow_pair import Pair
from tests.unit.flow_pair import _wait_for
from tests.unit.flow_pair import tiny as tiny  # the module-scoped model fixture

CODEC = MessageCodec()


def _from_d(s: Pair, msg: ControlMessage) -> None:
    s.td.send_notif(s.p_peer, CODEC.encode(msg), msg.xid)


def _flush_p(s: Pair) -> None:
    """Let every engine call queued on P so far (and those they queue) run."""
    for _ in range(3):
        s.ap.call(lambda _e: None).result(5)


def test_a_registration_dropped_for_no_job_leaves_a_tombstone(tiny: LoadedModel) -> None:
    """D registers ``ghost`` but P's job never starts: P keeps the registration a
    while, then refuses it (D falls back and reuses its blocks). A delayed copy of
    that registration must be refused too, not kept for a job that might still
    come, and a job that does come late under ``ghost`` must not start."""
    with Pair(tiny, wait_s=0.3) as s:
        reg = KVRegister("ghost", [1, 2, 3, 4, 5], 0, len(PROMPT), 5.0, 5.0)
        _from_d(s, reg)
        _wait_for(lambda: s.sender.tables()["send_early_registrations"] == 1, "the keeping")
        _wait_for(lambda: s.sender.tables()["send_early_registrations"] == 0, "the drop")
        refused = s.sender.stats.num_registrations_refused
        _from_d(s, reg)  # the delayed copy
        _wait_for(
            lambda: s.sender.stats.num_registrations_refused == refused + 1, "the refusal"
        )
        _flush_p(s)
        assert s.sender.tables()["send_early_registrations"] == 0
        with pytest.raises(ValueError):
            s.ap.call(lambda _e: s.sender.expect("ghost", s.d_peer, len(PROMPT))).result(5)
        assert s.sender.num_jobs() == 0


def test_only_the_transfers_receiver_may_cancel_it(tiny: LoadedModel) -> None:
    """A cluster member that is not the job's receiver sends KVCancel for it: P
    ignores it. The receiver's own KVCancel ends the job."""
    with Pair(tiny, wait_s=5.0) as s:
        member = s.fabric.endpoint(torch.zeros_like(s.d.kv_pool), s.d.layout)
        s.tp.connect(member.local_metadata())  # P handshook with it: a cluster member
        to_p = member.connect(s.tp.local_metadata())
        s.ap.call(lambda _e: s.sender.expect("victim", s.d_peer, len(PROMPT))).result(5)
        assert s.sender.num_jobs() == 1
        cancel = KVCancel("victim", "not yours")
        member.send_notif(to_p, CODEC.encode(cancel), cancel.xid)
        _from_d(s, KVWaiting("victim"))  # D's, delivered after the member's cancel
        _wait_for(lambda: s.sender.stats.num_waiting_received == 1, "D's KVWaiting")
        _flush_p(s)
        assert s.sender.num_jobs() == 1, "a stranger's cancel ended the job"
        _from_d(s, KVCancel("victim", "gave up"))
        _wait_for(lambda: s.sender.num_jobs() == 0, "the receiver's cancel")
        s.assert_clean()
        member.close()
