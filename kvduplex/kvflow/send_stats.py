"""What a sender counts: its statistics (served as push stats) and each ended job's
accounting (bytes, transfer time and the part of it not hidden behind compute)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import assert_never

from kvduplex.kvflow.machines.send import SendCounter
from kvduplex.kvflow.machines.send import SendMachine
from kvduplex.kvflow.metrics import KVFlowMetrics

logger = logging.getLogger(__name__)


@dataclass
class KVSenderStats:
    """This instance's sent jobs since it started (served as push stats)."""

    num_done: int = 0
    num_failed: int = 0
    num_written_blocks: int = 0
    num_writes: int = 0
    num_bytes: int = 0
    num_late_registrations: int = 0
    """Registrations that found blocks already computed (written at once)."""
    transfer_s: float = 0.0
    exposed_s: float = 0.0
    """Part of ``transfer_s`` after the job's compute ended (not hidden)."""
    num_alive_sent: int = 0
    num_waiting_received: int = 0
    num_teardowns: int = 0
    """Peer endpoints torn down because a failed WRITE would not settle."""
    num_registrations_refused: int = 0
    """Registrations answered with KVFailed (wrong engine, sizes, cancelled, ended)."""
    num_prompt_mismatches: int = 0
    """Registrations refused because they named other token ids than the job's."""
    num_reclaimed: int = 0
    """Finished pushes given up before the receiver registered, their blocks needed here."""

    def count(self, counter: SendCounter) -> None:
        """Add one to the statistic a machine's `Count` names."""
        match counter:
            case SendCounter.LATE_REGISTRATIONS:
                self.num_late_registrations += 1
            case SendCounter.WRITES:
                self.num_writes += 1
            case SendCounter.TEARDOWNS:
                self.num_teardowns += 1
            case SendCounter.ALIVE_SENT:
                self.num_alive_sent += 1
            case SendCounter.WAITING_RECEIVED:
                self.num_waiting_received += 1
            case SendCounter.PROMPT_MISMATCHES:
                self.num_prompt_mismatches += 1
            case SendCounter.RECLAIMED:
                self.num_reclaimed += 1
            case _:
                assert_never(counter)


def account(s: KVSenderStats, job: SendMachine, end: float, metrics: KVFlowMetrics | None) -> None:
    """Add ``job``, which ended at ``end``, to ``s`` (and a push's to ``metrics``)."""
    transfer_s = exposed_s = 0.0
    if job.first_post_at is not None and job.last_done_at is not None:
        transfer_s = job.last_done_at - job.first_post_at
        if job.compute_done_at is not None:
            exposed_s = max(0.0, end - max(job.compute_done_at, job.first_post_at))
    if job.error is None:
        s.num_done += 1
        s.num_written_blocks += job.num_blocks - (job.reg.first_block if job.reg else 0)
        s.num_bytes += job.num_bytes
        s.transfer_s += transfer_s
        s.exposed_s += min(exposed_s, transfer_s) if transfer_s else exposed_s
    else:
        s.num_failed += 1
    if metrics is not None and job.source.streams:
        metrics.on_push_sent(job.error is None, transfer_s, exposed_s)
    logger.debug(
        "xid=%s: send %s, %d bytes, transfer %.1f ms, exposed %.1f ms",
        job.xid, "done" if job.error is None else f"failed ({job.error})",
        job.num_bytes, transfer_s * 1e3, exposed_s * 1e3,
    )  # fmt: skip


__all__ = ["KVSenderStats", "account"]
