"""The send machine's sources, events and actions (`kvduplex.kvflow.machines.send`)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kvduplex.common.sampling import TokenLogprobs
from kvduplex.kvflow.machines.actions import AcquireBlocks
from kvduplex.kvflow.machines.actions import Log
from kvduplex.kvflow.machines.actions import ReleaseBlocks
from kvduplex.kvflow.machines.actions import TearDown
from kvduplex.kvflow.machines.actions import Tell
from kvduplex.kvflow.messages import KVRegister

# ---- sources ----


@dataclass(frozen=True)
class PrefillProgress:
    """Where the prefill of a push stands when its registration is applied."""

    num_computed_tokens: int
    block_ids: Sequence[int]
    """The request's blocks, in token order."""
    layer: int | None = None
    """The last layer whose WRITEs the running forward posted, when applied between two
    layers (None between steps, or in a forward before its first layer's WRITEs: a
    layer hook waiting for a loaded prefix)."""


@dataclass(frozen=True)
class PrefillSource:
    """Push: the KV of prefill request ``xid``, computed layer by layer."""

    num_layers: int
    streams: bool = True


@dataclass(frozen=True)
class HeldSource:
    """Return: KV already computed in ``block_ids``, referenced for the whole transfer."""

    block_ids: tuple[int, ...]
    streams: bool = False


Source = PrefillSource | HeldSource


# ---- events ----


@dataclass(frozen=True)
class Begin:
    """The transfer was created (before it is visible to anyone)."""

    now: float


@dataclass(frozen=True)
class Registered:
    """A `KVRegister` for this transfer from ``sender``, received at ``received_at``."""

    msg: KVRegister
    sender: str
    received_at: float
    now: float
    progress: PrefillProgress | None = None
    """Push: the prefill's progress (None: it has not started)."""


@dataclass(frozen=True)
class StepPlanned:
    """Push: the next forward computes tokens [start, end) of the prefill."""

    start: int
    end: int
    block_ids: Sequence[int]


@dataclass(frozen=True)
class LayerDone:
    """Push: the running forward finished ``layer``."""

    layer: int
    now: float


@dataclass(frozen=True)
class StepEnded:
    """Push: the forward ended (every layer's WRITEs of its chunk are posted)."""


@dataclass(frozen=True)
class FirstToken:
    """Push: the prefill sampled its first token."""

    token: int
    num_cached_tokens: int
    now: float
    logprobs: TokenLogprobs | None = None
    """The token's logprobs, when the request asked for them (they go with KVDone)."""


@dataclass(frozen=True)
class WriteEnded:
    """WRITE ``write_id`` is final (DONE or FAILED); a failed one may still land."""

    write_id: int
    ok: bool
    may_still_land: bool
    reason: str | None
    now: float


@dataclass(frozen=True)
class WriteSettled:
    """Nothing of WRITE ``write_id`` can land any more (it came after `WriteEnded`)."""

    write_id: int
    ok: bool
    num_bytes: int
    now: float


@dataclass(frozen=True)
class Cancelled:
    """Stop the transfer (``by``: the engine id of the receiver that asked, if one did)."""

    reason: str
    by: str | None = None


@dataclass(frozen=True)
class Reclaimed:
    """Push: prefill's pool needs the blocks its finished prefill holds for a receiver that
    has not registered (the receiver queues the request for room): give the transfer up;
    the receiver hears KVFailed with the first token and computes the prompt itself."""

    reason: str


@dataclass(frozen=True)
class Declined:
    """Return: the receiver takes nothing (ignored once registered)."""

    reason: str


@dataclass(frozen=True)
class PrefillAborted:
    """Push: the prefill request was aborted, or its computed KV cannot be trusted (a
    loaded prefix did not land): nothing more is written."""

    reason: str = "the prefill request was aborted"


@dataclass(frozen=True)
class Waiting:
    """The receiver's `KVWaiting`: it will register, keep waiting ``wait_s`` more."""

    sender: str
    wait_s: float
    now: float


@dataclass(frozen=True)
class AliveAck:
    """The receiver's `KVAliveAck` of our heartbeat sent at ``sent_at``."""

    sender: str
    sent_at: float
    now: float


@dataclass(frozen=True)
class Tick:
    """The clock moved (heartbeats, teardowns, deadlines); ``healthy``: our engine runs."""

    now: float
    healthy: bool


SendEvent = (
    Begin | Registered | StepPlanned | LayerDone | StepEnded | FirstToken | WriteEnded
    | WriteSettled | Cancelled | Reclaimed | Declined | PrefillAborted | Waiting | AliveAck
    | Tick
)  # fmt: skip


# ---- actions (besides the shared ones) ----


@dataclass(frozen=True)
class PostWrite:
    """Post one WRITE of ``src`` into the peer's ``dst`` (``layers``: None for all);
    its end and settling come back as `WriteEnded` and `WriteSettled` with ``write_id``."""

    write_id: int
    src: tuple[int, ...]
    dst: tuple[int, ...]
    layers: tuple[int, ...] | None
    deadline_s: float


@dataclass(frozen=True)
class Refuse:
    """Tell engine ``engine_id`` (KVFailed) that nothing will be written for its registration."""

    engine_id: str
    problem: str


@dataclass(frozen=True)
class AbortPrefill:
    """Push: the prefill request ``xid`` stops if it is still running (the adapter
    reports it to the engine's next step)."""


@dataclass(frozen=True)
class ReleasePrefill:
    """Push, once forgotten: the prefill's held blocks are freed, or it stops if
    unfinished (the adapter reports it to the engine's next step)."""


@dataclass(frozen=True)
class Tombstone:
    """Remember ``xid`` as cancelled for a while: a late registration is refused."""


@dataclass(frozen=True)
class Ended:
    """The transfer ended (``ok``: DONE): the adapter forgets it once the actions that
    follow (the source's release) are carried out."""

    ok: bool


class SendCounter(enum.Enum):
    """The sender's statistics a machine counts (`KVSenderStats.count`)."""

    LATE_REGISTRATIONS = "num_late_registrations"
    WRITES = "num_writes"
    TEARDOWNS = "num_teardowns"
    ALIVE_SENT = "num_alive_sent"
    WAITING_RECEIVED = "num_waiting_received"
    PROMPT_MISMATCHES = "num_prompt_mismatches"
    RECLAIMED = "num_reclaimed"


@dataclass(frozen=True)
class Count:
    """Add one to the sender's statistic ``counter``."""

    counter: SendCounter


SendAction = (
    PostWrite | Tell | Refuse | AcquireBlocks | ReleaseBlocks | TearDown | AbortPrefill
    | ReleasePrefill | Tombstone | Ended | Count | Log
)  # fmt: skip


__all__ = [
    "AbortPrefill",
    "AliveAck",
    "Begin",
    "Cancelled",
    "Count",
    "Declined",
    "Ended",
    "FirstToken",
    "HeldSource",
    "LayerDone",
    "PostWrite",
    "PrefillAborted",
    "PrefillProgress",
    "PrefillSource",
    "Reclaimed",
    "Refuse",
    "Registered",
    "ReleasePrefill",
    "SendAction",
    "SendCounter",
    "SendEvent",
    "Source",
    "StepEnded",
    "StepPlanned",
    "Tick",
    "Tombstone",
    "Waiting",
    "WriteEnded",
    "WriteSettled",
]
