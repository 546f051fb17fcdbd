"""One serving instance: engine + engine thread + HTTP app, run under uvicorn."""

from __future__ import annotations

import logging
from dataclasses import dataclass

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
    routers = _role_routers(engine, async_engine, state, engine_config, server_config.role)
    app = create_app(state, routers)
    async_engine.start()
    return Instance(engine=engine, async_engine=async_engine, app=app, state=state)


def _role_routers(
    engine: LLMEngine,
    async_engine: AsyncEngine,
    state: InstanceState,
    config: EngineConfig,
    role: Role,
) -> list[APIRouter]:
    """The transport and internal KV routes of a prefill or decode instance."""
    if role is Role.BOTH:
        return []
    from kvduplex.server.kv_routes import make_decode_hooks, make_prefill_router
    from kvduplex.transfer.handshake import PeerDirectory, make_handshake_router
    from kvduplex.transfer.nixl import NixlTransport
    from kvduplex.transfer.pull import PullConnector

    transport = NixlTransport(
        engine.kv_pool, engine.layout, default_deadline_s=config.transfer.transfer_timeout_s
    )
    routers = [make_handshake_router(transport)]
    if role is Role.PREFILL:
        routers.append(make_prefill_router(state, transport, config.transfer.pull_lease_s))
    else:
        connector = PullConnector(
            transport, async_engine, engine.layout.block_size, config.transfer.kv_wait_timeout_s
        )
        engine.connector = connector
        routers.append(make_decode_hooks(state, connector, PeerDirectory(transport)))
    return routers


def serve(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    """Serve until interrupted."""
    instance = build_instance(engine_config, server_config)
    logger.info(
        "serving %s as %s on http://%s:%d",
        instance.state.served_model_names[0], server_config.role.value,
        server_config.host, server_config.port,
    )
    uvicorn.run(
        instance.app,
        host=server_config.host,
        port=server_config.port,
        log_level="warning",
        timeout_graceful_shutdown=5,
    )
    instance.async_engine.shutdown()
