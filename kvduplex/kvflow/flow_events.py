"""The typed events other threads put into the flow inbox
(`kvduplex.kvflow.inbox.FlowInbox`), and the engine-thread objects that hear them.

Every event says what happened and whom it is for; none carries a callable to run
but `RegisterSpec`'s table. Each has a `Granularity`: whether the engine thread
applies it also between two layers of a forward that streams a push (LAYER) or
only between steps (STEP); `FlowInbox.granularity` decides it for every kind.
"""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING
from typing import Generic
from typing import Protocol
from typing import TypeVar

from kvduplex.transport.messages import ControlMessage
from kvduplex.transport.protocol import TransferHandle

if TYPE_CHECKING:
    from kvduplex.kvflow.pull import PullSpec
    from kvduplex.kvflow.push_decode import PushSpec


class Granularity(enum.Enum):
    """Where the engine thread applies an event."""

    LAYER = "layer"
    """Also between two layers of a forward that streams a push (`drain_layer`)."""
    STEP = "step"
    """Only between steps (`drain`)."""


SpecT = TypeVar("SpecT", "PullSpec", "PushSpec")
"""A spec a route registers for a request still to come: one of the flows' own."""
SpecT_contra = TypeVar("SpecT_contra", contravariant=True)


class TransferWatcher(Protocol):
    """Whoever posted a transfer and hears how it ends (engine thread)."""

    def on_transfer_ended(self, handle: TransferHandle) -> None: ...

    def on_transfer_settled(self, handle: TransferHandle) -> None: ...


class SenderCheckTarget(Protocol):
    def on_sender_checked(self, xid: str, gone: bool, now: float) -> None: ...


class SpecTable(Protocol[SpecT_contra]):
    """A flow's table of specs for requests still to come (push, pull)."""

    def register(self, spec: SpecT_contra) -> None:
        """Raises XidInUseError for an xid another request waits on."""


@dataclass(frozen=True)
class Heard:
    """A notification, with the engine id of the agent that delivered it (verified by
    the transport) and when the pump took it (monotonic)."""

    msg: ControlMessage
    sender: str
    received_at: float


@dataclass(frozen=True)
class TickAt:
    """The pump's clock moved; the inbox keeps at most one pending (see `FlowInbox.tick`)."""

    now: float


@dataclass(frozen=True)
class TransferEnded:
    """A transfer's done callback: it is final (DONE or FAILED)."""

    handle: TransferHandle
    to: TransferWatcher
    at: Granularity = Granularity.STEP


@dataclass(frozen=True)
class TransferSettled:
    """A transfer's settled callback: nothing of it can land any more."""

    handle: TransferHandle
    to: TransferWatcher
    at: Granularity = Granularity.STEP


@dataclass(frozen=True)
class SenderChecked:
    """The flow I/O thread asked whether a sender is gone (and, if not, asked it again to
    confirm a quarantined wait)."""

    xid: str
    gone: bool
    to: SenderCheckTarget


@dataclass(frozen=True)
class RegisterSpec(Generic[SpecT]):
    """An HTTP route registers a spec before its request reaches the engine; ``reply``
    gets None, or the ValueError of a duplicate xid."""

    spec: SpecT
    to: SpecTable[SpecT]
    reply: Future[None]

    def apply(self) -> None:
        """Engine thread: register the spec and answer the reply."""
        if not self.reply.set_running_or_notify_cancel():
            return  # failed already: the engine loop ended
        try:
            self.to.register(self.spec)
        except Exception as exc:  # a duplicate xid: the route answers 409
            self.reply.set_exception(exc)
        else:
            self.reply.set_result(None)


FlowEvent = (
    Heard | TickAt | TransferEnded | TransferSettled | SenderChecked
    | RegisterSpec["PullSpec"] | RegisterSpec["PushSpec"]
)  # fmt: skip


__all__ = [
    "FlowEvent", "Granularity", "Heard", "RegisterSpec", "SenderCheckTarget", "SenderChecked",
    "SpecT", "SpecTable", "TickAt", "TransferEnded", "TransferSettled", "TransferWatcher",
]  # fmt: skip
