"""Declaring Prometheus metrics: every family of a set on one registry, under one prefix.

Each process's metric sets (`kvduplex.engine.metrics`, `kvduplex.transport.metrics`,
`kvduplex.kvflow.metrics`, `kvduplex.router.metrics`) declare their families
through a `MetricFactory`, so a set's registry and its name prefix are said once.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry
from prometheus_client import Counter
from prometheus_client import Gauge
from prometheus_client import Histogram


class MetricFactory:
    """Creates metric families named ``prefix + name`` on ``registry``.

    ``registry`` None leaves them unregistered (throwaway sets in tests).
    """

    def __init__(self, registry: CollectorRegistry | None, prefix: str = "kvduplex_") -> None:
        self.registry = registry
        self.prefix = prefix

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(self.prefix + name, doc, labels, registry=self.registry)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(self.prefix + name, doc, labels, registry=self.registry)

    def histogram(
        self, name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = ()
    ) -> Histogram:
        return Histogram(self.prefix + name, doc, labels, buckets=buckets, registry=self.registry)


__all__ = ["MetricFactory"]
