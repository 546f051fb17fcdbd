"""A send transfer's state, the WRITEs it streams, and its end (`SendStream`, the base
of `kvduplex.kvflow.machines.send.SendMachine`, which applies the events).

Which blocks each WRITE carries::

    transfer blocks  [ 0 .. first_block | .. sent | chunk: sent .. hi | .. num_blocks )
                       receiver has them  posted   planned for this    later
                                                   step (or at once)

A chunk's source blocks are referenced from its planning until its last WRITE
is settled (`Chunk.num_pending`); a WRITE is never posted after a failure or
past the receiver's deadline. The transfer ends only once no WRITE is in
flight: KVDone when every block is sent (and, for a push, the first token is
known), KVFailed after a failure, since nothing can land any more.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import TYPE_CHECKING

from kvduplex.common.sampling import TokenLogprobs
from kvduplex.kvflow.machines.actions import AcquireBlocks
from kvduplex.kvflow.machines.actions import ReleaseBlocks
from kvduplex.kvflow.machines.actions import Tell
from kvduplex.kvflow.machines.send_events import Count
from kvduplex.kvflow.machines.send_events import Ended
from kvduplex.kvflow.machines.send_events import HeldSource
from kvduplex.kvflow.machines.send_events import LayerDone
from kvduplex.kvflow.machines.send_events import PostWrite
from kvduplex.kvflow.machines.send_events import PrefillProgress
from kvduplex.kvflow.machines.send_events import PrefillSource
from kvduplex.kvflow.machines.send_events import ReleasePrefill
from kvduplex.kvflow.machines.send_events import SendAction
from kvduplex.kvflow.machines.send_events import SendCounter
from kvduplex.kvflow.machines.send_events import Source
from kvduplex.kvflow.machines.send_events import StepEnded
from kvduplex.kvflow.machines.send_events import StepPlanned
from kvduplex.kvflow.machines.send_events import WriteSettled
from kvduplex.kvflow.messages import KVDone
from kvduplex.kvflow.messages import KVFailed
from kvduplex.kvflow.messages import KVRegister
from kvduplex.transport.messages import ControlMessage
from kvduplex.transport.protocol import PeerHandle

if TYPE_CHECKING:
    from kvduplex.kvflow.machines.send import SendMachine


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
"""The phases each phase may move to (`SendStream._move` checks every move)."""


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
class SendStream:
    """One transfer ``xid`` of ``num_blocks`` blocks to ``peer``: its state, its WRITE
    plan and its end. Not thread-safe: the adapter serialises its events. The fields
    are read by the adapter (accounting, introspection), written only by
    `SendMachine.handle`."""

    xid: str
    peer: PeerHandle
    num_tokens: int
    ids_digest: bytes
    """`ids_digest` of the token ids whose KV it sends: a registration must name the same."""
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
    """The receiver hears how the transfer ended even if it never registered: it cancelled,
    or it queues a request for this transfer, which the sender gave up (`Reclaimed`)."""
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

    # ---- the WRITE stream ----

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

    def _catch_up_prefill(self, progress: PrefillProgress, now: float) -> list[SendAction]:
        """Registration after the prefill began: WRITE what it computed at once. In a
        planned step (its forward running), the step's chunk is planned as well: the
        layers whose WRITEs were due already at once, the rest as they end. The step may
        not have posted any layer yet (``progress.layer`` None: a layer's hook waiting
        for a loaded prefix before layer 0's WRITEs); its chunk is then WRITTEN from
        layer 0 on, as if the registration had come before the step."""
        assert isinstance(self.source, PrefillSource)
        if self.step is None:
            hi = self._blocks_done(progress.num_computed_tokens)
            return self._catch_up(hi, progress.block_ids, now)
        start, end = self.step
        out = self._catch_up(self._blocks_done(start), progress.block_ids, now)
        hi = self._blocks_done(end)
        if hi > self.sent:
            done = 0 if progress.layer is None else progress.layer + 1
            # One WRITE of layers [0, done) now (if any), then one per later layer.
            num_pending = self.source.num_layers - done + (1 if done else 0)
            chunk = self._plan(hi, progress.block_ids, num_pending)
            chunk.from_layer = done
            self.chunk = chunk
            out += [AcquireBlocks(chunk.src)]
            if done:
                out += self._post(chunk, tuple(range(done)), now)
        return out

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

    # ---- ending ----

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

    def write_sources(self) -> dict[int, tuple[int, ...]]:
        """The source blocks of each WRITE that may still land (introspection, tests)."""
        return {wid: chunk.src for wid, chunk in self.writes.items()}


__all__ = ["TRANSITIONS", "Chunk", "SendPhase", "SendStream"]
