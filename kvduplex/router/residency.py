"""Where a session's KV likely lives, and the plan of its next turn.

Each instance's pool is a fixed number of blocks evicted least recently released first;
its clock is the number of blocks it has handed out since it started, fresh or revived
from its prefix cache (``kv_blocks_allocated`` in its /health body and in prefill's
answers). A session's blocks, last touched when the clock read `stamp`, can be gone
after about ``kv_num_blocks`` more blocks handed out (not before): the
router reads where the session's history still is from two numbers per instance,
without asking anyone on the request's path::

    clock  ... stamp ......................... latest reading
                 |<------ allocated since -------->|
    holds:  allocated since < HOLD_FRACTION x pool blocks

A turn then takes the cheapest plan, its cost counted in tokens computed on prefill:

* prefill holds the history (or neither holds it): push, prefill computes what it lacks;
* decode holds more of it than prefill: either prefill fetches what decode holds beyond
  its own (READs it from decode's pool, a token costing ``--fetch-token-cost``) and
  computes the rest, or decode computes the new tokens over its cached history (the short
  append, chosen by where the KV is), a token on decode costing ``--decode-token-cost``
  (decode's prefill stalls its running decodes). With ``--prefer-fetch`` (the default)
  prefill fetches whenever that costs less than computing what it lacks, which keeps
  decode's steps free for decoding; without, the cheapest of the three plans wins.

The return of a turn is worth its bytes only if prefill still holds the session's
history (returned blocks extend its chain, they do not start one) and keeps them until
the session's next turn: allocations over the expected gap, at prefill's recent rate,
must stay under KEEP_FRACTION of its pool. Otherwise the return is skipped (counted).

An estimate wrong either way costs time, never a token: a plan that misses recomputes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

HOLD_FRACTION = 0.8
"""Blocks allocated since a session's last touch, as a fraction of the pool, under which
its blocks count as still cached (in-use blocks and the shared prefix take the rest)."""
KEEP_FRACTION = 0.5
"""Blocks an instance may allocate over a session's expected gap, as a fraction of its
pool, for a return to count as kept until the next turn (margin for bursts)."""
RATE_HALF_LIFE_S = 30.0
"""Half-life of an instance's allocation rate (blocks per second)."""
RATE_WINDOW_S = 2.0
"""Shortest span of one sample of that rate."""


class Plan(enum.Enum):
    PUSH = "push"
    """Prefill computes what it lacks and pushes what decode lacks."""
    PREFILL_FETCH = "fetch"
    """Prefill READs the history decode holds, computes the rest and pushes what decode
    lacks (the new tokens)."""
    DECODE_LOCAL = "short_append"
    """Decode computes the new tokens over the history it holds."""


@dataclass
class PoolClock:
    """One instance's pool size and clock, as it last said, and its allocation rate."""

    num_blocks: int | None = None
    allocated: int = 0
    """The router's clock: the instance's count plus `base`."""
    base: int = 0
    """Added to the instance's count: moved past every earlier stamp at each restart."""
    window: tuple[int, float] | None = None
    """The clock and router time the current rate sample began (None: no reading yet)."""
    rate: float | None = None
    """Blocks allocated per second, decayed (None: not two readings yet)."""
    epoch: str | None = None
    """The instance's start its count runs from (None: not said)."""

    def note(self, num_blocks: int, allocated: int, now: float, epoch: str | None = None) -> None:
        """A reading of the instance's pool (a probe, a prefill answer): `allocated` as the
        instance counts, since the start it names `epoch`. A new epoch (or pool size) is a
        restarted instance: its cache is gone, so the router's clock jumps a whole pool
        ahead (every stamp before reads as turned over) and the rate starts again. Within
        an epoch the count only grows: a lower one is a reading that arrived late (probes
        and answers race), ignored. The rate is sampled over at least `RATE_WINDOW_S`
        (answers come in bursts)."""
        is_restart = (epoch is not None and self.epoch is not None and epoch != self.epoch) or (
            self.num_blocks is not None and num_blocks != self.num_blocks
        )
        if is_restart:
            self.base = self.allocated + max(num_blocks, self.num_blocks or 0)
            self.rate, self.window = None, None
        elif self.base + allocated < self.allocated:
            return
        self.epoch = epoch if epoch is not None else self.epoch
        reading = self.base + allocated
        if self.window is None:
            self.window = (reading, now)
        elif now - self.window[1] >= RATE_WINDOW_S:
            elapsed = now - self.window[1]
            rate = (reading - self.window[0]) / elapsed
            keep = 0.5 ** (elapsed / RATE_HALF_LIFE_S)
            self.rate = rate if self.rate is None else keep * self.rate + (1 - keep) * rate
            self.window = (reading, now)
        self.num_blocks, self.allocated = num_blocks, reading

    def stamp_of(self, allocated: int) -> int:
        """The router's clock for the instance's count `allocated` (read since its last
        restart)."""
        return self.base + allocated

    def holds(self, stamp: int | None) -> bool:
        """Whether blocks last touched at `stamp` are likely still cached (unknown: yes,
        as if the pool held everything; no stamp: no)."""
        if stamp is None:
            return False
        if self.num_blocks is None:
            return True
        return self.allocated - stamp < HOLD_FRACTION * self.num_blocks

    def keeps_for(self, gap_s: float | None) -> bool:
        """Whether blocks touched now are likely still cached `gap_s` seconds later
        (unknown gap or rate: yes)."""
        if gap_s is None or self.rate is None or self.num_blocks is None:
            return True
        return self.rate * gap_s < KEEP_FRACTION * self.num_blocks

    def read(self, body: object, now: float) -> None:
        """Note the pool reading in an instance's JSON answer, if it has one."""
        if not isinstance(body, dict):
            return
        num_blocks, allocated = body.get("kv_num_blocks"), body.get("kv_blocks_allocated")
        epoch = body.get("kv_epoch")
        if isinstance(num_blocks, int) and isinstance(allocated, int) and num_blocks > 0:
            self.note(num_blocks, max(0, allocated), now, epoch if isinstance(epoch, str) else None)


@dataclass(frozen=True)
class Residency:
    """What the router estimates of one turn's history: tokens each side holds."""

    prefill_tokens: int
    decode_tokens: int


def choose_plan(
    num_prompt_tokens: int, where: Residency, decode_token_cost: float,
    fetch_token_cost: float | None = None, prefer_fetch: bool = True,
) -> Plan:  # fmt: skip
    """The cheapest plan, in tokens computed on prefill::

        push          prompt - prefill's                 (prefill computes what it lacks)
        fetch         (decode's - prefill's) x fetch_token_cost + (prompt - decode's)
        decode-local  (prompt - decode's) x decode_token_cost

    Fetch is a plan only where decode holds more than prefill (and `fetch_token_cost` is
    given); decode-local only where decode has something to compute. With
    `prefer_fetch`, fetch wins whenever it costs less than push (decode's steps stay free
    for decoding); else the cheapest wins. A tie goes to prefill: push, then fetch."""
    num_prefill_computes = num_prompt_tokens - where.prefill_tokens
    num_decode_computes = num_prompt_tokens - where.decode_tokens
    costs: dict[Plan, float] = {Plan.PUSH: num_prefill_computes}
    num_fetched = where.decode_tokens - where.prefill_tokens
    if fetch_token_cost is not None and num_fetched > 0:
        # Prefill computes at least the last token, for its first token.
        costs[Plan.PREFILL_FETCH] = num_fetched * fetch_token_cost + max(num_decode_computes, 1)
        if prefer_fetch and costs[Plan.PREFILL_FETCH] < num_prefill_computes:
            return Plan.PREFILL_FETCH
    if num_decode_computes > 0:
        costs[Plan.DECODE_LOCAL] = num_decode_computes * decode_token_cost
    best = Plan.PUSH
    for plan, cost in costs.items():  # in order: push, fetch, decode-local
        if cost < costs[best]:
            best = plan
    return best
