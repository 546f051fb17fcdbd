"""Property-based (hypothesis stateful) test of the receive machine.

A scripted sender may WRITE into the registered blocks until it ends the
transfer (KVDone / KVFailed, sent only once nothing of its can land) or its
endpoint is torn down because its process is gone. Whatever order its
messages (from it or from another engine, in time or late, duplicated),
heartbeats, cancels, ticks, expiries and askings come in:

* our reference on every registered block is held while the sender may still
  write: the flow may give its own up at any failure, and no block goes to a
  new owner;
* the flow hears exactly one of done / failed; done (its blocks may enter a
  prefix cache) only after KVDone, before any fallback; failed with a cause
  that allows reusing the blocks (SENDER_FAILED) only after KVFailed;
* in the end, every reference is dropped.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine
from hypothesis.stateful import initialize
from hypothesis.stateful import invariant
from hypothesis.stateful import precondition
from hypothesis.stateful import rule

from kvduplex.kvflow.machines.actions import AcquireBlocks
from kvduplex.kvflow.machines.actions import ReleaseBlocks
from kvduplex.kvflow.machines.actions import TearDown
from kvduplex.kvflow.machines.actions import Tell
from kvduplex.kvflow.machines.receive import Acknowledged
from kvduplex.kvflow.machines.receive import Alive
from kvduplex.kvflow.machines.receive import Asked
from kvduplex.kvflow.machines.receive import AskSender
from kvduplex.kvflow.machines.receive import Begin
from kvduplex.kvflow.machines.receive import Cancel
from kvduplex.kvflow.machines.receive import FlowDone
from kvduplex.kvflow.machines.receive import FlowFailed
from kvduplex.kvflow.machines.receive import Forget
from kvduplex.kvflow.machines.receive import NotSent
from kvduplex.kvflow.machines.receive import ReceiveAction
from kvduplex.kvflow.machines.receive import ReceiveEvent
from kvduplex.kvflow.machines.receive import ReceiveMachine
from kvduplex.kvflow.machines.receive import ReceivePhase
from kvduplex.kvflow.machines.receive import SenderEnded
from kvduplex.kvflow.machines.receive import SenderGone
from kvduplex.kvflow.machines.receive import Tick
from kvduplex.kvflow.machines.receive import WaitFailure
from kvduplex.kvflow.messages import KVCancel
from kvduplex.kvflow.messages import KVDone
from kvduplex.kvflow.messages import KVFailed
from kvduplex.kvflow.messages import KVRegister
from kvduplex.kvflow.messages import ids_digest
from kvduplex.transport.protocol import PeerHandle

WAIT_S = 10.0
QUARANTINE_S = 5.0
PEER = "p0"
OTHER = "p1"


class ReceiveMachineTest(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 100.0
        self.refs: Counter[int] = Counter()
        self.flow_refs: Counter[int] = Counter()
        """The flow's own references (it gives them up when it hears the outcome)."""
        self.sender_may_write = True
        self.sender_ended = False
        self.outcomes: list[FlowDone | FlowFailed] = []
        self.cancels_sent = 0
        self.forgotten = False
        self.asking = False

    @initialize(
        num_blocks=st.integers(1, 4), sent=st.sampled_from([True, True, False]),
        can_ask=st.booleans(),
    )  # fmt: skip
    def begin(self, num_blocks: int, sent: bool, can_ask: bool) -> None:
        blocks = [10 + i for i in range(num_blocks)]
        self.blocks = blocks
        self.sent = sent
        self.flow_refs.update(blocks)
        reg = KVRegister("x", blocks, 0, 4 * num_blocks, WAIT_S, WAIT_S, ids_digest(range(4 * num_blocks)))
        peer = PeerHandle(PEER, "agent-" + PEER, None)  # type: ignore[arg-type]
        self.m = ReceiveMachine(
            "x", peer, tuple(blocks), reg, WAIT_S, QUARANTINE_S, deadline=self.now + WAIT_S,
            reg_sent_at=self.now, wants_first_token=True, can_ask=can_ask,
        )  # fmt: skip
        self.feed(Begin())
        if not sent:  # nothing reached the sender: it can never write
            self.sender_may_write = False
            self.feed(NotSent())
            self.flow_refs.subtract(blocks)

    def feed(self, event: ReceiveEvent) -> list[ReceiveAction]:
        actions = self.m.handle(event)
        for a in actions:
            self.check(a)
        return actions

    def check(self, a: ReceiveAction) -> None:
        if isinstance(a, AcquireBlocks):
            self.refs.update(a.block_ids)
        elif isinstance(a, ReleaseBlocks):
            assert not self.sender_may_write, "blocks released while the sender may write"
            self.refs.subtract(a.block_ids)
            assert all(n >= 0 for n in self.refs.values())
        elif isinstance(a, FlowDone):
            assert self.sender_ended and not self.sender_may_write
            assert not self.outcomes, "a second outcome"
            self.outcomes.append(a)
            self.flow_refs.subtract(self.blocks)  # into the prefix cache, then released
        elif isinstance(a, FlowFailed):
            assert not self.outcomes, "a second outcome"
            if not a.cause.may_still_be_written:
                assert not self.sender_may_write, "blocks declared reusable while writable"
            self.outcomes.append(a)
            self.flow_refs.subtract(self.blocks)  # the flow gives its own up at once
        elif isinstance(a, Tell) and isinstance(a.msg, KVCancel):
            self.cancels_sent += 1
        elif isinstance(a, Forget):
            assert not self.forgotten
            self.forgotten = True
        elif isinstance(a, AskSender):
            assert not self.asking, "asked again before the answer"
            self.asking = True
        elif isinstance(a, TearDown):
            self.sender_may_write = False  # its endpoint is gone (the sender's process too)

    # ---- the sender ----

    @precondition(lambda self: self.sender_may_write)
    @rule(done=st.booleans(), first_token=st.sampled_from([None, 3]))
    def sender_ends(self, done: bool, first_token: int | None) -> None:
        """Sent only once nothing of the sender's can land any more."""
        self.sender_may_write = False
        self.sender_ended = True
        msg = KVDone("x", 4, first_token) if done else KVFailed("x", "err", first_token)
        self.feed(SenderEnded(msg, PEER))

    @rule(done=st.booleans())
    def stray_end(self, done: bool) -> None:
        """An end message from another engine, or a duplicate of ours."""
        msg = KVDone("x") if done else KVFailed("x", "forged")
        self.feed(SenderEnded(msg, OTHER))
        if self.sender_ended:
            self.feed(SenderEnded(msg, PEER))

    @rule(sender=st.sampled_from([PEER, OTHER]), ack=st.booleans())
    def sender_speaks(self, sender: str, ack: bool) -> None:
        self.feed(Acknowledged(sender) if ack else Alive(sender, self.now, self.now))

    # ---- the flow and the clock ----

    @rule()
    def cancel(self) -> None:
        self.feed(Cancel("cancelled", self.now))

    @rule(dt=st.sampled_from([1.0, 4.0, 6.0, 11.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.feed(Tick(self.now))

    @precondition(lambda self: self.asking)
    @rule(gone=st.booleans())
    def asking_answered(self, gone: bool) -> None:
        self.asking = False
        if gone:  # the sender's process is gone: none of its WRITEs can land
            self.feed(SenderGone("the sender is gone"))
        else:
            self.feed(Asked(self.now))

    # ---- invariants ----

    @invariant()
    def blocks_held_while_writable(self) -> None:
        if self.sender_may_write:
            for b in self.blocks:
                assert self.refs[b] > 0, f"block {b} unreferenced while the sender may write"

    @invariant()
    def phases(self) -> None:
        if self.m.phase is ReceivePhase.QUARANTINED:
            assert self.outcomes and isinstance(self.outcomes[0], FlowFailed)
            assert self.outcomes[0].cause is not WaitFailure.SENDER_FAILED
            assert self.cancels_sent >= 1, "fell back without telling the sender"
        assert self.forgotten == (self.m.phase is ReceivePhase.ENDED)

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        if self.sender_may_write:  # the sender eventually ends (late, if we fell back)
            self.sender_ends(False, None)
        assert self.forgotten, "the wait never ended"
        assert len(self.outcomes) == (1 if self.sent else 0)
        held = {b: self.refs[b] + self.flow_refs[b] for b in self.blocks}
        held = {b: n for b, n in held.items() if n}
        assert not held, f"references never dropped: {held}"


ReceiveMachineTest.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None
)
test_receive_machine = ReceiveMachineTest.TestCase
