"""Push, the duplex return and pull between two engines stepped in one thread
(`tests.unit.flow_sim`): no threads, no polling, no sleeps; a fake clock moves only
when nothing else can. Then a seeded storm: late landings, dropped, duplicated and
reordered notifications, and a cluster member forging messages."""

from __future__ import annotations

import random

import pytest
import torch

from kvduplex.common.sampling import SamplingParams
from kvduplex.engine.block_pool import compute_block_hashes
from kvduplex.kvflow.messages import KVCancel
from kvduplex.kvflow.messages import KVDone
from kvduplex.kvflow.messages import KVFailed
from kvduplex.kvflow.messages import KVRegister
from kvduplex.model.loader import LoadedModel
from kvduplex.transport.messages import ControlMessage
from kvduplex.transport.messages import MessageCodec
from tests.support.fake_transport import NotifChaos
from tests.unit.flow_pair import BS
from tests.unit.flow_pair import PROMPT
from tests.unit.flow_pair import _reference
from tests.unit.flow_pair import tiny as tiny  # the module-scoped model fixture
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


class Member:
    """A cluster member (P and D handshook with it) that meddles in others' transfers:
    messages as itself, or with an envelope claiming to be P or D (a forged sender,
    which the transport refuses)."""

    def __init__(self, sim: Sim, rng: random.Random) -> None:
        self.sim, self.rng = sim, rng
        self.ep = sim.fabric.endpoint(torch.zeros_like(sim.d.kv_pool), sim.d.layout)
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
            (KVRegister(xid, [1, 2, 3, 4, 5], 0, len(prompt), 5.0, 5.0), True),
            (KVDone(xid, len(prompt), 7), False),
            (KVFailed(xid, "forged"), False),
        ]
        msg, to_p = self.rng.choice(msgs)
        if self.rng.random() < 0.3:  # claim to be the transfer's real peer
            self.ep.forge_next_sender(self.sim.td.engine_id if to_p else self.sim.tp.engine_id)
        self.ep.send_notif(self.to_p if to_p else self.to_d, self.codec.encode(msg), xid)
        self.num_sent += 1


def _transfer_faults(sim: Sim, rng: random.Random) -> int:
    """Maybe make the next transfer of P and of D fail, or land garbage late."""
    num = 0
    for ep in (sim.tp, sim.td):
        r = rng.random()
        if r < 0.08:
            ep.fail_next("injected")
            num += 1
        elif r < 0.16:
            ep.land_late_next(rng.choice([0.2, 1.0, 3.0]), corrupt=True)
            num += 1
    return num


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_seeded_storm_every_answer_is_exact_and_pools_end_clean(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """Rounds of up to four requests at once (pushes, some with the duplex return, and
    pulls) under: notifications dropped, duplicated and reordered; WRITEs and READs that
    fail, or fail at their deadline and land garbage later; and a member meddling with
    cancels, registrations and ends, as itself or claiming another's id. Every answer is
    token-exact, no late transfer lands in a block not reserved for it, and both pools
    end clean."""
    rng = random.Random(seed)
    sim = Sim(tiny, monkeypatch, wait_s=1.0, transfer_timeout_s=0.3, quarantine_s=1.0)
    for i, ep in enumerate((sim.tp, sim.td)):
        ep.chaos = NotifChaos(seed * 10 + i, p_drop=0.05, p_dup=0.05, p_reorder=0.05)
    member = Member(sim, rng)
    references: dict[tuple[int, ...], list[int]] = {}
    num_faults = 0
    n = 0
    for _ in range(6):
        batch: list[tuple[str, str, list[int]]] = []
        for _ in range(rng.randint(1, 4)):
            n += 1
            xid, prompt = f"s{seed}-{n}", [*PROMPT[: rng.randint(5, 18)], 60 + n % 7]
            batch.append((xid, rng.choice(["push", "push", "duplex", "pull"]), prompt))
            num_faults += _transfer_faults(sim, rng)
        for xid, mode, prompt in batch:
            if mode == "pull":
                sim.pull(xid, prompt)
            else:
                sim.push(xid, prompt, session=f"sess-{xid}" if mode == "duplex" else None)
            for _ in range(rng.randint(0, 2)):
                member.meddle(xid, prompt)
        pulls = [(xid, prompt) for xid, mode, prompt in batch if mode == "pull"]
        prefilled = [xid for xid, _ in pulls]
        sim.run(lambda prefilled=prefilled: all(map(sim.finished, prefilled)))  # type: ignore[misc]
        for xid, prompt in pulls:
            sim.pull_decode(xid, prompt)
        answered = [f"d-{xid}" for xid, _, _ in batch]
        sim.run(lambda answered=answered: all(map(sim.finished, answered)))  # type: ignore[misc]
        for xid, mode, prompt in batch:
            key = tuple(prompt)
            if key not in references:
                references[key] = _reference(tiny, prompt)
            assert sim.outputs[f"d-{xid}"] == references[key], f"{xid} ({mode})"
    assert member.num_sent > 0 and num_faults > 0
    sim.assert_clean()
