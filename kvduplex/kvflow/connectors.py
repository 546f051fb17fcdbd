"""Each disaggregated role's engine connector, composed of the flows it serves.

* prefill: the `KVSender`'s push hooks (plan each step's WRITEs, stream them
  layer by layer, end jobs when the first token is sampled);
* decode: pushed and pulled requests waiting for their prompt's KV (by the
  flow their ``kv_transfer_params`` named), and the duplex return of finished
  session turns.

Both drain the instance's flow inbox (`kvduplex.kvflow.inbox`) in
`get_finished`, before each step, and report pending work while it holds
events; prefill also applies its LAYER events (registrations, WRITE ends)
after each layer of a forward that streams a push, so that a registration
arriving mid-forward is written at once.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvduplex.engine.async_engine import AsyncEngine
from kvduplex.engine.connector import KVConnector
from kvduplex.engine.connector import chain_layer_hooks
from kvduplex.engine.handle import EngineHandle
from kvduplex.engine.request import FinishReason
from kvduplex.engine.request import Request
from kvduplex.engine.scheduler_output import KVConnectorMetadata
from kvduplex.engine.scheduler_output import KVTransferResult
from kvduplex.engine.scheduler_output import RemoteKVAllocation
from kvduplex.engine.scheduler_output import SchedulerOutput
from kvduplex.kvflow.flow_io import FlowIO
from kvduplex.kvflow.inbox import FlowInbox
from kvduplex.kvflow.metrics import KVFlowMetrics
from kvduplex.kvflow.prefix_load import PrefixLoads
from kvduplex.kvflow.pull import PullConnector
from kvduplex.kvflow.push_decode import PushDecode
from kvduplex.kvflow.push_prefill import PushPlan
from kvduplex.kvflow.push_prefill import PushSender
from kvduplex.kvflow.receiver import KVReceiver
from kvduplex.kvflow.return_pull import RetainedReader
from kvduplex.kvflow.return_pull import TurnRetainer
from kvduplex.kvflow.returns import ReturnAcceptor
from kvduplex.kvflow.returns import ReturnOfferer
from kvduplex.kvflow.sender import KVSender
from kvduplex.transport.base import Transport
from kvduplex.transport.notify import NotificationPump
from kvduplex.transport.protocol import PeerHandle

S = TypeVar("S", bound=KVSender)


class PrefillConnector(KVConnector):
    """Prefill's connector: the push sender's step hooks, and the layer-wise loads of
    fetched prefixes (`PrefixLoads`)."""

    def __init__(self, sender: PushSender, inbox: FlowInbox, loads: PrefixLoads) -> None:
        self.sender = sender
        self.inbox = inbox
        self.loads = loads

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        return self.loads.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        self.loads.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, out: SchedulerOutput) -> PushPlan:
        plan = self.sender.build_connector_meta(out)
        plan.loads = self.loads.take_planned()
        return plan

    def request_finished(self, request: Request, reason: FinishReason) -> bool:
        self.loads.request_finished(request)
        self.sender.request_finished(request, reason)
        return super().request_finished(request, reason)

    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        assert isinstance(meta, PushPlan)
        self.loads.start(meta.loads)  # posted first: a READ fails the push it feeds at once
        self.sender.start_load_kv(meta)

    def layer_hook(self, meta: KVConnectorMetadata | None) -> Callable[[int], None] | None:
        """Before each layer's attention: wait for that layer's loaded KV, then post its
        WRITEs (the inbox's LAYER events applied)."""
        assert isinstance(meta, PushPlan)
        wait = self.loads.layer_wait(meta.loads)
        push = self.sender.layer_hook(meta)
        return chain_layer_hooks(wait, push)

    def get_failed_loads(self) -> set[str]:
        return self.loads.get_failed_loads()

    def load_failed(self, request_id: str, reason: str) -> None:
        """A tier load failed mid-forward: its push stops before this layer's WRITEs."""
        self.sender.on_prefix_lost(request_id, f"its KV tier hit did not load ({reason})")

    def wait_for_save(self, meta: KVConnectorMetadata | None) -> None:
        assert isinstance(meta, PushPlan)
        self.sender.wait_for_save(meta)

    def get_finished(self) -> list[KVTransferResult]:
        self.inbox.drain()
        return self.sender.take_finished()

    def has_pending_work(self) -> bool:
        return self.inbox.has_events or self.sender.has_pending_work()


@dataclass
class RemoteKVLoads(KVConnectorMetadata):
    """The requests whose prompt's KV decode starts to receive this step, by flow."""

    push: list[RemoteKVAllocation]
    pull: list[RemoteKVAllocation]
    """Pulled, and those no flow knows (the pull flow computes them locally)."""


class DecodeConnector(KVConnector):
    """Decode's connector: pushed and pulled prompts, and the return of finished turns."""

    def __init__(
        self, pull: PullConnector, push: PushDecode, returns: ReturnOfferer,
        retainer: TurnRetainer, inbox: FlowInbox,
    ) -> None:  # fmt: skip
        self.inbox = inbox
        self.pull = pull
        self.push = push
        self.returns = returns
        self.retainer = retainer

    def build_connector_meta(self, out: SchedulerOutput) -> RemoteKVLoads | None:
        if not out.remote_kv_allocated:
            return None
        loads = RemoteKVLoads([], [])
        for alloc in out.remote_kv_allocated:
            (loads.push if self.push.owns(alloc.transfer_id) else loads.pull).append(alloc)
        return loads

    def request_finished(self, request: Request, reason: FinishReason) -> bool:
        if reason is FinishReason.ABORT:
            if request.remote_kv is not None:
                xid = request.remote_kv.transfer_id
                self.push.on_aborted(xid)
                self.pull.on_aborted(xid)
        else:
            self.returns.on_finished([request])
            self.retainer.on_finished([request])
        return super().request_finished(request, reason)

    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        if meta is None:
            return
        assert isinstance(meta, RemoteKVLoads)
        for alloc in meta.push:
            self.push.start(alloc)
        for alloc in meta.pull:
            self.pull.start(alloc)

    def get_finished(self) -> list[KVTransferResult]:
        self.returns.offer_finished()
        self.inbox.drain()
        return self.push.take_finished() + self.pull.take_finished()

    def has_pending_work(self) -> bool:
        return (
            self.inbox.has_events or self.returns.has_pending_work()
            or self.pull.has_pending_work() or self.push.has_pending_work()
        )  # fmt: skip


@dataclass
class PrefillFlows:
    """A prefill instance's flows: it sends pushes and receives returns."""

    sender: PushSender
    receiver: KVReceiver
    acceptor: ReturnAcceptor
    reader: RetainedReader
    loads: PrefixLoads
    connector: PrefillConnector
    inbox: FlowInbox
    io: FlowIO

    def tables(self) -> dict[str, int]:
        """Every flow table's size (`tombstones` aside, all 0 on an idle instance)."""
        return {
            **self.sender.tables(), "receive_waits": self.receiver.num_waiting(),
            "prefix_loads": self.loads.num_in_flight(),
        }  # fmt: skip

    def read_tables(self, _engine: object) -> dict[str, int]:
        """`tables`, run by the engine thread for a caller elsewhere (``_engine``: the
        engine that runs it; `AsyncEngine.run_in_engine`, a drain's owed checks)."""
        return self.tables()


@dataclass
class DecodeFlows:
    """A decode instance's flows: it receives pushes (or pulls) and sends returns."""

    sender: KVSender
    receiver: KVReceiver
    push: PushDecode
    pull: PullConnector
    offerer: ReturnOfferer
    retainer: TurnRetainer
    connector: DecodeConnector
    inbox: FlowInbox
    io: FlowIO

    def tables(self) -> dict[str, int]:
        """Every flow table's size (`tombstones` aside, all 0 on an idle instance but
        for retained turns and their pins, which ``--return-mode pull`` keeps by design)."""
        return {
            **self.sender.tables(),
            "receive_waits": self.receiver.num_waiting(),
            "push_specs": self.push.num_specs(),
            "pull_specs": self.pull.num_specs(),
            "pull_reads": self.pull.num_in_flight(),
            "retained_turns": self.retainer.num_retained(),
            "retained_pins": self.retainer.num_pinned(),
        }

    def read_tables(self, _engine: object) -> dict[str, int]:
        """`tables`, run by the engine thread for a caller elsewhere (``_engine``: the
        engine that runs it; `AsyncEngine.run_in_engine`, a drain's owed checks)."""
        return self.tables()


def _inbox_and_io(
    transport: Transport, engine: AsyncEngine, peer_of: Callable[[str], PeerHandle | None],
    reconnect: Callable[[str], PeerHandle | None] | None,
) -> tuple[FlowInbox, FlowIO]:  # fmt: skip
    """The instance's flow inbox (drained by ``engine``'s thread) and flow I/O thread."""
    inbox = FlowInbox(wake=engine.wake, is_alive=lambda: engine.is_running)
    engine.on_death(inbox.fail_pending)
    return inbox, FlowIO(transport, inbox, peer_of, reconnect)


def _halves(
    transport: Transport, handle: EngineHandle, inbox: FlowInbox, io: FlowIO,
    timing: FlowTiming, metrics: KVFlowMetrics | None,
    peer_of: Callable[[str], PeerHandle | None], kind: type[S],
    reconnect: Callable[[str], PeerHandle | None] | None = None,
    peer_gone: Callable[[str], bool] | None = None,
) -> tuple[S, KVReceiver]:  # fmt: skip
    sender = kind(
        transport, handle, inbox, io, registration_wait_s=timing.wait_s,
        deadline_s=timing.transfer_timeout_s, metrics=metrics, peer_of=peer_of,
        reconnect=reconnect,
    )  # fmt: skip
    receiver = KVReceiver(
        transport, handle, inbox, io, timing.wait_s, timing.quarantine_s, peer_gone, reconnect
    )
    return sender, receiver


def prefill_flows(
    transport: Transport, engine: AsyncEngine, pump: NotificationPump, timing: FlowTiming,
    peer_of: Callable[[str], PeerHandle | None], metrics: KVFlowMetrics | None = None,
    reconnect: Callable[[str], PeerHandle | None] | None = None,
    peer_gone: Callable[[str], bool] | None = None,
) -> PrefillFlows:  # fmt: skip
    """Build prefill's flows, have `pump` put what they take into their inbox, and
    install their connector into the engine.

    ``reconnect(engine_id)`` connects afresh to a peer whose endpoint was torn down;
    ``peer_gone(engine_id)``: see `KVReceiver`."""
    handle = EngineHandle(engine)
    inbox, io = _inbox_and_io(transport, engine, peer_of, reconnect)
    sender, receiver = _halves(
        transport, handle, inbox, io, timing, metrics, peer_of, PushSender, reconnect,
        peer_gone,
    )  # fmt: skip
    # Returns run in the background: one offer, and all accepted offers together, may
    # take at most a quarter of the pool (they may evict cached blocks).
    quarter = max(1, handle.num_blocks // 4)
    acceptor = ReturnAcceptor(
        receiver, handle, peer_of, metrics, max_blocks_per_offer=quarter,
        max_blocks_in_flight=quarter,
    )  # fmt: skip
    reader = RetainedReader(transport, handle, inbox, io, timing.transfer_timeout_s, metrics)
    loads = PrefixLoads(
        transport, handle, inbox, io, timing.layer_load_s or timing.transfer_timeout_s,
        sender.on_prefix_lost, metrics,
    )  # fmt: skip
    flows = PrefillFlows(
        sender, receiver, acceptor, reader, loads, PrefillConnector(sender, inbox, loads),
        inbox, io,
    )  # fmt: skip
    inbox.attach(pump)
    engine.core.connector = flows.connector
    return flows


def decode_flows(
    transport: Transport, engine: AsyncEngine, pump: NotificationPump, timing: FlowTiming,
    peer_of: Callable[[str], PeerHandle | None], metrics: KVFlowMetrics | None = None,
    release: Callable[[str, str], None] | None = None,
    reconnect: Callable[[str], PeerHandle | None] | None = None,
    peer_gone: Callable[[str], bool] | None = None,
) -> DecodeFlows:  # fmt: skip
    """Build decode's flows, have `pump` put what they take into their inbox, and
    install their connector into the engine.

    ``release(prefill_url, xid)`` ends a pull's lease (default: over HTTP);
    ``reconnect(engine_id)`` connects afresh to a peer whose endpoint was torn down;
    ``peer_gone(engine_id)``: see `KVReceiver`.
    """
    handle = EngineHandle(engine)
    inbox, io = _inbox_and_io(transport, engine, peer_of, reconnect)
    sender, receiver = _halves(
        transport, handle, inbox, io, timing, metrics, peer_of, KVSender, reconnect,
        peer_gone,
    )  # fmt: skip
    push = PushDecode(receiver, handle, metrics)
    pull = PullConnector(
        transport, handle, inbox, io, timing.wait_s, release=release, metrics=metrics
    )
    offerer = ReturnOfferer(sender, handle, metrics)
    retainer = TurnRetainer(
        handle, timing.retain_lease_s, pin_s=2 * timing.transfer_timeout_s, inbox=inbox
    )
    flows = DecodeFlows(
        sender, receiver, push, pull, offerer, retainer,
        DecodeConnector(pull, push, offerer, retainer, inbox), inbox, io,
    )  # fmt: skip
    inbox.attach(pump)
    engine.core.connector = flows.connector
    return flows


@dataclass(frozen=True)
class FlowTiming:
    """The deadlines every flow shares."""

    wait_s: float
    """A receiver's wait without word from its sender (and a sender's for a registration)."""
    transfer_timeout_s: float
    """One transfer's deadline."""
    quarantine_s: float
    """How long a receiver that gave up keeps its registered blocks unless the sender
    confirms sooner that no WRITE can land."""
    retain_lease_s: float = 60.0
    """``--return-mode pull``: how long decode holds a session's last turn."""
    layer_load_s: float | None = None
    """The fetch plan: how long the engine thread waits for one layer of a fetched
    prefix before the load fails and the request computes it (None: one transfer's
    deadline). The wait blocks the engine, so it stays under its stall limit."""
