"""Configuration: one frozen dataclass per concern.

CLI flags are generated from these (see `kvduplex.server.cli`), so every field's
docstring line doubles as its ``--help`` text and its default is the CLI default.
Environment variables are read only here, all prefixed ``KVDUPLEX_``.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field


class Role(enum.Enum):
    """What an instance does in a disaggregated deployment."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


class TransferMode(enum.Enum):
    """How KV moves from prefill to decode."""

    PUSH = "push"
    PULL = "pull"


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16
    """Tokens per KV block."""
    num_blocks: int = 0
    """Blocks in the pool; 0 sizes the pool from kv_cache_mb."""
    kv_cache_mb: int = 512
    """KV pool size in MiB when num_blocks is 0."""
    enable_prefix_caching: bool = True
    """Reuse full blocks whose token prefix was seen before."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0 (0 = size from kv_cache_mb), got {self.num_blocks}")
        if self.num_blocks == 0 and self.kv_cache_mb < 1:
            raise ValueError("set num_blocks >= 1 or kv_cache_mb >= 1")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching and chunked prefill."""

    max_num_seqs: int = 64
    """Most requests running at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one engine step (prefill chunks plus decodes)."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps so decodes keep flowing."""
    long_prefill_token_threshold: int = 0
    """Largest prefill chunk of one request per step; 0 means the whole budget."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")


@dataclass(frozen=True)
class ModelLoadConfig:
    """Which model to serve and how."""

    model: str = "tiny"
    """A built-in preset name (tiny, small, kv-heavy) or a local Hugging Face folder."""
    dtype: str = "auto"
    """float32, bfloat16 or auto (float32 on CPU, bfloat16 on CUDA)."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto."""
    seed: int = 0
    """Seed of a preset's random weights."""
    served_model_name: str = ""
    """Name clients use in requests; defaults to the model argument."""
    num_threads: int = 0
    """torch intra-op threads; 0 keeps torch's default."""
    decode_attention: str = "sdpa"
    """Decode attention: sdpa (blocks copied per length group, then SDPA) or flex
    (compiled FlexAttention reading the KV pool in place; compiles at start-up)."""

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.decode_attention not in ("sdpa", "flex"):
            raise ValueError(f"decode_attention must be sdpa or flex, got {self.decode_attention!r}")
        if self.num_threads < 0:
            raise ValueError("num_threads must be >= 0")


@dataclass(frozen=True)
class TransferConfig:
    """KV transfer between instances."""

    kv_wait_timeout_s: float = 10.0
    """How long decode waits for pushed KV without word from prefill before computing the
    prompt itself (and prefill for decode's registration); heartbeats restart it."""
    pull_lease_s: float = 30.0
    """How long prefill keeps a finished request's blocks for decode to read."""
    transfer_timeout_s: float = 10.0
    """Deadline of one transfer; on expiry it fails and its blocks are released."""
    retain_lease_s: float = 60.0
    """Decode, ``--return-mode pull`` only: how long a session's last turn stays held
    for prefill to read at the next turn."""

    def __post_init__(self) -> None:
        for name in ("kv_wait_timeout_s", "pull_lease_s", "transfer_timeout_s", "retain_lease_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server of one instance."""

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """Port to listen on; 0 picks a free one."""
    role: Role = Role.BOTH
    """prefill, decode or both."""
    log_level: str = "info"
    """Python log level."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one instance needs."""

    model: ModelLoadConfig = field(default_factory=ModelLoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)


@dataclass(frozen=True)
class Environment:
    """The few environment variables kvduplex reads."""

    log_level: str | None
    """KVDUPLEX_LOG_LEVEL: overrides --log-level."""

    @classmethod
    def read(cls) -> Environment:
        return cls(log_level=os.environ.get("KVDUPLEX_LOG_LEVEL"))
