"""The sending machine: one transfer this instance WRITEs into a peer's blocks.

Push and return are one machine; what differs is its *source*:

* `PrefillSource` (push): the KV of a prefill computing layer by layer. Its
  blocks fill as the prefill runs; each step's finished blocks are planned
  (`StepPlanned`), WRITTEN layer by layer (`LayerDone`), and the transfer ends
  once the first token is sampled (`FirstToken`).
* `HeldSource` (return): KV already in blocks, referenced from the start to
  the end of the transfer and WRITTEN all at once when the registration
  arrives.

States (``phase``, moved only along `TRANSITIONS`) and what moves them::

                 Registered (ok)                   every WRITE settled, all sent
    WAITING ───────────────────────► REGISTERED ──────────────────────────► DONE
       │                                 │  (push: and the first token)
       │ Cancelled / Declined / a tick   │ WRITE failed / Cancelled / a tick past
       │ past the deadline / refused     │ the deadline / PrefillAborted / a post
       ▼                                 ▼ past the deadline
    FAILED ◄─── last WRITE settled ─── FAILING (no WRITE posted any more; the
                                                ones posted *may still land*)

Actions out: `PostWrite`, `Tell` (KVRegistered, KVAlive, and KVDone/KVFailed
once the transfer ended), `Refuse` (a registration nothing will be written
into), `AcquireBlocks`/`ReleaseBlocks` (source references: a chunk's from
its planning until its last WRITE is settled), `TearDown` (a failed WRITE
still unsettled ``deadline_s`` later, and again, backing off, while it stays so:
NIXL may refuse a teardown), `AbortPrefill`, and `Ended` followed by
the source's own release (`ReleaseBlocks` of a held source, `ReleasePrefill`).

The invariant (tested with hypothesis): every source block of a WRITE that is
not settled is referenced by the machine, and the end message (which lets
the receiver reuse its blocks) goes out only once no WRITE can land.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import assert_never

from kvduplex.common.sampling import TokenLogprobs
from kvduplex.kvflow.machines.actions import AcquireBlocks
from kvduplex.kvflow.machines.actions import Log
from kvduplex.kvflow.machines.actions import ReleaseBlocks
from kvduplex.kvflow.machines.actions import TearDown
from kvduplex.kvflow.machines.actions import Tell
from kvduplex.kvflow.machines.actions import teardown_retry_s
from kvduplex.kvflow.machines.send_events import AbortPrefill
from kvduplex.kvflow.machines.send_events import AliveAck
from kvduplex.kvflow.machines.send_events import Begin
from kvduplex.kvflow.machines.send_events import Cancelled
from kvduplex.kvflow.machines.send_events import Count
from kvduplex.kvflow.machines.send_events import Declined
from kvduplex.kvflow.machines.send_events import Ended
from kvduplex.kvflow.machines.send_events import FirstToken
from kvduplex.kvflow.machines.send_events import HeldSource
from kvduplex.kvflow.machines.send_events import LayerDone
from kvduplex.kvflow.machines.send_events import PostWrite
from kvduplex.kvflow.machines.send_events import PrefillAborted
from kvduplex.kvflow.machines.send_events import PrefillProgress
from kvduplex.kvflow.machines.send_events import PrefillSource
from kvduplex.kvflow.machines.send_events import Refuse
from kvduplex.kvflow.machines.send_events import Registered
from kvduplex.kvflow.machines.send_events import ReleasePrefill
from kvduplex.kvflow.machines.send_events import SendAction
from kvduplex.kvflow.machines.send_events import SendCounter
from kvduplex.kvflow.machines.send_events import SendEvent
from kvduplex.kvflow.machines.send_events import Source
from kvduplex.kvflow.machines.send_events import StepEnded
from kvduplex.kvflow.machines.send_events import StepPlanned
from kvduplex.kvflow.machines.send_events import Tick
from kvduplex.kvflow.machines.send_events import Tombstone
from kvduplex.kvflow.machines.send_events import Waiting
from kvduplex.kvflow.machines.send_events import WriteEnded
from kvduplex.kvflow.machines.send_events import WriteSettled
from kvduplex.kvflow.messages import KVAlive
from kvduplex.kvflow.messages import KVDone
from kvduplex.kvflow.messages import KVFailed
from kvduplex.kvflow.messages import KVRegister
from kvduplex.kvflow.messages import KVRegistered
from kvduplex.transport.messages import ControlMessage
from kvduplex.transport.protocol import PeerHandle

HEARTBEATS_PER_WAIT = 3
"""`KVAlive` messages per wait period: a lost one or two do not end the wait."""


class SendPhase(enum.Enum):
    WAITING = "waiting"
    """No registration yet."""
    REGISTERED = "registered"
    FAILING = "failing"
    """Failed; WRITEs posted before may still land (their sources stay referenced)."""
    DONE = "done"
    FAILED = "failed"
    """Failed, and nothing of the transfer can land any more."""


TRANSITIONS: dict[SendPhase, frozenset[SendPhase]] = {
    SendPhase.WAITING: frozenset({SendPhase.REGISTERED, SendPhase.FAILING}),
    SendPhase.REGISTERED: frozenset({SendPhase.DONE, SendPhase.FAILING}),
    SendPhase.FAILING: frozenset({SendPhase.FAILED}),
    SendPhase.DONE: frozenset(),
    SendPhase.FAILED: frozenset(),
}
"""The phases each phase may move to (`SendMachine._move` checks every move)."""


@dataclass
class Chunk:
    """Blocks one step (or one catch-up) WRITEs, layer by layer or at once."""

    src: tuple[int, ...]
    dst: tuple[int, ...]
    hi: int
    """Transfer blocks [0, hi) are sent once this chunk's WRITEs are posted."""
    num_pending: int
    """WRITEs of this chunk not settled (or skipped) yet; the last drops the source refs."""
    from_layer: int = 0
    """First layer `LayerDone` still WRITEs (a registration mid-forward did the rest)."""


@dataclass
class SendMachine:
    """One transfer ``xid`` of ``num_blocks`` blocks to ``peer``. Not thread-safe: the
    adapter serialises its events. The fields are read by the adapter (accounting,
    introspection), written only by `handle`."""

    xid: str
    peer: PeerHandle
    num_tokens: int
    num_blocks: int
    block_size: int
    deadline_s: float
    """One WRITE's deadline; also how long a failed WRITE may stay unsettled."""
    source: Source
    expires_at: float
    """Registration deadline (until registered; `Waiting` moves it on), then the
    receiver's own deadline (moved on by each acknowledged heartbeat)."""
    reg: KVRegister | None = None
    sent: int = 0
    """Blocks [0, sent) are written (or posted, or the receiver has them)."""
    in_flight: int = 0
    """WRITEs posted and not settled."""
    error: str | None = None
    """Why the transfer failed (set with the move to FAILING)."""
    phase: SendPhase = SendPhase.WAITING
    declined: bool = False
    """The receiver took nothing (a return offer it did not need or had no room for)."""
    confirm_end: bool = False
    """The receiver cancelled: it hears how the transfer ended even if it never registered."""
    first_token: int | None = None
    first_token_logprobs: TokenLogprobs | None = None
    num_cached_tokens: int = 0
    """Prompt tokens the prefill served from its own prefix cache."""
    num_bytes: int = 0
    alive_sent_at: float = 0.0
    unsettled_since: float | None = None
    """When a WRITE first failed while its data could still land."""
    num_teardowns: int = 0
    """Teardowns asked for a failed WRITE that stays unsettled (tried again, backing off)."""
    torn_down_at: float = 0.0
    compute_done_at: float | None = None
    first_post_at: float | None = None
    last_done_at: float | None = None
    step: tuple[int, int] | None = None
    """Push: tokens [start, end) the running forward computes."""
    chunk: Chunk | None = None
    """Push: the running forward's WRITE plan."""
    writes: dict[int, Chunk] = field(default_factory=dict)
    """Posted WRITEs not settled, by write id."""
    next_write_id: int = 0
    on_end: list[Callable[[SendMachine], None]] = field(default_factory=list)
    """The adapter's callbacks once the transfer ended (the machine never calls them)."""

    @property
    def ended(self) -> bool:
        return self.phase in (SendPhase.DONE, SendPhase.FAILED)

    def _move(self, to: SendPhase) -> None:
        assert to in TRANSITIONS[self.phase], f"xid={self.xid}: {self.phase} -> {to}"
        self.phase = to

    def _set_error(self, reason: str) -> None:
        """The transfer failed: nothing is posted from now on (FAILING)."""
        if self.error is None and not self.ended:
            self.error = reason
            self._move(SendPhase.FAILING)

    # ---- events ----

    def handle(self, event: SendEvent) -> list[SendAction]:
        """Apply ``event``; the actions to carry out, in order."""
        match event:
            case Begin():
                return self._begin(event)
            case Tick():
                return self._on_tick(event)
            case WriteEnded():
                return self._write_ended(event)
            case WriteSettled():
                return self._write_settled(event)
            case StepPlanned() | LayerDone() | StepEnded() | FirstToken() | PrefillAborted():
                return self._on_prefill(event)
            case Registered() | Waiting() | AliveAck() | Cancelled() | Declined():
                return self._on_receiver(event)
            case _:
                assert_never(event)

    def _on_prefill(
        self, event: StepPlanned | LayerDone | StepEnded | FirstToken | PrefillAborted
    ) -> list[SendAction]:
        """What the prefill (push) or its request did."""
        match event:
            case StepPlanned():
                return self._step_planned(event)
            case LayerDone():
                return self._layer_done(event)
            case StepEnded():
                return self._step_ended(event)
            case FirstToken():
                return self._first_token(event)
            case PrefillAborted():
                return self._prefill_aborted(event)
            case _:
                assert_never(event)

    def _on_receiver(
        self, event: Registered | Waiting | AliveAck | Cancelled | Declined
    ) -> list[SendAction]:
        """What the receiver (or whoever cancels) said."""
        match event:
            case Registered():
                return self._on_registered(event)
            case Waiting():
                return self._waiting(event)
            case AliveAck():
                return self._alive_ack(event)
            case Cancelled():
                return self._on_cancelled(event)
            case Declined():
                return self._declined(event)
            case _:
                assert_never(event)

    def _layer_done(self, event: LayerDone) -> list[SendAction]:
        if self.chunk is not None and self.chunk.from_layer <= event.layer:
            return self._post(self.chunk, (event.layer,), event.now)
        return []

    def _step_ended(self, event: StepEnded) -> list[SendAction]:
        if self.chunk is not None:
            self.sent = self.chunk.hi
        self.chunk = None
        self.step = None
        return []

    def _first_token(self, event: FirstToken) -> list[SendAction]:
        if not self.source.streams:
            return []
        self.first_token = event.token
        self.first_token_logprobs = event.logprobs
        self.num_cached_tokens = event.num_cached_tokens
        self.compute_done_at = event.now
        return self._maybe_end(event.now)

    def _write_ended(self, event: WriteEnded) -> list[SendAction]:
        if not event.ok:
            self._set_error(f"WRITE failed: {event.reason}")
            if event.may_still_land and self.unsettled_since is None:
                self.unsettled_since = event.now
        return []

    def _declined(self, event: Declined) -> list[SendAction]:
        if self.reg is not None:
            return []
        self.declined = True
        return self._fail(event.reason, notify=False)

    def _prefill_aborted(self, event: PrefillAborted) -> list[SendAction]:
        if self.ended or self.error is not None:
            return []
        return [
            Log(logging.INFO, "prefill request aborted; cancelling its push"),
            *self._fail("the prefill request was aborted"),
        ]

    def _waiting(self, event: Waiting) -> list[SendAction]:
        if self.reg is None and not self.ended and event.sender == self.peer.engine_id:
            self.expires_at = max(self.expires_at, event.now + event.wait_s)
            return [Count(SendCounter.WAITING_RECEIVED)]
        return []

    def _alive_ack(self, event: AliveAck) -> list[SendAction]:
        # The receiver restarted its wait when our heartbeat arrived, so its deadline
        # is at least sent_at + its wait (sent_at: our clock, never trusted past now).
        if self.reg is not None and not self.ended and event.sender == self.peer.engine_id:
            sent_at = min(event.sent_at, event.now)
            self.expires_at = max(self.expires_at, sent_at + self.reg.wait_s)
        return []

    def _begin(self, event: Begin) -> list[SendAction]:
        if isinstance(self.source, HeldSource):
            self.compute_done_at = event.now
            return [AcquireBlocks(self.source.block_ids)]
        return []

    def _on_registered(self, event: Registered) -> list[SendAction]:
        msg, now = event.msg, event.now
        if event.sender != self.peer.engine_id:
            # Refused to its sender; the transfer waits on for its own receiver's.
            wrong = f"sent by {event.sender}, but the transfer goes to {self.peer.engine_id}"
            return [Refuse(event.sender, wrong)]
        if self.reg is not None:
            if self.ended:
                return []
            return [
                Log(logging.INFO, "duplicate registration; acknowledged again"),
                Tell(KVRegistered(self.xid)),
            ]
        if self.ended:
            return [Refuse(self.peer.engine_id, f"the transfer already ended: {self.error}")]
        problem = self._check_registration(msg)
        left = min(msg.wait_s, msg.time_left_s) - (now - event.received_at)
        if problem is None and not left > 0:  # NaN too
            problem = "it arrived after the receiver stopped waiting"
        if problem is not None:
            return [
                Refuse(self.peer.engine_id, problem),
                *self._fail(f"registration refused: {problem}"),
            ]
        self.reg = msg
        self._move(SendPhase.REGISTERED)
        self.expires_at = now + left
        self.alive_sent_at = now
        self.sent = msg.first_block
        out: list[SendAction] = [Tell(KVRegistered(self.xid))]
        if isinstance(self.source, HeldSource):
            out += self._catch_up(self.num_blocks, self.source.block_ids, now)
        elif event.progress is not None:
            out += self._catch_up_prefill(event.progress, now)
        return out + self._maybe_end(now)

    def _catch_up_prefill(self, progress: PrefillProgress, now: float) -> list[SendAction]:
        """Registration after the prefill began: WRITE what it computed at once; between
        two layers of a forward, this chunk's finished layers at once, the rest as they end."""
        assert isinstance(self.source, PrefillSource)
        if self.step is None or progress.layer is None:
            hi = self._blocks_done(progress.num_computed_tokens)
            return self._catch_up(hi, progress.block_ids, now)
        start, end = self.step
        out = self._catch_up(self._blocks_done(start), progress.block_ids, now)
        hi = self._blocks_done(end)
        if hi > self.sent:
            layer = progress.layer
            chunk = self._plan(hi, progress.block_ids, self.source.num_layers - layer)
            chunk.from_layer = layer + 1
            self.chunk = chunk
            out += [AcquireBlocks(chunk.src)]
            out += self._post(chunk, tuple(range(layer + 1)), now)
        return out

    def _check_registration(self, msg: KVRegister) -> str | None:
        """Why our own receiver's registration cannot be served, or None."""
        if msg.num_tokens != self.num_tokens:
            return f"the receiver has {msg.num_tokens} tokens, the sender {self.num_tokens}"
        if not 0 <= msg.first_block <= self.num_blocks or (
            msg.first_block + len(msg.block_ids) != self.num_blocks
        ):
            return (
                f"the receiver registered blocks {msg.first_block}..+{len(msg.block_ids)} "
                f"of a {self.num_blocks}-block transfer"
            )
        return None

    def _blocks_done(self, num_computed: int) -> int:
        """Transfer blocks whose every token is computed once ``num_computed`` tokens are."""
        if num_computed >= self.num_tokens:
            return self.num_blocks
        return num_computed // self.block_size

    def _plan(self, hi: int, block_ids: Sequence[int], num_pending: int) -> Chunk:
        """A chunk of blocks [sent, hi); the caller acquires its sources."""
        assert self.reg is not None
        lo, first = self.sent, self.reg.first_block
        return Chunk(
            src=tuple(block_ids[lo:hi]), dst=tuple(self.reg.block_ids[lo - first : hi - first]),
            hi=hi, num_pending=num_pending,
        )  # fmt: skip

    def _catch_up(self, hi: int, block_ids: Sequence[int], now: float) -> list[SendAction]:
        """WRITE blocks [sent, hi), every layer, in one transfer."""
        if hi <= self.sent:
            return []
        chunk = self._plan(hi, block_ids, 1)
        self.sent = hi
        out: list[SendAction] = []
        if self.source.streams:
            out.append(Count(SendCounter.LATE_REGISTRATIONS))
        out.append(AcquireBlocks(chunk.src))
        return out + self._post(chunk, None, now)

    def _step_planned(self, event: StepPlanned) -> list[SendAction]:
        if not isinstance(self.source, PrefillSource) or self.error is not None:
            return []
        self.step = (event.start, event.end)
        self.chunk = None
        if self.reg is None:
            return []
        hi = self._blocks_done(event.end)
        if hi <= self.sent:
            return []
        self.chunk = self._plan(hi, event.block_ids, self.source.num_layers)
        return [AcquireBlocks(self.chunk.src)]

    # ---- posting and settling ----

    def _post(self, chunk: Chunk, layers: tuple[int, ...] | None, now: float) -> list[SendAction]:
        out: list[SendAction] = []
        if self.error is None and now >= self.expires_at:
            out += self._fail("the receiver's wait ran out")  # never WRITE after its deadline
        if self.error is not None:
            return out + self._chunk_part_done(chunk)
        self.in_flight += 1
        if self.first_post_at is None:
            self.first_post_at = now
        write_id = self.next_write_id
        self.next_write_id += 1
        self.writes[write_id] = chunk
        deadline = min(self.deadline_s, max(0.001, self.expires_at - now))
        return [*out, PostWrite(write_id, chunk.src, chunk.dst, layers, deadline)]

    def _write_settled(self, event: WriteSettled) -> list[SendAction]:
        chunk = self.writes.pop(event.write_id)
        self.in_flight -= 1
        self.last_done_at = event.now
        out: list[SendAction] = []
        if event.ok:
            self.num_bytes += event.num_bytes
            out.append(Count(SendCounter.WRITES))
        out += self._chunk_part_done(chunk)
        return out + self._maybe_end(event.now)

    def _chunk_part_done(self, chunk: Chunk) -> list[SendAction]:
        """One of the chunk's WRITEs settled (or was skipped); the last drops its sources."""
        chunk.num_pending -= 1
        if chunk.num_pending <= 0 and chunk.src:
            return [ReleaseBlocks(chunk.src)]
        return []

    # ---- ending ----

    def _on_cancelled(self, event: Cancelled) -> list[SendAction]:
        if event.by is not None and event.by == self.peer.engine_id:
            self.confirm_end = True
        out: list[SendAction] = []
        if self.source.streams:
            out.append(AbortPrefill())
        return out + self._fail(event.reason)

    def _fail(self, reason: str, *, notify: bool = True) -> list[SendAction]:
        if self.ended:  # a late cancel does not turn a transfer that ended DONE into FAILED
            return []
        self._set_error(reason)
        return self._maybe_end(None, notify=notify)

    def _maybe_end(self, now: float | None, *, notify: bool = True) -> list[SendAction]:
        """End once nothing is in flight: KVDone when all is sent (and, for a push, the
        first token is known), KVFailed after a failure (nothing can land any more)."""
        if self.ended or self.in_flight > 0:
            return []
        if self.error is None and (
            self.reg is None
            or self.sent < self.num_blocks
            or (self.source.streams and self.first_token is None)
        ):
            return []
        self._move(SendPhase.DONE if self.error is None else SendPhase.FAILED)
        out: list[SendAction] = []
        if (self.reg is not None or self.confirm_end) and notify:
            msg: ControlMessage
            if self.error is None:
                msg = KVDone(
                    self.xid, self.num_tokens, self.first_token, self.num_cached_tokens,
                    self.first_token_logprobs,
                )  # fmt: skip
            else:
                msg = KVFailed(self.xid, self.error, self.first_token)
            out.append(Tell(msg))
        out.append(Ended(self.error is None))
        if isinstance(self.source, HeldSource):  # what the source holds goes last
            return [*out, ReleaseBlocks(self.source.block_ids)]
        return [*out, ReleasePrefill()]

    def _on_tick(self, event: Tick) -> list[SendAction]:
        now = event.now
        out: list[SendAction] = []
        if (
            self.unsettled_since is not None and self.num_teardowns == 0 and self.in_flight > 0
            and now - self.unsettled_since > self.deadline_s
        ):  # fmt: skip
            # NIXL has not let go of a failed WRITE: tearing the endpoint down is what
            # guarantees that it cannot land; the next transfer to the peer reconnects.
            self.num_teardowns, self.torn_down_at = 1, now
            out += [
                Count(SendCounter.TEARDOWNS),
                TearDown(f"a failed WRITE is still unsettled after {self.deadline_s:g} s"),
            ]
        elif (
            self.num_teardowns > 0 and self.in_flight > 0
            and now - self.torn_down_at >= teardown_retry_s(self.num_teardowns)
        ):  # fmt: skip
            # Still unsettled: NIXL refused the teardown (or it is still under way); ask
            # again, backing off, or the job never settles and its blocks stay held.
            waited = now - self.torn_down_at
            self.num_teardowns += 1
            self.torn_down_at = now
            out.append(TearDown(f"a failed WRITE is still unsettled {waited:g} s after "
                                f"its endpoint's teardown; trying it again"))  # fmt: skip
        reg = self.reg
        if (
            event.healthy and reg is not None and not self.ended and self.error is None
            and now - self.alive_sent_at >= reg.wait_s / HEARTBEATS_PER_WAIT
        ):  # fmt: skip
            self.alive_sent_at = now
            out += [Count(SendCounter.ALIVE_SENT), Tell(KVAlive(self.xid, now))]
        if not self.ended and now > self.expires_at:
            out += self._expire()
        return out

    def _expire(self) -> list[SendAction]:
        """The deadline passed: a registration that never came, or the receiver's wait."""
        what = (
            "no registration from the receiver"
            if self.reg is None
            else ("the receiver's wait ran out")
        )
        out: list[SendAction] = [Log(logging.WARNING, f"{what}; dropping the transfer")]
        if self.reg is None:
            out.append(Tombstone())
        return out + self._on_cancelled(Cancelled(what))

    def write_sources(self) -> dict[int, tuple[int, ...]]:
        """The source blocks of each WRITE that may still land (introspection, tests)."""
        return {wid: chunk.src for wid, chunk in self.writes.items()}


__all__ = [
    "HEARTBEATS_PER_WAIT", "TRANSITIONS", "AbortPrefill", "AliveAck", "Begin", "Cancelled",
    "Chunk", "Count", "Declined", "Ended", "FirstToken", "HeldSource", "LayerDone", "PostWrite",
    "PrefillAborted", "PrefillProgress", "PrefillSource", "Refuse", "Registered",
    "ReleasePrefill", "SendAction", "SendCounter", "SendEvent", "SendMachine", "SendPhase", "StepEnded",
    "StepPlanned", "Tick", "Tombstone", "Waiting", "WriteEnded", "WriteSettled",
]  # fmt: skip
