"""Prometheus metrics of one instance's engine. All names start with ``kvduplex_``.

Metrics live in a registry owned by the instance (no process-global state), so
several engines in one process (tests) do not collide.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvduplex.common.metrics import MetricFactory
from kvduplex.engine.eviction import Evictor
from kvduplex.engine.kv_manager import KVCacheManager
from kvduplex.engine.kv_tier import KVTier
from kvduplex.engine.kv_tier_store import StoreTier

if TYPE_CHECKING:
    from kvduplex.engine.engine import LLMEngine

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)


class EngineMetrics:
    """Request-level and KV-cache metrics."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        m = MetricFactory(registry)
        self.ttft = m.histogram(
            "time_to_first_token_seconds",
            "Time from arrival to the first output token.",
            _LATENCY_BUCKETS,
        )
        self.tpot = m.histogram(
            "time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request.",
            _LATENCY_BUCKETS,
        )
        self.e2e = m.histogram(
            "e2e_request_latency_seconds", "Time from arrival to the last token.", _LATENCY_BUCKETS
        )
        self.prompt_tokens = m.counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = m.counter("generation_tokens", "Generated tokens.")
        self.prefix_cache_hit_tokens = m.counter(
            "prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache instead of computed.",
        )
        self.prompt_computed_tokens = m.histogram(
            "request_prompt_computed_tokens",
            "Prompt tokens this instance computed per finished request (0 when the prompt's "
            "KV came from another instance; recomputations count).",
            (0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768),
        )
        self.requests_finished = m.counter(
            "requests_finished", "Finished requests by reason.", ["reason"]
        )
        self.running = m.gauge("num_requests_running", "Requests being computed.")
        self.waiting = m.gauge(
            "num_requests_waiting",
            "Requests queued for admission (new or preempted); not those waiting for remote KV.",
        )
        self.waiting_for_remote_kv = m.gauge(
            "num_requests_waiting_for_remote_kv",
            "Admitted requests whose prompt KV another instance is sending (their blocks held).",
        )
        self.blocks_in_use = m.gauge("kv_blocks_in_use", "KV blocks held by live requests.")
        self.blocks_cached = m.gauge(
            "kv_blocks_cached", "Unreferenced KV blocks kept for the prefix cache."
        )
        self.blocks_total = m.gauge("kv_blocks_total", "KV blocks in the pool.")

    def bind_engine(self, engine: LLMEngine) -> None:
        """Read `engine`'s queues, pool, evictions and KV tier at scrape time (called once,
        by `AsyncEngine`; the reads are of counters, safe off the engine thread)."""
        sched, pool = engine.scheduler, engine.block_pool
        self.bind_gauges(
            running=lambda: sched.num_running,
            waiting=lambda: sched.num_waiting,
            waiting_for_remote_kv=lambda: sched.num_waiting_for_remote_kv,
            blocks_in_use=lambda: pool.stats().num_in_use,
            blocks_cached=lambda: pool.stats().num_cached,
            blocks_total=lambda: pool.stats().total,
        )
        self.bind_eviction(pool.evictor)
        self.bind_hits(engine.kv_manager)
        if engine.kv_tier is not None:
            self.bind_kv_tier(engine.kv_tier.tier, engine.layout.block_size)

    def bind_gauges(
        self,
        running: Callable[[], float],
        waiting: Callable[[], float],
        waiting_for_remote_kv: Callable[[], float],
        blocks_in_use: Callable[[], float],
        blocks_cached: Callable[[], float],
        blocks_total: Callable[[], float],
    ) -> None:
        """Make the gauges read live values at scrape time."""
        self.running.set_function(running)
        self.waiting.set_function(waiting)
        self.waiting_for_remote_kv.set_function(waiting_for_remote_kv)
        self.blocks_in_use.set_function(blocks_in_use)
        self.blocks_cached.set_function(blocks_cached)
        self.blocks_total.set_function(blocks_total)

    def bind_kv_tier(self, tier: KVTier, block_size: int) -> None:
        """Export the KV tier's counters (read from the tier at scrape time)."""
        self.registry.register(KVTierCollector(tier, block_size))

    def bind_eviction(self, evictor: Evictor) -> None:
        """Export the pool's evictions by class (read from the evictor at scrape time)."""
        self.registry.register(EvictionCollector(evictor))

    def bind_hits(self, kv: KVCacheManager) -> None:
        """Export the prefix-cache hits by source (read from the manager at scrape time)."""
        self.registry.register(HitSourceCollector(kv))


class HitSourceCollector(Collector):
    """``kvduplex_kv_hit_tokens_total{source}``: prefix-cache hits at admission by where
    their blocks were (`kvduplex.engine.kv_manager.HitSource`)."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "kvduplex_kv_hit_tokens",
            "Prompt tokens found in the prefix cache at admission instead of computed, by "
            "where their KV was: pool (this instance's own pool: prefill's on a prefill "
            "instance, decode's on decode), tier (promoted from its host or file tier), "
            "store (promoted from the shared store), decode (sent or lent by a decode "
            "instance: a duplex return, a retained turn, a fetch). A block from elsewhere "
            "counts for its source at its first hit, as the pool's afterwards.",
            labels=["source"],
        )
        for source, num in list(self.kv.num_hit_tokens_by_source.items()):
            family.add_metric([source.value], num)
        yield family


class EvictionCollector(Collector):
    """``kvduplex_kv_evicted_blocks_total{class}``: cached blocks the pool evicted to make
    room (each demoted into the KV tier, if there is one), by class
    (`kvduplex.engine.eviction.EvictionClass`)."""

    def __init__(self, evictor: Evictor) -> None:
        self.evictor = evictor

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "kvduplex_kv_evicted_blocks",
            "Prefix-cache blocks the KV pool evicted to make room, by class: plain (no "
            "session), session (a session's history), returned (a duplex return's answer).",
            labels=["class"],
        )
        for cls, num in list(self.evictor.num_evicted.items()):  # a scrape thread's copy
            family.add_metric([cls.label], num)
        yield family


class KVTierCollector(Collector):
    """``kvduplex_kv_tier_*``: what the KV tier below the pool stored, served and lost.
    Its counters live in the tier (`TierStats`); a scrape reads them."""

    def __init__(self, tier: KVTier, block_size: int, prefix: str = "kvduplex_kv_tier_") -> None:
        self.tier = tier
        self.block_size = block_size
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        s, p = self.tier.stats, self.prefix
        counters = (
            ("hit_blocks", "Blocks loaded back from the KV tier into the pool (checksum "
             "verified) for a prompt's prefix.", s.num_loaded_blocks),
            ("hit_tokens", "Tokens of the blocks loaded back from the KV tier (the requests "
             "that use them count them among their prefix-cache hits).",
             s.num_loaded_blocks * self.block_size),
            ("stored_blocks", "Blocks evicted from the pool's prefix cache and copied into "
             "the KV tier.", s.num_stored_blocks),
            ("written_bytes", "Bytes written into the KV tier.", s.num_written_bytes),
            ("read_bytes", "Bytes read back from the KV tier.", s.num_read_bytes),
            ("corrupt_blocks", "KV tier slots that failed their check at load (dropped; "
             "their tokens were recomputed).", s.num_corrupt_blocks),
            ("write_failures", "Writes into the KV tier that failed (the entry is dropped).",
             s.num_write_failures),
            ("evicted_blocks", "Blocks dropped from the KV tier to make room.",
             s.num_evicted_blocks),
            ("unavailable", "Store tier: lookups, loads and demotions that answered miss or "
             "were dropped because the store failed, was too slow, or was being left alone "
             "after a failure (their tokens are computed).", s.num_unavailable),
        )  # fmt: skip
        for name, doc, value in counters:
            yield CounterMetricFamily(p + name, doc, value=value)
        tier = self.tier
        yield GaugeMetricFamily(p + "blocks_used", "Blocks the KV tier holds.", tier.num_used)
        yield GaugeMetricFamily(p + "blocks_total", "Blocks the KV tier can hold.", tier.num_slots)
        if isinstance(tier, StoreTier):
            yield GaugeMetricFamily(
                p + "store_up", "Store tier: 1 while the store answers (the last call "
                "succeeded), 0 while it is left alone after a failure, or not yet joined.",
                int(tier.health.is_up()),
            )  # fmt: skip
