"""Prometheus metrics of the router, in a registry of its own. Names start with
``kvduplex_router_``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvduplex.metrics import MetricFactory
from kvduplex.server.router.policy import RoutingPolicy


class RouterMetrics:
    """Session hits and misses, requests by flow, sessions remembered, instance health,
    requests routed again, streams ended by an error and first tokens that diverged."""

    def __init__(self, registry: CollectorRegistry, policy: RoutingPolicy) -> None:
        m = MetricFactory(registry, "kvduplex_router_")
        self.session_hits = m.counter(
            "session_hits",
            "Requests of a known session (named before, or continuing a recognised prompt).",
        )
        self.session_misses = m.counter("session_misses", "Requests that started a session.")
        self.requests = m.counter(
            "requests",
            "Requests routed, by flow: push, pull, or decode (no prefill instance).",
            ["mode"],
        )
        self.sessions = m.gauge("sessions", "Sessions the router remembers.")
        self.sessions.set_function(lambda: len(policy.sessions))
        self.instance_healthy = m.gauge(
            "instance_healthy",
            "1 while the router sends new work to the instance, else 0 (a failed connection, "
            "or failed probes in a row, until a later probe succeeds; not a 5xx answer).",
            ["url", "role"],
        )
        for role, pool in (("prefill", policy.prefill), ("decode", policy.decode)):
            for b in pool.backends:
                child = self.instance_healthy.labels(url=b.url, role=role)
                child.set_function(lambda b=b: float(b.is_healthy))  # type: ignore[misc]
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
        self.first_token_diverged = m.counter(
            "first_token_diverged",
            "Push streams ended with an error because decode's first token was not prefill's, "
            "already sent (decode fell back and sampled another).",
        )
