"""Push, the duplex return and pull between two engines stepped in one thread
(`tests.unit.flow_sim`): no threads, no polling, no sleeps; a fake clock moves only
when nothing else can.

Then a seeded storm over every flow at once: push, push with the duplex return, push
with the retained turn (prefill READs it), and pull, in concurrent multi-turn sessions
whose later turns reuse what the returns cached. Faults at random moments: WRITEs and
READs that fail, hang to their deadline, or land garbage after it; notifications
dropped, duplicated and reordered; clients that leave mid-answer; a cluster member
meddling with others' transfers (as itself, or forging another's id). What must hold:
every answer that completes is token-exact against a colocated engine; no late
transfer lands in a block that is free, cached, or owned by a request other than the
one waiting for it; afterwards every flow table is empty and both pools are clean."""

from __future__ import annotations

import random
from concurrent.futures import Future
from dataclasses import dataclass
from dataclasses import field

import pytest
import torch

from kvduplex.common.sampling import SamplingParams
from kvduplex.engine.block_pool import compute_block_hashes
from kvduplex.engine.request import Request
from kvduplex.kvflow.messages import KVCancel
from kvduplex.kvflow.messages import KVDone
from kvduplex.kvflow.messages import KVFailed
from kvduplex.kvflow.messages import KVRegister
from kvduplex.kvflow.messages import ids_digest
from kvduplex.kvflow.return_pull import RetainSpec
from kvduplex.model.loader import LoadedModel
from kvduplex.transport.messages import ControlMessage
from kvduplex.transport.messages import MessageCodec
from tests.support.fake_transport import NotifChaos
from tests.unit.flow_common import BS
from tests.unit.flow_common import PROMPT
from tests.unit.flow_common import _engine
from tests.unit.flow_common import _reference
from tests.unit.flow_common import tiny as tiny  # the module-scoped model fixture
from tests.unit.flow_sim import Sim

ANSWER = SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True)


def test_push_lands_and_decode_continues_from_prefills_token(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = Sim(tiny, monkeypatch)
    sim.push("x1")
    sim.run(lambda: sim.finished("d-x1"))
    assert sim.outputs["d-x1"] == _reference(tiny)
    assert sim.outputs["x1"] == _reference(tiny)[:1]
    assert sim.df.push.stats.num_received == 1 and sim.df.push.stats.num_fallbacks == 0
    assert sim.pf.sender.stats.num_done == 1
    assert sim.clock.now == 1000.0, "nothing had to wait for the clock"
    sim.assert_clean()


def test_a_registration_after_prefill_began_is_written_at_once(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P computes its prompt before D registers (D's request comes later): the late
    registration WRITEs what P computed at once, and D decodes from it."""
    sim = Sim(tiny, monkeypatch)
    sim.push("late", to_d=False)
    sim.run(lambda: sim.finished("late"))  # P's first token, its blocks held for the job
    assert sim.in_use(sim.p) == 5
    sim.push_decode("late")
    sim.run(lambda: sim.finished("d-late"))
    assert sim.outputs["d-late"] == _reference(tiny)
    assert sim.pf.sender.stats.num_late_registrations == 1
    sim.assert_clean()


def test_a_push_without_registration_is_dropped_at_its_deadline(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D never registers: P's job ends after its wait (on the fake clock) and P's held
    prefill blocks go back."""
    sim = Sim(tiny, monkeypatch, wait_s=2.0)
    sim.push("lonely", to_d=False)
    sim.run(lambda: sim.pf.sender.num_jobs() == 0)
    assert 2.0 < sim.clock.now - 1000.0 < 2.5
    assert sim.pf.sender.stats.num_failed == 1
    sim.assert_clean()


def _p_cached(sim: Sim, tokens: list[int]) -> int:
    keys = compute_block_hashes(tokens, BS, sim.p.kv_manager.identity)
    return sim.p.kv_manager.num_cached_prefix(keys)


def test_duplex_return_fills_prefills_cache(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A finished turn's blocks go back into P's prefix cache (the answer's full blocks
    that P lacks), so the next turn's prompt hits there."""
    sim = Sim(tiny, monkeypatch)
    sim.push("t1", PROMPT, ANSWER, session="s1")
    sim.run(lambda: sim.finished("d-t1"))
    history = PROMPT + sim.outputs["d-t1"]
    sim.settle()
    num_full = (len(history) - 1) // BS  # the last token's KV is never computed
    assert sim.df.offerer.stats.num_done == 1
    assert _p_cached(sim, history[: num_full * BS]) == num_full
    assert sim.pf.acceptor.stats.num_accepted == 1
    sim.assert_clean()


def test_pull_reads_prefills_held_blocks(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    sim = Sim(tiny, monkeypatch)
    sim.pull("pl")
    sim.run(lambda: sim.finished("pl"))
    sim.pull_decode("pl")
    sim.run(lambda: sim.finished("d-pl"))
    assert sim.outputs["d-pl"] == _reference(tiny)
    assert sim.df.pull.stats.num_pulled_blocks == 5 and sim.df.pull.stats.num_failed == 0
    assert not sim.p.scheduler._held, "decode's release ended prefill's hold"
    sim.assert_clean()


def test_a_late_write_keeps_its_blocks_until_it_lands(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P's WRITE fails at its deadline but lands later: nobody reuses the blocks under
    it meanwhile, and D answers right (it recomputes over what landed)."""
    sim = Sim(tiny, monkeypatch, wait_s=30.0, transfer_timeout_s=0.3, quarantine_s=30.0)
    sim.tp.land_late_next(1.0, corrupt=True)
    sim.push("xl")
    sim.run(lambda: sim.finished("d-xl"))
    assert sim.outputs["d-xl"] == _reference(tiny)
    assert sim.df.push.stats.num_fallbacks == 1
    sim.assert_clean()


# ---- the storm ----

STORM_ANSWER = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
MODES = ("push", "push+duplex", "push+retained", "pull")


class Member:
    """A cluster member (P and D handshook with it) that meddles in others' transfers:
    messages as itself, or with an envelope claiming to be P or D (a forged sender,
    which the transport refuses)."""

    def __init__(self, sim: Sim, rng: random.Random) -> None:
        self.sim, self.rng = sim, rng
        self.ep = sim.fabric.endpoint(
            torch.zeros_like(sim.d.kv_pool), sim.d.layout, engine_id="member"
        )
        sim.tp.connect(self.ep.local_metadata())
        sim.td.connect(self.ep.local_metadata())
        self.to_p = self.ep.connect(sim.tp.local_metadata())
        self.to_d = self.ep.connect(sim.td.local_metadata())
        self.codec = MessageCodec()
        self.num_sent = 0

    def meddle(self, xid: str, prompt: list[int]) -> None:
        """One message about ``xid`` to P or D that neither should act on."""
        msgs: list[tuple[ControlMessage, bool]] = [
            (KVCancel(xid, "forged"), True),
            (KVRegister(xid, [1, 2, 3, 4, 5], 0, len(prompt), 5.0, 5.0, ids_digest(prompt)), True),
            (KVDone(xid, len(prompt), 7), False),
            (KVFailed(xid, "forged"), False),
        ]
        msg, to_p = self.rng.choice(msgs)
        if self.rng.random() < 0.3:  # claim to be the transfer's real peer
            self.ep.forge_next_sender(self.sim.td.engine_id if to_p else self.sim.tp.engine_id)
        self.ep.send_notif(self.to_p if to_p else self.to_d, self.codec.encode(msg), xid)
        self.num_sent += 1


class Reference:
    """Colocated greedy answers, computed once per prompt."""

    def __init__(self, tiny: LoadedModel) -> None:
        self.engine = _engine(tiny)
        self._memo: dict[tuple[int, ...], list[int]] = {}

    def answer(self, prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in self._memo:
            rid = f"ref{len(self._memo)}"
            self.engine.add_request(Request(rid, prompt, STORM_ANSWER))
            out: list[int] = []
            while self.engine.has_unfinished():
                for o in self.engine.step():
                    out.extend(o.new_token_ids)
            self._memo[key] = out
        return self._memo[key]


@dataclass
class Session:
    sid: str
    mode: str
    history: list[int] = field(default_factory=list)


@dataclass
class Turn:
    session: Session
    xid: str
    prompt: list[int]


@dataclass
class Tally:
    num_requests: int = 0
    num_checked: int = 0
    num_left: int = 0
    num_refused: int = 0
    num_reconnects: int = 0
    faults: dict[str, int] = field(default_factory=dict)


class Storm:
    """Waves of one turn of every session at once, under seeded faults."""

    def __init__(self, tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
        self.sim = sim = Sim(
            tiny, monkeypatch, wait_s=0.6, transfer_timeout_s=0.3, quarantine_s=1.0
        )
        for i, ep in enumerate((sim.tp, sim.td)):
            ep.chaos = NotifChaos(seed * 10 + i, p_drop=0.03, p_dup=0.03, p_reorder=0.03)
        self.rng = random.Random(seed)
        self.member = Member(sim, self.rng)
        self.ref = Reference(tiny)
        self.tally = Tally()
        self._num_xids = 0

    def _inject(self, mode: str) -> None:
        """Maybe make the next transfer of P (a push's WRITEs, a retained turn's READ) and
        of D (a pull's READ, a return's WRITE) fail, hang to its deadline, or land garbage
        after it."""
        for name, ep, modes in (
            ("p", self.sim.tp, ("push", "push+duplex", "push+retained")),
            ("d", self.sim.td, ("pull", "push+duplex")),
        ):  # fmt: skip
            r = self.rng.random()
            kind = "fail" if r < 0.06 else "hang" if r < 0.10 else "late" if r < 0.18 else None
            if kind is None or mode not in modes:
                continue
            self.tally.faults[f"{name}-{kind}"] = self.tally.faults.get(f"{name}-{kind}", 0) + 1
            if kind == "fail":
                ep.fail_next("injected")
            elif kind == "hang":
                ep.hang_next()
            else:  # lands soon, a while later, or never (until its endpoint is torn down)
                late_s = self.rng.choice([self.rng.uniform(0.0, 0.4), 1.0, None])
                ep.land_late_next(late_s, corrupt=True)

    def wave(self, sessions: list[Session]) -> None:
        """One turn of each session, all at once; every answer checked."""
        sim, rng = self.sim, self.rng
        self.tally.num_reconnects += sim.reconnect()
        turns: list[Turn] = []
        for session in sessions:
            self._num_xids += 1
            new = [rng.randrange(1, 250) for _ in range(rng.randrange(3, 14))]
            turns.append(Turn(session, f"{session.sid}-{self._num_xids}", session.history + new))
            self._inject(session.mode)
            if rng.random() < 0.06:
                sim.leave_after(f"d-{turns[-1].xid}", 2)
        # Before the prompt: a pull's prefill, a retained turn's READ by P.
        reads = [self._read_retained(t) for t in turns if t.session.mode == "push+retained"]
        for t in turns:
            if t.session.mode == "pull":
                sim.pull(t.xid, t.prompt)
        pulls = [t.xid for t in turns if t.session.mode == "pull"]
        sim.run(lambda: all(f.done() for f in reads) and all(map(sim.finished, pulls)))
        for t in turns:
            self.tally.num_requests += 1
            if t.session.mode == "pull":
                sim.pull_decode(t.xid, t.prompt, STORM_ANSWER)
            else:
                self._push(t)
            for _ in range(rng.randint(0, 2)):
                self.member.meddle(t.xid, t.prompt)
        sim.run(lambda: all(sim.finished(f"d-{t.xid}") for t in turns))
        for t in turns:
            rid = f"d-{t.xid}"
            if sim.finish[rid] == "abort":  # its client left
                self.tally.num_left += 1
                continue
            expected = self.ref.answer(t.prompt)
            assert sim.outputs[rid] == expected, f"{t.xid} ({t.session.mode})"
            self.tally.num_checked += 1
            t.session.history = t.prompt + sim.outputs[rid]

    def _push(self, t: Turn) -> None:
        sim, sid = self.sim, t.session.sid
        try:
            sim.push_prefill(t.xid, t.prompt)
        except ValueError:  # refused (a meddler's early cancel): D answers anyway
            self.tally.num_refused += 1
        meta = RetainSpec(sid) if t.session.mode == "push+retained" else None
        session = sid if t.session.mode == "push+duplex" else None
        sim.push_decode(t.xid, t.prompt, STORM_ANSWER, session=session, meta=meta)

    def _read_retained(self, t: Turn) -> Future[int]:
        """P READs what it lacks of the session's retained turn on D (0 if none)."""
        sim = self.sim
        info = sim.df.retainer.describe(t.session.sid)
        if info is None:
            done: Future[int] = Future()
            done.set_result(0)
            return done
        return sim.pf.reader.start(
            sim.d_peer, f"{t.xid}-r", info["block_ids"], info["keys"], info["token_ids"]
        )


@pytest.mark.parametrize("seed", [1, 2, 3, 6])  # each one's faults cover every kind
def test_seeded_storm_every_answer_is_exact_and_pools_end_clean(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """8 sessions (2 of each mode), 7 turns each: 56 requests under every fault kind
    (the runs are deterministic: the asserts on what a seed covered hold for these)."""
    storm = Storm(tiny, monkeypatch, seed)
    sim, t = storm.sim, storm.tally
    sessions = [Session(f"s{i}", MODES[i % len(MODES)]) for i in range(8)]
    for _ in range(7):
        storm.wave(sessions)
    sim.settle(max_s=300)  # deadlines, quarantines, late landings, retained leases run out
    assert sim.tp.num_late() == 0 and sim.td.num_late() == 0
    sim.assert_clean()  # late landings checked too: `Sim.late_problems`
    summary = (t, sim.df.push.stats, sim.df.pull.stats)
    assert t.num_requests == 56 and t.num_checked + t.num_left == t.num_requests, summary
    assert t.num_checked >= 45, summary
    chaos = [ep.chaos for ep in (sim.tp, sim.td) if ep.chaos is not None]
    notif_faults = sum(c.num_dropped + c.num_duplicated + c.num_reordered for c in chaos)
    assert sum(t.faults.values()) >= 8 and notif_faults >= 5, (t.faults, notif_faults)
    assert {k.split("-")[1] for k in t.faults} == {"fail", "hang", "late"}, t.faults
    assert sim.num_late_landed > 0 and storm.member.num_sent > 0
    assert t.num_reconnects > 0, "endpoints torn down under late transfers were reconnected"
    # Later turns reused what the returns brought back; pulls and pushes landed.
    assert sim.pf.acceptor.stats.num_received_blocks > 0
    assert sim.pf.reader.num_read_blocks > 0
    assert sim.df.pull.stats.num_pulls > 0 and sim.df.push.stats.num_received > 0, summary
