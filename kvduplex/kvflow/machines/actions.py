"""Actions the transfer machines share: what an adapter does for them.

An adapter performs a machine's actions in the order given, after the call
that returned them (never under the lock that serialises the machine's
events: an action may complete a transfer inline, which is a new event).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvduplex.transport.messages import ControlMessage


@dataclass(frozen=True)
class Tell:
    """Send ``msg`` to the transfer's peer (off the caller's thread; a lost one is logged)."""

    msg: ControlMessage


@dataclass(frozen=True)
class AcquireBlocks:
    """Take a reference on each block, at once (the caller is on the engine thread)."""

    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class ReleaseBlocks:
    """Drop a reference on each block, on the engine thread."""

    block_ids: tuple[int, ...]


TEARDOWN_RETRY_S = 1.0
"""After a teardown, how long a transfer may stay unsettled before the teardown is tried
again (NIXL may refuse to remove an endpoint; nothing else would ask it again)."""
TEARDOWN_RETRY_MAX_S = 30.0


def teardown_retry_s(num_teardowns: int) -> float:
    """The wait before the next try after ``num_teardowns`` (>= 1): doubling, capped."""
    return float(min(TEARDOWN_RETRY_S * 2 ** (num_teardowns - 1), TEARDOWN_RETRY_MAX_S))


@dataclass(frozen=True)
class TearDown:
    """Remove the peer's endpoint: whatever of ours NIXL still holds towards it settles."""

    why: str


@dataclass(frozen=True)
class Log:
    """A lifecycle line for the transfer's log (``level``: a `logging` level)."""

    level: int
    text: str


__all__ = ["AcquireBlocks", "Log", "ReleaseBlocks", "TearDown", "Tell"]
