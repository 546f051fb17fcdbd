"""Which unreferenced cached block the pool evicts next: plain LRU, or by session value.

The block pool (`block_pool.BlockPool`) keeps its CACHED blocks (ref 0, keyed) in an
`Evictor` and asks it for the next victim when it needs room. Every block carries a
class, set when a request releases it (`ReleaseTag`), the highest one kept::

    PLAIN     released by requests without a session only
    SESSION   released by a request that named a session: a conversation's history
    RETURNED  inserted by a duplex return: a finished turn the next one will want

A session's block that a plain request uses too keeps its class (a shared system
prompt is not demoted); the next session to release it becomes its owner. A
RETURNED block that its own session's next request releases becomes SESSION: the
answer was read, it is history now. A session's activity is the time of its last
request on this instance (`note_session`) or of the last release of one of its blocks.

Order of `SessionEvictor` (least recently released first within each step)::

    1. PLAIN blocks
    2. blocks of idle sessions (no activity for idle_s), least recently active
       session first; its RETURNED blocks (the end of its chain) before its SESSION ones
    3. SESSION blocks of live sessions, least recently active session first
    4. RETURNED blocks of live sessions, least recently active session first

Every class still goes when nothing else is left: the pool never refuses an
allocation that plain LRU would have served. `LRUEvictor` is that plain LRU
(``--eviction lru``): classes are still tracked, for the eviction counters only.

Blocks a session's request used but a plain request released last stay with the
pseudo-session `SHARED`, whose activity is every such release: shared blocks stay
hot while anything uses them. Bookkeeping is per released block (no per-token work);
the sessions remembered are those with cached blocks. Engine thread only.
"""

from __future__ import annotations

import enum
import itertools
import time
from abc import ABC
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Iterator
from dataclasses import dataclass

from kvduplex.common.engine_config import EvictionPolicy


class EvictionClass(enum.IntEnum):
    """A cached block's value to keep; higher goes later (see the module docstring)."""

    PLAIN = 0
    SESSION = 1
    RETURNED = 2

    @property
    def label(self) -> str:
        """The ``class`` label of the eviction counter."""
        return self.name.lower()


SHARED = ""
"""Owner of the session blocks a plain request released last (no session id is empty)."""

Clock = Callable[[], float]
"""Monotonic seconds."""


@dataclass(frozen=True, slots=True)
class ReleaseTag:
    """Who drops a reference: the class its blocks get, and the session it names."""

    cls: EvictionClass
    session: str | None = None

    def __post_init__(self) -> None:
        if (self.cls is EvictionClass.PLAIN) != (self.session is None) or self.session == SHARED:
            raise ValueError(f"{self.cls.name} with session {self.session!r}")

    @classmethod
    def of_request(cls, session_id: str | None) -> ReleaseTag:
        """A request's blocks: SESSION when it names a session, else PLAIN."""
        return PLAIN_TAG if not session_id else cls(EvictionClass.SESSION, session_id)

    @classmethod
    def returned(cls, session_id: str) -> ReleaseTag:
        """Blocks a duplex return of `session_id`'s turn inserted (PLAIN without one)."""
        return PLAIN_TAG if not session_id else cls(EvictionClass.RETURNED, session_id)


PLAIN_TAG = ReleaseTag(EvictionClass.PLAIN)


class Evictor(ABC):
    """The CACHED blocks of one pool and their eviction order; the blocks' classes.

    The pool calls `tag` on every release by a request (the block is referenced),
    `push` when a block becomes CACHED, `remove` when a cached block is acquired
    again, `pop` for a victim and `untag` when it hands a block out fresh.
    """

    def __init__(self, num_blocks: int) -> None:
        self.classes = [EvictionClass.PLAIN] * num_blocks
        """Each block's class (meaningful while it is keyed)."""
        self.owners: list[str | None] = [None] * num_blocks
        """Each non-PLAIN block's session (or `SHARED`)."""
        self.num_evicted = dict.fromkeys(EvictionClass, 0)
        """Blocks evicted since start, by class."""

    # ---- classes ----

    def tag(self, block_id: int, tag: ReleaseTag) -> None:
        """A request releases a referenced block: raise its class, name its owner."""
        cur, new = self.classes[block_id], tag.cls
        if new is EvictionClass.PLAIN:
            if cur is not EvictionClass.PLAIN:
                self.owners[block_id] = SHARED
            return
        if cur is EvictionClass.RETURNED and self.owners[block_id] == tag.session:
            self.classes[block_id] = new  # its own session read it: history now
        elif new > cur:
            self.classes[block_id] = new
        self.owners[block_id] = tag.session

    def untag(self, block_id: int) -> None:
        """The block is handed out fresh: it holds nothing of anyone's."""
        self.classes[block_id] = EvictionClass.PLAIN
        self.owners[block_id] = None

    def note_session(self, session_id: str) -> None:  # noqa: B027 (only one order cares)
        """A request of `session_id` arrived: its cached blocks are wanted again."""

    # ---- the cached set ----

    def pop(self, count: bool = True) -> int:
        """Remove and return the next victim (there must be one); `count`: it is an
        eviction (a reset is not)."""
        block_id = self._pop()
        if count:
            self.num_evicted[self.classes[block_id]] += 1
        return block_id

    @abstractmethod
    def push(self, block_id: int) -> None:
        """The block became CACHED (most recently released), under its class and owner."""

    @abstractmethod
    def remove(self, block_id: int) -> None:
        """A CACHED block is referenced again (it leaves the eviction order)."""

    @abstractmethod
    def _pop(self) -> int: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, block_id: int) -> bool: ...

    @abstractmethod
    def __iter__(self) -> Iterator[int]:
        """The cached blocks (in no promised order)."""

    def problems(self) -> list[str]:
        """Broken invariants of the order's own structures (for the pool's check)."""
        return []


class LRUEvictor(Evictor):
    """Least recently released first, whatever the class."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self._lru: OrderedDict[int, None] = OrderedDict()

    def push(self, block_id: int) -> None:
        self._lru[block_id] = None

    def remove(self, block_id: int) -> None:
        del self._lru[block_id]

    def _pop(self) -> int:
        return self._lru.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._lru

    def __iter__(self) -> Iterator[int]:
        return iter(self._lru)


Group = OrderedDict[int, None]
"""One session's cached blocks of one class, least recently released first."""


class SessionEvictor(Evictor):
    """Evicts by session value (the order in the module docstring).

    Per class above PLAIN, the sessions with cached blocks of that class, least
    recently active first, each with its blocks: every activity moves the session to
    the end of both, so the front is always the least recently active.
    """

    def __init__(self, num_blocks: int, idle_s: float, clock: Clock = time.monotonic) -> None:
        if not idle_s > 0:
            raise ValueError(f"session_idle_s must be > 0, got {idle_s}")
        super().__init__(num_blocks)
        self.idle_s = idle_s
        self.clock = clock
        self._plain: OrderedDict[int, None] = OrderedDict()
        self._groups: dict[EvictionClass, OrderedDict[str, Group]] = {
            EvictionClass.SESSION: OrderedDict(),
            EvictionClass.RETURNED: OrderedDict(),
        }
        self._active_at: dict[str, float] = {}
        """Last activity of each session with cached blocks."""
        self._num_cached = 0

    def note_session(self, session_id: str) -> None:
        if session_id in self._active_at:
            self._touch(session_id)

    def _touch(self, session: str) -> None:
        self._active_at[session] = self.clock()
        for groups in self._groups.values():
            if session in groups:
                groups.move_to_end(session)

    def push(self, block_id: int) -> None:
        cls = self.classes[block_id]
        self._num_cached += 1
        if cls is EvictionClass.PLAIN:
            self._plain[block_id] = None
            return
        owner = self.owners[block_id]
        assert owner is not None, f"block {block_id} is {cls.name} without an owner"
        groups = self._groups[cls]
        group = groups.get(owner)
        if group is None:
            group = groups[owner] = OrderedDict()
        group[block_id] = None
        self._touch(owner)

    def remove(self, block_id: int) -> None:
        cls = self.classes[block_id]
        if cls is EvictionClass.PLAIN:
            del self._plain[block_id]
        else:
            owner = self.owners[block_id]
            assert owner is not None
            del self._groups[cls][owner][block_id]
            self._drop_if_empty(cls, owner)
        self._num_cached -= 1

    def _pop(self) -> int:
        if self._plain:
            self._num_cached -= 1
            return self._plain.popitem(last=False)[0]
        cls, owner = self._victim_group()
        block_id = self._groups[cls][owner].popitem(last=False)[0]
        self._drop_if_empty(cls, owner)
        self._num_cached -= 1
        return block_id

    def _victim_group(self) -> tuple[EvictionClass, str]:
        """The class and session whose oldest block goes next (no PLAIN block is left)."""
        session = _first(self._groups[EvictionClass.SESSION])
        returned = _first(self._groups[EvictionClass.RETURNED])
        idle_before = self.clock() - self.idle_s
        active = self._active_at
        # An idle session's answer, unless a session idle longer has history cached.
        if (
            returned is not None
            and active[returned] < idle_before
            and (session is None or active[returned] <= active[session])
        ):
            return EvictionClass.RETURNED, returned
        if session is not None:  # an idle session's history, else the least active one's
            return EvictionClass.SESSION, session
        assert returned is not None, "nothing cached to evict"
        return EvictionClass.RETURNED, returned

    def _drop_if_empty(self, cls: EvictionClass, owner: str) -> None:
        groups = self._groups[cls]
        if groups[owner]:
            return
        del groups[owner]
        if not any(owner in g for g in self._groups.values()):
            del self._active_at[owner]

    def __len__(self) -> int:
        return self._num_cached

    def __contains__(self, block_id: int) -> bool:
        cls = self.classes[block_id]
        if cls is EvictionClass.PLAIN:
            return block_id in self._plain
        owner = self.owners[block_id]
        group = None if owner is None else self._groups[cls].get(owner)
        return group is not None and block_id in group

    def __iter__(self) -> Iterator[int]:
        yield from self._plain
        for groups in self._groups.values():
            for group in groups.values():
                yield from group

    def problems(self) -> list[str]:
        problems: list[str] = []
        num = len(self._plain)
        problems += [
            f"block {b} is {self.classes[b].name} but in the plain order"
            for b in self._plain
            if self.classes[b] is not EvictionClass.PLAIN
        ]
        owners: set[str] = set()
        for cls, groups in self._groups.items():
            owners.update(groups)
            times = [self._active_at.get(s, float("nan")) for s in groups]
            if any(not a <= b for a, b in itertools.pairwise(times)):
                problems.append(f"{cls.name} sessions out of activity order")
            for owner, group in groups.items():
                num += len(group)
                if not group:
                    problems.append(f"empty {cls.name} group of session {owner!r}")
                problems += [
                    f"block {b} in session {owner!r}'s {cls.name} group is "
                    f"{self.classes[b].name} of {self.owners[b]!r}"
                    for b in group
                    if (self.classes[b], self.owners[b]) != (cls, owner)
                ]
        if owners != self._active_at.keys():
            problems.append("sessions with cached blocks and their activity times differ")
        if num != self._num_cached:
            problems.append(f"{num} blocks in the order, {self._num_cached} counted")
        return problems


def _first(groups: OrderedDict[str, Group]) -> str | None:
    return next(iter(groups), None)


def make_evictor(
    policy: EvictionPolicy, num_blocks: int, idle_s: float, clock: Clock = time.monotonic
) -> Evictor:
    """The evictor ``--eviction`` names."""
    if policy is EvictionPolicy.LRU:
        return LRUEvictor(num_blocks)
    return SessionEvictor(num_blocks, idle_s, clock)


__all__ = [
    "PLAIN_TAG",
    "SHARED",
    "Clock",
    "EvictionClass",
    "Evictor",
    "LRUEvictor",
    "ReleaseTag",
    "SessionEvictor",
    "make_evictor",
]
