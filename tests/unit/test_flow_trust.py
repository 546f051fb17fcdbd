"""Control messages and transfer ids the flows must not trust, over the in-process
transport: an offer from an engine this instance never handshook with, offers and
KVDone whose envelopes claim another engine, transfer ids that belong to another
request, and the pump's test-only drop hook.

P and D are stepped in one thread (`tests.unit.flow_sim`), but for the pump's own
test, which runs the pump's thread."""

from __future__ import annotations

import threading

import pytest
import torch
from prometheus_client import REGISTRY

from kvduplex.common.limits import RequestRejected
from kvduplex.engine.block_pool import compute_block_hashes
from kvduplex.engine.handle import EngineHandle
from kvduplex.engine.request import Request
from kvduplex.kvflow.lease import LeaseTable
from kvduplex.kvflow.messages import KVDone
from kvduplex.kvflow.messages import KVOffer
from kvduplex.kvflow.messages import KVRegister
from kvduplex.kvflow.messages import ids_digest
from kvduplex.model.loader import LoadedModel
from kvduplex.transport.messages import ControlMessage
from kvduplex.transport.messages import MessageCodec
from kvduplex.transport.notify import NotificationPump
from tests.support.faults import DropMessages
from tests.unit.flow_common import BS
from tests.unit.flow_common import FIRST
from tests.unit.flow_common import PROMPT
from tests.unit.flow_common import tiny as tiny  # the module-scoped model fixture
from tests.unit.flow_sim import Sim


def _offer(s: Sim, xid: str, tokens: list[int]) -> KVOffer:
    """A well-formed offer of `tokens` (whole blocks), keys as P computes them."""
    keys = compute_block_hashes(tokens, BS, s.p.kv_manager.identity)
    return KVOffer(xid, "session", [bytes(k) for k in keys], tokens)


def _p_cached_blocks(s: Sim, tokens: list[int]) -> int:
    keys = compute_block_hashes(tokens, BS, s.p.kv_manager.identity)
    return int(s.p.kv_manager.num_cached_prefix(keys))


def _refused(reason: str) -> float:
    """P's and D's transports count on the process-wide registry (the Sim's default)."""
    value = REGISTRY.get_sample_value("kvduplex_kv_notifications_refused_total", {"reason": reason})
    return value or 0.0


def test_offer_from_an_engine_that_never_handshook_is_refused(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A third endpoint holds P's metadata (it connected to P), but P never connected
    to it: P's transport refuses its offer (unknown agent), nothing is allocated or
    cached, and it hears nothing."""
    s = Sim(tiny, monkeypatch, wait_s=1.0)
    s.tp.unknown_agent_grace_s = 0.2
    rogue = s.fabric.endpoint(torch.zeros_like(s.d.kv_pool), s.d.layout)
    to_p = rogue.connect(s.tp.local_metadata())
    tokens = PROMPT[:16]  # 4 whole blocks
    acceptor = s.pf.acceptor
    before = _refused("unknown_agent")
    rogue.send_notif(to_p, MessageCodec().encode(_offer(s, "rogue-1", tokens)), "rogue-1")
    s.deliver()
    assert _refused("unknown_agent") == before, "held for its grace first"
    s.run(lambda: _refused("unknown_agent") == before + 1)  # the refusal
    assert s.clock.now - 1000.0 >= 0.2
    assert acceptor.stats.num_accepted == 0 and acceptor.stats.num_refused == 0
    assert s.pf.receiver.num_waiting() == 0
    assert _p_cached_blocks(s, tokens) == 0
    s.assert_clean()
    assert rogue.poll_notifs() == [], "no registration or decline for a stranger"
    # The same offer from the engine P did handshake with is taken (registered).
    acceptor.accept(_offer(s, "d-1", tokens), s.td.engine_id)
    assert acceptor.stats.num_accepted == 1
    s.assert_clean()  # D never WRITEs it: P's wait ends, its quarantine too
    assert _p_cached_blocks(s, tokens) == 0


def test_forged_offer_and_done_never_enter_prefills_cache(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KVOffer + KVDone whose envelopes claim to come from D, sent by a stranger and by a
    member that is not D: P's transport refuses every one, so P neither allocates nor
    caches blocks nobody wrote. A KVDone forged for a real offer P registered does not
    end that wait either: it runs out, and nothing is cached."""
    s = Sim(tiny, monkeypatch, wait_s=1.0)
    s.tp.unknown_agent_grace_s = 0.2
    codec = MessageCodec()
    tokens = PROMPT[:16]
    acceptor, receiver = s.pf.acceptor, s.pf.receiver
    stranger = s.fabric.endpoint(torch.zeros_like(s.d.kv_pool), s.d.layout)
    member = s.fabric.endpoint(torch.zeros_like(s.d.kv_pool), s.d.layout)
    s.tp.connect(member.local_metadata())  # P handshook with it: a cluster member
    forged, unknown = _refused("forged_sender"), _refused("unknown_agent")
    for ep, xid in ((stranger, "forged-1"), (member, "forged-2")):
        to_p = ep.connect(s.tp.local_metadata())
        for msg in (_offer(s, xid, tokens), KVDone(xid, len(tokens))):
            ep.forge_next_sender(s.td.engine_id)
            ep.send_notif(to_p, codec.encode(msg), xid)
    s.run(lambda: _refused("unknown_agent") == unknown + 2)  # the stranger's refusals
    assert _refused("forged_sender") == forged + 2, "the member's claims of D's id"
    assert acceptor.stats.num_accepted == 0 and receiver.num_waiting() == 0
    # D's own offer, registered by P; then a KVDone for it that claims to be D's.
    real = _offer(s, "real-1", tokens)
    acceptor.accept(real, s.td.engine_id)
    assert acceptor.stats.num_accepted == 1 and receiver.is_waiting("real-1")
    member.forge_next_sender(s.td.engine_id)
    done = codec.encode(KVDone("real-1", len(tokens)))
    member.send_notif(member.connect(s.tp.local_metadata()), done, "real-1")
    assert _refused("forged_sender") == forged + 3
    s.assert_clean()  # the wait ran out (D never wrote), its blocks went back
    assert receiver.stats.num_received == 0
    assert _p_cached_blocks(s, tokens) == 0


def test_push_prefill_under_another_requests_id_is_refused(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A push named like a request P holds (a pull's leased prefill) must neither start
    nor, when cancelled, release or abort that request."""
    s = Sim(tiny, monkeypatch)
    s.p.add_request(Request("lease-1", PROMPT, FIRST, hold_blocks_on_finish=True))
    s.run(lambda: s.finished("lease-1"))
    in_use = s.in_use(s.p)
    assert in_use > 0
    with pytest.raises(ValueError, match="in use by another request"):
        s.pf.sender.expect("lease-1", s.d_peer, PROMPT)
    assert s.pf.sender.num_jobs() == 0 and s.in_use(s.p) == in_use
    # A second request under the held id: rejected, nothing aborted.
    with pytest.raises(RequestRejected, match="already in use"):
        s.p.add_request(Request("lease-1", PROMPT, FIRST, hold_blocks_on_finish=True))
    s.step()
    assert s.in_use(s.p) == in_use, "the held request lost its blocks"
    leases = LeaseTable(EngineHandle(s.ap), lease_s=30.0)
    assert leases.release("lease-1") is False, "held, but not under a lease"
    leases.start("lease-1")
    assert leases.release("lease-1") is True
    s.assert_clean()


def test_transfer_ids_waited_on_are_not_taken_twice(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch)
    push = s.df.push
    first = push.submit(s.push_spec("x1"))  # from a route: through the inbox
    other = push.submit(s.push_spec("x1"))
    s.step()  # the engine thread drains them, in order
    assert first.result(0) is None
    with pytest.raises(ValueError, match="in use"):
        other.result(0)
    assert push.cancel("x1", "test")
    receiver = s.df.receiver
    blocks = s.d.kv_manager.try_allocate_blocks(2)
    assert blocks is not None
    ok = receiver.expect("x2", s.p_peer, blocks, 0, list(range(2 * BS)), lambda _m: None, lambda *_: None)
    refs = s.d.block_pool.ref_count(blocks[0])
    again = receiver.expect("x2", s.p_peer, blocks, 0, list(range(2 * BS)), lambda _m: None, lambda *_: None)
    assert s.d.block_pool.ref_count(blocks[0]) == refs, "no second reference"
    receiver.cancel("x2", "test")
    s.d.kv_manager.release_blocks(blocks)
    assert (ok, again, refs) == (True, False, 2)
    s.assert_clean()  # P cancels its side; D's quarantine ends


def test_pump_drops_the_named_message_types_only(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pump's own thread (the sim, which would take the notifications first, is not
    stepped): a KVRegister is dropped by its filter, the KVDone behind it dispatched."""
    s = Sim(tiny, monkeypatch)
    got: list[str] = []
    arrived = threading.Event()
    pump = NotificationPump(s.tp, 0.01, accept=DropMessages(frozenset({"kv_register"})))

    def record(msg: ControlMessage, _sender: str) -> None:
        got.append(msg.xid)
        arrived.set()

    pump.on(KVRegister, record)
    pump.on(KVDone, record)
    pump.start()
    try:
        codec = MessageCodec()
        s.td.send_notif(s.p_peer, codec.encode(KVRegister("r", [1], 0, BS, 1.0, 1.0, ids_digest(range(BS)))), "r")
        s.td.send_notif(s.p_peer, codec.encode(KVDone("d", BS, 7, 0)), "d")
        assert arrived.wait(10), "the KVDone never came"
        assert got == ["d"]
        assert pump.num_dropped == 1
    finally:
        pump.close()
    with pytest.raises(ValueError, match="kv_registr"):
        DropMessages(frozenset({"kv_registr"}))
