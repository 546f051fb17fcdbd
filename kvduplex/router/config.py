"""The router's config (`RouterConfig`): its instances (listed, or found by DNS), how it
routes sessions and watches the instances' health, and the parsers of the answers it
relays.

``kvduplex router`` takes these fields as flags, environment variables and config-file
keys (`kvduplex.cli.settings.RouterSettings`); ``kvduplex up`` takes `RouterTuning`'s
and hands them on to the routers it starts.
"""

from __future__ import annotations

import ipaddress

from pydantic import Field
from pydantic import ValidationInfo
from pydantic import field_validator
from pydantic import model_validator

from kvduplex.common.config import ConfigSection
from kvduplex.common.config import DrainTimeout
from kvduplex.common.config import Port
from kvduplex.common.config import ReturnMode
from kvduplex.common.config import TransferMode
from kvduplex.common.config import host_and_port
from kvduplex.common.openai.parsing_config import ParsingConfig


class RouterTuning(ConfigSection):
    """How the router spreads sessions, watches the instances' health and limits what it
    accepts: what ``kvduplex up`` hands on to the routers it starts."""

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
    instance has no /ready; a draining one gets no new work at once). A call that could
    not reach the instance (refused, timed out) marks it unhealthy at once,
    ``--health-failures`` failed probes in a row do too; it then gets no new work until a
    probe that began after the failure succeeds. A call whose connection failed once it
    was written fails its own request only and has the instance probed at once (a 5xx
    answer, not even that)."""
    health_timeout_s: float = 2.0
    """Deadline of one health probe; a probe past it counts as failed."""
    health_failures: int = 2
    """Failed health probes in a row that mark an instance unhealthy (1: the first). When
    an instance is marked unhealthy, the router abandons its calls in flight to it: a
    prefill ends as failed (decode computes the prompt), a decode answer ends with an
    error. So a hung instance holds a request for at most about --health-interval-s x
    this + --health-timeout-s."""
    return_mode: ReturnMode = ReturnMode.PUSH
    """Return of a finished turn's KV from decode to prefill, push mode only: push (duplex,
    the default: decode WRITEs the blocks prefill lacks into its prefix cache after the
    turn, while the session's client sends its answers back as returned); none; pull
    (vLLM-style, for comparison: decode keeps the turn, prefill READs it next turn)."""
    short_append_tokens: int = 0
    """Push mode: a session's turn whose part decode has not cached (its new input) is at
    most this many tokens goes to decode alone, which prefills it over its cached history
    (0: off). With ``return_mode`` push, decode then returns the turn to prefill. Off by
    default: decode's prefill then competes with its decodes (docs/benchmarks.md measures
    it); it pays where the prefill instances are the bottleneck."""
    plan_by_residency: bool = True
    """Push mode: each session turn takes the cheapest plan by where its history's KV
    likely is, read from each instance's pool clock (its /health): decode computes the new
    tokens over the history it holds when prefill's pool has turned over since the session
    was there (--no-plan-by-residency: prefill computes every turn, as far as it lacks it,
    unless --short-append-tokens applies)."""
    decode_token_cost: float = 2.0
    """With ``plan_by_residency``: what a prompt token computed on decode costs, in tokens
    computed on prefill (decode's prefill stalls every running decode). A turn goes to
    decode alone when its new tokens, at this cost, are fewer than what prefill lacks."""
    fetch_token_cost: float = 0.1
    """With ``plan_by_residency``: what a prompt token that prefill READs from decode's pool
    (the fetch plan: decode holds the session's history, prefill no longer does) costs, in
    tokens computed on prefill: its KV's bytes over the link against its compute (small
    over RDMA; over a slow TCP link it may pass 1). At 1 or more a fetch never pays, and
    prefill computes what it lacks."""
    prefer_fetch: bool = True
    """With ``plan_by_residency``: where decode holds a session's history that prefill
    lacks, prefill fetches it whenever that costs less than computing it, rather than
    decode computing the turn's new tokens (which stalls decode's running decodes)
    (--no-prefer-fetch: the cheaper of the two, by --fetch-token-cost and
    --decode-token-cost)."""
    fetch_timeout_s: float = 1.0
    """The fetch plan: how long the router waits for decode to lease the history before
    prefill's call goes out without it (prefill then computes the history)."""
    return_only_if_kept: bool = True
    """With ``return_mode`` push: return a turn only if prefill likely still holds the
    history it extends and keeps it until the next turn, at its pool's recent turnover and
    the session's think time (--no-return-only-if-kept: return every turn of a returning
    session)."""
    max_body_mb: int = 8
    """Largest request body accepted, in MiB (larger: HTTP 413, before it is parsed). A
    prompt that fits a 128k-token context is well under 8 MiB of JSON."""
    keep_alive_s: int = 75
    """How long an idle client connection is kept open, in seconds: longer than a load
    balancer in front keeps one idle for reuse (nginx, AWS ALB: 60 s; GCP's: 600 s, Envoy:
    1 h, unless set lower), so that it closes the connection first (a request sent just as
    the router closes it fails, and a POST is not sent again)."""
    prompt_threads: int = 4
    """Threads that build prompts (chat template, tokenizer) off the event loop, which
    stays free for health probes and the streams relayed; more requests than this wait
    for one."""

    @field_validator(
        "session_ttl_s", "load_half_life_s", "health_interval_s", "health_timeout_s",
        "keep_alive_s", "decode_token_cost", "fetch_token_cost", "fetch_timeout_s",
    )  # fmt: skip
    @classmethod
    def _check_positive(cls, value: float, info: ValidationInfo) -> float:
        if not value > 0:
            raise ValueError(f"{info.field_name} must be > 0, got {value}")
        return value

    @field_validator(
        "health_failures", "max_sessions", "max_body_mb", "session_busy_margin", "prompt_threads"
    )
    @classmethod
    def _check_lows(cls, value: int, info: ValidationInfo) -> int:
        low = 0 if info.field_name == "session_busy_margin" else 1
        if value < low:
            raise ValueError(f"{info.field_name} must be >= {low}, got {value}")
        return value

    @field_validator("short_append_tokens")
    @classmethod
    def _check_short_append(cls, value: int) -> int:
        if value < 0:
            raise ValueError(f"short_append_tokens must be >= 0 (0 = off), got {value}")
        return value


class RouterConfig(RouterTuning, ParsingConfig):
    """The router: the OpenAI front door over prefill and decode instances. Its parsing
    fields (`ParsingConfig`, as ``parsing``) parse the chat answers here: instances are
    asked for raw text."""

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
    port: Port = 8000
    """Port to listen on."""
    api_key: str = Field(default="", repr=False)
    """Key clients must send on every /v1/* route (header Authorization: Bearer KEY); empty:
    KVDUPLEX_API_KEY, or no key (open). The router sends it on to the instances.
    /health and /metrics stay open."""
    log_level: str = "warning"
    """Python log level."""
    cluster_secret_file: str = ""
    """File holding the cluster's shared secret, which the router sends to the instances
    (they need it on their internal routes); empty: KVDUPLEX_CLUSTER_SECRET, or none."""
    drain_timeout_s: DrainTimeout = 60.0
    """At SIGTERM the router drains: /ready answers 503, new requests are refused (503,
    code draining), and the requests in flight finish; then it exits 0. After this many
    seconds it exits anyway (1, logged). A second SIGTERM or SIGINT exits at once."""

    @field_validator("prefill", "decode")
    @classmethod
    def _check_urls(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"instance URLs start with http:// or https://, got {url!r}")
        return tuple(u.rstrip("/") for u in urls)

    @field_validator("prefill_dns", "decode_dns")
    @classmethod
    def _check_dns_name(cls, value: str, info: ValidationInfo) -> str:
        if value:
            host_and_port(value, str(info.field_name))
        return value

    @field_validator("dns_server")
    @classmethod
    def _check_dns_server(cls, value: str) -> str:
        if value:
            host, _ = host_and_port(value, "dns_server", default_port=53)
            try:
                ipaddress.ip_address(host)
            except ValueError:
                raise ValueError(f"dns_server is an IP address, got {host!r}") from None
        return value

    @field_validator("dns_interval_s")
    @classmethod
    def _check_dns_interval(cls, value: float) -> float:
        if not value > 0:
            raise ValueError(f"dns_interval_s must be > 0, got {value}")
        return value

    @model_validator(mode="after")
    def _check_decode(self) -> RouterConfig:
        if not self.decode and not self.decode_dns:
            raise ValueError("give at least one --decode URL, or --decode-dns NAME:PORT")
        return self
