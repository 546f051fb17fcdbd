"""Property-based (hypothesis stateful) test of the read machine (pull and
retained-turn READs): whatever order the READ's end, its settling and its
overdue check come in, the target blocks stay referenced while the READ may
still land, the flow hears one outcome, which asks for fresh blocks whenever
the READ may still land, the endpoint is torn down only for a failed READ
still unsettled, and every reference is dropped once it settled."""

from __future__ import annotations

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
from kvduplex.kvflow.machines.read import ArmCheck
from kvduplex.kvflow.machines.read import Begin
from kvduplex.kvflow.machines.read import Ended
from kvduplex.kvflow.machines.read import Outcome
from kvduplex.kvflow.machines.read import Overdue
from kvduplex.kvflow.machines.read import PostFailed
from kvduplex.kvflow.machines.read import PostRead
from kvduplex.kvflow.machines.read import ReadAction
from kvduplex.kvflow.machines.read import ReadEvent
from kvduplex.kvflow.machines.read import ReadMachine
from kvduplex.kvflow.machines.read import Settled


class ReadMachineTest(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.refs = 0
        self.posted = False
        self.final = False
        self.may_land = False
        """The READ's data may still reach the targets."""
        self.settled = False
        self.outcomes: list[Outcome] = []
        self.armed = False

    @initialize(acquire=st.booleans(), post_fails=st.sampled_from([False, False, True]))
    def begin(self, acquire: bool, post_fails: bool) -> None:
        self.m = ReadMachine((1, 2, 3), after_s=1.0)
        if not acquire:
            self.refs = 1  # the allocation's reference is ours
        self.feed(Begin(acquire))
        assert self.posted
        if post_fails:
            self.final = self.settled = True
            self.may_land = False
            self.feed(PostFailed("no peer"))
        else:
            self.may_land = True

    def feed(self, event: ReadEvent) -> list[ReadAction]:
        actions = self.m.handle(event)
        for a in actions:
            if isinstance(a, AcquireBlocks):
                self.refs += 1
            elif isinstance(a, ReleaseBlocks):
                assert not self.may_land, "targets released while the READ may land"
                self.refs -= 1
                assert self.refs == 0
            elif isinstance(a, PostRead):
                assert self.refs == 1, "READ posted into unreferenced targets"
                self.posted = True
            elif isinstance(a, Outcome):
                assert not self.outcomes, "a second outcome"
                if a.ok:
                    assert self.final and not self.may_land
                if self.may_land:
                    assert not a.ok and a.discard, "the flow would reuse blocks that may be written"
                self.outcomes.append(a)
            elif isinstance(a, ArmCheck):
                self.armed = True
            elif isinstance(a, TearDown):
                assert self.may_land and self.final and not self.settled
                # NIXL may refuse the teardown: the READ may land until it settles (the
                # machine asks again while it does not).
        return actions

    @precondition(lambda self: self.posted and not self.final)
    @rule(ok=st.booleans(), may_still_land=st.booleans())
    def read_ends(self, ok: bool, may_still_land: bool) -> None:
        self.final = True
        self.may_land = not ok and may_still_land
        self.feed(Ended(ok, self.may_land, None if ok else "deadline"))

    @precondition(lambda self: self.final and not self.settled)
    @rule()
    def read_settles(self) -> None:
        self.settled = True
        self.may_land = False
        self.feed(Settled())

    @rule()
    def overdue(self) -> None:
        """The check (armed or a stray one: the machine alone decides on a teardown)."""
        self.feed(Overdue(self.settled))

    @invariant()
    def targets_held_while_landing(self) -> None:
        if self.may_land:
            assert self.refs == 1

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        if not self.final:
            self.read_ends(False, True)
        if not self.settled:
            self.read_settles()
        assert len(self.outcomes) == 1 and self.refs == 0


ReadMachineTest.TestCase.settings = settings(
    max_examples=200, stateful_step_count=20, deadline=None
)
test_read_machine = ReadMachineTest.TestCase


def test_a_refused_teardown_is_tried_again_backing_off() -> None:
    """NIXL may refuse to remove an endpoint: while the failed READ stays unsettled, each
    check tears it down again and re-arms itself, backing off (1 s, 2 s, ...)."""
    m = ReadMachine((7, 8), after_s=5.0)
    m.handle(Begin(True))
    ended = m.handle(Ended(False, True, "deadline"))
    assert ArmCheck(5.0) in ended
    first = m.handle(Overdue(False))
    assert any(isinstance(a, TearDown) for a in first) and ArmCheck(1.0) in first
    second = m.handle(Overdue(False))  # the teardown was refused: still unsettled
    assert any(isinstance(a, TearDown) for a in second) and ArmCheck(2.0) in second
    assert m.handle(Settled()) == [ReleaseBlocks((7, 8))]
    assert m.handle(Overdue(True)) == []
