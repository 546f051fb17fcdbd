"""Fixtures of the unit tests: an in-process instance of the tiny model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvduplex.common.engine_config import CacheConfig
from kvduplex.common.engine_config import EngineConfig
from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.instance.config import ServerConfig
from kvduplex.instance.server import Instance
from kvduplex.instance.server import build_instance


def tiny_instance() -> Instance:
    """An instance of the tiny model with a 16 MB KV cache, its app not served (port 0)."""
    cfg = EngineConfig(model=ModelLoadConfig(model="tiny"), cache=CacheConfig(kv_cache_mb=16))
    return build_instance(cfg, ServerConfig(port=0))


@pytest.fixture(scope="module")
def instance() -> Iterator[Instance]:
    """One `tiny_instance` per test module; its engine is shut down afterwards."""
    inst = tiny_instance()
    try:
        yield inst
    finally:
        inst.async_engine.shutdown()
