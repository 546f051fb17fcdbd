"""The push flow (`KVSender` on P, `PushDecode` + `KVReceiver` on D) over the in-process
transport, in every order of events.

Two engines (P and D) in one process, each in its own engine thread, each with
its notification pump and the flows of its role, wired as an instance wires them;
P writes layer by layer into D's registered blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from kvduplex.common.sampling import SamplingParams
from kvduplex.engine.request import RemoteKVSpec
from kvduplex.engine.request import Request
from kvduplex.kvflow.messages import KVCancel
from kvduplex.kvflow.messages import KVRegister
from kvduplex.kvflow.push_decode import PushSpec
from kvduplex.kvflow.push_prefill import PushPlan
from kvduplex.model.loader import LoadedModel
from kvduplex.transport.messages import ControlMessage
from tests.unit.flow_pair import FIRST
from tests.unit.flow_pair import GREEDY
from tests.unit.flow_pair import PROMPT
from tests.unit.flow_pair import Pair
from tests.unit.flow_pair import Starved
from tests.unit.flow_pair import _reference
from tests.unit.flow_pair import _wait_for
from tests.unit.flow_pair import tiny as tiny  # the module-scoped model fixture


def test_concurrent_push_matches_local(tiny: LoadedModel) -> None:
    with Pair(tiny) as s:

        async def both() -> tuple[list[int], list[int]]:
            return await asyncio.gather(s.prefill("x1"), s.decode("x1"))

        p_out, d_out = asyncio.run(both())
        expected = _reference(tiny)
        assert d_out == expected and p_out == expected[:1]
        assert s.push.stats.num_received == 1 and s.push.stats.num_fallbacks == 0
        assert s.push.stats.num_received_blocks == 5
        s.assert_clean()
        assert s.sender.stats.num_done == 1 and s.sender.stats.transfer_s > 0


def test_chunked_prefill_pushes_each_chunk_layer_by_layer(tiny: LoadedModel) -> None:
    s = Pair(tiny, p_budget=6)  # 18 tokens in chunks of 6: blocks finish mid-chunk
    try:

        async def both() -> tuple[list[int], list[int]]:
            d = asyncio.ensure_future(s.decode("xc"))
            # Registration first, so that every chunk streams.
            await asyncio.to_thread(
                _wait_for, lambda: s.df.receiver.num_waiting() == 1, "registration"
            )
            return await asyncio.gather(s.prefill("xc"), d)

        _, d_out = asyncio.run(both())
        assert d_out == _reference(tiny)
        num_layers = s.p.layout.num_layers
        assert s.sender.stats.num_writes == 3 * num_layers  # one WRITE per layer per chunk
        s.assert_clean()
    finally:
        s.close()


def test_registration_after_prefill_finished(tiny: LoadedModel) -> None:
    with Pair(tiny) as s:
        assert asyncio.run(s.prefill("late")) == _reference(tiny)[:1]
        assert s.in_use(s.ap) == 5  # held for the push
        assert asyncio.run(s.decode("late")) == _reference(tiny)
        assert s.sender.stats.num_writes == 1  # everything at once
        s.assert_clean()


def test_registration_before_prefill_arrives(tiny: LoadedModel) -> None:
    with Pair(tiny) as s:

        async def decode_first() -> tuple[list[int], list[int]]:
            d = asyncio.ensure_future(s.decode("early"))
            await asyncio.to_thread(
                _wait_for, lambda: "early" in s.sender._early, "the early registration"
            )
            return await asyncio.gather(d, s.prefill("early"))

        d_out, _ = asyncio.run(decode_first())
        assert d_out == _reference(tiny)
        s.assert_clean()


def test_decode_prefix_hit_is_not_pushed(tiny: LoadedModel) -> None:
    with Pair(tiny) as s:

        async def run(xid: str, prompt: list[int]) -> list[int]:
            _, out = await asyncio.gather(s.prefill(xid, prompt), s.decode(xid, prompt))
            return out

        asyncio.run(run("h1", PROMPT))
        longer = [*PROMPT, 30, 31, 32, 33, 34, 35]  # 24 tokens: 6 blocks, D has 4 of them
        assert asyncio.run(run("h2", longer)) == _reference(tiny, longer)
        assert s.push.stats.num_skipped_blocks == 4
        assert s.push.stats.num_received_blocks == 5 + 2
        s.assert_clean()


def test_failed_write_makes_decode_compute_locally(tiny: LoadedModel) -> None:
    with Pair(tiny) as s:
        s.tp.fail_next("link down")

        async def both() -> tuple[list[int], list[int]]:
            return await asyncio.gather(s.prefill("xf"), s.decode("xf"))

        _, d_out = asyncio.run(both())
        assert d_out == _reference(tiny)
        assert s.push.stats.num_fallbacks == 1 and s.sender.stats.num_failed == 1
        s.assert_clean()


def test_prefill_that_never_comes_falls_back_and_quarantine_ends(tiny: LoadedModel) -> None:
    with Pair(tiny, wait_s=0.2) as s:
        assert asyncio.run(s.decode("ghost")) == _reference(tiny)
        assert s.push.stats.num_fallbacks == 1
        s.assert_clean()  # registered blocks come back after the quarantine
        assert s.df.receiver.num_waiting() == 0


def test_cancelled_push_is_refused_when_prefill_arrives_later(tiny: LoadedModel) -> None:
    with Pair(tiny) as s:
        assert not s.ap.call(lambda _e: s.sender.cancel("gone", "router")).result(5)
        with pytest.raises(ValueError, match="cancelled"):
            asyncio.run(s.prefill("gone"))
        s.assert_clean()


def test_aborted_decode_keeps_registered_blocks_until_prefill_is_done(tiny: LoadedModel) -> None:
    with Pair(tiny) as s:

        async def leave_early() -> None:
            task = asyncio.ensure_future(s.decode("ab"))
            await asyncio.to_thread(
                _wait_for, lambda: s.df.receiver.num_waiting() == 1, "registration"
            )
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        asyncio.run(leave_early())
        # D told P (KVCancel); P, which never began, confirms that nothing was written,
        # and only then does D let its registered blocks go.
        _wait_for(lambda: s.sender.tables()["send_cancelled_tombstones"] == 1, "P to hear it")
        s.assert_clean()
        with pytest.raises(ValueError, match="cancelled by its receiver"):
            asyncio.run(s.prefill("ab"))  # P refuses the prefill D gave up
        assert s.push.stats.num_received == 0 and s.df.receiver.stats.num_late == 1


def test_registration_mid_forward_writes_finished_layers_then_streams(tiny: LoadedModel) -> None:
    with Pair(tiny) as s:
        held: list[tuple[ControlMessage, str]] = []
        s.pumps[0].on(KVRegister, lambda msg, sender: held.append((msg, sender)))
        orig = s.sender.layer_hook

        def late_hook(plan: PushPlan) -> Callable[[int], None] | None:
            hook = orig(plan)

            def on_layer_done(layer: int) -> None:
                if layer == 0 and held:  # the registration lands while layer 1 is computed
                    msg, sender = held.pop()
                    assert isinstance(msg, KVRegister)
                    s.pf.inbox.heard(msg, sender)  # as the pump does
                if hook is not None:
                    hook(layer)

            return on_layer_done

        s.sender.layer_hook = late_hook  # type: ignore[method-assign]

        async def decode_first() -> list[int]:
            d = asyncio.ensure_future(s.decode("mid"))
            await asyncio.to_thread(_wait_for, lambda: bool(held), "the registration")
            await s.prefill("mid")
            return await d

        assert asyncio.run(decode_first()) == _reference(tiny)
        # Layer 0 in one WRITE when the registration landed, then one per remaining layer.
        assert s.sender.stats.num_writes == s.p.layout.num_layers
        s.assert_clean()


def test_seeded_sampling_continues_where_prefill_stopped(tiny: LoadedModel) -> None:
    with Pair(tiny) as s:
        seeded = SamplingParams(max_tokens=8, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)
        first = SamplingParams(max_tokens=1, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)

        async def both() -> tuple[list[int], list[int]]:
            return await asyncio.gather(
                s.prefill("seeded", params=first), s.decode("seeded", params=seeded)
            )

        p_out, d_out = asyncio.run(both())
        expected = _reference(tiny, params=seeded)
        assert p_out == expected[:1] and d_out == expected
        s.assert_clean()


def test_prefill_queued_longer_than_the_wait_keeps_decode_waiting(tiny: LoadedModel) -> None:
    """P holds the registered job but its engine is busy elsewhere for over D's wait:
    its heartbeats restart D's wait, and D gets the pushed KV instead of recomputing."""
    s = Pair(tiny, wait_s=0.3)
    gate: Starved | None = None
    try:

        def admit() -> None:
            s.sender.expect("q", s.d_peer, len(PROMPT))  # applies the early registration

        async def run() -> list[int]:
            nonlocal gate
            d = asyncio.ensure_future(s.decode("q"))
            await asyncio.to_thread(_wait_for, lambda: "q" in s.sender._early, "registration")
            gate = Starved(s.ap)  # P's engine is busy: its prefill is not scheduled meanwhile
            p = asyncio.ensure_future(_collect(s.ap.generate(
                Request("q", PROMPT, FIRST, hold_blocks_on_finish=True), on_admit=admit)))  # fmt: skip
            # Four heartbeats at 0.1 s intervals: D's original 0.3 s wait is over.
            await asyncio.to_thread(
                _wait_for, lambda: s.df.receiver.stats.num_alive_received >= 4, "heartbeats"
            )
            gate.end()
            await p
            return await d

        assert asyncio.run(run()) == _reference(tiny)
        assert s.push.stats.num_fallbacks == 0 and s.push.stats.num_received == 1
        assert s.sender.stats.num_alive_sent >= 4 and s.sender.stats.num_done == 1
        s.assert_clean()
    finally:
        if gate is not None:
            gate.end()
        s.close()


def test_decode_queued_longer_than_the_wait_keeps_prefill_holding(tiny: LoadedModel) -> None:
    """D's request waits for admission for over P's wait for the registration: D's
    heartbeats keep P holding the computed KV, then P pushes it."""
    s = Pair(tiny, wait_s=0.3)
    gate = Starved(s.ad)  # D's engine is busy: nothing is admitted
    try:

        async def run() -> list[int]:
            d = asyncio.ensure_future(s.decode("dq"))
            assert await s.prefill("dq") == _reference(tiny)[:1]
            await asyncio.to_thread(
                _wait_for, lambda: s.sender.stats.num_waiting_received >= 4, "heartbeats"
            )
            assert s.in_use(s.ap) == 5  # still held for the push
            gate.end()
            return await d

        assert asyncio.run(run()) == _reference(tiny)
        assert s.push.stats.num_fallbacks == 0 and s.sender.stats.num_failed == 0
        s.assert_clean()
    finally:
        gate.end()
        s.close()


def test_decode_request_gone_before_admission_stops_its_heartbeats(tiny: LoadedModel) -> None:
    s = Pair(tiny, wait_s=0.3)
    gate = Starved(s.ad)
    try:

        async def leave_before_admission() -> None:
            task = asyncio.ensure_future(s.decode("orphan"))
            await asyncio.to_thread(_wait_for, lambda: s.push.owns("orphan"), "the spec")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        asyncio.run(leave_before_admission())
        gate.end()
        _wait_for(lambda: not s.push.owns("orphan"), "the orphaned spec to be dropped")
        assert not s.push._spec_waiting_at  # nothing left to send heartbeats for
        s.assert_clean()
    finally:
        gate.end()
        s.close()


async def _collect(gen: object) -> list[int]:
    out: list[int] = []
    async for o in gen:  # type: ignore[attr-defined]
        out.extend(o.new_token_ids)
    return out


def test_cached_tokens_are_prefills_prefix_hits(tiny: LoadedModel) -> None:
    with Pair(tiny) as s:
        asyncio.run(_collect(s.ap.generate(Request("warm", PROMPT, FIRST))))  # P caches PROMPT's blocks

        async def both() -> object:
            await asyncio.wrap_future(s.push.submit(PushSpec("c1", s.p_peer, "http://p", "d-c1")))
            last = None
            d = s.ad.generate(Request("d-c1", PROMPT, GREEDY, remote_kv=RemoteKVSpec("c1")))
            p = asyncio.ensure_future(s.prefill("c1"))
            async for o in d:
                last = o
            await p
            return last

        last = asyncio.run(both())
        assert last.num_cached_tokens == 16 and last.num_local_cached_tokens == 0  # type: ignore[attr-defined]
        s.assert_clean()


def test_unanswered_heartbeats_do_not_extend_prefills_deadline(tiny: LoadedModel) -> None:
    """D gave up (and its KVCancel is lost): it does not acknowledge P's heartbeats,
    so P's deadline stays D's, and P writes nothing into the blocks D let go of."""
    s = Pair(tiny, wait_s=0.3)
    gate: Starved | None = None
    s.pumps[0].on(KVCancel, lambda _msg, _sender: None)  # the cancel never arrives
    try:

        def admit() -> None:
            s.sender.expect("u", s.d_peer, len(PROMPT))

        async def run() -> list[int]:
            nonlocal gate
            d = asyncio.ensure_future(s.decode("u"))
            await asyncio.to_thread(_wait_for, lambda: "u" in s.sender._early, "registration")
            gate = Starved(s.ap)  # P's engine is busy: its prefill is not scheduled meanwhile
            p = asyncio.ensure_future(_collect(s.ap.generate(
                Request("u", PROMPT, FIRST, hold_blocks_on_finish=True), on_admit=admit)))  # fmt: skip
            await asyncio.to_thread(_wait_for, lambda: s.df.receiver.stats.num_alive_received >= 1, "a beat")
            job = s.sender._jobs["u"]
            assert s.ad.call(lambda _e: s.push.cancel("u", "test")).result(5)
            sent = s.sender.stats.num_alive_sent
            # Unanswered beats, until P's own deadline (D's) ends the job.
            await asyncio.to_thread(
                _wait_for, lambda: s.sender.stats.num_alive_sent >= sent + 3 or job.ended,
                "unanswered beats",
            )  # fmt: skip
            assert job.expires_at < time.monotonic()
            gate.end()
            await p
            return await d

        assert asyncio.run(run()) == _reference(tiny)  # computed on D
        assert s.sender.stats.num_writes == 0 and s.sender.stats.num_failed == 1
        assert s.push.stats.num_fallbacks == 1
        s.assert_clean()
    finally:
        if gate is not None:
            gate.end()
        s.close()
