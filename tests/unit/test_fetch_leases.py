"""Decode lends a prompt's cached prefix to prefill (the router's fetch plan,
`kvduplex.kvflow.fetch`): its blocks stay referenced under a lease until prefill releases
it or it expires, and prefill, having read them, computes only the rest, exactly.

P and D are stepped in one thread (`tests.unit.flow_sim`); prefill's read side, an async
facade, runs on an event loop turned between the steps (`_drive`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from collections.abc import Coroutine
from concurrent.futures import Future
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from typing import TypeVar

import pytest

from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.handle import EngineHandle
from kvduplex.engine.request import Request
from kvduplex.kvflow.fetch import FetchRefusal
from kvduplex.kvflow.fetch import FetchRefused
from kvduplex.kvflow.fetch import PrefixLease
from kvduplex.kvflow.fetch import PrefixLeases
from kvduplex.kvflow.fetch import lendable_keys
from kvduplex.kvflow.return_pull import RetainedReadSide
from kvduplex.kvflow.return_pull import RetainedTurnRef
from kvduplex.model.loader import LoadedModel
from kvduplex.transport.protocol import PeerHandle
from tests.unit.flow_common import BS
from tests.unit.flow_common import GREEDY
from tests.unit.flow_common import PROMPT
from tests.unit.flow_common import _reference
from tests.unit.flow_common import tiny as tiny  # the module-scoped model fixture
from tests.unit.flow_sim import Sim

T = TypeVar("T")


class _Inline(ThreadPoolExecutor):
    """Runs what an event loop hands its executor (``asyncio.to_thread``) at once, on
    the test's thread: it never starts a thread (the loop takes only this class)."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        done: Future[T] = Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            done.set_exception(exc)
        return done


def _drive(s: Sim, coro: Coroutine[Any, Any, T]) -> T:
    """Run an async facade on the stepper: its loop turns once between steps, its engine
    commands are carried out by `Sim.step` (the engine front's command queue), and what
    it hands a thread runs inline. Its result, once it has one."""
    loop = asyncio.new_event_loop()
    loop.set_default_executor(_Inline())
    try:
        task = loop.create_task(coro)

        def turned() -> bool:
            loop.call_soon(loop.stop)
            loop.run_forever()  # one pass over the callbacks ready now
            return task.done()

        s.run(turned)
        return task.result()
    finally:
        loop.close()


def _generate(s: Sim, on_decode: bool, rid: str, prompt: list[int]) -> tuple[list[int], int]:
    """Run `prompt` whole on one engine of the pair: its tokens and its cached tokens."""
    engine = s.d if on_decode else s.p
    engine.add_request(Request(rid, prompt, GREEDY))
    s.run(lambda: s.finished(rid))
    return s.outputs[rid], s.last[rid].num_local_cached_tokens


def _refs(s: Sim, blocks: list[int]) -> list[int]:
    return [s.d.block_pool.ref_count(b) for b in blocks]


def _leases(s: Sim, max_blocks: int | None = None) -> PrefixLeases:
    """Decode's fetch leases, ticked by its flow inbox (on the sim's clock)."""
    return PrefixLeases(EngineHandle(s.ad), lease_s=5.0, inbox=s.df.inbox, max_blocks=max_blocks)


def _grant(s: Sim, leases: PrefixLeases, xid: str, prompt: list[int]) -> PrefixLease:
    keys = lendable_keys(prompt, BS, s.d.kv_manager.identity)
    return leases.grant(xid, keys)


def _refusal(s: Sim, leases: PrefixLeases, xid: str, prompt: list[int]) -> FetchRefusal:
    with pytest.raises(FetchRefused) as info:
        _grant(s, leases, xid, prompt)
    return info.value.reason


def _read(s: Sim, lease: PrefixLease, turn: list[int]) -> int:
    """Prefill's READ of the leased blocks it lacks, as its push route does: blocks cached."""

    def get_peer(_url: str, _engine_id: str | None) -> PeerHandle:
        return s.d_peer

    side = RetainedReadSide(s.ap, s.pf.reader, get_peer)
    ref = RetainedTurnRef(
        "http://d", None, lease.block_ids, [bytes(k).hex() for k in lease.keys],
        turn[: lease.num_tokens], lease.lease_s,
    )  # fmt: skip
    return _drive(s, side.read("x-1", ref, s.clock.now))


def test_prefill_reads_a_leased_history_and_computes_only_the_rest(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch)
    answer, _ = _generate(s, True, "turn-1", PROMPT)  # decode served the first turn
    # 18 + 6 tokens, the last one without KV: 5 full blocks cached on decode.
    turn = PROMPT + answer + [77, 78, 79]
    leases = _leases(s)
    lease = _grant(s, leases, "fetch-1", turn)
    assert (len(lease.block_ids), lease.num_tokens) == (5, 5 * BS)
    assert _refs(s, lease.block_ids) == [1] * 5, "the lease's own reference"

    assert _read(s, lease, turn) == 5
    assert leases.release("fetch-1")
    assert _refs(s, lease.block_ids) == [0] * 5, "released: cached, evictable again"
    assert not leases.release("fetch-1")

    got, num_cached = _generate(s, False, "turn-2", turn)
    assert num_cached == 5 * BS, "prefill computed only the tokens after the history"
    assert got == _reference(tiny, turn, GREEDY)
    s.assert_clean()


def test_a_read_keeps_the_cached_prefix_it_extends(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill holds the history's first blocks, least recently used, and no free block:
    allocating the blocks to read into evicts cached blocks, but not that prefix (the
    blocks read would be cached after a gap no lookup gets past)."""
    s = Sim(tiny, monkeypatch)
    answer, _ = _generate(s, True, "turn-1", PROMPT)
    turn = PROMPT + answer + [77, 78, 79]
    _generate(s, False, "old", PROMPT[: 2 * BS + 1])  # caches the first 2 blocks
    _generate(s, False, "recent", [200 + i for i in range(6 * BS)])  # more recent ones

    def take_free(e: LLMEngine) -> list[int]:
        blocks = e.kv_manager.try_allocate_blocks(e.block_pool.stats().num_free)
        assert blocks is not None
        return blocks

    held = take_free(s.p)
    leases = _leases(s)
    lease = _grant(s, leases, "fetch-1", turn)
    assert _read(s, lease, turn) == 3, "the 3 it lacked"
    leases.release("fetch-1")
    s.p.kv_manager.release_blocks(held)
    got, num_cached = _generate(s, False, "turn-2", turn)
    assert num_cached == 5 * BS, "its 2 blocks, then the 3 read"
    assert got == _reference(tiny, turn, GREEDY)
    s.assert_clean()


def test_decode_lends_only_what_it_holds_within_its_bound(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch)
    _generate(s, True, "turn-1", PROMPT)
    leases = _leases(s, max_blocks=6)
    assert _refusal(s, leases, "f0", [5, *PROMPT]) is FetchRefusal.NOT_CACHED
    assert _refusal(s, leases, "f0", PROMPT[:BS]) is FetchRefusal.NOT_CACHED, (
        "the prompt's last token is never lent: prefill computes it"
    )
    lease = _grant(s, leases, "f1", PROMPT[: 4 * BS])
    assert len(lease.block_ids) == 3, "16 tokens: 3 full blocks before the last token"
    assert _refusal(s, leases, "f1", PROMPT) is FetchRefusal.XID_IN_USE
    part = _grant(s, leases, "f2", PROMPT)
    assert part.block_ids == lease.block_ids, "4 blocks held, 3 more leased at most: its head"
    assert part.num_tokens == 3 * BS
    assert _refs(s, lease.block_ids) == [2, 2, 2], "two leases on the same blocks"
    assert _refusal(s, leases, "f3", PROMPT) is FetchRefusal.NO_ROOM
    assert leases.release("f1")
    granted_at = s.clock.now
    again = _grant(s, leases, "f3", PROMPT[: 3 * BS])
    assert (len(leases), leases.num_leased_blocks()) == (2, 5)
    assert leases.release("f2")
    assert _refs(s, again.block_ids) == [1, 1]

    s.tick(leases.hold_s)  # the lease and its grace, to the end: still held
    s.run(lambda: not s.inboxes_pending())
    assert len(leases) == 1 and _refs(s, again.block_ids) == [1, 1]
    s.run(lambda: len(leases) == 0)  # past it, on the sim's clock: let go
    assert s.clock.now - granted_at > leases.hold_s
    assert _refs(s, again.block_ids) == [0, 0]
    s.assert_clean()
