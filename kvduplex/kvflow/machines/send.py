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

This module applies the events (registration, the receiver's messages,
cancels, deadlines, heartbeats and teardowns); the transfer's state, which
blocks each WRITE carries and how the transfer ends are its base's,
`kvduplex.kvflow.machines.send_stream.SendStream`; the sources, events and
actions are in `send_events`.
"""

from __future__ import annotations

import logging
from typing import assert_never

from kvduplex.kvflow.machines.actions import AcquireBlocks
from kvduplex.kvflow.machines.actions import Log
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
from kvduplex.kvflow.machines.send_events import Reclaimed
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
from kvduplex.kvflow.machines.send_stream import TRANSITIONS
from kvduplex.kvflow.machines.send_stream import Chunk
from kvduplex.kvflow.machines.send_stream import SendPhase
from kvduplex.kvflow.machines.send_stream import SendStream
from kvduplex.kvflow.messages import KVAlive
from kvduplex.kvflow.messages import KVRegister
from kvduplex.kvflow.messages import KVRegistered

HEARTBEATS_PER_WAIT = 3
"""`KVAlive` messages per wait period: a lost one or two do not end the wait."""


class SendMachine(SendStream):
    """One transfer ``xid`` of ``num_blocks`` blocks to ``peer``: applies its events
    (its state, WRITE stream and end are `SendStream`'s). Not thread-safe: the adapter
    serialises its events."""

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
            case Reclaimed():
                return self._reclaimed(event)
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

    def _reclaimed(self, event: Reclaimed) -> list[SendAction]:
        """Give up a finished push that the receiver has not registered, so that prefill's
        pool gets its blocks back; a registration or a WRITE under way keeps it."""
        if self.reg is not None or self.ended or self.error is not None:
            return []
        if not self.source.streams or self.first_token is None or self.in_flight > 0:
            return []
        # The receiver queues a request for this transfer: it must hear the end (KVFailed,
        # with the first token the client may have) to compute the prompt from that token.
        self.confirm_end = True
        return [
            Count(SendCounter.RECLAIMED),
            Log(logging.INFO, f"{event.reason}; decode computes the prompt"),
            *self._fail(event.reason),
        ]

    def _prefill_aborted(self, event: PrefillAborted) -> list[SendAction]:
        if self.ended or self.error is not None:
            return []
        return [
            Log(logging.INFO, f"{event.reason}; cancelling its push"),
            *self._fail(event.reason),
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
                *self._note_mismatch(msg),
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

    def _check_registration(self, msg: KVRegister) -> str | None:
        """Why our own receiver's registration cannot be served, or None."""
        if msg.num_tokens != self.num_tokens:
            return f"the receiver has {msg.num_tokens} tokens, the sender {self.num_tokens}"
        if msg.ids_digest != self.ids_digest:
            return (
                f"the receiver's {msg.num_tokens} token ids are not the sender's (ids digest "
                f"{msg.ids_digest.hex()[:16]} there, {self.ids_digest.hex()[:16]} here)"
            )
        if not 0 <= msg.first_block <= self.num_blocks or (
            msg.first_block + len(msg.block_ids) != self.num_blocks
        ):
            return (
                f"the receiver registered blocks {msg.first_block}..+{len(msg.block_ids)} "
                f"of a {self.num_blocks}-block transfer"
            )
        return None

    def _note_mismatch(self, msg: KVRegister) -> list[SendAction]:
        """A registration of as many tokens as ours but other ids (another prompt under
        this xid): counted and logged apart, since it points at a bug or a stranger, not
        at a race. Nothing is written: the receiver computes its prompt itself."""
        if msg.num_tokens != self.num_tokens or msg.ids_digest == self.ids_digest:
            return []
        return [
            Count(SendCounter.PROMPT_MISMATCHES),
            Log(logging.WARNING, "registration names other token ids than ours; refused"),
        ]

    def _on_cancelled(self, event: Cancelled) -> list[SendAction]:
        if event.by is not None and event.by == self.peer.engine_id:
            self.confirm_end = True
        out: list[SendAction] = []
        if self.source.streams:
            out.append(AbortPrefill())
        return out + self._fail(event.reason)

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


__all__ = [
    "HEARTBEATS_PER_WAIT", "TRANSITIONS", "AbortPrefill", "AliveAck", "Begin", "Cancelled",
    "Chunk", "Count", "Declined", "Ended", "FirstToken", "HeldSource", "LayerDone", "PostWrite",
    "PrefillAborted", "PrefillProgress", "PrefillSource", "Reclaimed", "Refuse", "Registered",
    "ReleasePrefill", "SendAction", "SendCounter", "SendEvent", "SendMachine", "SendPhase",
    "Source", "StepEnded", "StepPlanned", "Tick", "Tombstone", "Waiting", "WriteEnded",
    "WriteSettled",
]  # fmt: skip
