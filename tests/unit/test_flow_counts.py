"""The machines' `Count` actions name a typed counter, and each adds to exactly its own
statistic of the sender's or the receiver's stats."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from kvduplex.kvflow.machines.receive import ReceiveCounter
from kvduplex.kvflow.machines.send import SendCounter
from kvduplex.kvflow.receiver import KVReceiverStats
from kvduplex.kvflow.sender import KVSenderStats


@pytest.mark.parametrize("counter", list(SendCounter))
def test_each_send_counter_adds_to_its_own_statistic(counter: SendCounter) -> None:
    stats = KVSenderStats()
    before = asdict(stats)
    stats.count(counter)
    after = asdict(stats)
    changed = {k: after[k] - before[k] for k in before if after[k] != before[k]}
    assert changed == {counter.value: 1}


@pytest.mark.parametrize("counter", list(ReceiveCounter))
def test_each_receive_counter_adds_to_its_own_statistic(counter: ReceiveCounter) -> None:
    stats = KVReceiverStats()
    before = asdict(stats)
    stats.count(counter, 3)
    after = asdict(stats)
    changed = {k: after[k] - before[k] for k in before if after[k] != before[k]}
    assert changed == {counter.value: 3}
