"""The engine's configuration: which model, the paged KV cache, the scheduler and KV
transfers (`EngineConfig`, one frozen section per concern).

Only the instance runs an engine, but the model loader and the KV layout read these
too, so they sit in the torch-free common part. Nothing here knows the OpenAI API:
the parsers' config is `kvduplex.common.openai.parsing_config`. The flags,
environment variables and config-file keys of ``kvduplex serve`` are these fields
(`kvduplex.cli.settings.ServeSettings`); each field's docstring is its ``--help``.
"""

from __future__ import annotations

import enum
import os
from typing import Any

from pydantic import Field
from pydantic import ValidationInfo
from pydantic import field_validator
from pydantic import model_validator

from kvduplex.common.config import ConfigSection
from kvduplex.common.config import host_and_port


class DecodeAttention(enum.StrEnum):
    """How a step's decodes attend over the paged KV pool (``--decode-attention``)."""

    AUTO = enum.auto()
    """``kernel`` where it applies and torch runs one thread; else ``paged`` for models
    without sliding-window layers, ``copy`` for the others."""
    PAGED = enum.auto()
    """Every decode reads the pool in place where its blocks form long ranges; the rest of
    each sequence is copied; partials merged by log-sum-exp."""
    COPY = enum.auto()
    """Each decode's blocks copied into a scratch buffer, grouped by length, one SDPA per
    group (a lone decode over a few ranges read in place)."""
    FLEX = enum.auto()
    """One compiled FlexAttention call reading the pool in place (compiles at start-up)."""
    KERNEL = enum.auto()
    """CPU, float32: a C kernel, built at first use, reads every decode's blocks in place
    through its block table, split over torch's threads (`model/cpu_decode.py`)."""

    @classmethod
    def parse(cls, value: str) -> DecodeAttention:
        """`value` as a member; ``sdpa``, the name ``auto`` had before, reads as ``auto``."""
        if value == "sdpa":
            return cls.AUTO
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise ValueError(f"decode_attention must be one of {choices}, got {value!r}") from None


class PrefillAttention(enum.StrEnum):
    """How prefill chunks attend (``--prefill-attention``)."""

    AUTO = enum.auto()
    """``kernel`` where it applies (CPU, float32), the CPU has AVX-512 (where it was
    measured) and it builds; else ``sdpa``."""
    KERNEL = enum.auto()
    """CPU, float32: a C kernel, built at first use, reads each chunk's keys in place
    through its block table, split over torch's threads (`model/cpu_prefill.py`)."""
    SDPA = enum.auto()
    """torch's scaled_dot_product_attention (its flash kernel on CPU) over the chunk's
    own K/V and its cached context copied out of the pool."""


class KVTierKind(enum.StrEnum):
    """Where the prefix-cache blocks the KV pool evicts are kept (``--kv-tier``)."""

    NONE = enum.auto()
    """Nowhere: an evicted block is gone, recomputed when a prompt needs it again."""
    HOST = enum.auto()
    """Host memory (pinned on CUDA): the tier of GPU instances."""
    FILE = enum.auto()
    """One preallocated file under kv_tier_path (a local SSD): the tier of CPU instances."""
    STORE = enum.auto()
    """A Mooncake store that instances share (kv_store_master): a block one instance
    demoted, another loads. Needs ``pip install 'kvduplex[store]'``."""


STORE_METADATA_PORT = 8080
"""Port of the metadata server a Mooncake master serves itself (its default)."""


class EvictionPolicy(enum.StrEnum):
    """Which unreferenced cached block the KV pool evicts first (``--eviction``)."""

    LRU = enum.auto()
    """The least recently released, whatever it holds."""
    SESSION = enum.auto()
    """By session value: blocks of requests without a session first, then those of
    sessions idle longer than session_idle_s, then the rest (a fresh duplex return last);
    least recently released first within each (`kvduplex.engine.eviction`)."""


def _at_least(name: str, value: int | float, low: int | float, note: str = "") -> None:
    if value < low:
        raise ValueError(f"{name} must be >= {low}{note}, got {value}")


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")


class CacheConfig(ConfigSection):
    """The paged KV cache."""

    block_size: int = 16
    """Tokens per KV block."""
    num_blocks: int = 0
    """Blocks in the pool; 0 sizes the pool from kv_cache_mb."""
    kv_cache_mb: int = 512
    """KV pool size in MiB when num_blocks is 0."""
    enable_prefix_caching: bool = True
    """Reuse full blocks whose token prefix was seen before."""
    kv_tier: KVTierKind = KVTierKind.NONE
    """Where prefix-cache blocks evicted from the pool go, to be loaded back (checksum
    verified) when a prompt needs them again: none (dropped), host (host memory; GPU
    instances), file (one preallocated file in kv_tier_path; CPU instances) or store (a
    Mooncake store the instances share, at kv_store_master)."""
    kv_tier_gib: float = 4.0
    """Size of the KV tier in GiB when kv_tier_blocks is 0 (store tier: the share of the
    store this instance counts on when it tells the router how long blocks stay)."""
    kv_tier_blocks: int = 0
    """Blocks the KV tier holds; 0 sizes it from kv_tier_gib."""
    kv_tier_path: str = ""
    """Directory of the file tier's file, on local storage (empty: the system's temporary
    directory). The file has no name (removed as soon as it is open), so it never outlives
    the instance and no two instances share one; its contents do not survive a restart."""
    kv_tier_overlap_blocks: int | None = None
    """Host and file tiers: a tier hit of at least this many blocks after a new request's
    pool hit is read layer by layer while the request's first forward runs (each layer's
    attention waits only for that layer); a shorter one, and every store tier hit, is
    loaded whole before the step. 0: always before. None (the default): 4 where the pool
    is on a GPU (the loader's reads and copies run beside the device's forward), 0 on a
    CPU pool, whose forward already uses the cores the loader would take (measured on 2
    cores: the wait gone, TTFT 0.78-1.24x the whole promotion; docs/benchmarks.md)."""
    kv_store_master: str = ""
    """Store tier: HOST:PORT of the Mooncake master (its RPC port)."""
    kv_store_metadata_url: str = ""
    """Store tier: the Mooncake metadata server, http://HOST:PORT/metadata; empty: the one
    the master serves itself (mooncake_master --enable_http_metadata_server) on the
    master's host, port 8080."""
    kv_store_local_host: str = ""
    """Store tier: this instance's address as the store's nodes reach it; empty: the
    address of the interface that routes to the master."""
    kv_store_timeout_s: float = 1.0
    """Store tier: the longest the engine waits for one store call (a prefix lookup's check,
    a block's load). Past it, or on an error, the tier answers miss (the tokens are
    computed) and leaves the store alone for kv_store_retry_s."""
    kv_store_retry_s: float = 1.0
    """Store tier: how long a failing store is left alone before it is tried again; doubles
    while it keeps failing, up to 30 s."""
    eviction: EvictionPolicy = EvictionPolicy.SESSION
    """Which cached blocks the pool evicts first when it needs room: session (blocks of
    requests without a session first, then those of sessions idle longer than
    session_idle_s, then the rest, a fresh duplex return last) or lru (least recently
    released first, whatever they hold)."""
    session_idle_s: float = 180.0
    """With eviction session: seconds after its last request or released block on this
    instance when a session counts as finished (the longest expected think time
    between turns); its cached blocks then go before those of live sessions."""

    @field_validator("block_size")
    @classmethod
    def _check_block_size(cls, value: int) -> int:
        if not 1 <= value <= 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {value}")
        return value

    @field_validator("num_blocks")
    @classmethod
    def _check_num_blocks(cls, value: int) -> int:
        _at_least("num_blocks", value, 0, " (0 = size from kv_cache_mb)")
        return value

    @field_validator("kv_tier_blocks")
    @classmethod
    def _check_tier_blocks(cls, value: int) -> int:
        _at_least("kv_tier_blocks", value, 0, " (0 = size from kv_tier_gib)")
        return value

    @field_validator("kv_tier_overlap_blocks")
    @classmethod
    def _check_overlap_blocks(cls, value: int | None) -> int | None:
        if value is not None:
            _at_least(
                "kv_tier_overlap_blocks", value, 0, " (0 = load every tier hit before the step)"
            )
        return value

    @field_validator("kv_store_timeout_s", "kv_store_retry_s")
    @classmethod
    def _check_store_times(cls, value: float, info: ValidationInfo) -> float:
        _positive(str(info.field_name), value)
        return value

    def store_metadata_url(self) -> str:
        """The metadata server the store tier uses (kv_store_metadata_url, or the master's)."""
        if self.kv_store_metadata_url:
            return self.kv_store_metadata_url
        host, _ = host_and_port(self.kv_store_master, "kv_store_master")
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{STORE_METADATA_PORT}/metadata"

    @field_validator("session_idle_s")
    @classmethod
    def _check_session_idle(cls, value: float) -> float:
        _positive("session_idle_s", value)
        return value

    @model_validator(mode="after")
    def _check_pool_size(self) -> CacheConfig:
        if self.num_blocks == 0 and self.kv_cache_mb < 1:
            raise ValueError("set num_blocks >= 1 or kv_cache_mb >= 1")
        return self

    @model_validator(mode="after")
    def _check_tier(self) -> CacheConfig:
        tier, path = self.kv_tier, self.kv_tier_path
        if path and tier is not KVTierKind.FILE:
            raise ValueError(
                f"kv_tier_path is the file tier's directory; set kv_tier to file or leave "
                f"kv_tier_path empty (kv_tier is {tier.value})"
            )
        self._check_store_settings()
        if tier is KVTierKind.NONE:
            return self
        if not self.enable_prefix_caching:
            raise ValueError(
                f"kv_tier {tier.value} keeps prefix-cache blocks; turn enable_prefix_caching "
                "on or set kv_tier to none"
            )
        if self.kv_tier_blocks == 0 and not self.kv_tier_gib > 0:
            raise ValueError(
                f"kv_tier_gib must be > 0 (or set kv_tier_blocks), got {self.kv_tier_gib}"
            )
        if path and not os.path.isdir(path):
            raise ValueError(
                f"kv_tier_path {path!r} is not an existing directory; create it or name another"
            )
        return self

    def _check_store_settings(self) -> None:
        named = {
            "kv_store_master": self.kv_store_master,
            "kv_store_metadata_url": self.kv_store_metadata_url,
            "kv_store_local_host": self.kv_store_local_host,
        }
        if self.kv_tier is not KVTierKind.STORE:
            for name, value in named.items():
                if value:
                    raise ValueError(
                        f"{name} is a setting of the store tier; set kv_tier to store or "
                        f"leave {name} empty (kv_tier is {self.kv_tier.value})"
                    )
            return
        if not self.kv_store_master:
            raise ValueError(
                "kv_tier store needs kv_store_master: HOST:PORT of the Mooncake master's RPC "
                "(kvduplex up --kv-store starts one)"
            )
        host_and_port(self.kv_store_master, "kv_store_master")
        url = self.kv_store_metadata_url
        if url and not (url.startswith("http://") and url.rstrip("/").endswith("/metadata")):
            raise ValueError(
                f"kv_store_metadata_url must be http://HOST:PORT/metadata (Mooncake's HTTP "
                f"metadata server), got {url!r}"
            )


class SchedulerConfig(ConfigSection):
    """Continuous batching, chunked prefill and the engine loop's health."""

    max_num_seqs: int = 64
    """Most requests running at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one engine step (prefill chunks plus decodes)."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps so decodes keep flowing."""
    long_prefill_token_threshold: int = 0
    """Largest prefill chunk of one request per step; 0 means the whole budget."""
    max_prefill_tokens_with_decodes: int = 0
    """Most prefill tokens in a step that also runs decodes (the step's budget is then the
    decodes plus this, at most max_num_batched_tokens); 0: no cap beyond the budget. A step
    without decodes prefills the whole budget. Smaller: the tokens of running requests keep
    coming while a burst of new prompts prefills (lower TPOT), each of those prompts taking
    a few more, shorter steps (slightly later first tokens)."""
    engine_stall_timeout_s: float = 8.0
    """Seconds the engine loop may spend in one iteration (a step, or a call run between
    steps) while it has work before the instance calls itself unhealthy: /health answers
    503 and KV heartbeats stop, so decode stops waiting for this instance's pushes and the
    router sends new requests elsewhere; healthy again once the iteration ends. An idle
    loop (waiting for work) is healthy. One step computes at most max_num_batched_tokens,
    so keep this above the longest such step (on CPU, a whole step's prefill takes seconds;
    a GPU step well under one), and below
    --kv-wait-timeout-s, so that a wedged prefill instance costs decode at most the sum."""

    @field_validator("max_num_seqs", "max_num_batched_tokens")
    @classmethod
    def _check_at_least_one(cls, value: int, info: ValidationInfo) -> int:
        _at_least(str(info.field_name), value, 1)
        return value

    @field_validator("long_prefill_token_threshold", "max_prefill_tokens_with_decodes")
    @classmethod
    def _check_at_least_zero(cls, value: int, info: ValidationInfo) -> int:
        _at_least(str(info.field_name), value, 0)
        return value

    @field_validator("engine_stall_timeout_s")
    @classmethod
    def _check_stall(cls, value: float) -> float:
        _positive("engine_stall_timeout_s", value)
        return value


class ModelLoadConfig(ConfigSection):
    """Which model to serve and how."""

    model: str = "tiny"
    """A built-in preset name (tiny, small, kv-heavy, long) or a local Hugging Face folder."""
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
    decode_attention: DecodeAttention = DecodeAttention.AUTO
    """Decode attention: auto (kernel on CPU with one torch thread where it builds; else
    paged, or copy for models with sliding-window layers), kernel (a compiled CPU kernel
    walking each block table), paged (read the KV pool in place where blocks run), copy
    (blocks copied per length group, then SDPA) or flex (compiled FlexAttention in place;
    compiles at start-up)."""
    prefill_attention: PrefillAttention = PrefillAttention.AUTO
    """Prefill attention: auto (kernel on CPUs with AVX-512 where it applies and builds, else
    sdpa), kernel (a compiled CPU kernel reading each chunk's keys in place) or sdpa (torch's
    SDPA)."""
    cpu_packed_weights: bool = True
    """On CPU, also keep every float32 linear weight packed for oneDNN and use it for
    matmuls of two rows or more (decode batches whole, prefill chunks in tiles of 256
    rows); a single row uses the plain weight (MKL's gemv). Doubles the memory of the
    linear weights; off keeps one copy (MKL for every matmul)."""

    @field_validator("dtype")
    @classmethod
    def _check_dtype(cls, value: str) -> str:
        if value not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {value!r}")
        return value

    @field_validator("decode_attention", mode="before")
    @classmethod
    def _parse_decode_attention(cls, value: Any) -> Any:
        return DecodeAttention.parse(value) if isinstance(value, str) else value

    @field_validator("num_threads")
    @classmethod
    def _check_threads(cls, value: int) -> int:
        _at_least("num_threads", value, 0)
        return value


class TransferConfig(ConfigSection):
    """KV transfer between instances."""

    kv_wait_timeout_s: float = 10.0
    """How long decode waits for pushed KV without word from prefill before computing the
    prompt itself (and prefill for decode's registration); heartbeats restart it. Also the
    deadline of a pull READ, shortened to end 0.5 s before prefill's lease does."""
    pull_lease_s: float = 30.0
    """How long prefill keeps a finished request's blocks for decode to read, as told to
    decode; prefill holds them 2 s longer (`kvduplex.kvflow.lease.TRANSIT_GRACE_S`) since
    decode counts it from its own arrival."""
    transfer_timeout_s: float = 10.0
    """Deadline of each WRITE of a push (prefill) or a return (decode), never past the
    receiver's wait; a failed WRITE fails the transfer and decode computes the prompt. The
    deadline ends the wait, not the WRITE: its blocks stay referenced until it cannot land
    (NIXL released it; a sender tears the endpoint down if that takes another deadline).
    A receiver that gave up keeps its blocks until the sender confirms, asking it again
    every twice this plus 1 s, or until the sender's process is known to be gone. Pull
    READs use kv_wait_timeout_s instead."""
    retain_lease_s: float = 60.0
    """Decode, ``--return-mode pull`` only: how long a session's last turn stays held
    for prefill to read at the next turn."""
    fetch_lease_s: float = 10.0
    """Decode: how long it keeps the cached prefix it lent for prefill to read (the
    router's fetch plan), as told to prefill, which releases it once its read ended;
    decode holds it 2 s longer (`kvduplex.kvflow.lease.TRANSIT_GRACE_S`) unless released.
    Prefill's read must end 0.5 s before the lease does, counted from its arrival, or it
    computes the prefix itself."""
    peer_recheck_s: float = 1.0
    """For a request that names no engine id for its peer (the router names them, from
    each instance's /health): how long a connection to a peer is used before the engine id
    at its URL is checked again (one HTTP GET, at the next request that needs the peer); a
    peer restarted at the same address is handshaken afresh at its first use after this. A
    peer that does not answer the check within 0.5 s is kept (the transfers' deadlines
    cover it)."""
    peer_idle_s: float = 600.0
    """How long a peer (an instance this one exchanged KV with) may go unused, with no
    transfer with it in flight, before it is forgotten: its NIXL agent removed, its
    prepared descriptors released, its entry dropped (0: never for idleness). A peer
    whose address refuses the handshake, or a transfer or notification to which failed,
    is forgotten as soon as nothing with it is in flight. A forgotten peer that comes
    back is handshaken afresh. Bounds the memory of a long-lived instance in a cluster
    whose pods come and go. Must outlast every flow's wait: more than kv_wait_timeout_s
    and than twice transfer_timeout_s plus 1 s (a receiver's quarantine)."""

    @model_validator(mode="after")
    def _check_peer_idle(self) -> TransferConfig:
        floor = max(self.kv_wait_timeout_s, 2 * self.transfer_timeout_s + 1)
        if self.peer_idle_s < 0 or (self.peer_idle_s != 0 and self.peer_idle_s <= floor):
            raise ValueError(
                f"peer_idle_s must be 0 (never) or > {floor:g} s (kv_wait_timeout_s and twice "
                f"transfer_timeout_s plus 1 s, the longest a flow waits on a peer unheard), "
                f"got {self.peer_idle_s:g}; raise it or lower those"
            )
        return self

    @field_validator("peer_recheck_s")
    @classmethod
    def _check_recheck(cls, value: float) -> float:
        _at_least("peer_recheck_s", value, 0)
        return value

    @field_validator(
        "kv_wait_timeout_s", "pull_lease_s", "transfer_timeout_s", "retain_lease_s",
        "fetch_lease_s",
    )  # fmt: skip
    @classmethod
    def _check_positive(cls, value: float, info: ValidationInfo) -> float:
        _positive(str(info.field_name), value)
        return value


class EngineConfig(ConfigSection):
    """Everything one instance's engine needs."""

    model: ModelLoadConfig = Field(default_factory=ModelLoadConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    transfer: TransferConfig = Field(default_factory=TransferConfig)
