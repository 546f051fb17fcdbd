"""Prometheus metrics of one instance's engine. All names start with ``kvduplex_``.

Metrics live in a registry owned by the instance (no process-global state), so
several engines in one process (tests) do not collide.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry
from prometheus_client import Counter
from prometheus_client import Gauge
from prometheus_client import Histogram

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)


class EngineMetrics:
    """Request-level and KV-cache metrics."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.ttft = Histogram(
            "kvduplex_time_to_first_token_seconds",
            "Time from arrival to the first output token.",
            buckets=_LATENCY_BUCKETS, registry=registry,
        )
        self.tpot = Histogram(
            "kvduplex_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request.",
            buckets=_LATENCY_BUCKETS, registry=registry,
        )
        self.e2e = Histogram(
            "kvduplex_e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            buckets=_LATENCY_BUCKETS, registry=registry,
        )
        self.prompt_tokens = Counter(
            "kvduplex_prompt_tokens", "Prompt tokens of finished requests.", registry=registry
        )
        self.generation_tokens = Counter(
            "kvduplex_generation_tokens", "Generated tokens.", registry=registry
        )
        self.prefix_cache_hit_tokens = Counter(
            "kvduplex_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache instead of computed.",
            registry=registry,
        )
        self.prompt_computed_tokens = Histogram(
            "kvduplex_request_prompt_computed_tokens",
            "Prompt tokens this instance computed per finished request (0 when the prompt's "
            "KV came from another instance; recomputations count).",
            buckets=(0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768),
            registry=registry,
        )
        self.requests_finished = Counter(
            "kvduplex_requests_finished", "Finished requests by reason.", ["reason"],
            registry=registry,
        )
        self.running = Gauge(
            "kvduplex_num_requests_running", "Requests being computed.", registry=registry
        )
        self.waiting = Gauge(
            "kvduplex_num_requests_waiting",
            "Requests queued for admission (new or preempted); not those waiting for remote KV.",
            registry=registry,
        )
        self.blocks_in_use = Gauge(
            "kvduplex_kv_blocks_in_use", "KV blocks held by live requests.", registry=registry
        )
        self.blocks_cached = Gauge(
            "kvduplex_kv_blocks_cached",
            "Unreferenced KV blocks kept for the prefix cache.", registry=registry,
        )
        self.blocks_total = Gauge(
            "kvduplex_kv_blocks_total", "KV blocks in the pool.", registry=registry
        )

    def bind_gauges(
        self,
        running: Callable[[], float],
        waiting: Callable[[], float],
        blocks_in_use: Callable[[], float],
        blocks_cached: Callable[[], float],
        blocks_total: Callable[[], float],
    ) -> None:
        """Make the gauges read live values at scrape time."""
        self.running.set_function(running)
        self.waiting.set_function(waiting)
        self.blocks_in_use.set_function(blocks_in_use)
        self.blocks_cached.set_function(blocks_cached)
        self.blocks_total.set_function(blocks_total)
