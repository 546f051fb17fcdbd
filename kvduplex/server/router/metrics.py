"""Prometheus metrics of the router, in a registry of its own. Names start with
``kvduplex_router_``."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge


class RouterMetrics:
    """Session hits and misses, requests by flow, sessions remembered."""

    def __init__(self, registry: CollectorRegistry, num_sessions: Callable[[], float]) -> None:
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
        self.sessions.set_function(num_sessions)
