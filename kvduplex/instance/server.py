"""One serving instance: engine + engine thread + HTTP app, run under uvicorn."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from functools import partial
from typing import TYPE_CHECKING

import httpx
from fastapi import APIRouter
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from kvduplex.common.auth import APIKeyGuard
from kvduplex.common.auth import resolve_api_key
from kvduplex.common.challenge import Responder
from kvduplex.common.config import Environment
from kvduplex.common.config import Role
from kvduplex.common.drain import DrainingServer
from kvduplex.common.drain import DrainState
from kvduplex.common.drain import exit_code
from kvduplex.common.drain import uvicorn_config
from kvduplex.common.engine_config import EngineConfig
from kvduplex.common.fingerprint import ModelFingerprint
from kvduplex.common.fingerprint import model_fingerprint
from kvduplex.common.guard import InternalGuard
from kvduplex.common.guard import load_cluster_secret
from kvduplex.engine.async_engine import AsyncEngine
from kvduplex.engine.async_engine import LoopGate
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.engine import SampleHook
from kvduplex.engine.metrics import EngineMetrics
from kvduplex.instance.api import create_app
from kvduplex.instance.auth_routes import make_auth_router
from kvduplex.instance.config import ServerConfig
from kvduplex.instance.state import InstanceState

if TYPE_CHECKING:
    from kvduplex.kvflow.connectors import FlowTiming
    from kvduplex.transport.notify import MessageFilter
    from kvduplex.transport.notify import NotificationPump

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class InstanceParts:
    """Parts that whoever builds an instance (`build_instance`, `serve`) may pass in place
    of the defaults; each None is the default, which does nothing. ``kvduplex serve``
    passes none."""

    sample_hook: SampleHook | None = None
    """Given to the engine (`LLMEngine`): may replace the tokens each step sampled."""
    loop_gate: LoopGate | None = None
    """Given to the engine thread (`AsyncEngine`): called at the start of each iteration."""
    message_filter: MessageFilter | None = None
    """Given to the notification pump of a prefill or decode instance: may drop arriving
    control messages."""


@dataclass
class Instance:
    engine: LLMEngine
    async_engine: AsyncEngine
    app: FastAPI
    state: InstanceState
    closers: list[Callable[[], None]] = field(default_factory=list)
    """Run in order at shutdown, after the engine thread stopped."""

    def shutdown(self) -> None:
        self.async_engine.shutdown()
        for close in self.closers:
            close()


def build_instance(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    env: Environment | None = None,
    parts: InstanceParts | None = None,
) -> Instance:
    """Load the model, allocate the KV pool, start the engine thread, build the app.

    `env` (default: the process's environment) gives the cluster secret unless
    ``server_config.cluster_secret_file`` does; with one, every ``/internal/*``
    route needs it but the two where a caller proves it (`auth_routes`), every
    internal call to a peer sends it once the peer proved it too, and
    ``kv_transfer_params`` and the engine id in /health are for callers that send
    it. The model fingerprint (`engine_fingerprint`) goes into the KV handshake and
    /health. The API key
    (``server_config.api_key``, else the environment's) guards the ``/v1/*`` routes.
    `parts` (default: none) go to the engine, its thread and the notification pump.
    """
    env = env if env is not None else Environment.read()
    parts = parts if parts is not None else InstanceParts()
    secret = load_cluster_secret(server_config.cluster_secret_file, env.cluster_secret)
    engine = LLMEngine(engine_config, sample_hook=parts.sample_hook)
    engine.warmup()
    fingerprint = engine_fingerprint(engine, engine_config)
    registry = CollectorRegistry()
    async_engine = AsyncEngine(engine, EngineMetrics(registry), gate=parts.loop_gate)
    names = [engine_config.model.served_model_name or engine_config.model.model]
    state = InstanceState(
        engine=async_engine,
        served_model_names=names,
        registry=registry,
        role=server_config.role.value,
        parsing=server_config.parsing,
        drain=DrainState(timeout_s=server_config.drain_timeout_s),
        cluster_secret=secret,
        fingerprint=fingerprint,
    )
    instance = Instance(engine=engine, async_engine=async_engine, app=FastAPI(), state=state)
    if engine.kv_tier is not None:
        instance.closers.append(engine.kv_tier.close)
    routers = _role_routers(
        instance, engine_config, server_config.role, secret, parts.message_filter
    )
    responder = None if secret is None else Responder(secret, server_config.role.value)
    instance.app = create_app(state, [make_auth_router(responder), *routers])
    instance.app.add_middleware(
        InternalGuard, secret=secret, max_body_bytes=server_config.internal_max_body_mb << 20,
        public_max_body_bytes=server_config.max_body_mb << 20,
    )  # fmt: skip
    instance.app.add_middleware(
        APIKeyGuard, api_key=resolve_api_key(server_config.api_key, env.api_key)
    )
    if secret is None and server_config.role is not Role.BOTH:
        logger.warning(
            "no cluster secret: anyone who reaches this port can use its internal KV routes "
            "(set KVDUPLEX_CLUSTER_SECRET or --cluster-secret-file on every instance and router)"
        )
    async_engine.start()
    return instance


def flow_timing(config: EngineConfig) -> FlowTiming:
    """The flows' deadlines from the transfer settings."""
    from kvduplex.kvflow.connectors import FlowTiming

    cfg = config.transfer
    # Quarantine: a sender settles a failed WRITE within one transfer deadline after it
    # failed (tearing its endpoint down if it must), and a WRITE fails at most one
    # deadline after it was posted: two deadlines and a second cover both. A fetched
    # prefix's layer READ is waited for on the engine thread: half the stall limit at
    # most, so a hung READ fails the load (the request computes the history) before the
    # engine would count as stalled.
    return FlowTiming(
        cfg.kv_wait_timeout_s, cfg.transfer_timeout_s, 2 * cfg.transfer_timeout_s + 1,
        cfg.retain_lease_s,
        layer_load_s=min(cfg.transfer_timeout_s, config.scheduler.engine_stall_timeout_s / 2),
    )  # fmt: skip


def engine_fingerprint(engine: LLMEngine, config: EngineConfig) -> ModelFingerprint:
    """What `engine` serves (`kvduplex.common.fingerprint`): computed once per instance,
    sent in its KV handshake and shown by its /health."""
    loaded = engine.loaded
    dtype = str(loaded.dtype).removeprefix("torch.")
    return model_fingerprint(config.model.model, loaded.config, loaded.weights, dtype, engine.layout)


def _role_routers(
    instance: Instance,
    config: EngineConfig,
    role: Role,
    secret: str | None,
    message_filter: MessageFilter | None,
) -> list[APIRouter]:
    """The transport, connector and internal KV routes of a prefill or decode instance.

    Each role runs one `KVSender` and one `KVReceiver`: prefill sends pushes and
    receives returns, decode receives pushes and sends returns.
    """
    if role is Role.BOTH:
        return []
    from kvduplex.instance.decode_routes import make_decode_hooks
    from kvduplex.instance.kv_routes import make_prefill_router
    from kvduplex.instance.kv_routes import make_push_prefill_router
    from kvduplex.kvflow.connectors import decode_flows
    from kvduplex.kvflow.connectors import prefill_flows
    from kvduplex.kvflow.metrics import KVFlowMetrics
    from kvduplex.kvflow.pull import http_release
    from kvduplex.transport.handshake import PeerDirectory
    from kvduplex.transport.handshake import make_handshake_router
    from kvduplex.transport.metrics import TransferMetrics
    from kvduplex.transport.nixl import NixlTransport
    from kvduplex.transport.notify import NotificationPump
    from kvduplex.transport.peer_trust import PeerVerifier

    engine, state = instance.engine, instance.state
    cfg = config.transfer
    transport = NixlTransport(
        engine.kv_pool, engine.layout, default_deadline_s=cfg.transfer_timeout_s,
        metrics=TransferMetrics(state.registry), fingerprint=state.fingerprint,
    )  # fmt: skip
    state.engine_id = transport.engine_id
    metrics = KVFlowMetrics(state.registry)
    # One client, its connections kept alive, for every call to a peer (handshakes and
    # their rechecks, proofs of the secret, lease releases): building one per call costs
    # tens of milliseconds of CPU (its SSL context) and memory the process keeps.
    peer_client = httpx.Client()
    verifier = None if secret is None else PeerVerifier(secret, client=peer_client)
    directory = PeerDirectory(
        transport, client=peer_client, secret=secret, recheck_s=cfg.peer_recheck_s,
        verifier=verifier, idle_s=cfg.peer_idle_s or None,
    )  # fmt: skip
    pump = NotificationPump(transport, accept=message_filter)
    pump.every_tick(directory.tick)  # forgets peers that left (`PeerDirectory.sweep`)
    watch_pump(state, pump)
    timing = flow_timing(config)
    routers = [make_handshake_router(transport)]
    # Ends a peer's lease (pull on P, fetch on D), sending the secret only to a peer that
    # proved it holds it too.
    release = partial(
        http_release, secret=secret, verify=None if verifier is None else verifier.ensure,
        client=peer_client,
    )  # fmt: skip
    if role is Role.PREFILL:
        p = prefill_flows(
            transport, instance.async_engine, pump, timing, directory.peer_by_engine, metrics,
            reconnect=directory.reconnect, peer_gone=directory.is_gone,
        )  # fmt: skip
        routers.append(make_prefill_router(state, transport, cfg.pull_lease_s, p.inbox))
        routers.append(make_push_prefill_router(state, p, directory, release))
        state.drain.owed_checks.append(p.read_tables)
        instance.closers += [p.sender.close, p.io.close]
    else:
        d = decode_flows(
            transport, instance.async_engine, pump, timing, directory.peer_by_engine, metrics,
            release=release, reconnect=directory.reconnect, peer_gone=directory.is_gone,
        )  # fmt: skip
        routers.append(make_decode_hooks(state, d, directory, release, cfg.fetch_lease_s))
        state.drain.owed_checks.append(d.read_tables)
        instance.closers += [d.pull.close, d.sender.close]
    pump.start()
    instance.closers += [pump.close, transport.close, peer_client.close]
    return routers


def watch_pump(state: InstanceState, pump: NotificationPump) -> None:
    """Make /health and /ready answer 503 once ``pump`` stopped on its own: the instance
    no longer hears its peers' KV notifications (registrations, ends of transfers)."""
    state.health_checks.append(pump.problem)


def serve(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    env: Environment | None = None,
    parts: InstanceParts | None = None,
) -> int:
    """Serve until a signal, draining first (`kvduplex.common.drain`); the exit code.
    `env` and `parts` as in `build_instance`."""
    instance = build_instance(engine_config, server_config, env, parts)
    logger.info(
        "serving %s as %s on http://%s:%d",
        instance.state.served_model_names[0],
        server_config.role.value,
        server_config.host,
        server_config.port,
    )
    config = uvicorn_config(
        instance.app, server_config.host, server_config.port, server_config.keep_alive_s
    )
    server = DrainingServer(config, instance.state.drain, instance.async_engine)
    try:
        server.run()
    finally:
        instance.shutdown()
    logger.info("stopped")
    return exit_code(server)
