"""What an instance reports of its engine's memory (``GET /internal/kv/stats``)."""

from __future__ import annotations

from dataclasses import dataclass

from kvduplex.engine.engine import LLMEngine


@dataclass(frozen=True)
class PoolReport:
    """The block pool's counts and its integrity check, with the scheduler's queues, read
    together on the engine thread (``num_free + num_in_use + num_cached == total`` when
    ``integrity_ok``)."""

    num_free: int
    num_in_use: int
    num_cached: int
    total: int
    integrity_ok: bool
    integrity_error: str | None
    """The first broken invariant the check found (None: none)."""
    num_running: int
    num_waiting: int


def pool_report(engine: LLMEngine) -> PoolReport:
    """Check ``engine``'s block pool and count it; engine thread (`AsyncEngine.run_in_engine`).
    A broken invariant is reported, not raised."""
    error = None
    try:
        engine.check_integrity()
    except AssertionError as exc:
        error = str(exc) or "integrity check failed"
    st = engine.block_pool.stats()
    return PoolReport(
        num_free=st.num_free, num_in_use=st.num_in_use, num_cached=st.num_cached,
        total=st.total, integrity_ok=error is None, integrity_error=error,
        num_running=engine.scheduler.num_running, num_waiting=engine.scheduler.num_waiting,
    )  # fmt: skip


__all__ = ["PoolReport", "pool_report"]
