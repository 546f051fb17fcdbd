"""One serving instance: engine + engine thread + HTTP app, run under uvicorn."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import uvicorn
from fastapi import APIRouter, FastAPI
from prometheus_client import CollectorRegistry

from kvduplex.config import EngineConfig, Role, ServerConfig
from kvduplex.engine.async_engine import AsyncEngine
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.metrics import EngineMetrics
from kvduplex.server.api import InstanceState, create_app

logger = logging.getLogger(__name__)


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


def build_instance(engine_config: EngineConfig, server_config: ServerConfig) -> Instance:
    """Load the model, allocate the KV pool, start the engine thread, build the app."""
    engine = LLMEngine(engine_config)
    engine.warmup()
    registry = CollectorRegistry()
    async_engine = AsyncEngine(engine, EngineMetrics(registry))
    names = [engine_config.model.served_model_name or engine_config.model.model]
    state = InstanceState(
        engine=async_engine,
        served_model_names=names,
        registry=registry,
        role=server_config.role.value,
    )
    instance = Instance(engine=engine, async_engine=async_engine, app=FastAPI(), state=state)
    routers = _role_routers(instance, engine_config, server_config.role)
    instance.app = create_app(state, routers)
    async_engine.start()
    return instance


def _role_routers(instance: Instance, config: EngineConfig, role: Role) -> list[APIRouter]:
    """The transport, connector and internal KV routes of a prefill or decode instance."""
    if role is Role.BOTH:
        return []
    from kvduplex.server.kv_routes import (
        make_decode_hooks,
        make_prefill_router,
        make_push_prefill_router,
    )
    from kvduplex.transfer.decode import DecodeConnector
    from kvduplex.transfer.handshake import PeerDirectory, make_handshake_router
    from kvduplex.transfer.metrics import KVFlowMetrics, TransferMetrics
    from kvduplex.transfer.nixl import NixlTransport
    from kvduplex.transfer.notify import NotificationPump
    from kvduplex.transfer.pull import PullConnector
    from kvduplex.transfer.push import PushReceiver, PushSender

    engine, async_engine, state = instance.engine, instance.async_engine, instance.state
    cfg = config.transfer
    block_size = engine.layout.block_size
    transport = NixlTransport(
        engine.kv_pool, engine.layout, default_deadline_s=cfg.transfer_timeout_s,
        metrics=TransferMetrics(state.registry),
    )  # fmt: skip
    flow_metrics = KVFlowMetrics(state.registry)
    directory = PeerDirectory(transport)
    pump = NotificationPump(transport)
    routers = [make_handshake_router(transport)]
    if role is Role.PREFILL:
        sender = PushSender(
            transport, async_engine, block_size, registration_wait_s=cfg.kv_wait_timeout_s,
            deadline_s=cfg.transfer_timeout_s, metrics=flow_metrics,
            peer_of=directory.peer_by_engine,
        )  # fmt: skip
        sender.attach(pump)
        engine.connector = sender
        routers.append(make_prefill_router(state, transport, cfg.pull_lease_s))
        routers.append(make_push_prefill_router(state, sender, directory))
        instance.closers.append(sender.close)
    else:
        pull = PullConnector(
            transport, async_engine, block_size, cfg.kv_wait_timeout_s, metrics=flow_metrics
        )
        receiver = PushReceiver(
            transport, async_engine, block_size, wait_s=cfg.kv_wait_timeout_s,
            quarantine_s=cfg.transfer_timeout_s + 1.0, metrics=flow_metrics,
        )  # fmt: skip
        receiver.attach(pump)
        engine.connector = DecodeConnector(pull, receiver)
        routers.append(make_decode_hooks(state, pull, receiver, directory))
        instance.closers.append(pull.close)
    pump.start()
    instance.closers += [pump.close, transport.close]
    return routers


def serve(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    """Serve until interrupted."""
    instance = build_instance(engine_config, server_config)
    logger.info(
        "serving %s as %s on http://%s:%d",
        instance.state.served_model_names[0],
        server_config.role.value,
        server_config.host,
        server_config.port,
    )
    uvicorn.run(
        instance.app,
        host=server_config.host,
        port=server_config.port,
        log_level="warning",
        timeout_graceful_shutdown=5,
    )
    instance.shutdown()
