"""Prefill's READ of a decode's retained turn (``--return-mode pull``) ends before
decode's pin does, whatever the handshake and the wait for the engine thread took:
decode may reuse the blocks once the pin is over, and a READ still running then
would put their new contents into prefill's prefix cache."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest

from kvduplex.kvflow import return_pull
from kvduplex.kvflow.return_pull import READ_PIN_MARGIN_S
from kvduplex.kvflow.return_pull import RetainedReadSide
from kvduplex.kvflow.return_pull import RetainedTurnRef

HANDSHAKE_S = 1.0
ENGINE_BUSY_S = 1.5
"""A prefill step the READ's post waits behind."""


class Clock:
    """Stands in for ``time`` in `return_pull`: moves only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


class Reader:
    """Records the deadline each READ is posted with, and when."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.posts: list[tuple[float, float | None]] = []

    def start(self, *args: Any) -> Future[int]:
        deadline_s = args[-1]
        self.posts.append((self.clock.now, deadline_s))
        done: Future[int] = Future()
        done.set_result(1)
        return done


def _retained_read(clock: Clock, reader: Reader) -> RetainedReadSide:
    peer = SimpleNamespace(layout=SimpleNamespace(num_blocks=64), engine_id="d")

    def get_peer(_url: str, _engine_id: str | None) -> Any:
        clock.now += HANDSHAKE_S
        return peer

    class Engine:
        async def run_in_engine(self, fn: Callable[[Any], Any]) -> Any:
            clock.now += ENGINE_BUSY_S
            return fn(None)

    return RetainedReadSide(Engine(), reader, get_peer)  # type: ignore[arg-type]


@pytest.mark.parametrize("pin_left_s", [5.0, 3.0, 2.0, 0.4])
def test_a_retained_turn_read_ends_before_decodes_pin(
    monkeypatch: pytest.MonkeyPatch, pin_left_s: float
) -> None:
    clock = Clock()
    monkeypatch.setattr(return_pull, "time", clock)
    reader = Reader(clock)
    src = RetainedTurnRef(
        decode_url="http://d", engine_id=None, block_ids=[1], keys=["00"], token_ids=[1],
        pin_left_s=pin_left_s,
    )  # fmt: skip
    arrived = clock.now
    num_read = asyncio.run(_retained_read(clock, reader).read("x", src, arrived))
    pin_ends = arrived + pin_left_s
    left_at_post = pin_left_s - HANDSHAKE_S - ENGINE_BUSY_S - READ_PIN_MARGIN_S
    if left_at_post <= 0:
        assert reader.posts == [] and num_read == 0, "nothing left of the pin: not read"
        return
    assert num_read == 1
    [(posted_at, deadline_s)] = reader.posts
    assert deadline_s == pytest.approx(left_at_post)
    assert posted_at + deadline_s == pytest.approx(pin_ends - READ_PIN_MARGIN_S)
