"""One serving instance: engine + engine thread + HTTP app, run under uvicorn."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from kvduplex.config import EngineConfig, ServerConfig
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
    app = create_app(state)
    async_engine.start()
    return Instance(engine=engine, async_engine=async_engine, app=app, state=state)


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
