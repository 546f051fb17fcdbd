"""Configuration: one frozen dataclass per concern.

The flags of ``kvduplex serve`` are generated from these (see
`kvduplex.cli.flags`), so every field's docstring doubles as its ``--help``
text and its default is the CLI default. The flags of ``kvduplex router`` and
``kvduplex up`` are written out in `kvduplex.cli.main`, and those of
``kvduplex bench`` in `kvduplex.bench.serving` (defaulted by its `Options`).
Environment variables are all prefixed ``KVDUPLEX_``: the few that are not flags
are read here (`Environment`); every flag of serve, router and up is also
``KVDUPLEX_<FLAG_NAME>``, layered with ``--config`` by `kvduplex.cli.settings`.
"""

from __future__ import annotations

import enum
import ipaddress
import os
from dataclasses import dataclass
from dataclasses import field
from urllib.parse import urlsplit

from kvduplex.common.openai.reasoning import REASONING_PARSERS
from kvduplex.common.openai.tool_parsers import TOOL_CALL_PARSERS


class Role(enum.StrEnum):
    """What an instance does in a disaggregated deployment (``--role``)."""

    PREFILL = enum.auto()
    DECODE = enum.auto()
    BOTH = enum.auto()


class TransferMode(enum.StrEnum):
    """How KV moves from prefill to decode (the router's ``--mode``)."""

    PUSH = enum.auto()
    PULL = enum.auto()


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


class ReturnMode(enum.StrEnum):
    """How decode hands a finished turn's KV back to prefill (``--return-mode``)."""

    NONE = enum.auto()
    PUSH = enum.auto()
    PULL = enum.auto()


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
    """Continuous batching, chunked prefill and the engine loop's health."""

    max_num_seqs: int = 64
    """Most requests running at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one engine step (prefill chunks plus decodes)."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps so decodes keep flowing."""
    long_prefill_token_threshold: int = 0
    """Largest prefill chunk of one request per step; 0 means the whole budget."""
    engine_stall_timeout_s: float = 8.0
    """Seconds the engine loop may spend in one iteration (a step, or a call run between
    steps) while it has work before the instance calls itself unhealthy: /health answers
    503 and KV heartbeats stop, so decode stops waiting for this instance's pushes and the
    router sends new requests elsewhere; healthy again once the iteration ends. An idle
    loop (waiting for work) is healthy. One step computes at most max_num_batched_tokens,
    so keep this above the longest such step (a whole 2,048-token prefill of the small
    preset takes about 5 s on 2 CPU cores; a GPU step takes well under 1 s), and below
    --kv-wait-timeout-s, so that a wedged prefill instance costs decode at most the sum."""

    def __post_init__(self) -> None:
        if not self.engine_stall_timeout_s > 0:
            raise ValueError(
                f"engine_stall_timeout_s must be > 0, got {self.engine_stall_timeout_s}"
            )
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
    decode_attention: DecodeAttention = DecodeAttention.AUTO
    """Decode attention: auto (kernel on CPU with one torch thread where it builds; else
    paged, or copy for models with sliding-window layers), kernel (a compiled CPU kernel
    walking each block table), paged (read the KV pool in place where blocks run), copy
    (blocks copied per length group, then SDPA) or flex (compiled FlexAttention in place;
    compiles at start-up)."""
    cpu_packed_weights: bool = True
    """On CPU, also keep every float32 linear weight packed for oneDNN and use it for
    matmuls of 2 to 64 rows (decode batches); a single row (MKL's gemv) and longer inputs
    (prefill chunks) use the plain weight. Doubles the memory of the linear weights; off
    keeps one copy."""

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        object.__setattr__(self, "decode_attention", DecodeAttention.parse(self.decode_attention))
        if self.num_threads < 0:
            raise ValueError("num_threads must be >= 0")


@dataclass(frozen=True)
class TransferConfig:
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
    peer_recheck_s: float = 1.0
    """For a request that names no engine id for its peer (the router names them, from
    each instance's /health): how long a connection to a peer is used before the engine id
    at its URL is checked again (one HTTP GET, at the next request that needs the peer); a
    peer restarted at the same address is handshaken afresh at its first use after this. A
    peer that does not answer the check within 0.5 s is kept (the transfers' deadlines
    cover it)."""

    def __post_init__(self) -> None:
        if self.peer_recheck_s < 0:
            raise ValueError(f"peer_recheck_s must be >= 0, got {self.peer_recheck_s}")
        for name in ("kv_wait_timeout_s", "pull_lease_s", "transfer_timeout_s", "retain_lease_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class ParsingConfig:
    """Tool calls and reasoning parsed out of chat answers (the router's, or an instance's
    for what it serves directly), with vLLM's flag names."""

    tool_call_parser: str = ""
    """Format of the model's tool calls: hermes (Hermes, Qwen2.5, Qwen3) or llama3_json
    (Llama 3.x); empty: none. Calls become the answer's tool_calls."""
    reasoning_parser: str = ""
    """Format of the model's reasoning: deepseek_r1 or qwen3 (<think>...</think>); empty:
    none. The reasoning becomes the answer's reasoning_content."""
    enable_auto_tool_choice: bool = False
    """Parse tool calls when a request gives tools with tool_choice auto (its default);
    needs --tool-call-parser. Without it, tool_choice auto is refused (400)."""

    def __post_init__(self) -> None:
        if self.tool_call_parser and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {sorted(TOOL_CALL_PARSERS)}, got "
                f"{self.tool_call_parser!r}"
            )
        if self.reasoning_parser and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {list(REASONING_PARSERS)}, got "
                f"{self.reasoning_parser!r}"
            )
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


ROUTER_POOL_IDLE_S = 60.0
"""The longest the router keeps an idle connection to an instance for its next call
(`router.wire.WirePool`); an instance keeps one open longer (--keep-alive-s)."""


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
    api_key: str = field(default="", repr=False)
    """Key clients must send on every /v1/* route (header Authorization: Bearer KEY); empty:
    KVDUPLEX_API_KEY, or no key (open). /health and /metrics stay open."""
    drain_timeout_s: float = 60.0
    """At SIGTERM the instance drains: /ready answers 503, new requests are refused (503,
    code draining), and the work in flight finishes, the KV pushes and returns it owes
    included; then it exits 0. After this many seconds it exits anyway (1, logged). A
    second SIGTERM or SIGINT exits at once."""
    keep_alive_s: int = 75
    """How long an idle client connection is kept open, in seconds: longer than any
    client keeps one idle for reuse (the router: 60 s), so that the client closes it first
    (a request sent just as the server closes the connection fails, and a POST is not
    sent again)."""
    parsing: ParsingConfig = field(default_factory=ParsingConfig)
    """Tool calls and reasoning parsed out of the chat answers this instance serves
    directly (a router asks for raw text and parses them itself)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if not self.keep_alive_s > ROUTER_POOL_IDLE_S:
            raise ValueError(
                f"keep_alive_s must be > {ROUTER_POOL_IDLE_S:g} (the router keeps an idle "
                f"connection to an instance that long), got {self.keep_alive_s}"
            )
        for name in ("internal_max_body_mb", "max_body_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


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


@dataclass(frozen=True)
class RouterConfig:
    """The router: the OpenAI front door over prefill and decode instances."""

    prefill: tuple[str, ...] = ()
    """Prefill instance URLs (none: decode instances compute whole requests)."""
    decode: tuple[str, ...] = ()
    """Decode instance URLs."""
    prefill_dns: str = ""
    """NAME:PORT: every address of DNS name NAME (its A and AAAA records, as a Kubernetes
    headless Service gives) is a prefill instance on PORT, re-resolved every
    --dns-interval-s; with or instead of --prefill."""
    decode_dns: str = ""
    """NAME:PORT: every address of DNS name NAME is a decode instance on PORT (as
    --prefill-dns); with or instead of --decode."""
    dns_interval_s: float = 5.0
    """Seconds between resolutions of --prefill-dns and --decode-dns: an address that
    appears joins once its /health names the role, one that is gone leaves."""
    dns_server: str = ""
    """IP or IP:PORT of the DNS server that --prefill-dns and --decode-dns ask (empty: the
    system's, in /etc/resolv.conf)."""
    mode: TransferMode = TransferMode.PUSH
    """KV transfer: push (prefill writes layer by layer) or pull (decode reads after)."""
    model: str = "tiny"
    """A preset or local Hugging Face folder: its tokenizer and chat template."""
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """Port to listen on."""
    session_ttl_s: float = 600.0
    """Seconds a session is remembered after its last turn."""
    max_sessions: int = 100_000
    """Most sessions remembered; the least recently used is forgotten first."""
    session_busy_margin: int = 2
    """A session's next turn leaves its instance (a named session's: the first of its
    rendezvous rank, for the next) when that one has more than this many requests in
    flight beyond the least busy one."""
    load_half_life_s: float = 30.0
    """Half-life of the count of recent assignments that spreads new sessions."""
    health_interval_s: float = 2.0
    """Seconds between the router's probes of each instance's /ready (/health where an
    instance has no /ready; a draining one gets no new work at once). A failed call
    (unreachable, or its connection failed; not a 5xx answer) marks the instance
    unhealthy at once, ``--health-failures`` failed probes in a row do too; it then gets
    no new work until a probe that began after the failure succeeds."""
    health_timeout_s: float = 2.0
    """Deadline of one health probe; a probe past it counts as failed."""
    health_failures: int = 2
    """Failed health probes in a row that mark an instance unhealthy (1: the first). When
    an instance is marked unhealthy, the router abandons its calls in flight to it: a
    prefill ends as failed (decode computes the prompt), a decode answer ends with an
    error. So a hung instance holds a request for at most about --health-interval-s x
    this + --health-timeout-s."""
    api_key: str = field(default="", repr=False)
    """Key clients must send on every /v1/* route (header Authorization: Bearer KEY); empty:
    KVDUPLEX_API_KEY, or no key (open). The router sends it on to the instances.
    /health and /metrics stay open."""
    return_mode: ReturnMode = ReturnMode.PUSH
    """Return of a finished turn's KV from decode to prefill, push mode only: push (duplex,
    the default: decode WRITEs the blocks prefill lacks into its prefix cache after the
    turn, while the session's client sends its answers back as returned); none; pull
    (vLLM-style, for comparison: decode keeps the turn, prefill READs it next turn)."""
    short_append_tokens: int = 0
    """Push mode: a session's turn whose part decode has not cached (its new input) is at
    most this many tokens goes to decode alone, which prefills it over its cached history
    (0: off). With ``return_mode`` push, decode then returns the turn to prefill. Off by
    default: in the agentic benchmark (six sessions decoding, 40-160-token appends) decode's
    prefill raised TTFT 1.36x and TPOT 1.06x over prefill's (docs/benchmarks.md); it pays where the
    prefill instances are the bottleneck."""
    max_body_mb: int = 8
    """Largest request body accepted, in MiB (larger: HTTP 413, before it is parsed). A
    prompt that fits a 128k-token context is well under 8 MiB of JSON."""
    log_level: str = "warning"
    """Python log level."""
    cluster_secret_file: str = ""
    """File holding the cluster's shared secret, which the router sends to the instances
    (they need it on their internal routes); empty: KVDUPLEX_CLUSTER_SECRET, or none."""
    drain_timeout_s: float = 60.0
    """At SIGTERM the router drains: /ready answers 503, new requests are refused (503,
    code draining), and the requests in flight finish; then it exits 0. After this many
    seconds it exits anyway (1, logged). A second SIGTERM or SIGINT exits at once."""
    keep_alive_s: int = 75
    """How long an idle client connection is kept open, in seconds: longer than a load
    balancer in front keeps one idle for reuse (nginx, AWS ALB: 60 s; GCP's: 600 s, Envoy:
    1 h, unless set lower), so that it closes the connection first (a request sent just as
    the router closes it fails, and a POST is not sent again)."""
    prompt_threads: int = 4
    """Threads that build prompts (chat template, tokenizer) off the event loop, which
    stays free for health probes and the streams relayed; more requests than this wait
    for one."""
    parsing: ParsingConfig = field(default_factory=ParsingConfig)
    """Tool calls and reasoning parsed out of chat answers, here (instances are asked
    for raw text)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefill", tuple(u.rstrip("/") for u in self.prefill))
        object.__setattr__(self, "decode", tuple(u.rstrip("/") for u in self.decode))
        if not self.decode and not self.decode_dns:
            raise ValueError("give at least one --decode URL, or --decode-dns NAME:PORT")
        for url in (*self.prefill, *self.decode):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"instance URLs start with http:// or https://, got {url!r}")
        self._check_dns()
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        positive = ("session_ttl_s", "load_half_life_s", "health_interval_s", "health_timeout_s",
                    "dns_interval_s", "keep_alive_s")  # fmt: skip
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        lows = (("health_failures", 1), ("max_sessions", 1), ("max_body_mb", 1),
                ("session_busy_margin", 0), ("drain_timeout_s", 0), ("prompt_threads", 1))  # fmt: skip
        for name, low in lows:
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if self.short_append_tokens < 0:
            raise ValueError(
                f"short_append_tokens must be >= 0 (0 = off), got {self.short_append_tokens}"
            )

    def _check_dns(self) -> None:
        for name in ("prefill_dns", "decode_dns"):
            if getattr(self, name):
                host_and_port(getattr(self, name), name)
        if self.dns_server:
            host, _ = host_and_port(self.dns_server, "dns_server", default_port=53)
            try:
                ipaddress.ip_address(host)
            except ValueError:
                raise ValueError(f"dns_server is an IP address, got {host!r}") from None


@dataclass(frozen=True)
class EngineConfig:
    """Everything one instance needs."""

    model: ModelLoadConfig = field(default_factory=ModelLoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)


CLUSTER_SECRET_VAR = "KVDUPLEX_CLUSTER_SECRET"
"""The variable `kvduplex up` sets for every process it starts."""
API_KEY_VAR = "KVDUPLEX_API_KEY"
"""The variable that gives the router and the instances their API key (``--api-key``
takes precedence)."""


@dataclass(frozen=True)
class Environment:
    """The few environment variables kvduplex reads."""

    log_level: str | None = None
    """KVDUPLEX_LOG_LEVEL: overrides --log-level."""
    cluster_secret: str | None = field(default=None, repr=False)
    """KVDUPLEX_CLUSTER_SECRET: the cluster's shared secret (``--cluster-secret-file``
    takes precedence)."""
    api_key: str | None = field(default=None, repr=False)
    """KVDUPLEX_API_KEY: the key clients send on /v1/* routes (``--api-key`` takes
    precedence)."""
    test_drop_messages: frozenset[str] = frozenset()
    """KVDUPLEX_TEST_DROP_MESSAGES, for fault tests only: comma-separated control message
    types (``kv_register``, ``kv_offer``, ``kv_done``, ...) that this instance's
    notification pump drops on arrival, as if the network lost them."""
    test_stall_engine_file: str | None = None
    """KVDUPLEX_TEST_STALL_ENGINE_FILE, for fault tests only: a path; while a file exists
    there, this instance's engine loop stops at the start of its next iteration, as if a
    step were wedged (it goes on once the file is removed)."""

    test_scripted_output: str | None = None
    """KVDUPLEX_TEST_SCRIPTED_OUTPUT, for tests only: a text; this instance's engine
    samples its tokens (the text encoded, then end of sequence) in place of the model's
    at each output position, so a test controls what the model writes (tool calls,
    reasoning) while everything downstream of the sampler runs as it does in service."""

    @classmethod
    def read(cls) -> Environment:
        drop = os.environ.get("KVDUPLEX_TEST_DROP_MESSAGES", "")
        return cls(
            test_stall_engine_file=os.environ.get("KVDUPLEX_TEST_STALL_ENGINE_FILE") or None,
            test_scripted_output=os.environ.get("KVDUPLEX_TEST_SCRIPTED_OUTPUT") or None,
            log_level=os.environ.get("KVDUPLEX_LOG_LEVEL"),
            cluster_secret=os.environ.get(CLUSTER_SECRET_VAR) or None,
            api_key=os.environ.get(API_KEY_VAR) or None,
            test_drop_messages=frozenset(t.strip() for t in drop.split(",") if t.strip()),
        )
