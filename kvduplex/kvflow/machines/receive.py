"""The receiving machine: one registration of blocks this instance waits on.

States (``phase``) and what moves them::

             KVDone / KVFailed (from the sender)
    WAITING ────────────────────────────────────────────────► ENDED
       │ deadline (no word for wait_s) / Cancel                  ▲
       ▼                                                         │ KVDone / KVFailed
    QUARANTINED ── every quarantine_s: ask the sender again ─────┤ (late: the sender
       (the flow fell back; our references stay:                 │  confirms nothing
        a late WRITE may still land)                             │  can land any more)
       └── the sender's process is gone (or no way to ask) ──────┘ TearDown, then ENDED

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

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
class Expire:
    """The engine thread's turn after `ScheduleExpire` (``can_ask``: whether we can tell
    that the sender's process is gone, so a quarantine asks it again instead of ending)."""

    now: float
    can_ask: bool


@dataclass(frozen=True)
class Asked:
    """The sender was asked again (KVCancel) to confirm: quarantine on."""

    now: float


@dataclass(frozen=True)
class SenderGone:
    """Give the quarantined blocks back without the sender's word (``why``)."""

    why: str


ReceiveEvent = (
    Begin | NotSent | SenderEnded | Cancel | Alive | Acknowledged | Tick | Expire | Asked
    | SenderGone
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
class ScheduleExpire:
    """Feed `Expire` from the engine thread (one at a time)."""


@dataclass(frozen=True)
class AskSender:
    """Off the engine thread: is the sender gone (then `SenderGone`)? else ask it again
    (KVCancel) and feed `Asked`."""


Counter = Literal[
    "num_received", "num_received_blocks", "num_failed", "num_late", "num_alive_received", "num_teardowns",
    "num_quarantine_asks", "num_registrations_resent",
]  # fmt: skip


@dataclass(frozen=True)
class Count:
    name: Counter
    n: int = 1


ReceiveAction = (
    AcquireBlocks | ReleaseBlocks | Tell | TearDown | Log | FlowDone | FlowFailed
    | FlowFirstToken | Forget | ScheduleExpire | AskSender | Count
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
    is_registered: bool = False
    """The sender acknowledged the registration (KVRegistered or a KVAlive)."""
    fell_back: bool = False
    ended: bool = False
    quarantine_until: float = 0.0
    expiring: bool = False
    """`ScheduleExpire` (or `AskSender`) is under way."""

    @property
    def phase(self) -> ReceivePhase:
        if self.ended:
            return ReceivePhase.ENDED
        return ReceivePhase.QUARANTINED if self.fell_back else ReceivePhase.WAITING

    def handle(self, event: ReceiveEvent) -> list[ReceiveAction]:
        """Apply ``event``; the actions to carry out, in order."""
        on_event: Callable[[ReceiveEvent], list[ReceiveAction]] = getattr(self, _ON[type(event)])
        return on_event(event)

    def _begin(self, event: Begin) -> list[ReceiveAction]:
        return [AcquireBlocks(self.blocks)]

    def _not_sent(self, event: NotSent) -> list[ReceiveAction]:
        self.ended = True
        return [Forget(), ReleaseBlocks(self.blocks)]

    def _sender_ended(self, event: SenderEnded) -> list[ReceiveAction]:
        msg = event.msg
        if self.ended:
            return []
        if event.sender != self.peer.engine_id:
            text = f"message from {event.sender}, expected {self.peer.engine_id}; ignored"
            return [Log(logging.WARNING, text)]
        self.ended = True
        out: list[ReceiveAction] = [Forget(), ReleaseBlocks(self.blocks)]
        if (
            self.wants_first_token
            and msg.first_token is not None
            and (self.fell_back or isinstance(msg, KVFailed))
        ):
            out.append(FlowFirstToken(msg.first_token))
        if self.fell_back:
            return [*out, Count("num_late")]
        if isinstance(msg, KVDone):
            received = [Count("num_received"), Count("num_received_blocks", len(self.blocks))]
            return [*out, *received, FlowDone(msg)]
        return [
            *out, Count("num_failed"), Log(logging.WARNING, f"the sender gave up ({msg.reason})"),
            FlowFailed(WaitFailure.SENDER_FAILED, msg.reason),
        ]  # fmt: skip

    def _cancel(self, event: Cancel) -> list[ReceiveAction]:
        if self.ended or self.fell_back:
            return []
        return self._give_up(event.reason, WaitFailure.CANCELLED, event.now)

    def _give_up(self, reason: str, cause: WaitFailure, now: float) -> list[ReceiveAction]:
        """Stop waiting: the flow falls back; the registered blocks stay ours (quarantine)."""
        self.fell_back = True
        self.quarantine_until = now + self.quarantine_s
        return [
            Count("num_failed"), Log(logging.WARNING, f"{reason}; falling back"),
            Tell(KVCancel(self.xid, reason)), FlowFailed(cause, reason),
        ]  # fmt: skip

    def _alive(self, event: Alive) -> list[ReceiveAction]:
        if self.ended or self.fell_back or event.sender != self.peer.engine_id:
            return []  # no answer: the sender's deadline stays where ours was
        self.deadline = max(self.deadline, event.now + self.wait_s)
        self.is_registered = True
        return [Count("num_alive_received"), Tell(KVAliveAck(self.xid, event.sent_at))]

    def _acknowledged(self, event: Acknowledged) -> list[ReceiveAction]:
        if event.sender == self.peer.engine_id:
            self.is_registered = True
        return []

    def _tick(self, event: Tick) -> list[ReceiveAction]:
        now = event.now
        if self.ended:
            return []
        limit = self.quarantine_until if self.fell_back else self.deadline
        if now > limit and not self.expiring:
            self.expiring = True
            return [ScheduleExpire()]
        if (
            not self.fell_back and not self.is_registered
            and now - self.reg_sent_at >= self.wait_s / HEARTBEATS_PER_WAIT
        ):  # fmt: skip
            self.reg_sent_at = now
            again = msgspec.structs.replace(self.reg, time_left_s=self.deadline - now)
            return [
                Count("num_registrations_resent"),
                Log(logging.INFO, "registration not acknowledged; sending it again"),
                Tell(again),
            ]
        return []

    def _expire(self, event: Expire) -> list[ReceiveAction]:
        self.expiring = False
        if self.ended:
            return []
        if not self.fell_back:
            if event.now > self.deadline:
                reason = f"no word from the sender for {self.wait_s:g} s"
                return self._give_up(reason, WaitFailure.DEADLINE, event.now)
            return []
        if not event.can_ask:
            return self._sender_gone(SenderGone("no word from the sender"))
        # Only the sender can say that nothing of its can land: ask it again (off the
        # engine thread: it may need a handshake), unless its process is gone.
        self.expiring = True  # until the answer to the asking
        return [AskSender()]

    def _asked(self, event: Asked) -> list[ReceiveAction]:
        self.quarantine_until = event.now + self.quarantine_s
        self.expiring = False
        return [Count("num_quarantine_asks")] if not self.ended else []

    def _sender_gone(self, event: SenderGone) -> list[ReceiveAction]:
        if self.ended:
            return []  # confirmed meanwhile
        self.ended = True
        text = f"{event.why} ({self.peer.engine_id}); releasing quarantined blocks"
        return [
            Forget(), Log(logging.WARNING, text), Count("num_teardowns"),
            TearDown(event.why), ReleaseBlocks(self.blocks),
        ]  # fmt: skip


_ON: dict[type, str] = {
    Begin: "_begin", NotSent: "_not_sent", SenderEnded: "_sender_ended", Cancel: "_cancel",
    Alive: "_alive", Acknowledged: "_acknowledged", Tick: "_tick", Expire: "_expire",
    Asked: "_asked", SenderGone: "_sender_gone",
}  # fmt: skip
"""The `ReceiveMachine` method that applies each kind of event."""


__all__ = [
    "Acknowledged", "Alive", "AskSender", "Asked", "Begin", "Cancel", "Count", "Expire",
    "FlowDone", "FlowFailed", "FlowFirstToken", "Forget", "NotSent", "ReceiveAction",
    "ReceiveEvent", "ReceiveMachine", "ReceivePhase", "ScheduleExpire", "SenderEnded",
    "SenderGone", "Tick", "WaitFailure",
]  # fmt: skip
