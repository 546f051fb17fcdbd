"""Prometheus metrics of the router, in a registry of its own. Names start with
``kvduplex_router_``.

Answer hits are exported without a label per session: a router remembers up to
``--max-sessions`` (100,000) sessions, and a series each would grow Prometheus
without bound as sessions come and go. The cluster-wide rate is
``answer_tokens_total{outcome="hit"}`` over all outcomes; the spread over
sessions is a gauge histogram of the live sessions' rates, computed at each
scrape; each session's own figures are in the router's JSON view, ``GET
/sessions``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client import Counter
from prometheus_client.core import GaugeHistogramMetricFamily
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvduplex.common.metrics import MetricFactory
from kvduplex.router.pairing import ROLES
from kvduplex.router.pairing import unpaired
from kvduplex.router.policy import RoutingPolicy
from kvduplex.router.sessions import SessionTable

HIT_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)


class RouterMetrics:
    """Session hits and misses, requests by flow, sessions remembered, instance health
    (`InstanceHealth`), requests routed again, streams ended by an error and first tokens
    that diverged."""

    def __init__(self, registry: CollectorRegistry, policy: RoutingPolicy) -> None:
        m = MetricFactory(registry, "kvduplex_router_")
        self.session_hits = m.counter(
            "session_hits",
            "Requests of a known session (named before, or continuing a recognised prompt).",
        )
        self.session_misses = m.counter("session_misses", "Requests that started a session.")
        self.requests = m.counter(
            "requests",
            "Requests routed, by flow: push, fetch (push after prefill fetched the history "
            "from decode), short_append (decode alone), pull, or decode (no prefill "
            "instance).",
            ["mode"],
        )
        self.fetched_tokens = m.counter(
            "fetched_tokens",
            "Prompt tokens prefill read from decode's pool before its prefill (the fetch "
            "plan), as its answers say.",
        )
        self.fetch_misses = m.counter(
            "fetch_misses",
            "Fetch plans in which decode lent nothing (it held none of the prompt, had no "
            "room, failed or answered too late): prefill computed the history.",
        )
        self._requests_by_mode: dict[str, Counter] = {}
        self.sessions = m.gauge("sessions", "Sessions the router remembers.")
        self.sessions.set_function(lambda: len(policy.sessions))
        registry.register(InstanceHealth(policy))
        registry.register(UnpairedInstances(policy))
        self.decode_alone_unpaired = m.counter(
            "decode_alone_unpaired",
            "Requests decode served alone because no healthy prefill instance serves what it "
            "serves (model fingerprints differ), though some prefill instance was healthy.",
        )
        self.rerouted = m.counter(
            "rerouted",
            "Requests sent to another decode instance because theirs could not be reached.",
        )
        self.unavailable = m.counter(
            "unavailable", "Requests refused with 503: no healthy decode instance."
        )
        self.stream_errors = m.counter(
            "stream_errors",
            "Answers cut by their decode instance mid-way (a stream ended with an error event).",
        )
        self.answer_tokens = m.counter(
            "answer_tokens",
            "Tokens of answers returned to prefill that it could cache (up to the last full "
            "block, less the last token), counted at the session's next turn: outcome hit (in "
            "prefill's prefix cache) or miss.",
            ["outcome"],
        )
        self.answer_hit = m.histogram(
            "answer_hit_ratio",
            "Per turn, the share of the previous (returned) answer found in prefill's cache.",
            HIT_BUCKETS,
        )
        self.returns_skipped = m.counter(
            "returns_skipped",
            "Turns not returned to prefill: their session's client did not send its last "
            "answer back as returned (the return resumes when it does).",
        )
        self.returns_skipped_room = m.counter(
            "returns_skipped_room",
            "Turns not returned to prefill because it would not hold them until the session's "
            "next turn: its pool lacks the history they extend, or turns over before then.",
        )
        self.sessions_returning = m.gauge(
            "sessions_returning", "Sessions whose turns are returned to prefill now."
        )
        table = policy.sessions
        self.sessions_returning.set_function(
            lambda: sum(1 for s in table.sessions() if s.is_returning)
        )
        registry.register(SessionHitRates(table))
        self.instance_refusals = m.counter(
            "instance_refusals",
            "Attempts to admit an address as an instance that it failed, by role and reason: "
            "a proof of the cluster secret that failed (wrong_secret, no_secret, "
            "no_challenge, malformed, role, address), or a /health of a DNS address naming "
            "another role (role). Such an address is sent nothing and asked again later.",
            ["role", "reason"],
        )
        self.first_token_diverged = m.counter(
            "first_token_diverged",
            "Push streams ended with an error because decode's first token was not prefill's, "
            "already sent (decode fell back and sampled another).",
        )

    def note_request(self, mode: str) -> None:
        """One request routed by `mode`'s flow (its counter's child kept: `labels` builds
        the key each time)."""
        child = self._requests_by_mode.get(mode)
        if child is None:
            child = self._requests_by_mode[mode] = self.requests.labels(mode=mode)
        child.inc()

    def note_answer_hit(self, num_hit: int, num_returnable: int) -> None:
        self.answer_tokens.labels(outcome="hit").inc(num_hit)
        self.answer_tokens.labels(outcome="miss").inc(num_returnable - num_hit)
        self.answer_hit.observe(num_hit / num_returnable)


class InstanceHealth(Collector):
    """``kvduplex_router_instance_healthy``: each instance the router knows now (given by
    URL or discovered by DNS), computed at each scrape."""

    def __init__(self, policy: RoutingPolicy) -> None:
        self.policy = policy

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "kvduplex_router_instance_healthy",
            "1 while the router sends new work to the instance, else 0 (a call that could not "
            "reach it, or failed probes in a row, until a later probe succeeds; not a call "
            "whose connection failed once written, nor a 5xx answer).",
            labels=["url", "role"],
        )
        for role, pool in (("prefill", self.policy.prefill), ("decode", self.policy.decode)):
            for b in pool.backends:
                family.add_metric([b.url, role], float(b.is_healthy))
        yield family


class UnpairedInstances(Collector):
    """``kvduplex_router_unpaired_instances{role}``: healthy instances of each role that no
    healthy instance of the other role pairs with (`pairing.unpaired`), at each scrape."""

    def __init__(self, policy: RoutingPolicy) -> None:
        self.policy = policy

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "kvduplex_router_unpaired_instances",
            "Healthy instances that no healthy instance of the other role serves the same "
            "model as (their fingerprints differ): an unpaired decode instance computes every "
            "prompt itself, an unpaired prefill instance gets no work.",
            labels=["role"],
        )
        for role in ROLES:
            family.add_metric([role], float(len(unpaired(self.policy, role))))
        yield family


class SessionHitRates(Collector):
    """``kvduplex_router_session_answer_hit_ratio``: how many live sessions have an answer
    hit rate (over their turns so far) at most each bucket's bound."""

    def __init__(self, table: SessionTable) -> None:
        self.table = table

    def collect(self) -> Iterator[GaugeHistogramMetricFamily]:
        rates = [r for s in self.table.sessions() if (r := s.answer_hit_rate) is not None]
        buckets = [(str(b), float(sum(1 for r in rates if r <= b))) for b in HIT_BUCKETS]
        buckets.append(("+Inf", float(len(rates))))
        yield GaugeHistogramMetricFamily(
            "kvduplex_router_session_answer_hit_ratio",
            "Live sessions by their answer hit rate so far (returned answer tokens found in "
            "prefill's cache over those it could cache).",
            buckets=buckets, gsum_value=sum(rates),
        )  # fmt: skip
