"""An instance's HTTP server config (`ServerConfig`): where it listens, its role, its
limits, keys and drain, and the parsers of the chat answers it serves directly.

``kvduplex serve`` takes these fields, with the engine's
(`kvduplex.common.engine_config`), as flags, environment variables and config-file
keys (`kvduplex.cli.settings.ServeSettings`).
"""

from __future__ import annotations

from pydantic import Field
from pydantic import ValidationInfo
from pydantic import field_validator

from kvduplex.common.config import ROUTER_POOL_IDLE_S
from kvduplex.common.config import DrainTimeout
from kvduplex.common.config import Port
from kvduplex.common.config import Role
from kvduplex.common.openai.parsing_config import ParsingConfig


class ServerConfig(ParsingConfig):
    """The HTTP server of one instance. Its parsing fields (`ParsingConfig`, as
    ``parsing``) are for the chat answers this instance serves directly: a router asks
    for raw text and parses them itself."""

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: Port = 8000
    """Port to listen on; 0 picks a free one."""
    role: Role = Role.BOTH
    """prefill, decode or both."""
    log_level: str = "info"
    """Python log level."""
    cluster_secret_file: str = ""
    """File holding the cluster's shared secret, which every /internal/* request must carry
    (header X-KVDuplex-Cluster-Secret); empty: KVDUPLEX_CLUSTER_SECRET, or no secret at all
    (internal routes open to anyone who can reach the port)."""
    internal_max_body_mb: int = 16
    """Largest request body an /internal/* route accepts, in MiB (larger: HTTP 413)."""
    max_body_mb: int = 32
    """Largest request body the OpenAI routes accept, in MiB (larger: HTTP 413, before it is
    parsed). Keep it at least 3x the router's --max-body-mb plus 1: the router forwards a
    body as ASCII JSON, which can triple the size of non-ASCII text."""
    api_key: str = Field(default="", repr=False)
    """Key clients must send on every /v1/* route (header Authorization: Bearer KEY); empty:
    KVDUPLEX_API_KEY, or no key (open). /health and /metrics stay open."""
    drain_timeout_s: DrainTimeout = 60.0
    """At SIGTERM the instance drains: /ready answers 503, new requests are refused (503,
    code draining), and the work in flight finishes, the KV pushes and returns it owes
    included; then it exits 0. After this many seconds it exits anyway (1, logged). A
    second SIGTERM or SIGINT exits at once."""
    keep_alive_s: int = 75
    """How long an idle client connection is kept open, in seconds: longer than any
    client keeps one idle for reuse (the router: 60 s), so that the client closes it first
    (a request sent just as the server closes the connection fails, and a POST is not
    sent again)."""

    @field_validator("keep_alive_s")
    @classmethod
    def _check_keep_alive(cls, value: int) -> int:
        if not value > ROUTER_POOL_IDLE_S:
            raise ValueError(
                f"keep_alive_s must be > {ROUTER_POOL_IDLE_S:g} (the router keeps an idle "
                f"connection to an instance that long), got {value}"
            )
        return value

    @field_validator("internal_max_body_mb", "max_body_mb")
    @classmethod
    def _check_body(cls, value: int, info: ValidationInfo) -> int:
        if value < 1:
            raise ValueError(f"{info.field_name} must be >= 1, got {value}")
        return value
