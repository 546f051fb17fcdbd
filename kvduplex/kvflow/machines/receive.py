"""The receiving machine: one registration of blocks this instance waits on.

States (``phase``, moved only along `TRANSITIONS`) and what moves them::

             KVDone / KVFailed (from the sender)
    WAITING ────────────────────────────────────────────────► ENDED
       │ a tick past the deadline (no word for wait_s) / Cancel   ▲
       ▼                                                         │ KVDone / KVFailed
    QUARANTINED ── every quarantine_s: ask the sender again ─────┤ (late: the sender
       (the flow fell back; our references stay:                 │  confirms nothing
        a late WRITE may still land)                             │  can land any more)
       └── the sender's process is gone (or no way to ask) ──────┘ TearDown, then ENDED

Asking the sender again is I/O (is its process gone? a handshake to reach it):
`AskSender` goes to the flow I/O thread, whose answer comes back as `Asked` or
`SenderGone`; the wait is not asked again meanwhile.

While WAITING the registration is sent again every third of the wait until
the sender acknowledges it (KVRegistered or a KVAlive); each KVAlive restarts
the wait and is answered by KVAliveAck.

The invariant (tested with hypothesis): our reference on each registered
block is held until the sender said it ended (nothing of its can land) or its
endpoint is torn down because it is gone; the flow hears `FlowDone` (its blocks
may enter a prefix cache) only after KVDone arrived in time, and exactly one
of `FlowDone` / `FlowFailed`.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import assert_never

import msgspec

from kvduplex.kvflow.machines.actions import AcquireBlocks
from kvduplex.kvflow.machines.actions import Log
from kvduplex.kvflow.machines.actions import ReleaseBlocks
from kvduplex.kvflow.machines.actions import TearDown
from kvduplex.kvflow.machines.actions import Tell
from kvduplex.kvflow.machines.send import HEARTBEATS_PER_WAIT
from kvduplex.kvflow.messages import KVAliveAck
from kvduplex.kvflow.messages import KVCancel
from kvduplex.kvflow.messages import KVDone
from kvduplex.kvflow.messages import KVFailed
from kvduplex.kvflow.messages import KVRegister
from kvduplex.transport.protocol import PeerHandle


class WaitFailure(enum.Enum):
    """Why a wait ended without the KV (a metrics label too)."""

    SENDER_FAILED = "sender_failed"
    """KVFailed: nothing is in flight any more; the blocks may be reused."""
    DEADLINE = "deadline"
    CANCELLED = "cancelled"

    @property
    def may_still_be_written(self) -> bool:
        """A late WRITE may still land in the registered blocks: compute elsewhere."""
        return self is not WaitFailure.SENDER_FAILED


class ReceivePhase(enum.Enum):
    WAITING = "waiting"
    QUARANTINED = "quarantined"
    """The flow fell back; the blocks stay referenced until the sender confirms."""
    ENDED = "ended"


TRANSITIONS: dict[ReceivePhase, frozenset[ReceivePhase]] = {
    ReceivePhase.WAITING: frozenset({ReceivePhase.QUARANTINED, ReceivePhase.ENDED}),
    ReceivePhase.QUARANTINED: frozenset({ReceivePhase.ENDED}),
    ReceivePhase.ENDED: frozenset(),
}
"""The phases each phase may move to (`ReceiveMachine._move` checks every move)."""


# ---- events ----


@dataclass(frozen=True)
class Begin:
    """The registration is about to be sent."""


@dataclass(frozen=True)
class NotSent:
    """The registration could not be sent: nothing can be written, the wait is void."""


@dataclass(frozen=True)
class SenderEnded:
    """KVDone or KVFailed for this transfer from ``sender``."""

    msg: KVDone | KVFailed
    sender: str


@dataclass(frozen=True)
class Cancel:
    """Stop waiting now (the flow falls back)."""

    reason: str
    now: float


@dataclass(frozen=True)
class Alive:
    """The sender's heartbeat (KVAlive, sent at ``sent_at`` on its clock)."""

    sender: str
    sent_at: float
    now: float


@dataclass(frozen=True)
class Acknowledged:
    """KVRegistered: the sender holds our registration."""

    sender: str


@dataclass(frozen=True)
class Tick:
    now: float


@dataclass(frozen=True)
class Asked:
    """The sender was asked again (KVCancel) to confirm: quarantine on."""

    now: float


@dataclass(frozen=True)
class SenderGone:
    """Give the quarantined blocks back without the sender's word (``why``)."""

    why: str


ReceiveEvent = (
    Begin | NotSent | SenderEnded | Cancel | Alive | Acknowledged | Tick | Asked | SenderGone
)  # fmt: skip


# ---- actions (besides the shared ones) ----


@dataclass(frozen=True)
class FlowDone:
    """Tell the flow that the KV arrived (``msg``: the sender's KVDone)."""

    msg: KVDone


@dataclass(frozen=True)
class FlowFailed:
    """Tell the flow that the wait ended without the KV."""

    cause: WaitFailure
    reason: str


@dataclass(frozen=True)
class FlowFirstToken:
    """Tell the flow the sender's first token (its fallback continues from it)."""

    token: int


@dataclass(frozen=True)
class Forget:
    """Drop the wait: its xid may be waited on again."""


@dataclass(frozen=True)
class AskSender:
    """On the flow I/O thread: is the sender gone (then `SenderGone`)? else ask it again
    (KVCancel) and feed `Asked`."""


class ReceiveCounter(enum.Enum):
    """The receiver's statistics a machine counts (`KVReceiverStats.count`)."""

    RECEIVED = "num_received"
    RECEIVED_BLOCKS = "num_received_blocks"
    FAILED = "num_failed"
    LATE = "num_late"
    ALIVE_RECEIVED = "num_alive_received"
    TEARDOWNS = "num_teardowns"
    QUARANTINE_ASKS = "num_quarantine_asks"
    REGISTRATIONS_RESENT = "num_registrations_resent"


@dataclass(frozen=True)
class Count:
    """Add ``n`` to the receiver's statistic ``counter``."""

    counter: ReceiveCounter
    n: int = 1


ReceiveAction = (
    AcquireBlocks | ReleaseBlocks | Tell | TearDown | Log | FlowDone | FlowFailed
    | FlowFirstToken | Forget | AskSender | Count
)  # fmt: skip


@dataclass
class ReceiveMachine:
    """One wait for transfer ``xid`` into ``blocks``. Not thread-safe: the adapter
    serialises its events."""

    xid: str
    peer: PeerHandle
    blocks: tuple[int, ...]
    reg: KVRegister
    """What we registered (re-sent, with what is left of the wait, until acknowledged)."""
    wait_s: float
    quarantine_s: float
    deadline: float
    reg_sent_at: float
    wants_first_token: bool = False
    """The flow continues from the sender's first token when it ends without the KV."""
    can_ask: bool = False
    """We can tell whether the sender's process is gone: a quarantine past its time asks
    the sender again instead of ending."""
    is_registered: bool = False
    """The sender acknowledged the registration (KVRegistered or a KVAlive)."""
    phase: ReceivePhase = ReceivePhase.WAITING
    was_quarantined: bool = False
    """Ended after a quarantine (an end message then counts as late)."""
    quarantine_until: float = 0.0
    asking: bool = False
    """`AskSender` is under way (its answer not in yet)."""

    @property
    def fell_back(self) -> bool:
        """The flow fell back (quarantine, or ended after it)."""
        return self.phase is ReceivePhase.QUARANTINED or self.was_quarantined

    @property
    def ended(self) -> bool:
        return self.phase is ReceivePhase.ENDED

    def _move(self, to: ReceivePhase) -> None:
        assert to in TRANSITIONS[self.phase], f"xid={self.xid}: {self.phase} -> {to}"
        if self.phase is ReceivePhase.QUARANTINED:
            self.was_quarantined = True
        self.phase = to

    def handle(self, event: ReceiveEvent) -> list[ReceiveAction]:
        """Apply ``event``; the actions to carry out, in order."""
        match event:
            case Begin():
                return [AcquireBlocks(self.blocks)]
            case NotSent():
                return self._not_sent(event)
            case SenderEnded():
                return self._sender_ended(event)
            case Cancel():
                return self._cancel(event)
            case Alive():
                return self._alive(event)
            case Acknowledged():
                return self._acknowledged(event)
            case Tick():
                return self._tick(event)
            case Asked():
                return self._asked(event)
            case SenderGone():
                return self._sender_gone(event)
            case _:
                assert_never(event)

    def _not_sent(self, event: NotSent) -> list[ReceiveAction]:
        self._move(ReceivePhase.ENDED)
        return [ReleaseBlocks(self.blocks), Forget()]

    def _sender_ended(self, event: SenderEnded) -> list[ReceiveAction]:
        msg = event.msg
        if self.ended:
            return []
        if event.sender != self.peer.engine_id:
            text = f"message from {event.sender}, expected {self.peer.engine_id}; ignored"
            return [Log(logging.WARNING, text)]
        fell_back = self.fell_back
        self._move(ReceivePhase.ENDED)
        out: list[ReceiveAction] = [ReleaseBlocks(self.blocks)]
        if (
            self.wants_first_token
            and msg.first_token is not None
            and (fell_back or isinstance(msg, KVFailed))
        ):
            out.append(FlowFirstToken(msg.first_token))
        if fell_back:
            out.append(Count(ReceiveCounter.LATE))
        elif isinstance(msg, KVDone):
            received = [
                Count(ReceiveCounter.RECEIVED),
                Count(ReceiveCounter.RECEIVED_BLOCKS, len(self.blocks)),
            ]
            out += [*received, FlowDone(msg)]
        else:
            out += [
                Count(ReceiveCounter.FAILED), Log(logging.WARNING, f"the sender gave up ({msg.reason})"),
                FlowFailed(WaitFailure.SENDER_FAILED, msg.reason),
            ]  # fmt: skip
        return [*out, Forget()]  # the wait goes last: whoever sees it gone sees it all done

    def _cancel(self, event: Cancel) -> list[ReceiveAction]:
        if self.ended or self.fell_back:
            return []
        return self._give_up(event.reason, WaitFailure.CANCELLED, event.now)

    def _give_up(self, reason: str, cause: WaitFailure, now: float) -> list[ReceiveAction]:
        """Stop waiting: the flow falls back; the registered blocks stay ours (quarantine)."""
        self._move(ReceivePhase.QUARANTINED)
        self.quarantine_until = now + self.quarantine_s
        return [
            Count(ReceiveCounter.FAILED), Log(logging.WARNING, f"{reason}; falling back"),
            Tell(KVCancel(self.xid, reason)), FlowFailed(cause, reason),
        ]  # fmt: skip

    def _alive(self, event: Alive) -> list[ReceiveAction]:
        if self.ended or self.fell_back or event.sender != self.peer.engine_id:
            return []  # no answer: the sender's deadline stays where ours was
        self.deadline = max(self.deadline, event.now + self.wait_s)
        self.is_registered = True
        return [Count(ReceiveCounter.ALIVE_RECEIVED), Tell(KVAliveAck(self.xid, event.sent_at))]

    def _acknowledged(self, event: Acknowledged) -> list[ReceiveAction]:
        if event.sender == self.peer.engine_id:
            self.is_registered = True
        return []

    def _tick(self, event: Tick) -> list[ReceiveAction]:
        now = event.now
        if self.ended:
            return []
        limit = self.quarantine_until if self.fell_back else self.deadline
        if now > limit and not self.asking:
            return self._expire(now)
        if (
            not self.fell_back and not self.is_registered
            and now - self.reg_sent_at >= self.wait_s / HEARTBEATS_PER_WAIT
        ):  # fmt: skip
            self.reg_sent_at = now
            again = msgspec.structs.replace(self.reg, time_left_s=self.deadline - now)
            return [
                Count(ReceiveCounter.REGISTRATIONS_RESENT),
                Log(logging.INFO, "registration not acknowledged; sending it again"),
                Tell(again),
            ]
        return []

    def _expire(self, now: float) -> list[ReceiveAction]:
        """The deadline (or the quarantine's time) passed."""
        if not self.fell_back:
            reason = f"no word from the sender for {self.wait_s:g} s"
            return self._give_up(reason, WaitFailure.DEADLINE, now)
        if not self.can_ask:
            return self._sender_gone(SenderGone("no word from the sender"))
        # Only the sender can say that nothing of its can land: ask it again (on the I/O
        # thread: it may need a handshake), unless its process is gone.
        self.asking = True  # until the answer to the asking
        return [AskSender()]

    def _asked(self, event: Asked) -> list[ReceiveAction]:
        self.quarantine_until = event.now + self.quarantine_s
        self.asking = False
        return [Count(ReceiveCounter.QUARANTINE_ASKS)] if not self.ended else []

    def _sender_gone(self, event: SenderGone) -> list[ReceiveAction]:
        self.asking = False
        if self.ended:
            return []  # confirmed meanwhile
        self._move(ReceivePhase.ENDED)
        text = f"{event.why} ({self.peer.engine_id}); releasing quarantined blocks"
        return [
            Log(logging.WARNING, text), Count(ReceiveCounter.TEARDOWNS), TearDown(event.why),
            ReleaseBlocks(self.blocks), Forget(),
        ]  # fmt: skip


__all__ = [
    "TRANSITIONS", "Acknowledged", "Alive", "AskSender", "Asked", "Begin", "Cancel", "Count",
    "FlowDone", "FlowFailed", "FlowFirstToken", "Forget", "NotSent", "ReceiveAction",
    "ReceiveCounter", "ReceiveEvent", "ReceiveMachine", "ReceivePhase", "SenderEnded", "SenderGone", "Tick",
    "WaitFailure",
]  # fmt: skip
