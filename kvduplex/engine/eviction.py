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
    3. blocks of live sessions with history cached, least recently active session
       first; its RETURNED blocks (the end of its chain) before its SESSION ones
    4. RETURNED blocks of the other live sessions, least recently active session first

A returned answer extends its session's history: once that history is evicted, a
lookup stops before the answer, so the answer goes with it, never after it.

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
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Sequence
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

    The pool calls `tag` with the blocks a request releases (still referenced),
    `push` with those that became CACHED, `remove` when a cached block is acquired
    again, `pop` for victims and `untag` with the blocks it hands out fresh. Each
    takes a whole release or allocation at once: the per-block work is a few list
    and dict operations.
    """

    def __init__(self, num_blocks: int) -> None:
        self.classes = [EvictionClass.PLAIN] * num_blocks
        """Each block's class (meaningful while it is keyed)."""
        self.owners: list[str | None] = [None] * num_blocks
        """Each non-PLAIN block's session (or `SHARED`)."""
        self._num_evicted = [0] * len(EvictionClass)

    @property
    def num_evicted(self) -> dict[EvictionClass, int]:
        """Blocks evicted since start, by class (any thread: a copy)."""
        return {cls: self._num_evicted[cls] for cls in EvictionClass}

    # ---- classes ----

    def tag(self, block_ids: Iterable[int], tag: ReleaseTag) -> None:
        """A request releases these referenced blocks: raise their class, name their owner."""
        classes, owners, new, session = self.classes, self.owners, tag.cls, tag.session
        if new is EvictionClass.PLAIN:
            for b in block_ids:
                if classes[b] is not EvictionClass.PLAIN:
                    owners[b] = SHARED
            return
        for b in block_ids:
            cur = classes[b]
            if cur is EvictionClass.RETURNED and owners[b] == session:
                classes[b] = new  # its own session read it: history now
            elif new > cur:
                classes[b] = new
            owners[b] = session

    def untag(self, block_ids: Iterable[int]) -> None:
        """The blocks are handed out fresh: they hold nothing of anyone's."""
        classes, owners = self.classes, self.owners
        for b in block_ids:
            classes[b] = EvictionClass.PLAIN
            owners[b] = None

    def note_session(self, session_id: str) -> None:  # noqa: B027 (only one order cares)
        """A request of `session_id` arrived: its cached blocks are wanted again."""

    # ---- the cached set ----

    def pop(self, num_blocks: int, count: bool = True) -> list[int]:
        """Remove and return the next `num_blocks` victims, in order (there must be as
        many); `count`: they are evictions (a reset's are not)."""
        victims = self._pop(num_blocks)
        if count:
            num_evicted, classes = self._num_evicted, self.classes
            for b in victims:
                num_evicted[classes[b]] += 1
        return victims

    @abstractmethod
    def push(self, block_ids: Sequence[int]) -> None:
        """The blocks became CACHED (most recently released, in this order), under their
        class and owner."""

    @abstractmethod
    def remove(self, block_id: int) -> None:
        """A CACHED block is referenced again (it leaves the eviction order)."""

    @abstractmethod
    def _pop(self, num_blocks: int) -> list[int]: ...

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

    def push(self, block_ids: Sequence[int]) -> None:
        self._lru.update(dict.fromkeys(block_ids))

    def remove(self, block_id: int) -> None:
        del self._lru[block_id]

    def _pop(self, num_blocks: int) -> list[int]:
        lru = self._lru
        return [lru.popitem(last=False)[0] for _ in range(num_blocks)]

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
            self._touch(session_id, self.clock())

    def _touch(self, session: str, now: float) -> None:
        self._active_at[session] = now
        for groups in self._groups.values():
            if session in groups:
                groups.move_to_end(session)

    def push(self, block_ids: Sequence[int]) -> None:
        classes, owners, plain = self.classes, self.owners, self._plain
        touched: dict[str, None] = {}
        group_cls, group_owner, group = EvictionClass.PLAIN, "", plain  # a release's last
        for b in block_ids:
            cls = classes[b]
            if cls is EvictionClass.PLAIN:
                plain[b] = None
                continue
            owner = owners[b]
            assert owner is not None, f"block {b} is {cls.name} without an owner"
            if cls is not group_cls or owner != group_owner:
                groups = self._groups[cls]
                group_cls, group_owner = cls, owner
                group = groups.get(owner) or groups.setdefault(owner, OrderedDict())
                touched[owner] = None
            group[b] = None
        self._num_cached += len(block_ids)
        if touched:  # each owner once per release: its activity is now
            now = self.clock()
            for owner in touched:
                self._touch(owner, now)

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

    def _pop(self, num_blocks: int) -> list[int]:
        plain = self._plain
        victims = [plain.popitem(last=False)[0] for _ in range(min(num_blocks, len(plain)))]
        if len(victims) < num_blocks:
            now = self.clock()  # one instant: a victim group stays the victim until empty
            while len(victims) < num_blocks:
                cls, owner = self._victim_group(now)
                group = self._groups[cls][owner]
                num = num_blocks - len(victims)
                if num >= len(group):  # the whole group
                    victims += group
                    group.clear()
                else:
                    victims += [group.popitem(last=False)[0] for _ in range(num)]
                self._drop_if_empty(cls, owner)
        self._num_cached -= len(victims)
        return victims

    def _victim_group(self, now: float) -> tuple[EvictionClass, str]:
        """The class and session whose oldest block goes next (no PLAIN block is left)."""
        session = _first(self._groups[EvictionClass.SESSION])
        returned = _first(self._groups[EvictionClass.RETURNED])
        idle_before = now - self.idle_s
        active = self._active_at
        # An idle session's answer, unless a session idle longer has history cached.
        if (
            returned is not None
            and active[returned] < idle_before
            and (session is None or active[returned] <= active[session])
        ):
            return EvictionClass.RETURNED, returned
        if session is not None:  # an idle session's history, else the least active one's
            if session in self._groups[EvictionClass.RETURNED]:
                # its answer first: the end of its chain, never hit once the history is gone
                return EvictionClass.RETURNED, session
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
