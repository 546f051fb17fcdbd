"""The read machine: one READ of a peer's blocks into blocks of ours (pull, retained turn).

::

    Begin: AcquireBlocks(targets) ── PostRead ──► PENDING
    PENDING ── Ended(ok) ─────────────────────► DONE: Outcome(ok) ── Settled ──► SETTLED:
                                                                    ReleaseBlocks(targets)
    PENDING ── Ended(failed, cannot land) ────► FAILED: Outcome(failed) ── Settled ──► SETTLED
    PENDING ── Ended(failed, may still land) ─► MAY_LAND: Outcome(failed, discard) and
               ArmCheck(after_s); Overdue while unsettled: TearDown and ArmCheck again
               (backing off: NIXL may refuse a teardown); Settled ──► SETTLED
    PostFailed ──────────────────────────────► SETTLED: Outcome(failed), ReleaseBlocks

Our references on the target blocks go only once nothing of the READ can
land in them (`Settled`), never merely when it failed; the outcome says
whether the flow must compute into fresh blocks (``discard``). A READ that
may still land and is still unsettled ``after_s`` after it failed has its
peer's endpoint torn down, which settles it; a teardown NIXL refused is asked
for again while the READ stays unsettled.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import assert_never

from kvduplex.kvflow.machines.actions import AcquireBlocks
from kvduplex.kvflow.machines.actions import ReleaseBlocks
from kvduplex.kvflow.machines.actions import TearDown
from kvduplex.kvflow.machines.actions import teardown_retry_s


class ReadPhase(enum.Enum):
    NEW = "new"
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    MAY_LAND = "may_land"
    """Failed, and its data may still land in the targets (they stay referenced)."""
    SETTLED = "settled"


TRANSITIONS: dict[ReadPhase, frozenset[ReadPhase]] = {
    ReadPhase.NEW: frozenset({ReadPhase.PENDING}),
    ReadPhase.PENDING: frozenset(
        {ReadPhase.DONE, ReadPhase.FAILED, ReadPhase.MAY_LAND, ReadPhase.SETTLED}
    ),
    ReadPhase.DONE: frozenset({ReadPhase.SETTLED}),
    ReadPhase.FAILED: frozenset({ReadPhase.SETTLED}),
    ReadPhase.MAY_LAND: frozenset({ReadPhase.SETTLED}),
    ReadPhase.SETTLED: frozenset(),
}
"""The phases each phase may move to (`ReadMachine._move` checks every move)."""


@dataclass(frozen=True)
class Begin:
    """Take our references on the targets, then post (``acquire``: False when the
    targets were freshly allocated for the READ, whose allocation is our reference)."""

    acquire: bool = True


@dataclass(frozen=True)
class PostFailed:
    reason: str


@dataclass(frozen=True)
class Ended:
    """The READ is final (its done callback)."""

    ok: bool
    may_still_land: bool
    reason: str | None = None


@dataclass(frozen=True)
class Settled:
    """Nothing of the READ can land any more (its settled callback)."""


@dataclass(frozen=True)
class Overdue:
    """``after_s`` passed since `ArmCheck`; ``settled``: whether the handle is settled."""

    settled: bool


ReadEvent = Begin | PostFailed | Ended | Settled | Overdue


@dataclass(frozen=True)
class PostRead:
    """Post the READ of the peer's blocks into ``targets``."""


@dataclass(frozen=True)
class Outcome:
    """Tell the flow how the READ ended: ``ok`` (the targets hold the KV, cache them or
    resume), else compute locally, into fresh blocks when ``discard``."""

    ok: bool
    discard: bool
    reason: str | None = None


@dataclass(frozen=True)
class ArmCheck:
    """Feed `Overdue` ``after_s`` from now."""

    after_s: float


ReadAction = AcquireBlocks | ReleaseBlocks | TearDown | PostRead | Outcome | ArmCheck


@dataclass
class ReadMachine:
    """One READ into ``targets``; ``after_s``: how long a failed READ may stay unsettled."""

    targets: tuple[int, ...]
    after_s: float
    phase: ReadPhase = ReadPhase.NEW
    num_teardowns: int = 0
    """Teardowns asked for a failed READ that stays unsettled (tried again, backing off)."""

    def _move(self, to: ReadPhase) -> None:
        assert to in TRANSITIONS[self.phase], f"{self.phase} -> {to}"
        self.phase = to

    def handle(self, event: ReadEvent) -> list[ReadAction]:
        """Apply ``event``; the actions to carry out, in order."""
        match event:
            case Begin(acquire):
                self._move(ReadPhase.PENDING)
                return [AcquireBlocks(self.targets), PostRead()] if acquire else [PostRead()]
            case PostFailed(reason):
                self._move(ReadPhase.SETTLED)
                return [Outcome(False, False, reason), ReleaseBlocks(self.targets)]
            case Ended():
                return self._ended(event)
            case Settled():
                if self.phase in (ReadPhase.NEW, ReadPhase.SETTLED):
                    return []
                assert self.phase is not ReadPhase.PENDING, "settled before final"
                self._move(ReadPhase.SETTLED)
                return [ReleaseBlocks(self.targets)]
            case Overdue(settled):
                if self.phase is not ReadPhase.MAY_LAND or settled:
                    return []
                # Unsettled: tear the endpoint down, and again (backing off) while it stays
                # so, since NIXL may refuse; nothing else would ask it again.
                self.num_teardowns += 1
                why = (f"a failed READ is still unsettled after {self.after_s:g} s"
                       if self.num_teardowns == 1 else
                       f"a failed READ is still unsettled after {self.num_teardowns - 1} "
                       "teardowns; trying again")  # fmt: skip
                return [TearDown(why), ArmCheck(teardown_retry_s(self.num_teardowns))]
            case _:
                assert_never(event)

    def _ended(self, event: Ended) -> list[ReadAction]:
        if self.phase is not ReadPhase.PENDING:
            return []
        if event.ok:
            self._move(ReadPhase.DONE)
            return [Outcome(True, False)]
        if not event.may_still_land:
            self._move(ReadPhase.FAILED)
            return [Outcome(False, False, event.reason)]
        self._move(ReadPhase.MAY_LAND)
        return [Outcome(False, True, event.reason), ArmCheck(self.after_s)]


__all__ = [
    "TRANSITIONS", "ArmCheck", "Begin", "Ended", "Outcome", "Overdue", "PostFailed", "PostRead", "ReadAction",
    "ReadEvent", "ReadMachine", "ReadPhase", "Settled",
]  # fmt: skip
