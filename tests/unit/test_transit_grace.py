"""A holder of blocks that a peer READs keeps them past the time it tells the reader:
the reader counts that time from its own arrival, after the transit through the
router, so a READ it starts within its window never finds the blocks reused."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from kvduplex.kvflow import lease
from kvduplex.kvflow import return_pull
from kvduplex.kvflow.inbox import FlowInbox
from kvduplex.kvflow.lease import TRANSIT_GRACE_S
from kvduplex.kvflow.lease import LeaseTable
from kvduplex.kvflow.return_pull import RetainSpec
from kvduplex.kvflow.return_pull import TurnRetainer


class PrefillEngine:
    """The engine handle a lease uses: which held requests it let go."""

    def __init__(self) -> None:
        self.released: list[str] = []

    def release_held(self, request_id: str) -> bool:
        self.released.append(request_id)
        return True


def test_a_pull_lease_holds_the_blocks_past_the_lease_it_tells(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock()
    monkeypatch.setattr(lease, "time", clock)
    engine = PrefillEngine()
    inbox = FlowInbox()
    leases = LeaseTable(engine, lease_s=30.0, inbox=inbox)  # type: ignore[arg-type]
    leases.start("x")
    started = clock.now

    def advance_to(now: float) -> None:  # the flow inbox's tick, on the engine thread
        clock.now = now
        inbox.tick(now)
        inbox.drain()

    advance_to(started + leases.lease_s + 0.1)  # D, arrived late, may still READ
    assert engine.released == [] and len(leases) == 1
    advance_to(started + leases.lease_s + TRANSIT_GRACE_S + 0.1)
    assert engine.released == ["x"] and len(leases) == 0


class Clock:
    """Stands in for ``time`` in `return_pull`."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class DecodeEngine:
    """What a `TurnRetainer` asks of decode's engine, with one finished turn."""

    block_size = 4

    def __init__(self) -> None:
        self.refs: dict[int, int] = {}
        self.turn = SimpleNamespace(
            request_id="t1", connector_meta=RetainSpec("s1"), finish_reason=None,
            block_ids=[5, 6], block_hashes=[b"a" * 8, b"b" * 8], num_computed_tokens=8,
            all_token_ids=list(range(8)),
        )  # fmt: skip

    def get_request(self, request_id: str) -> Any:
        return self.turn if request_id == self.turn.request_id else None

    def acquire_blocks(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            self.refs[b] = self.refs.get(b, 0) + 1

    def release_blocks(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            self.refs[b] -= 1

    def release_held(self, request_id: str) -> bool:
        return True


def test_a_retained_turns_pin_holds_past_the_pin_it_tells(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(return_pull, "time", clock)
    engine = DecodeEngine()
    retainer = TurnRetainer(engine, lease_s=600.0, max_blocks=8, pin_s=20.0)  # type: ignore[arg-type]
    retainer.on_finished([engine.turn])  # type: ignore[list-item]
    info = retainer.describe("s1")
    assert info is not None and info["pin_s"] == 20.0
    described = clock.now
    clock.now = described + info["pin_s"] + 0.1  # P, reached late, may still READ
    retainer._expire()
    assert retainer.num_pinned() == 1 and engine.refs == {5: 1, 6: 1}
    clock.now = described + info["pin_s"] + TRANSIT_GRACE_S + 0.1
    retainer._expire()
    assert retainer.num_pinned() == 0 and engine.refs == {5: 0, 6: 0}
