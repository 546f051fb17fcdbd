"""Two engines (P and D) with the flows of their roles, stepped in one thread.

Deterministic: the in-process fabric's deadlines and late landings run on
`ManualTimers`, every flow module reads a fake clock, the notification pump's
and the flow I/O thread's work is done by the stepper itself, and the engines
are `LLMEngine`s stepped by hand. Nothing polls and nothing sleeps: `run`
steps both engines while anything moves, and moves the clock by one tick when
nothing does::

    sim = Sim(tiny, monkeypatch)
    sim.push("x1")                 # P and D both get the request (the router's job)
    sim.run(lambda: sim.finished("d-x1"))
    assert sim.outputs["d-x1"] == reference

The flows are built by `prefill_flows` / `decode_flows` exactly as an instance
builds them; only the threads around them are replaced.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import pytest

from kvduplex.common.sampling import SamplingParams
from kvduplex.engine.async_engine import AsyncEngine
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.request import RemoteKVSpec
from kvduplex.engine.request import Request
from kvduplex.engine.request import RequestStatus
from kvduplex.kvflow import inbox as inbox_module
from kvduplex.kvflow import pull as pull_module
from kvduplex.kvflow import push_decode as push_decode_module
from kvduplex.kvflow import push_prefill as push_prefill_module
from kvduplex.kvflow import receiver as receiver_module
from kvduplex.kvflow import return_pull as return_pull_module
from kvduplex.kvflow import sender as sender_module
from kvduplex.kvflow.connectors import DecodeFlows
from kvduplex.kvflow.connectors import FlowTiming
from kvduplex.kvflow.connectors import PrefillFlows
from kvduplex.kvflow.connectors import decode_flows
from kvduplex.kvflow.connectors import prefill_flows
from kvduplex.kvflow.flow_io import FlowIO
from kvduplex.kvflow.inbox import FlowInbox
from kvduplex.kvflow.pull import PullSpec
from kvduplex.kvflow.push_decode import PushSpec
from kvduplex.kvflow.returns import ReturnSpec
from kvduplex.model.loader import LoadedModel
from kvduplex.transport.base import Post
from kvduplex.transport.messages import MessageCodec
from kvduplex.transport.notify import NotificationPump
from kvduplex.transport.protocol import TransferOp
from tests.support.fake_transport import InProcessFabric
from tests.support.fake_transport import InProcessTransport
from tests.support.fake_transport import ManualTimers
from tests.unit.flow_pair import FIRST
from tests.unit.flow_pair import GREEDY
from tests.unit.flow_pair import PROMPT
from tests.unit.flow_pair import _engine

CLOCKED = (
    inbox_module, pull_module, push_decode_module, push_prefill_module, receiver_module,
    return_pull_module, sender_module,
)  # fmt: skip
"""The flow modules that read the clock (``time.monotonic``)."""


class Clock:
    """The ``time`` module as the flow modules use it, on the test's own clock."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


class SteppedEngine(AsyncEngine):
    """An engine front whose loop never starts: the test steps ``core`` itself (so the
    flows' engine thread is the test's thread)."""

    @property
    def is_running(self) -> bool:
        return True

    @property
    def is_healthy(self) -> bool:
        return True


def _synchronous(io: FlowIO) -> None:
    """The flow I/O thread's requests, carried out at once on the test's thread."""
    io.submit = io.carry_out  # type: ignore[method-assign]


class Sim:
    """P and D on one fabric, their flows built as instances build them, stepped here."""

    def __init__(
        self, tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, *, wait_s: float = 5.0,
        transfer_timeout_s: float = 5.0, quarantine_s: float = 0.5, tick_s: float = 0.05,
        p_budget: int = 256,
    ) -> None:  # fmt: skip
        self.clock = Clock()
        for module in CLOCKED:
            monkeypatch.setattr(module, "time", self.clock)
        self.tick_s = tick_s
        self.p, self.d = _engine(tiny, p_budget), _engine(tiny)
        self.timers = ManualTimers(self.clock.now)
        self.fabric = fabric = InProcessFabric(self.timers)
        self.tp: InProcessTransport = fabric.endpoint(self.p.kv_pool, self.p.layout)
        self.td: InProcessTransport = fabric.endpoint(self.d.kv_pool, self.d.layout)
        self.tp.unknown_agent_grace_s = 0.0  # a stranger's notification is refused at once
        self.td.unknown_agent_grace_s = 0.0
        self.d_peer = self.tp.connect(self.td.local_metadata())  # P writes into D
        self.p_peer = self.td.connect(self.tp.local_metadata())  # D notifies P
        timing = FlowTiming(
            wait_s=wait_s, transfer_timeout_s=transfer_timeout_s, quarantine_s=quarantine_s
        )
        peers_of_p = {self.td.engine_id: self.d_peer}
        peers_of_d = {self.tp.engine_id: self.p_peer}
        self.pf: PrefillFlows = prefill_flows(
            self.tp, SteppedEngine(self.p), NotificationPump(self.tp), timing, peers_of_p.get
        )
        self.df: DecodeFlows = decode_flows(
            self.td, SteppedEngine(self.d), NotificationPump(self.td), timing, peers_of_d.get,
            release=lambda _url, xid: self.p.scheduler.release_held(xid),
        )  # fmt: skip
        _synchronous(self.pf.io)
        _synchronous(self.df.io)
        self.codec = MessageCodec()
        self.outputs: dict[str, list[int]] = defaultdict(list)
        self.finish: dict[str, str | None] = {}
        self.num_steps = 0
        self.late_problems: list[str] = []
        self.tp.late_check = lambda post: self.late_problems.extend(
            landing_problems(self.d if post.handle.op is TransferOp.WRITE else self.p, post)
        )
        self.td.late_check = lambda post: self.late_problems.extend(
            landing_problems(self.p if post.handle.op is TransferOp.WRITE else self.d, post)
        )

    # ---- what the router and the routes do ----

    def push(
        self, xid: str, prompt: list[int] = PROMPT, params: SamplingParams = GREEDY,
        *, to_d: bool = True, session: str | None = None,
    ) -> None:  # fmt: skip
        """Dispatch a push to P and (``to_d``) D, as the router does."""
        self.push_prefill(xid, prompt)
        if to_d:
            self.push_decode(xid, prompt, params, session=session)

    def push_prefill(self, xid: str, prompt: list[int] = PROMPT) -> None:
        """P's prefill, its job first (as the push route's admission does)."""
        self.pf.sender.expect(xid, self.d_peer, len(prompt))
        self.p.add_request(Request(xid, prompt, FIRST, hold_blocks_on_finish=True))

    def push_decode(
        self, xid: str, prompt: list[int] = PROMPT, params: SamplingParams = GREEDY,
        *, session: str | None = None,
    ) -> None:  # fmt: skip
        """D's request, its spec first (as the decode route does); ``session``: its
        finished turn returns to P."""
        self.df.push.register(PushSpec(xid, self.p_peer, "http://p", f"d-{xid}"))
        meta = None if session is None else ReturnSpec(session, self.p_peer)
        self.d.add_request(Request(
            f"d-{xid}", prompt, params, remote_kv=RemoteKVSpec(xid),
            hold_blocks_on_finish=meta is not None, connector_meta=meta,
        ))  # fmt: skip

    def pull(self, xid: str, prompt: list[int] = PROMPT) -> None:
        """Dispatch a pull: P prefills and holds the blocks; once it has, D READs them
        (call `pull_decode` when ``finished(xid)``)."""
        self.p.add_request(Request(xid, prompt, FIRST, hold_blocks_on_finish=True))

    def pull_decode(self, xid: str, prompt: list[int] = PROMPT) -> None:
        req = self.p.scheduler.get_request(xid)
        assert req is not None, f"{xid} is not held on P"
        self.df.pull.register(PullSpec(
            xid, self.p_peer, "http://p", list(req.block_ids), req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens, request_id=f"d-{xid}",
        ))  # fmt: skip
        self.d.add_request(Request(f"d-{xid}", prompt, GREEDY, remote_kv=RemoteKVSpec(xid)))

    # ---- stepping ----

    def deliver(self) -> int:
        """The pumps' work: what each endpoint received, into its flows' inbox."""
        n = 0
        for ep, inbox in ((self.tp, self.pf.inbox), (self.td, self.df.inbox)):
            for notif in ep.poll_notifs(0.0):
                inbox.heard(self.codec.decode(notif.payload), notif.peer_engine_id)
                n += 1
        return n

    def step(self) -> bool:
        """One step of each engine that has work; whether anything moved."""
        moved = self.deliver() > 0
        for engine in (self.p, self.d):
            if not engine.has_unfinished():
                continue
            self.num_steps += 1
            for o in engine.step():
                moved = True
                self.outputs[o.request_id].extend(o.new_token_ids)
                if o.finished:
                    self.finish[o.request_id] = o.finish_reason
            moved = moved or engine.last_step_did_work
        return moved

    def tick(self, dt: float | None = None) -> None:
        """Move the clock: the fabric's timers that are due fire, and the flows tick."""
        self.clock.now += self.tick_s if dt is None else dt
        self.timers.advance_to(self.clock.now)
        for inbox in (self.pf.inbox, self.df.inbox):
            inbox.tick(self.clock.now)

    def run(self, until: Callable[[], bool], max_s: float = 60.0, max_steps: int = 20000) -> None:
        """Step while anything moves, tick when nothing does, until ``until()``."""
        deadline = self.clock.now + max_s
        for _ in range(max_steps):
            if until():
                return
            if self.step() or until():
                continue
            assert self.clock.now < deadline, f"nothing happened for {max_s:g} s (sim)"
            self.tick()
        raise AssertionError(f"not done after {max_steps} steps")

    def settle(self, max_s: float = 120.0) -> None:
        """Run until both engines are idle and every flow table is empty."""
        self.run(self.is_quiet, max_s)

    def is_quiet(self) -> bool:
        """Nothing in flight: no notification on its way, no timer to fire (a deadline,
        a late landing, a check of an unsettled READ), no work on either engine, and
        every flow table empty (cancelled xids remembered aside)."""
        if self.deliver() or self.inboxes_pending() or self.timers.num_pending:
            return False
        if self.pf.inbox.num_timers or self.df.inbox.num_timers:
            return False
        if self.p.has_unfinished() or self.d.has_unfinished():
            return False
        for tables in (self.pf.tables(), self.df.tables()):
            tables.pop("send_cancelled_tombstones")
            if any(tables.values()):
                return False
        return True

    def inboxes_pending(self) -> bool:
        return any(i.has_events for i in (self.pf.inbox, self.df.inbox))

    def finished(self, rid: str) -> bool:
        return rid in self.finish

    def in_use(self, engine: LLMEngine) -> int:
        return engine.block_pool.stats().num_in_use

    def assert_clean(self) -> None:
        """Both pools empty and consistent (held prefills released first)."""
        for rid in list(self.p.scheduler._held):
            self.p.scheduler.release_held(rid)
        self.settle()
        for name, engine in (("P", self.p), ("D", self.d)):
            held = {r.request_id: r.block_ids for r in engine.scheduler._held.values()}
            running = list(engine.scheduler._requests)
            assert self.in_use(engine) == 0, f"{name}: held {held}, requests {running}"
            engine.check_integrity()
        assert self.late_problems == []


def landing_problems(engine: LLMEngine, post: Post) -> list[str]:
    """Where a late transfer is about to land on ``engine``'s pool, what is wrong: a
    target block free, in the prefix cache, or owned by a request other than one still
    waiting for remote KV. Empty: reserved."""
    nb = engine.layout.num_blocks
    idx = post.remote if post.handle.op is TransferOp.WRITE else post.local
    blocks = {int(i) % nb for i in idx}
    xid = post.handle.xid
    problems = []
    for b in sorted(blocks):
        if engine.block_pool.ref_count(b) < 1:
            problems.append(f"{xid}: block {b} is free")
        if engine.block_pool.key_of(b) is not None:
            problems.append(f"{xid}: block {b} is in the prefix cache")
    sched = engine.scheduler
    for req in [*sched._requests.values(), *sched._held.values()]:
        if req.status is not RequestStatus.WAITING_FOR_REMOTE_KV and (
            shared := blocks & set(req.block_ids)
        ):
            problems.append(f"{xid}: blocks {sorted(shared)} belong to {req.request_id}")
    return problems


__all__ = ["Clock", "FlowInbox", "Sim", "SteppedEngine", "landing_problems"]
