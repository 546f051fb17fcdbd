"""The fetch plan's layer-wise load on prefill: decode's cached history is READ layer by
layer while prefill computes the new tokens (`kvduplex.kvflow.prefix_load`).

Stepped in one thread (`flow_sim.Sim`): each layer's READ lands on the fabric's clock
(``slow_next``), the attention of each layer of prefill's forward is recorded, and the
answers are compared with a colocated engine's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvduplex.engine.block_pool import compute_block_hashes
from kvduplex.engine.kv_manager import HitSource
from kvduplex.engine.request import Request
from kvduplex.kvflow.flow_events import FlowEvent
from kvduplex.kvflow.messages import KVRegister
from kvduplex.kvflow.prefix_load import PrefixLoadSpec
from kvduplex.model import decoder
from kvduplex.model.loader import LoadedModel
from kvduplex.transport.base import Post
from kvduplex.transport.messages import ControlMessage
from kvduplex.transport.protocol import TransferOp
from tests.unit.flow_common import BS
from tests.unit.flow_common import FIRST
from tests.unit.flow_common import GREEDY
from tests.unit.flow_common import _reference
from tests.unit.flow_common import tiny  # noqa: F401 - fixture
from tests.unit.flow_sim import Sim

HISTORY = [(7 * i + 3) % 500 + 1 for i in range(24)]  # 6 full blocks decode holds
PROMPT = [*HISTORY, 11, 12, 13, 14, 15, 16, 17]  # the turn: 7 new tokens
NUM_LAYERS = 4  # the tiny preset's


class Timeline:
    """What happened, in order: each READ of a layer landing on prefill, and each layer's
    attention in prefill's forwards."""

    def __init__(self, sim: Sim, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, int, float]] = []
        self.sim = sim
        pool = sim.p.kv_pool
        per_layer = pool[0].numel() * pool.element_size()
        attention = decoder.paged_attention

        def recorded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_pool: torch.Tensor,
                     *args: Any) -> torch.Tensor:  # fmt: skip
            offset = layer_pool.data_ptr() - pool.data_ptr()
            if 0 <= offset < pool.numel() * pool.element_size():
                self.events.append(("attention", offset // per_layer, sim.clock.now))
            return attention(q, k, v, layer_pool, *args)

        monkeypatch.setattr(decoder, "paged_attention", recorded)
        copy = sim.tp._copy

        def landed(post: Post, *args: Any, **kwargs: Any) -> None:
            if post.handle.op is TransferOp.READ and "-load-l" in post.handle.xid:
                layer = int(post.handle.xid.rsplit("-load-l", 1)[1])
                self.events.append(("landed", layer, sim.clock.now))
            copy(post, *args, **kwargs)

        monkeypatch.setattr(sim.tp, "_copy", landed)

    def first(self, kind: str, layer: int) -> int:
        return next(i for i, (k, n, _) in enumerate(self.events) if (k, n) == (kind, layer))


def _history_on_decode(s: Sim) -> None:
    """Decode computed and cached the history (an earlier turn)."""
    s.d.add_request(Request("d-turn1", [*HISTORY, 1], FIRST))
    s.run(lambda: s.finished("d-turn1"))


def _fetch(s: Sim, xid: str, released: list[str]) -> PrefixLoadSpec:
    """Decode's lease on the prompt's cached history, as prefill's route gets it: its
    blocks referenced until the spec lets them go (the lease released)."""
    keys = compute_block_hashes(PROMPT[: len(HISTORY)], BS, s.d.kv_manager.identity)
    blocks = s.d.kv_manager.cached_prefix(keys)
    assert len(blocks) == len(keys)
    s.d.kv_manager.acquire_blocks(blocks)

    def release() -> None:
        released.append(xid)
        s.d.kv_manager.release_blocks(blocks)

    return PrefixLoadSpec(s.d_peer, blocks, [bytes(k).hex() for k in keys], None, release)


def _fetch_turn(s: Sim, xid: str, released: list[str]) -> PrefixLoadSpec:
    """The fetch plan's turn: prefill loads the history and pushes the new blocks; decode
    admits over its own hit."""
    spec = _fetch(s, xid, released)
    s.pf.sender.expect(xid, s.d_peer, PROMPT)
    s.p.add_request(Request(xid, PROMPT, FIRST, hold_blocks_on_finish=True, connector_meta=spec))
    s.push_decode(xid, PROMPT)
    return spec


def _slow_reads(s: Sim, delay: Callable[[int], float]) -> None:
    """Prefill's next READs (one per layer, layer 0 first) land ``delay(layer)`` s after
    their post."""
    for layer in range(NUM_LAYERS):
        s.tp.slow_next(delay(layer))


def test_each_layer_attends_only_after_its_blocks_landed(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """1. Decode holds the history; prefill holds none of it.
    2. Prefill's READ of each layer lands 0.1 s later than the one before.
    3. Its first forward starts at once: layer 0 attends once layer 0 landed, before
       the last layer's blocks are there; no layer attends before its blocks landed.
    4. Both answers are the colocated engine's; nothing is recomputed anywhere; the lease
       is released once; nothing leaks."""
    ref = _reference(tiny, PROMPT, GREEDY)
    s = Sim(tiny, monkeypatch, tick_s=0.01)
    _history_on_decode(s)
    timeline = Timeline(s, monkeypatch)
    released: list[str] = []
    _slow_reads(s, lambda layer: 0.1 * (layer + 1))
    spec = _fetch_turn(s, "x1", released)
    s.run(lambda: s.finished("x1") and s.finished("d-x1"))

    for layer in range(NUM_LAYERS):
        assert timeline.first("landed", layer) < timeline.first("attention", layer), timeline.events
    assert timeline.first("attention", 0) < timeline.first("landed", NUM_LAYERS - 1), "no overlap"
    assert s.outputs["x1"] == ref[:1]
    assert s.outputs["d-x1"] == ref
    assert spec.done.result() == len(HISTORY)
    assert s.last["x1"].num_cached_tokens == len(HISTORY)
    assert s.pf.loads.num_failed == 0
    # counted as hits from decode (the hits-by-source metric reads this)
    assert s.p.kv_manager.num_hit_tokens_by_source[HitSource.DECODE] == len(HISTORY)
    s.assert_clean()
    assert released == ["x1"]
    # The READ blocks are prefill's prefix cache now: the next turn hits them.
    keys = compute_block_hashes(PROMPT[: len(HISTORY)], BS, s.p.kv_manager.identity)
    assert s.p.kv_manager.num_cached_prefix(keys) == len(keys)


def _fail_third_layer(s: Sim, fault: str) -> None:
    """Prefill's READs of layers 0 and 1 land; layer 2's fails at once (``fail``), at its
    deadline (``hang``), or at its deadline and lands later (``late``)."""
    s.tp.slow_next(0.05)
    s.tp.slow_next(0.1)
    if fault == "fail":
        s.tp.fail_next("link down")
    elif fault == "hang":
        s.tp.hang_next()
    else:
        s.tp.land_late_next(0.5)


@pytest.mark.parametrize("fault", ["fail", "hang", "late"])
def test_a_layer_that_does_not_land_stops_the_push(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, fault: str  # noqa: F811
) -> None:
    """1. Prefill's READ of layer 2 does not land (`_fail_third_layer`).
    2. The forward's step is void (nothing it sampled is kept, nothing of it cached) and
       the push stops: decode hears KVFailed and computes the new tokens over its own
       history; prefill's request ends as a failed push does (aborted, no token), or,
       had it computed its prompt first, with the colocated first token.
    3. Decode's answer is the colocated engine's; the READ's blocks stay referenced until
       nothing can land in them; the lease is released once; nothing leaks."""
    ref = _reference(tiny, PROMPT, GREEDY)
    s = Sim(tiny, monkeypatch, tick_s=0.05, transfer_timeout_s=1.0)
    _history_on_decode(s)
    released: list[str] = []
    _fail_third_layer(s, fault)
    spec = _fetch_turn(s, "x1", released)
    s.run(lambda: s.finished("x1") and s.finished("d-x1"))

    assert (s.outputs["x1"], s.finish["x1"]) in (([], "abort"), (ref[:1], "length"))
    assert s.outputs["d-x1"] == ref
    assert spec.done.result() == 0
    assert s.pf.loads.num_failed == 1
    assert s.p.kv_manager.num_hit_tokens_by_source[HitSource.DECODE] == 0
    s.assert_clean()
    assert released == ["x1"]
    keys = compute_block_hashes(PROMPT[: len(HISTORY)], BS, s.p.kv_manager.identity)
    assert s.p.kv_manager.num_cached_prefix(keys) == 0, "nothing of the READ is cached"


@pytest.mark.parametrize("fault", ["fail", "hang", "late"])
def test_a_layer_that_does_not_land_is_computed(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, fault: str  # noqa: F811
) -> None:
    """Without a push to stop: the void step's request computes its whole prompt
    (its first token the colocated one), and the blocks it computed are cached."""
    s = Sim(tiny, monkeypatch, tick_s=0.05, transfer_timeout_s=1.0)
    _history_on_decode(s)
    released: list[str] = []
    _fail_third_layer(s, fault)
    spec = _fetch(s, "x1", released)
    s.p.add_request(Request("x1", PROMPT, FIRST, connector_meta=spec))
    s.run(lambda: s.finished("x1"))

    assert s.outputs["x1"] == _reference(tiny, PROMPT, FIRST)
    assert s.last["x1"].num_cached_tokens == 0, "prefill computed the prompt"
    assert spec.done.result() == 0
    assert s.pf.loads.num_failed == 1
    s.assert_clean()
    assert released == ["x1"]
    assert s.num_late_landed == (1 if fault == "late" else 0)
    keys = compute_block_hashes(PROMPT[: len(HISTORY)], BS, s.p.kv_manager.identity)
    assert s.p.kv_manager.num_cached_prefix(keys) == len(keys), "the computed prompt is cached"
    assert s.late_problems == []


def test_a_prompt_that_differs_from_the_lease_loads_nothing(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """Keys that are not the prompt's are not read: prefill computes, the lease goes."""
    s = Sim(tiny, monkeypatch)
    _history_on_decode(s)
    released: list[str] = []
    spec = _fetch(s, "x1", released)
    spec.keys = ["00" * 16] * len(spec.keys)
    other = [*PROMPT[:-1], 99]
    s.p.add_request(Request("x1", other, FIRST, connector_meta=spec))
    s.run(lambda: s.finished("x1"))
    assert spec.done.result() == 0
    assert s.pf.loads.num_failed == 0
    assert s.outputs["x1"] == _reference(tiny, other, FIRST)
    s.assert_clean()
    assert released == ["x1"]


def test_a_registration_that_arrives_while_layer_0_waits_is_served(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """1. Decode admits first: its KVRegister is on its way to prefill.
    2. Prefill's first forward waits for the READ of layer 0; the registration arrives
       then (the pump runs while the engine thread blocks), before any layer's WRITE.
    3. The push still WRITEs the step's blocks layer by layer: decode hears KVDone and
       its answer is the colocated engine's; nothing is recomputed; no flow table keeps
       an entry (a push that never ends holds prefill's send job and decode's receive
       wait for as long as their heartbeats go)."""
    ref = _reference(tiny, PROMPT, GREEDY)
    s = Sim(tiny, monkeypatch, tick_s=0.01)
    _history_on_decode(s)
    timeline = Timeline(s, monkeypatch)
    released: list[str] = []
    held: list[tuple[ControlMessage, str]] = []
    arrived = "held"

    def on_register(msg: ControlMessage, sender: str) -> None:
        if arrived == "held":
            held.append((msg, sender))
        else:
            s.pf.inbox.heard(msg, sender)

    s.intercept(s.tp, KVRegister, on_register)
    spec = _fetch(s, "x1", released)
    s.push_decode("x1", PROMPT)
    s.step()  # decode admits and registers; prefill has nothing yet
    s.deliver()
    assert len(held) == 1, "decode registered"

    wait = s.pf.inbox._next_event

    def next_event(timeout_s: float) -> FlowEvent | None:  # prefill's layer waits
        nonlocal arrived
        if held:
            landed = sum(1 for kind, _, _ in timeline.events if kind == "landed")
            arrived = f"with {landed} layers landed"
            for msg, sender in held:
                s.pf.inbox.heard(msg, sender)
            held.clear()
        return wait(timeout_s)

    monkeypatch.setattr(s.pf.inbox, "_next_event", next_event)
    _slow_reads(s, lambda layer: 0.1 * (layer + 1))
    s.pf.sender.expect("x1", s.d_peer, PROMPT)
    s.p.add_request(Request("x1", PROMPT, FIRST, hold_blocks_on_finish=True, connector_meta=spec))
    give_up_at = s.clock.now + 2 * s.timing.wait_s  # past decode's wait, but for heartbeats
    s.run(lambda: s.finished("x1") and (s.finished("d-x1") or s.clock.now > give_up_at))

    assert arrived == "with 0 layers landed", arrived
    assert s.finished("d-x1"), f"the push never ended: {s.busy_tables()}"
    assert s.outputs["x1"] == ref[:1]
    assert s.outputs["d-x1"] == ref
    assert spec.done.result() == len(HISTORY)
    assert s.pf.loads.num_failed == 0
    s.assert_clean()
    assert released == ["x1"]
