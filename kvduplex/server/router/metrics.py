"""Prometheus metrics of the router, in a registry of its own. Names start with
``kvduplex_router_``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client import Counter
from prometheus_client import Gauge

from kvduplex.server.router.policy import RoutingPolicy


class RouterMetrics:
    """Session hits and misses, requests by flow, sessions remembered, instance health,
    requests routed again and streams ended by an error."""

    def __init__(self, registry: CollectorRegistry, policy: RoutingPolicy) -> None:
        self.session_hits = Counter(
            "kvduplex_router_session_hits",
            "Requests of a known session (named before, or continuing a recognised prompt).",
            registry=registry,
        )
        self.session_misses = Counter(
            "kvduplex_router_session_misses", "Requests that started a session.", registry=registry
        )
        self.requests = Counter(
            "kvduplex_router_requests",
            "Requests routed, by flow: push, pull, or decode (no prefill instance).",
            ["mode"], registry=registry,
        )  # fmt: skip
        self.sessions = Gauge(
            "kvduplex_router_sessions", "Sessions the router remembers.", registry=registry
        )
        self.sessions.set_function(lambda: len(policy.sessions))
        self.instance_healthy = Gauge(
            "kvduplex_router_instance_healthy",
            "1 while the router sends new work to the instance (its last call or probe "
            "succeeded), else 0.",
            ["url", "role"], registry=registry,
        )  # fmt: skip
        for role, pool in (("prefill", policy.prefill), ("decode", policy.decode)):
            for b in pool.backends:
                child = self.instance_healthy.labels(url=b.url, role=role)
                child.set_function(lambda b=b: float(b.is_healthy))  # type: ignore[misc]
        self.rerouted = Counter(
            "kvduplex_router_rerouted",
            "Requests sent to another decode instance because theirs could not be reached.",
            registry=registry,
        )
        self.unavailable = Counter(
            "kvduplex_router_unavailable",
            "Requests refused with 503: no healthy decode instance.",
            registry=registry,
        )
        self.stream_errors = Counter(
            "kvduplex_router_stream_errors",
            "Answers cut by their decode instance mid-way (a stream ended with an error event).",
            registry=registry,
        )
