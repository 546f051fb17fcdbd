"""Property-based (hypothesis stateful) test of the send machine, push and return.

Whatever order registrations (right, wrong, late, duplicate), the prefill's
steps and layers, WRITE ends and settlings, cancels, declines, aborts,
heartbeat answers and ticks (and the deadlines they pass) come in:

* every source block of a WRITE that is not settled is referenced by the
  machine (no block can go to a new owner while a WRITE out of it may land);
* the end message (KVDone / KVFailed, which lets the receiver reuse its blocks)
  goes out at most once and only when no WRITE can land any more;
* no WRITE is posted once the transfer failed or past the receiver's deadline;
* KVDone means every registered block was written, every layer, by a WRITE
  that ended DONE;
* in the end, every reference the machine took is dropped.
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

from kvduplex.common.kv_layout import num_blocks_for_tokens
from kvduplex.kvflow.machines.actions import AcquireBlocks
from kvduplex.kvflow.machines.actions import ReleaseBlocks
from kvduplex.kvflow.machines.actions import TearDown
from kvduplex.kvflow.machines.actions import Tell
from kvduplex.kvflow.machines.send import AliveAck
from kvduplex.kvflow.machines.send import Begin
from kvduplex.kvflow.machines.send import Cancelled
from kvduplex.kvflow.machines.send import Declined
from kvduplex.kvflow.machines.send import Ended
from kvduplex.kvflow.machines.send import FirstToken
from kvduplex.kvflow.machines.send import HeldSource
from kvduplex.kvflow.machines.send import LayerDone
from kvduplex.kvflow.machines.send import PostWrite
from kvduplex.kvflow.machines.send import PrefillAborted
from kvduplex.kvflow.machines.send import PrefillProgress
from kvduplex.kvflow.machines.send import PrefillSource
from kvduplex.kvflow.machines.send import Reclaimed
from kvduplex.kvflow.machines.send import Registered
from kvduplex.kvflow.machines.send import ReleasePrefill
from kvduplex.kvflow.machines.send import SendAction
from kvduplex.kvflow.machines.send import SendEvent
from kvduplex.kvflow.machines.send import SendMachine
from kvduplex.kvflow.machines.send import SendPhase
from kvduplex.kvflow.machines.send import StepEnded
from kvduplex.kvflow.machines.send import StepPlanned
from kvduplex.kvflow.machines.send import Tick
from kvduplex.kvflow.machines.send import Waiting
from kvduplex.kvflow.machines.send import WriteEnded
from kvduplex.kvflow.machines.send import WriteSettled
from kvduplex.kvflow.messages import KVDone
from kvduplex.kvflow.messages import KVFailed
from kvduplex.kvflow.messages import KVRegister
from kvduplex.kvflow.messages import ids_digest
from kvduplex.transport.protocol import PeerHandle

BLOCK_SIZE = 4
NUM_LAYERS = 3
WAIT_S = 10.0
DEADLINE_S = 5.0
PEER = "d0"
OTHER = "d1"


class SendMachineTest(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 100.0
        self.refs: Counter[int] = Counter()
        self.writes: dict[int, PostWrite] = {}
        """Posted WRITEs not settled."""
        self.ended_writes: dict[int, bool] = {}
        """Of those, the ones final: ok?"""
        self.may_land: set[int] = set()
        self.ever_may_land = False
        self.written: set[tuple[int, int]] = set()
        """(dst block, layer) written by a WRITE that ended DONE."""
        self.end_msgs: list[KVDone | KVFailed] = []
        self.num_ended = 0
        self.forgotten = False
        """The adapter forgets the transfer right after the actions that ended it."""
        self.teardowns = 0
        # the prefill (push)
        self.num_computed = 0
        self.in_step: tuple[int, int] | None = None
        self.next_layer = 0
        self.req_added = False
        self.first_token_sent = False

    @initialize(push=st.booleans(), num_tokens=st.integers(1, 24))
    def begin(self, push: bool, num_tokens: int) -> None:
        num_blocks = num_blocks_for_tokens(num_tokens, BLOCK_SIZE)
        self.push = push
        self.src = [100 + i for i in range(num_blocks)]
        source = PrefillSource(NUM_LAYERS) if push else HeldSource(tuple(self.src))
        peer = PeerHandle(PEER, "agent-" + PEER, None)  # type: ignore[arg-type]
        self.m = SendMachine(
            "x", peer, num_tokens, ids_digest(range(num_tokens)), num_blocks, BLOCK_SIZE, DEADLINE_S, source,
            expires_at=self.now + WAIT_S,
        )  # fmt: skip
        self.feed(Begin(self.now))

    # ---- feeding the machine and checking each action ----

    def feed(self, event: SendEvent) -> list[SendAction]:
        actions = self.m.handle(event)
        for a in actions:
            self.check(a)
        return actions

    def check(self, a: SendAction) -> None:
        if isinstance(a, AcquireBlocks):
            self.refs.update(a.block_ids)
        elif isinstance(a, ReleaseBlocks):
            self.refs.subtract(a.block_ids)
            assert all(n >= 0 for n in self.refs.values()), "released more than acquired"
        elif isinstance(a, PostWrite):
            assert not self.end_msgs and not self.num_ended, "WRITE after the end"
            assert self.m.error is None, "WRITE posted after a failure"
            assert self.now < self.m.expires_at, "WRITE posted past the receiver's deadline"
            assert 0 < a.deadline_s <= DEADLINE_S
            assert len(a.src) == len(a.dst) > 0
            assert a.write_id not in self.writes
            self.writes[a.write_id] = a
        elif isinstance(a, Tell) and isinstance(a.msg, KVDone | KVFailed):
            assert not self.writes, f"{a.msg} while WRITEs {sorted(self.writes)} may land"
            self.end_msgs.append(a.msg)
            if isinstance(a.msg, KVDone):
                assert self.m.reg is not None
                dst = self.m.reg.block_ids
                missing = {(b, k) for b in dst for k in range(NUM_LAYERS)} - self.written
                assert not missing, f"KVDone with blocks not written: {sorted(missing)}"
        elif isinstance(a, Ended):
            self.num_ended += 1
            assert not self.writes, "ended while WRITEs may land"
            self.forgotten = True
        elif isinstance(a, TearDown):
            assert self.ever_may_land and self.writes, "teardown with no failed WRITE unsettled"
            self.teardowns += 1
        elif isinstance(a, ReleasePrefill):
            assert self.push and self.forgotten

    # ---- registration ----

    def _registration(self, first_block: int, time_left: float, good_size: bool) -> KVRegister:
        n = self.m.num_blocks
        first = min(first_block, n)
        dst = [500 + i for i in range(first, n)]
        num_tokens = self.m.num_tokens if good_size else self.m.num_tokens + 1
        return KVRegister("x", dst, first, num_tokens, WAIT_S, time_left, ids_digest(range(num_tokens)))

    def _progress(self, layer: int | None) -> PrefillProgress | None:
        if not self.push or not self.req_added:
            return None
        return PrefillProgress(self.num_computed, self.src, layer)

    @precondition(
        lambda self: not self.forgotten
        and (self.in_step is None or self.next_layer < NUM_LAYERS)
    )  # fmt: skip
    @rule(
        first_block=st.sampled_from([0, 0, 0, 1, 2, 9]),
        time_left=st.sampled_from([WAIT_S, WAIT_S, 3.0, -1.0]),
        good_size=st.sampled_from([True, True, True, False]),
        right_sender=st.sampled_from([True, True, True, False]),
        delay=st.sampled_from([0.0, 0.0, 4.0]),
        in_wait=st.booleans(),
    )  # fmt: skip
    def register(
        self, first_block: int, time_left: float, good_size: bool, right_sender: bool,
        delay: float, in_wait: bool,
    ) -> None:  # fmt: skip
        msg = self._registration(first_block, time_left, good_size)
        sender = PEER if right_sender else OTHER
        # In a forward, the registration is applied by a layer's hook, which then posts
        # that layer, or (``in_wait``) while the hook waits for that layer's loaded
        # prefix, before the layer's WRITEs: the layers before it are the ones done
        # (none before layer 0), and the layer is posted later; between steps, by an
        # engine call.
        if self.in_step is not None and in_wait:
            done = self.next_layer - 1
            self.feed(Registered(msg, sender, self.now - delay, self.now,
                                 self._progress(None if done < 0 else done)))  # fmt: skip
            return
        layer = self.next_layer if self.in_step is not None else None
        self.feed(Registered(msg, sender, self.now - delay, self.now, self._progress(layer)))
        if layer is not None:
            self._layer(layer)
            self.next_layer += 1

    # ---- the prefill (push) ----

    def _can_step(self) -> bool:
        return (
            self.push and not self.forgotten and self.in_step is None
            and self.num_computed < self.m.num_tokens and self.m.error is None
        )  # fmt: skip

    @precondition(lambda self: self._can_step())
    @rule(num_new=st.integers(1, 10))
    def plan_step(self, num_new: int) -> None:
        end = min(self.num_computed + num_new, self.m.num_tokens)
        self.req_added = True
        self.in_step = (self.num_computed, end)
        self.next_layer = 0
        self.feed(StepPlanned(self.num_computed, end, self.src))

    def _layer(self, layer: int) -> None:
        if self.m.chunk is not None:  # the adapter feeds only jobs with a chunk
            self.feed(LayerDone(layer, self.now))

    @precondition(lambda self: self.in_step is not None and self.next_layer < NUM_LAYERS)
    @rule()
    def layer_done(self) -> None:
        self._layer(self.next_layer)
        self.next_layer += 1

    @precondition(lambda self: self.in_step is not None and self.next_layer == NUM_LAYERS)
    @rule()
    def step_ended(self) -> None:
        assert self.in_step is not None
        self.feed(StepEnded())
        self.num_computed = self.in_step[1]
        self.in_step = None

    @precondition(
        lambda self: self.push and not self.forgotten and not self.first_token_sent
        and self.in_step is None and self.num_computed == self.m.num_tokens
    )  # fmt: skip
    @rule()
    def first_token(self) -> None:
        self.first_token_sent = True
        self.feed(FirstToken(7, 0, self.now))

    # ---- WRITEs ----

    def _unended(self) -> list[int]:
        return sorted(w for w in self.writes if w not in self.ended_writes)

    @precondition(lambda self: bool(self._unended()))
    @rule(data=st.data(), ok=st.booleans(), may_still_land=st.booleans())
    def write_ends(self, data: st.DataObject, ok: bool, may_still_land: bool) -> None:
        wid = data.draw(st.sampled_from(self._unended()))
        self.ended_writes[wid] = ok
        a = self.writes[wid]
        if ok:
            layers = range(NUM_LAYERS) if a.layers is None else a.layers
            self.written.update((b, layer) for b in a.dst for layer in layers)
        elif may_still_land:
            self.may_land.add(wid)
            self.ever_may_land = True
        self.feed(WriteEnded(wid, ok, may_still_land and not ok, None if ok else "err", self.now))

    @precondition(lambda self: bool(self.ended_writes))
    @rule(data=st.data())
    def write_settles(self, data: st.DataObject) -> None:
        wid = data.draw(st.sampled_from(sorted(self.ended_writes)))
        self._settle(wid)

    def _settle(self, wid: int) -> None:
        ok = self.ended_writes.pop(wid)
        self.may_land.discard(wid)
        self.writes.pop(wid)
        self.feed(WriteSettled(wid, ok, 64 if ok else 0, self.now))

    # ---- the receiver and the engine ----

    @precondition(lambda self: not self.forgotten)
    @rule(
        what=st.sampled_from(["cancel", "cancel_by_peer", "cancel_by_other", "declined",
                              "prefill_aborted", "reclaimed"])
    )  # fmt: skip
    def interrupt(self, what: str) -> None:
        """One rule for every way a transfer is stopped (each would end most runs early)."""
        if what.startswith("cancel"):
            by = {"cancel": None, "cancel_by_peer": PEER, "cancel_by_other": OTHER}[what]
            self.feed(Cancelled("cancelled", by))
        elif what == "declined" and not self.push:
            self.feed(Declined("has_all"))
        elif what == "prefill_aborted" and self.push:
            self.feed(PrefillAborted())
        elif what == "reclaimed":
            self.feed(Reclaimed("the pool is short"))

    @precondition(lambda self: not self.forgotten)
    @rule(sender=st.sampled_from([PEER, OTHER]), back=st.sampled_from([0.0, 2.0, -50.0]))
    def receiver_answers(self, sender: str, back: float) -> None:
        self.feed(Waiting(sender, WAIT_S, self.now))
        self.feed(AliveAck(sender, self.now - back, self.now))  # -50: a forged future time

    @rule(dt=st.sampled_from([0.5, 3.0, 6.0, 11.0]), healthy=st.booleans())
    def tick(self, dt: float, healthy: bool) -> None:
        self.now += dt
        if not self.forgotten:
            self.feed(Tick(self.now, healthy))

    # ---- invariants ----

    @invariant()
    def sources_held_while_writes_may_land(self) -> None:
        for wid, a in self.writes.items():
            for b in a.src:
                assert self.refs[b] > 0, f"block {b} of WRITE {wid} unreferenced while it may land"

    @invariant()
    def a_served_push_ends(self) -> None:
        """A registered push whose first token is known, with no failure and no WRITE
        that may land, has ended: nothing else would end it (the receiver's heartbeats
        keep both sides waiting)."""
        if (
            self.push and self.first_token_sent and self.m.reg is not None
            and self.m.error is None and not self.writes
        ):  # fmt: skip
            assert self.m.ended, f"sent {self.m.sent} of {self.m.num_blocks} blocks, not ended"

    @invariant()
    def ends_once(self) -> None:
        assert len(self.end_msgs) <= 1 and self.num_ended <= 1
        if self.writes and self.m.error is not None:
            assert self.m.phase is SendPhase.FAILING
        if self.end_msgs and isinstance(self.end_msgs[0], KVDone):
            assert self.m.phase is SendPhase.DONE

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        # Whatever was posted ends and settles (NIXL lets go, or the endpoint goes).
        for wid in self._unended():
            self.ended_writes[wid] = False
            self.feed(WriteEnded(wid, False, False, "closed", self.now))
        for wid in sorted(self.ended_writes):
            self._settle(wid)
        if self.in_step is not None:
            for layer in range(self.next_layer, NUM_LAYERS):
                self._layer(layer)
            self.feed(StepEnded())
            for wid in sorted(self.writes):  # posted by the last layers
                self.ended_writes[wid] = False
                self._settle(wid)
        if not self.num_ended and not self.forgotten:
            self.feed(Cancelled("closed"))
        assert self.num_ended == 1, "the transfer never ended"
        held = {b: n for b, n in self.refs.items() if n}
        assert not held, f"references never dropped: {held}"


SendMachineTest.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None
)
test_send_machine = SendMachineTest.TestCase


def _teardowns(actions: list[SendAction]) -> int:
    return sum(isinstance(a, TearDown) for a in actions)


def test_a_refused_teardown_is_tried_again_backing_off() -> None:
    """NIXL may refuse to remove an endpoint: while a failed WRITE stays unsettled after
    its teardown, the machine asks for it again (after 1 s, then 2 s, ...), and stops once
    the WRITE settles; else the job never settles and its blocks stay held."""
    now = 100.0
    peer = PeerHandle(PEER, "agent-" + PEER, None)  # type: ignore[arg-type]
    m = SendMachine("x", peer, 8, ids_digest(range(8)), 2, BLOCK_SIZE, DEADLINE_S, HeldSource((100, 101)),
                    expires_at=now + WAIT_S)  # fmt: skip
    m.handle(Begin(now))
    posted = m.handle(Registered(KVRegister("x", [500, 501], 0, 8, WAIT_S, WAIT_S, ids_digest(range(8))), PEER, now,
                                 now, None))  # fmt: skip
    writes = [a for a in posted if isinstance(a, PostWrite)]
    assert writes
    for w in writes:
        m.handle(WriteEnded(w.write_id, False, True, "err", now))
    now += DEADLINE_S + 0.1
    assert _teardowns(m.handle(Tick(now, True))) == 1
    assert _teardowns(m.handle(Tick(now + 0.5, True))) == 0
    assert _teardowns(m.handle(Tick(now + 1.0, True))) == 1, "tried again after 1 s"
    assert _teardowns(m.handle(Tick(now + 2.0, True))) == 0
    assert _teardowns(m.handle(Tick(now + 3.0, True))) == 1, "then after 2 s"
    for w in writes:
        m.handle(WriteSettled(w.write_id, False, 0, now + 3.5))
    assert _teardowns(m.handle(Tick(now + 60.0, True))) == 0, "settled: nothing to tear down"


def test_a_registration_before_the_first_layers_writes_streams_the_step() -> None:
    """1. A push's prefill plans its only step (the whole prompt) before any registration.
    2. The registration is applied in that step's forward before any layer's WRITEs (a
       layer hook waiting for a loaded prefix: no layer done, ``progress.layer`` None).
    3. Each layer's hook WRITEs that layer of the step's blocks; the step ends; the
       first token is sampled.
    4. Once every WRITE settled, the transfer ends with KVDone and lets its blocks go
       (planned as between steps instead, the step's blocks would never be written and
       the transfer would wait for them for as long as the receiver's heartbeats go)."""
    now = 100.0
    src = (100, 101)
    peer = PeerHandle(PEER, "agent-" + PEER, None)  # type: ignore[arg-type]
    m = SendMachine("x", peer, 8, ids_digest(range(8)), 2, BLOCK_SIZE, DEADLINE_S, PrefillSource(NUM_LAYERS),
                    expires_at=now + WAIT_S)  # fmt: skip
    assert m.handle(StepPlanned(0, 8, src)) == []
    reg = KVRegister("x", [500, 501], 0, 8, WAIT_S, WAIT_S, ids_digest(range(8)))
    actions = m.handle(Registered(reg, PEER, now, now, PrefillProgress(0, src, None)))
    assert AcquireBlocks(src) in actions
    assert not any(isinstance(a, PostWrite) for a in actions), "no layer is done yet"
    posts = [a for layer in range(NUM_LAYERS) for a in m.handle(LayerDone(layer, now))]
    assert [(p.layers, p.src, p.dst) for p in posts if isinstance(p, PostWrite)] == [
        ((layer,), src, (500, 501)) for layer in range(NUM_LAYERS)
    ]
    assert m.handle(StepEnded()) == []
    assert m.handle(FirstToken(7, 0, now)) == [], "WRITEs may still land"
    ends: list[SendAction] = []
    for p in posts:
        assert isinstance(p, PostWrite)
        ends += m.handle(WriteEnded(p.write_id, True, False, None, now))
        ends += m.handle(WriteSettled(p.write_id, True, 64, now))
    assert m.phase is SendPhase.DONE
    assert [type(a.msg) for a in ends if isinstance(a, Tell)] == [KVDone]
    assert ReleaseBlocks(src) in ends


def test_a_finished_push_not_registered_is_given_up_for_the_pool_and_tells_its_first_token() -> None:
    """1. A push's prefill is still computing: reclaiming it does nothing.
    2. Its first token is sampled, no registration came: reclaimed, it fails and tells
       the receiver (which queues a request for it) KVFailed with the first token, then
       releases the prefill.
    3. A push whose receiver registered is never reclaimed."""
    now = 100.0
    peer = PeerHandle(PEER, "agent-" + PEER, None)  # type: ignore[arg-type]

    def machine() -> SendMachine:
        return SendMachine("x", peer, 8, ids_digest(range(8)), 2, BLOCK_SIZE, DEADLINE_S,
                           PrefillSource(NUM_LAYERS), expires_at=now + WAIT_S)  # fmt: skip

    m = machine()
    m.handle(StepPlanned(0, 8, (100, 101)))
    assert m.handle(Reclaimed("short")) == []
    m.handle(StepEnded())
    assert m.handle(FirstToken(7, 0, now)) == []  # waits for the registration
    actions = m.handle(Reclaimed("short"))
    assert m.phase is SendPhase.FAILED
    told = [a.msg for a in actions if isinstance(a, Tell)]
    assert len(told) == 1 and isinstance(told[0], KVFailed) and told[0].first_token == 7
    assert actions[-2:] == [Ended(False), ReleasePrefill()]
    registered = machine()
    reg = KVRegister("x", [500, 501], 0, 8, WAIT_S, WAIT_S, ids_digest(range(8)))
    registered.handle(Registered(reg, PEER, now, now, None))
    registered.handle(FirstToken(7, 0, now))
    assert registered.handle(Reclaimed("short")) == []
    assert registered.error is None
