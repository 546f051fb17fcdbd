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
builds them; only the threads around them are replaced. Faults: the fabric's
own (`fail_next`, `hang_next`, `land_late_next`, `drop_next_notif`,
`forge_next_sender`, `chaos`, closing an endpoint), plus what arrives
intercepted (`intercept`: a message lost or held back), a starved pool
(`Starved`), a client that leaves mid-answer (`leave_after`), and a check of
every late landing's target blocks (`late_problems`, asserted by `assert_clean`).
"""

from __future__ import annotations

import queue
from collections import defaultdict
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from kvduplex.common.sampling import SamplingParams
from kvduplex.engine.async_engine import AsyncEngine
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.engine import RequestOutput
from kvduplex.engine.handle import EngineHandle
from kvduplex.engine.request import RemoteKVSpec
from kvduplex.engine.request import Request
from kvduplex.kvflow import fetch as fetch_module
from kvduplex.kvflow import inbox as inbox_module
from kvduplex.kvflow import lease as lease_module
from kvduplex.kvflow import prefix_load as prefix_load_module
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
from kvduplex.kvflow.flow_events import FlowEvent
from kvduplex.kvflow.flow_io import FlowIO
from kvduplex.kvflow.flow_io import IORequest
from kvduplex.kvflow.inbox import FlowInbox
from kvduplex.kvflow.lease import LeaseTable
from kvduplex.kvflow.messages import ids_digest
from kvduplex.kvflow.metrics import KVFlowMetrics
from kvduplex.kvflow.pull import PullSpec
from kvduplex.kvflow.push_decode import PushSpec
from kvduplex.kvflow.returns import ReturnSpec
from kvduplex.model.loader import LoadedModel
from kvduplex.transport import base as transport_base_module
from kvduplex.transport.base import Post
from kvduplex.transport.messages import ControlMessage
from kvduplex.transport.messages import MessageCodec
from kvduplex.transport.notify import NotificationPump
from kvduplex.transport.protocol import PeerHandle
from kvduplex.transport.protocol import TransferOp
from tests.support.fake_transport import InProcessFabric
from tests.support.fake_transport import InProcessTransport
from tests.support.fake_transport import ManualTimers
from tests.unit.flow_common import FIRST
from tests.unit.flow_common import GREEDY
from tests.unit.flow_common import PROMPT
from tests.unit.flow_common import Starved
from tests.unit.flow_common import _engine
from tests.unit.flow_common import landing_problems

CLOCKED = (
    fetch_module, inbox_module, lease_module, prefix_load_module, pull_module, push_decode_module,
    push_prefill_module, receiver_module, return_pull_module, sender_module, transport_base_module,
)  # fmt: skip
"""The flow modules, and the transport's (a stranger's notification held for its grace),
that read the clock (``time.monotonic``)."""

Intercept = Callable[[ControlMessage, str], None]
"""``fn(message, sender_engine_id)``: takes an arriving message instead of the flows."""


class Clock:
    """The ``time`` module as the flow modules use it, on the test's own clock."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now

    perf_counter = time = monotonic


class SteppedEngine(AsyncEngine):
    """An engine front whose loop never starts: the test steps ``core`` itself (so the
    flows' engine thread is the test's thread); `Sim.step` carries out its commands."""

    @property
    def is_running(self) -> bool:
        return self._dead is None

    def dead_reason(self) -> str | None:
        return None if self._dead is None else str(self._dead)

    @property
    def is_healthy(self) -> bool:
        return self._dead is None


class Sim:
    """P and D on one fabric, their flows built as instances build them, stepped here."""

    def __init__(
        self, tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, *, wait_s: float = 5.0,
        transfer_timeout_s: float = 5.0, quarantine_s: float = 0.5, tick_s: float = 0.05,
        p_budget: int = 256, lease_s: float = 30.0, p_tier_blocks: int = 0,
        metrics: bool = False,
    ) -> None:  # fmt: skip
        """``p_tier_blocks``: P gets a host KV tier of that many blocks (`close` ends it);
        ``metrics``: each side's flows count into a registry of its own (`p_registry`,
        `d_registry`)."""
        self.clock = Clock()
        for module in CLOCKED:
            monkeypatch.setattr(module, "time", self.clock)
        self.tick_s = tick_s
        self.p, self.d = _engine(tiny, p_budget, p_tier_blocks), _engine(tiny)
        self.timers = ManualTimers(self.clock.now)
        self.fabric = fabric = InProcessFabric(self.timers)
        self.tp: InProcessTransport = fabric.endpoint(self.p.kv_pool, self.p.layout, engine_id="p")
        self.td: InProcessTransport = fabric.endpoint(self.d.kv_pool, self.d.layout, engine_id="d")
        self.tp.unknown_agent_grace_s = 0.0  # a stranger's notification is refused at once
        self.td.unknown_agent_grace_s = 0.0
        self.d_peer = self.tp.connect(self.td.local_metadata())  # P writes into D
        self.p_peer = self.td.connect(self.tp.local_metadata())  # D notifies P
        self.peers_of_p: dict[str, PeerHandle] = {self.td.engine_id: self.d_peer}
        self.peers_of_d: dict[str, PeerHandle] = {self.tp.engine_id: self.p_peer}
        self.timing = FlowTiming(
            wait_s=wait_s, transfer_timeout_s=transfer_timeout_s, quarantine_s=quarantine_s
        )
        self.ap, self.ad = SteppedEngine(self.p), SteppedEngine(self.d)
        self.pumps = [NotificationPump(self.tp), NotificationPump(self.td)]
        self.released: list[tuple[str, str]] = []
        """``(prefill_url, xid)`` of each release decode sent (P's route ends the lease)."""
        self.p_registry, self.d_registry = CollectorRegistry(), CollectorRegistry()
        p_metrics = KVFlowMetrics(self.p_registry) if metrics else None
        d_metrics = KVFlowMetrics(self.d_registry) if metrics else None
        self.pf: PrefillFlows = prefill_flows(
            self.tp, self.ap, self.pumps[0], self.timing, self.peers_of_p.get, p_metrics
        )
        self.leases = LeaseTable(EngineHandle(self.ap), lease_s, self.pf.inbox)
        """P's pull leases, as its prefill routes keep them (started by `pull_spec`)."""
        self.df: DecodeFlows = decode_flows(
            self.td, self.ad, self.pumps[1], self.timing, self.peers_of_d.get, d_metrics,
            release=self._release,
        )  # fmt: skip
        self.io_log: list[IORequest] = []
        """Every request handed to either flow I/O thread, in order."""
        self.in_flow_io = False
        """The flow I/O thread's work is being done (by `_carry_out_here`)."""
        self._carry_out_here(self.pf.io)
        self._carry_out_here(self.df.io)
        self._wait_here(self.pf.inbox)
        self._wait_here(self.df.inbox)
        self.codec = MessageCodec()
        self.outputs: dict[str, list[int]] = defaultdict(list)
        self.last: dict[str, RequestOutput] = {}
        self.finish: dict[str, str | None] = {}
        self.num_steps = 0
        self.on: LLMEngine | None = None
        """The engine whose threads (engine, pump) run now; None: the fabric's timers."""
        self._intercepts: dict[tuple[str, type[ControlMessage]], Intercept] = {}
        self._leaving: dict[str, int] = {}
        self.late_problems: list[str] = []
        """What was wrong where each late transfer landed (see `landing_problems`)."""
        self.num_late_landed = 0
        self.tp.late_check = lambda post: self._check_landing(post, self.d, self.p)
        self.td.late_check = lambda post: self._check_landing(post, self.p, self.d)

    def _check_landing(self, post: Post, peer: LLMEngine, own: LLMEngine) -> None:
        """Just before a late transfer lands: its WRITE into ``peer``, its READ into ``own``."""
        self.num_late_landed += 1
        target = peer if post.handle.op is TransferOp.WRITE else own
        self.late_problems.extend(landing_problems(target, post))

    def _release(self, url: str, xid: str) -> None:
        """Decode's release of a pull's lease: P's release route."""
        self.released.append((url, xid))
        self.leases.release(xid)

    def _carry_out_here(self, io: FlowIO) -> None:
        """The flow I/O thread's requests, carried out at once on the test's thread."""

        def submit(request: IORequest) -> None:
            self.io_log.append(request)
            was, self.in_flow_io = self.in_flow_io, True
            try:
                io.carry_out(request)
            finally:
                self.in_flow_io = was

        io.submit = submit  # type: ignore[method-assign]

    def _wait_here(self, inbox: FlowInbox) -> None:
        """The engine thread's blocking wait on its inbox (a layer waiting for its loaded
        KV): the clock moves by a tick while nothing is queued, instead of sleeping."""

        def next_event(timeout_s: float) -> FlowEvent | None:
            try:
                return inbox._events.get_nowait()
            except queue.Empty:
                pass
            on = self.on
            self.tick(min(self.tick_s, timeout_s))
            self.on = on
            try:
                return inbox._events.get_nowait()
            except queue.Empty:
                return None

        inbox._next_event = next_event  # type: ignore[method-assign]

    # ---- what the router, the routes and the clients do ----

    def push(
        self, xid: str, prompt: list[int] = PROMPT, params: SamplingParams = GREEDY,
        *, to_d: bool = True, session: str | None = None, meta: object = None,
        p_params: SamplingParams = FIRST,
    ) -> None:  # fmt: skip
        """Dispatch a push to P (``p_params``: its sampling) and (``to_d``) D, as the
        router does; ``session``, ``meta``: see `decode`."""
        self.push_prefill(xid, prompt, p_params)
        if to_d:
            self.push_decode(xid, prompt, params, session=session, meta=meta)

    def push_prefill(
        self, xid: str, prompt: list[int] = PROMPT, params: SamplingParams = FIRST
    ) -> None:
        """P's prefill, its job first (as the push route's admission does)."""
        self.pf.sender.expect(xid, self.d_peer, prompt)
        self.p.add_request(Request(xid, prompt, params, hold_blocks_on_finish=True))

    def push_decode(
        self, xid: str, prompt: list[int] = PROMPT, params: SamplingParams = GREEDY,
        *, session: str | None = None, meta: object = None,
    ) -> None:  # fmt: skip
        """D's request, its spec first (as the decode route does); see `decode`."""
        self.df.push.register(self.push_spec(xid))
        self.decode(xid, prompt, params, session=session, meta=meta)

    def push_spec(self, xid: str) -> PushSpec:
        return PushSpec(xid, self.p_peer, "http://p", f"d-{xid}")

    def decode(
        self, xid: str, prompt: list[int] = PROMPT, params: SamplingParams = GREEDY,
        *, session: str | None = None, meta: object = None,
    ) -> None:  # fmt: skip
        """D's request ``d-<xid>`` for remote KV under ``xid`` (its spec registered apart).
        ``session``: its finished turn returns to P; ``meta``: another ``connector_meta``
        (either holds its blocks on finish)."""
        if session is not None:
            meta = ReturnSpec(session, self.p_peer)
        self.d.add_request(Request(
            f"d-{xid}", prompt, params, remote_kv=RemoteKVSpec(xid),
            hold_blocks_on_finish=meta is not None, connector_meta=meta,
        ))  # fmt: skip

    def pull(self, xid: str, prompt: list[int] = PROMPT) -> None:
        """Dispatch a pull: P prefills and holds the blocks; once it has, D READs them
        (call `pull_decode` when ``finished(xid)``)."""
        self.p.add_request(Request(xid, prompt, FIRST, hold_blocks_on_finish=True))

    def pull_decode(
        self, xid: str, prompt: list[int] = PROMPT, params: SamplingParams = GREEDY
    ) -> None:
        self.df.pull.register(self.pull_spec(xid))
        self.d.add_request(Request(f"d-{xid}", prompt, params, remote_kv=RemoteKVSpec(xid)))

    def pull_spec(self, xid: str) -> PullSpec:
        """P's held prefill ``xid`` under a lease from now (P's answer), as the spec of D's
        request ``d-<xid>``."""
        req = self.p.scheduler.get_request(xid)
        assert req is not None, f"{xid} is not held on P"
        self.leases.start(xid)
        return PullSpec(
            xid, self.p_peer, "http://p", list(req.block_ids), req.num_prompt_tokens,
            ids_digest(req.prompt_token_ids),
            lease_ends_at=self.clock.now + self.leases.lease_s,
            num_cached_tokens=req.num_cached_tokens, request_id=f"d-{xid}",
        )  # fmt: skip

    def leave_after(self, rid: str, num_tokens: int) -> None:
        """``rid``'s client leaves once it has ``num_tokens`` (its request is aborted)."""
        self._leaving[rid] = num_tokens

    def reconnect(self) -> int:
        """What each instance's peer directory does: connect afresh to a peer whose
        endpoint a flow tore down; how many were."""
        n = 0
        if not self.tp.is_connected(self.td.engine_id):
            self.d_peer = self.peers_of_p[self.td.engine_id] = self.tp.connect(self.td.local_metadata())
            n += 1
        if not self.td.is_connected(self.tp.engine_id):
            self.p_peer = self.peers_of_d[self.tp.engine_id] = self.td.connect(self.tp.local_metadata())
            n += 1
        return n

    def intercept(
        self, to: InProcessTransport, msg_type: type[ControlMessage], fn: Intercept | None = None
    ) -> list[tuple[ControlMessage, str]]:
        """Messages of ``msg_type`` arriving at ``to`` go to ``fn`` instead of its flows;
        without ``fn``, into the list returned (held back: lost unless the test hands one
        on with ``inbox.heard``)."""
        held: list[tuple[ControlMessage, str]] = []
        self._intercepts[to.engine_id, msg_type] = fn or (lambda m, s: held.append((m, s)))
        return held

    # ---- stepping ----

    def deliver(self) -> int:
        """The pumps' work: what each endpoint received, into its flows' inbox."""
        n = 0
        for ep, inbox, engine in ((self.tp, self.pf.inbox, self.p), (self.td, self.df.inbox, self.d)):
            self.on = engine
            for notif in ep.poll_notifs(0.0):
                msg = self.codec.decode(notif.payload)
                fn = self._intercepts.get((ep.engine_id, type(msg)), inbox.heard)
                fn(msg, notif.peer_engine_id)
                n += 1
        self.on = None
        return n

    def step(self) -> bool:
        """One step of each engine that has work; whether anything moved."""
        moved = self.deliver() > 0
        for front in (self.ap, self.ad):
            engine = self.on = front.core
            moved = front._drain_inbox() or moved  # its commands (calls, adds, aborts)
            if not engine.has_unfinished():
                continue
            self.num_steps += 1
            for o in engine.step():
                moved = True
                self._output(engine, o)
            moved = moved or engine.last_step_did_work
        self.on = None
        return moved

    def _output(self, engine: LLMEngine, o: RequestOutput) -> None:
        rid = o.request_id
        self.outputs[rid].extend(o.new_token_ids)
        self.last[rid] = o
        if o.finished:
            self.finish[rid] = o.finish_reason
        elif rid in self._leaving and len(self.outputs[rid]) >= self._leaving[rid]:
            del self._leaving[rid]
            engine.abort_request(rid)  # the client closed its stream

    def tick(self, dt: float | None = None) -> None:
        """Move the clock: the fabric's timers that are due fire, and the flows tick."""
        self.clock.now += self.tick_s if dt is None else dt
        self.timers.advance_to(self.clock.now)
        for inbox, engine in ((self.pf.inbox, self.p), (self.df.inbox, self.d)):
            self.on = engine
            inbox.tick(self.clock.now)
        self.on = None

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
        return not self.busy_tables()

    def busy_tables(self) -> dict[str, int]:
        """The flow tables of P and D that are not empty (cancelled xids aside)."""
        tables = {f"p.{k}": v for k, v in self.pf.tables().items()}
        tables |= {f"d.{k}": v for k, v in self.df.tables().items()}
        return {k: v for k, v in tables.items() if v and not k.endswith("tombstones")}

    def inboxes_pending(self) -> bool:
        fronts = any(not front._inbox.empty() for front in (self.ap, self.ad))
        return fronts or any(i.has_events for i in (self.pf.inbox, self.df.inbox))

    def close(self) -> None:
        """Close what the engines hold beyond memory (a KV tier's writer thread)."""
        for engine in (self.p, self.d):
            if engine.kv_tier is not None:
                engine.kv_tier.close()

    def finished(self, rid: str) -> bool:
        return rid in self.finish

    def in_use(self, engine: LLMEngine) -> int:
        return engine.block_pool.stats().num_in_use

    def assert_clean(self) -> None:
        """Both pools empty and consistent (held prefills released first), and no late
        transfer landed in a block not reserved for it."""
        for rid in list(self.p.scheduler._held):
            self.p.scheduler.release_held(rid)
        self.settle()
        for name, engine in (("P", self.p), ("D", self.d)):
            held = {r.request_id: r.block_ids for r in engine.scheduler._held.values()}
            running = list(engine.scheduler._requests)
            assert self.in_use(engine) == 0, f"{name}: held {held}, requests {running}"
            engine.check_integrity()
        assert self.late_problems == []


__all__ = ["Clock", "FlowInbox", "Sim", "Starved", "SteppedEngine"]
