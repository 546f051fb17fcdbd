"""Configuration that the instance and the router share: torch-free, and free of the
OpenAI parsers, so that the engine's config needs neither.

The configs are split by process, one frozen `ConfigSection` per concern:

* `kvduplex.common.engine_config`: the engine (model, KV cache, scheduler, transfers);
* `kvduplex.common.openai.parsing_config`: tool-call and reasoning parsers;
* `kvduplex.instance.config`: an instance's HTTP server;
* `kvduplex.router.config`: the router.

Each process's flags, environment variables and config file come from one settings
model built from these sections (`kvduplex.common.settings`): a field's docstring is
its ``--help`` text. `Environment` names the few variables read outside of them.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from dataclasses import field
from typing import Annotated
from typing import ClassVar
from urllib.parse import urlsplit

import pydantic
from pydantic import AfterValidator
from pydantic_settings import SettingsConfigDict


def _port_in_range(value: int) -> int:
    if not 0 <= value <= 65535:
        raise ValueError(f"port must be in [0, 65535] (0: a free one), got {value}")
    return value


def _drain_not_negative(value: float) -> float:
    if value < 0:
        raise ValueError(f"drain_timeout_s must be >= 0, got {value}")
    return value


Port = Annotated[int, AfterValidator(_port_in_range)]
"""A TCP port a server listens on (0: a free one)."""
DrainTimeout = Annotated[float, AfterValidator(_drain_not_negative)]
"""Seconds a server drains for on SIGTERM (``--drain-timeout-s``)."""


class ConfigSection(pydantic.BaseModel):
    """Base of every config section: frozen, unknown keys refused, and each field's
    docstring its description (the ``--help`` text of its flag). A value out of range
    raises a ValueError (pydantic's ValidationError) that names the field."""

    # A SettingsConfigDict (holding only pydantic's own keys), so that a settings model
    # (`kvduplex.common.settings.ProcessSettings`) can take sections as its bases.
    model_config: ClassVar[SettingsConfigDict] = SettingsConfigDict(
        frozen=True, extra="forbid", use_attribute_docstrings=True
    )


class Role(enum.StrEnum):
    """What an instance does in a disaggregated deployment (``--role``)."""

    PREFILL = enum.auto()
    DECODE = enum.auto()
    BOTH = enum.auto()


class TransferMode(enum.StrEnum):
    """How KV moves from prefill to decode (the router's ``--mode``)."""

    PUSH = enum.auto()
    PULL = enum.auto()


class ReturnMode(enum.StrEnum):
    """How decode hands a finished turn's KV back to prefill (``--return-mode``)."""

    NONE = enum.auto()
    PUSH = enum.auto()
    PULL = enum.auto()


ROUTER_POOL_IDLE_S = 60.0
"""The longest the router keeps an idle connection to an instance for its next call
(`router.wire.WirePool`); an instance keeps one open longer (--keep-alive-s)."""


def host_and_port(text: str, what: str, default_port: int | None = None) -> tuple[str, int]:
    """`text` as HOST:PORT (an IPv6 address in brackets; PORT may be left out where
    `default_port` is given); a ValueError naming `what` if it is not one."""
    form = "HOST:PORT" if default_port is None else "HOST or HOST:PORT"
    problem = ValueError(f"{what} must be {form} (e.g. kvduplex-decode-headless:8000), got {text!r}")
    try:
        parts = urlsplit("//" + text)
        host, port = parts.hostname, parts.port
    except ValueError:
        raise problem from None
    if port is None and not text.endswith(":"):
        port = default_port
    if not host or not port or parts.path or parts.query or parts.fragment or parts.username:
        raise problem
    return host, port


ENV_PREFIX = "KVDUPLEX_"
"""Prefix of every environment variable kvduplex reads. A settings field ``name`` is
``KVDUPLEX_NAME`` unless its settings model keeps it out of the environment
(`kvduplex.common.settings`): no name read here may be one that a Kubernetes service
link injects (``<SVC>_PORT``, ``<SVC>_SERVICE_HOST``, ...)."""
CLUSTER_SECRET_VAR = "KVDUPLEX_CLUSTER_SECRET"
"""The variable `kvduplex up` sets for every process it starts."""
API_KEY_VAR = "KVDUPLEX_API_KEY"
"""The variable that gives the router and the instances their API key (``--api-key``
takes precedence)."""
LOG_LEVEL_VAR = "KVDUPLEX_LOG_LEVEL"
"""The variable that overrides every command's ``--log-level``."""
CACHE_DIR_VAR = "KVDUPLEX_CACHE_DIR"
"""Where compiled CPU kernels are cached (`kvduplex.model.cpu_decode`)."""


@dataclass(frozen=True)
class Environment:
    """The few environment variables kvduplex reads outside the settings models (all in
    `ENVIRONMENT_VARIABLES`)."""

    log_level: str | None = None
    """KVDUPLEX_LOG_LEVEL: overrides --log-level."""
    cluster_secret: str | None = field(default=None, repr=False)
    """KVDUPLEX_CLUSTER_SECRET: the cluster's shared secret (``--cluster-secret-file``
    takes precedence)."""
    api_key: str | None = field(default=None, repr=False)
    """KVDUPLEX_API_KEY: the key clients send on /v1/* routes (``--api-key`` takes
    precedence)."""

    @classmethod
    def read(cls) -> Environment:
        return cls(
            log_level=os.environ.get(LOG_LEVEL_VAR),
            cluster_secret=os.environ.get(CLUSTER_SECRET_VAR) or None,
            api_key=os.environ.get(API_KEY_VAR) or None,
        )


ENVIRONMENT_VARIABLES = (
    LOG_LEVEL_VAR,
    CLUSTER_SECRET_VAR,
    API_KEY_VAR,
    CACHE_DIR_VAR,
)
"""Every variable read outside the settings models (`Environment.read`, the kernel cache)."""
