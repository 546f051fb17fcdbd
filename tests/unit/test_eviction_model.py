"""The block pool's eviction under random operations against a plain model of its rules:
the classes releases give, the order of evictions (session value, or LRU), idle
sessions on an injected clock, the hook called for every evicted block."""

from __future__ import annotations

import hashlib

from hypothesis import HealthCheck
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine
from hypothesis.stateful import invariant
from hypothesis.stateful import precondition
from hypothesis.stateful import rule

from kvduplex.common.engine_config import EvictionPolicy
from kvduplex.engine.block_pool import BlockHash
from kvduplex.engine.block_pool import BlockPool
from kvduplex.engine.eviction import PLAIN_TAG
from kvduplex.engine.eviction import SHARED
from kvduplex.engine.eviction import EvictionClass
from kvduplex.engine.eviction import ReleaseTag

NUM_BLOCKS = 8
IDLE_S = 60.0
SESSIONS = ("a", "b", "c")
TAGS: list[ReleaseTag | None] = [
    None, PLAIN_TAG,
    *(ReleaseTag.of_request(s) for s in SESSIONS), *(ReleaseTag.returned(s) for s in SESSIONS[:2]),
]  # fmt: skip
PLAIN, SESSION, RETURNED = EvictionClass.PLAIN, EvictionClass.SESSION, EvictionClass.RETURNED


def key(n: int) -> BlockHash:
    return BlockHash(hashlib.blake2b(n.to_bytes(8, "little"), digest_size=32).digest())


class EvictionMachine(RuleBasedStateMachine):
    """Drives a pool and a model of it; evictions must come in the model's order."""

    policy = EvictionPolicy.SESSION

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.pool = BlockPool(
            NUM_BLOCKS, eviction=self.policy, session_idle_s=IDLE_S, clock=lambda: self.now
        )
        self.hooked: list[int] = []
        self.pool.on_evict = lambda block_id, k: self.hooked.append(block_id)
        self.refs = [0] * NUM_BLOCKS
        self.keyed: set[int] = set()
        self.cls = [PLAIN] * NUM_BLOCKS
        self.owner: list[str | None] = [None] * NUM_BLOCKS
        self.cached: dict[int, int] = {}  # block -> push order
        self.active: dict[str, tuple[float, int]] = {}  # session -> (time, order) of last touch
        self.seq = 0
        self.next_key = 0

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    # ---- the model's rules ----

    def _tag(self, b: int, tag: ReleaseTag) -> None:
        cur = self.cls[b]
        if tag.cls is PLAIN:
            if cur is not PLAIN:
                self.owner[b] = SHARED
            return
        if cur is RETURNED and self.owner[b] == tag.session:
            self.cls[b] = tag.cls
        else:
            self.cls[b] = max(cur, tag.cls)
        self.owner[b] = tag.session

    def _push(self, b: int) -> None:
        self.cached[b] = self._next()
        owner = self.owner[b]
        if self.cls[b] is not PLAIN and owner is not None:
            self.active[owner] = (self.now, self._next())

    def _uncache(self, b: int) -> None:
        del self.cached[b]
        owner = self.owner[b]
        if owner is not None and not any(
            self.owner[x] == owner and self.cls[x] is not PLAIN for x in self.cached
        ):
            self.active.pop(owner, None)

    def _order(self, b: int) -> tuple[float, ...]:
        if self.policy is EvictionPolicy.LRU or self.cls[b] is PLAIN:
            return (0, self.cached[b])
        owner = self.owner[b]
        assert owner is not None
        t, seq = self.active[owner]
        rank = 0 if self.cls[b] is RETURNED else 1
        if t < self.now - IDLE_S:  # idle: least recently active first, its answer first
            return (1, t, rank, seq, self.cached[b])
        has_history = any(
            self.owner[x] == owner and self.cls[x] is SESSION for x in self.cached
        )
        if has_history:  # live with history: least recently active first, its answer first
            return (2, t, seq, rank, self.cached[b])
        return (3, t, seq, self.cached[b])  # live, answers only

    def _expect_victims(self, n: int) -> list[int]:
        victims: list[int] = []
        for _ in range(n):
            b = min(self.cached, key=self._order)
            self._uncache(b)
            self.keyed.discard(b)
            victims.append(b)
        return victims

    # ---- rules ----

    @rule(n=st.integers(0, NUM_BLOCKS + 1))
    def allocate(self, n: int) -> None:
        num_free = NUM_BLOCKS - len(self.cached) - sum(1 for r in self.refs if r > 0)
        self.hooked.clear()
        got = self.pool.try_allocate(n)
        if n > num_free + len(self.cached):
            assert got is None and not self.hooked
            return
        assert got is not None
        victims = self._expect_victims(max(0, n - num_free))
        assert self.hooked == victims, "evicted out of order, or without the hook"
        for b in got:
            assert self.refs[b] == 0 and b not in self.cached
            self.refs[b] = 1
            self.cls[b], self.owner[b] = PLAIN, None

    @rule(n=st.integers(0, 3))
    def evict(self, n: int) -> None:
        self.hooked.clear()
        want = self._expect_victims(min(n, len(self.cached)))
        assert self.pool.evict(n) == want == self.hooked

    @precondition(lambda self: any(self.refs) or self.cached)
    @rule(data=st.data())
    def acquire(self, data: st.DataObject) -> None:
        held = [b for b in range(NUM_BLOCKS) if self.refs[b] > 0]
        b = data.draw(st.sampled_from(held + sorted(self.cached)))
        self.pool.acquire([b])
        if b in self.cached:
            self._uncache(b)
        self.refs[b] += 1

    @precondition(lambda self: any(self.refs))
    @rule(data=st.data(), tag=st.sampled_from(TAGS))
    def release(self, data: st.DataObject, tag: ReleaseTag | None) -> None:
        b = data.draw(st.sampled_from([b for b in range(NUM_BLOCKS) if self.refs[b] > 0]))
        self.pool.release([b], tag)
        if tag is not None:
            self._tag(b, tag)
        self.refs[b] -= 1
        if self.refs[b] == 0 and b in self.keyed:
            self._push(b)

    @precondition(lambda self: any(r > 0 and b not in self.keyed for b, r in enumerate(self.refs)))
    @rule(data=st.data())
    def insert_cached(self, data: st.DataObject) -> None:
        fresh = [b for b, r in enumerate(self.refs) if r > 0 and b not in self.keyed]
        b = data.draw(st.sampled_from(fresh))
        self.next_key += 1
        assert self.pool.insert_cached(b, key(self.next_key)) == b
        self.keyed.add(b)

    @rule(dt=st.sampled_from([0.0, 10.0, 45.0, 70.0]))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(session=st.sampled_from(SESSIONS))
    def note_session(self, session: str) -> None:
        self.pool.note_session(session)
        if self.policy is EvictionPolicy.SESSION and session in self.active:
            self.active[session] = (self.now, self._next())

    @invariant()
    def consistent(self) -> None:
        pool = self.pool
        pool.check_integrity()
        s = pool.stats()
        assert s.num_free + s.num_in_use + s.num_cached == s.total == NUM_BLOCKS
        assert s.num_cached == len(self.cached)
        for b in range(NUM_BLOCKS):
            assert pool.ref_count(b) == self.refs[b]
            if b in self.keyed:
                assert (pool.evictor.classes[b], pool.evictor.owners[b]) == (
                    self.cls[b], self.owner[b],
                )  # fmt: skip


class LRUMachine(EvictionMachine):
    """``--eviction lru``: the same operations, least recently released first."""

    policy = EvictionPolicy.LRU


_SETTINGS = settings(
    max_examples=80,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSessionEviction = EvictionMachine.TestCase
TestSessionEviction.settings = _SETTINGS
TestLRUEviction = LRUMachine.TestCase
TestLRUEviction.settings = _SETTINGS
