"""A seeded storm over every flow at once, on two engines joined by the in-process
fabric: push, push with the duplex return, push with the vLLM-style retained turn
(prefill READs it), and pull, in multi-turn sessions whose later turns reuse what
the returns cached. Faults at random moments: WRITEs and READs that fail, hang to
their deadline, or land garbage after their deadline; notifications dropped,
duplicated and reordered; clients that leave mid-answer.

What must hold: every answer that completes is token-exact against a colocated
engine; no late transfer lands in a block that is free, cached, or owned by a
request other than the one waiting for it; afterwards every flow table is empty
and both pools are clean."""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass
from dataclasses import field

import pytest

from kvduplex.common.sampling import SamplingParams
from kvduplex.engine.request import RemoteKVSpec
from kvduplex.engine.request import Request
from kvduplex.kvflow.pull import PullSpec
from kvduplex.kvflow.pull import block_ids_of
from kvduplex.kvflow.push_decode import PushSpec
from kvduplex.kvflow.return_pull import RetainSpec
from kvduplex.kvflow.returns import ReturnSpec
from kvduplex.model.loader import LoadedModel
from kvduplex.transport.protocol import TransferOp
from tests.support.fake_transport import NotifChaos
from tests.unit.flow_pair import FIRST
from tests.unit.flow_pair import Pair
from tests.unit.flow_pair import _engine
from tests.unit.flow_pair import _wait_for
from tests.unit.flow_pair import landing_problems
from tests.unit.flow_pair import tiny as tiny  # the module-scoped model fixture

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ANSWER = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
MODES = ("push", "push+duplex", "push+retained", "pull")
NUM_SESSIONS = 8
NUM_TURNS = 7  # 8 x 7 = 56 sessions turns per round; 4 rounds: 224 requests


@dataclass
class Session:
    sid: str
    mode: str
    history: list[int] = field(default_factory=list)


@dataclass
class Tally:
    num_requests: int = 0
    num_checked: int = 0
    num_left: int = 0
    num_reconnects: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)


class Reference:
    """Colocated greedy answers, computed once per prompt."""

    def __init__(self, tiny: LoadedModel) -> None:
        self.engine = _engine(tiny)
        self._memo: dict[tuple[int, ...], list[int]] = {}
        self._n = 0

    def answer(self, prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in self._memo:
            self._n += 1
            rid = f"ref{self._n}"
            self.engine.add_request(Request(rid, prompt, ANSWER))
            out: list[int] = []
            while self.engine.has_unfinished():
                for o in self.engine.step():
                    out.extend(o.new_token_ids)
            self._memo[key] = out
        return self._memo[key]


class Storm:
    def __init__(self, tiny: LoadedModel, seed: int) -> None:
        self.s = s = Pair(tiny, wait_s=0.6, transfer_timeout_s=0.3, quarantine_s=1.0)
        self.rng = random.Random(seed)
        self.ref = Reference(tiny)
        self.tally = Tally()
        s.tp.late_check = lambda post: self.tally.violations.extend(landing_problems(
            s.ad if post.handle.op is TransferOp.WRITE else s.ap, post
        ))  # fmt: skip
        s.td.late_check = lambda post: self.tally.violations.extend(landing_problems(
            s.ap if post.handle.op is TransferOp.WRITE else s.ad, post
        ))  # fmt: skip
        for i, ep in enumerate((s.tp, s.td)):
            ep.chaos = NotifChaos(seed * 10 + i, p_drop=0.03, p_dup=0.03, p_reorder=0.03)
        # Pull: decode's release of prefill's lease ends the held request on P.
        s.df.pull._release = lambda _url, xid: s.ap.call(lambda e: e.scheduler.release_held(xid))
        self._xids = 0

    def _xid(self, session: Session) -> str:
        self._xids += 1
        return f"{session.sid}-{self._xids}"

    def _inject(self) -> None:
        for name, ep in (("p", self.s.tp), ("d", self.s.td)):
            r = self.rng.random()
            kind = "fail" if r < 0.06 else "hang" if r < 0.10 else "late" if r < 0.18 else None
            if kind is None:
                continue
            self.tally.faults[f"{name}-{kind}"] = self.tally.faults.get(f"{name}-{kind}", 0) + 1
            if kind == "fail":
                ep.fail_next("injected")
            elif kind == "hang":
                ep.hang_next()
            else:
                ep.land_late_next(self.rng.uniform(0.0, 0.4), corrupt=True)

    def _reconnect(self) -> None:
        """What each instance's peer directory does: a peer whose endpoint a flow tore
        down is connected afresh at its next use."""
        s = self.s
        if not s.tp.is_connected(s.td.engine_id):
            self.tally.num_reconnects += 1
            s.d_peer = s.tp.connect(s.td.local_metadata())
        if not s.td.is_connected(s.tp.engine_id):
            self.tally.num_reconnects += 1
            s.p_peer = s.td.connect(s.tp.local_metadata())

    async def turn(self, session: Session) -> None:
        self._reconnect()
        new = [self.rng.randrange(1, 250) for _ in range(self.rng.randrange(3, 14))]
        prompt = session.history + new
        self._inject()
        leave_after = 2 if self.rng.random() < 0.06 else None
        xid = self._xid(session)
        self.tally.num_requests += 1
        if session.mode == "pull":
            out = await self._pull(xid, prompt, leave_after)
        else:
            out = await self._push(session, xid, prompt, leave_after)
        if out is None:
            self.tally.num_left += 1
            return
        expected = self.ref.answer(prompt)
        assert out == expected, f"{xid} ({session.mode}): {out} != {expected}"
        self.tally.num_checked += 1
        session.history = prompt + out

    async def _collect(self, req: Request, leave_after: int | None) -> list[int] | None:
        out: list[int] = []
        gen = self.s.ad.generate(req)
        try:
            async for o in gen:
                out.extend(o.new_token_ids)
                if leave_after is not None and len(out) >= leave_after:
                    return None  # the client leaves: closing the stream aborts
        finally:
            await gen.aclose()  # type: ignore[attr-defined]
        return out

    async def _push(
        self, session: Session, xid: str, prompt: list[int], leave_after: int | None
    ) -> list[int] | None:
        s = self.s
        meta: object = None
        if session.mode == "push+duplex":
            meta = ReturnSpec(session.sid, s.p_peer)
        elif session.mode == "push+retained":
            meta = RetainSpec(session.sid)
            await self._read_retained(session, xid)
        s.push.submit(PushSpec(xid, s.p_peer, "http://p", f"d-{xid}")).result(5)
        req = Request(
            f"d-{xid}", prompt, ANSWER, remote_kv=RemoteKVSpec(xid),
            hold_blocks_on_finish=meta is not None, connector_meta=meta,
        )  # fmt: skip
        p = asyncio.ensure_future(s.prefill(xid, prompt))
        try:
            return await self._collect(req, leave_after)
        finally:
            with contextlib.suppress(Exception):  # refused or stopped: D answers anyway
                await p

    async def _read_retained(self, session: Session, xid: str) -> None:
        s = self.s
        info = await asyncio.wrap_future(s.ad.call(lambda _e: s.df.retainer.describe(session.sid)))
        if info is None:
            return
        fut = await asyncio.wrap_future(s.ap.call(lambda _e: s.pf.reader.start(
            s.d_peer, f"{xid}-r", info["block_ids"], info["keys"], info["token_ids"],
        )))  # fmt: skip
        await asyncio.wrap_future(fut)

    async def _pull(self, xid: str, prompt: list[int], leave_after: int | None) -> list[int] | None:
        s = self.s
        async for _ in s.ap.generate(Request(xid, prompt, FIRST, hold_blocks_on_finish=True)):
            pass
        held = await asyncio.wrap_future(s.ap.call(lambda e: block_ids_of(e, xid)))
        assert held is not None
        await asyncio.wrap_future(s.df.pull.submit(PullSpec(
            xid, s.p_peer, "http://p", held["block_ids"], held["num_tokens"],
            num_cached_tokens=held["num_cached_tokens"], request_id=f"d-{xid}",
        )))  # fmt: skip
        req = Request(f"d-{xid}", prompt, ANSWER, remote_kv=RemoteKVSpec(xid))
        return await self._collect(req, leave_after)

    def settle(self) -> None:
        """Let every deadline, quarantine and late landing run out; let go of retained turns."""
        s = self.s
        r = s.df.retainer

        def let_go() -> None:
            r._by_session = {k: (rid, 0.0, n) for k, (rid, _, n) in r._by_session.items()}
            r._pins = [(0.0, b) for _, b in r._pins]
            r._expire()

        def quiet() -> bool:
            s.ad.call(lambda _e: let_go()).result(10)
            p = s.ap.call(lambda _e: s.pf.tables()).result(10)
            d = s.ad.call(lambda _e: s.df.tables()).result(10)
            busy = {k: v for k, v in {**p, **d}.items() if v and not k.endswith("tombstones")}
            return not busy and s.tp.num_late() == 0 and s.td.num_late() == 0

        _wait_for(quiet, "every flow to end", timeout_s=60)
        s.assert_clean()


@pytest.mark.parametrize("seed", [1])
def test_storm_of_faults_over_every_flow_is_token_exact_and_leaks_nothing(
    tiny: LoadedModel, seed: int
) -> None:
    storm = Storm(tiny, seed)
    try:
        sessions = [Session(f"s{i}", MODES[i % len(MODES)]) for i in range(NUM_SESSIONS)]

        async def run_session(session: Session) -> None:
            for _ in range(NUM_TURNS):
                await storm.turn(session)

        async def run() -> None:
            for _ in range(4):  # rounds: sessions start afresh on a warm cache
                for session in sessions:
                    session.history = []
                await asyncio.gather(*(run_session(x) for x in sessions))

        asyncio.run(run())
        storm.settle()
        t = storm.tally
        assert t.violations == []
        summary = (t, storm.s.push.stats, storm.s.df.pull.stats)
        assert t.num_requests >= 200 and t.num_checked + t.num_left == t.num_requests, summary
        assert t.num_checked >= 150
        faults = sum(t.faults.values())
        chaos = [ep.chaos for ep in (storm.s.tp, storm.s.td)]
        notif_faults = sum(c.num_dropped + c.num_duplicated + c.num_reordered for c in chaos if c)
        assert faults >= 30 and notif_faults >= 10, (t.faults, notif_faults)
        # Later turns reused what the returns brought back.
        assert storm.s.pf.acceptor.stats.num_received_blocks > 0
        assert storm.s.pf.reader.num_read_blocks > 0
    finally:
        storm.s.close()
