"""Prometheus metrics of the KV transfer layer.

`TransferMetrics.default()` uses the metric objects below, registered once on
prometheus_client's default registry (what an instance's ``/metrics`` serves);
``TransferMetrics(registry)`` creates a fresh set on a registry of your own
(tests, several transports in one process).
"""

from __future__ import annotations

from prometheus_client import REGISTRY
from prometheus_client import CollectorRegistry

from kvduplex.common.metrics import MetricFactory
from kvduplex.transport.messages import NotifRefusal
from kvduplex.transport.peer_usage import ForgetReason
from kvduplex.transport.protocol import FailureKind
from kvduplex.transport.protocol import TransferHandle
from kvduplex.transport.protocol import TransferOp

_POST_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1)
_XFER_BUCKETS = (
    1e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


class TransferMetrics:
    """Counters and histograms, labelled by ``direction`` (write, read)."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        """Create the metrics on ``registry`` (None: unregistered, for throwaway use)."""
        m = MetricFactory(registry, "kvduplex_kv_")
        self.bytes_total = m.counter(
            "transfer_bytes", "Bytes moved by completed KV transfers.", ["direction"]
        )
        self.transfers_total = m.counter("transfers", "KV transfers posted.", ["direction"])
        self.descriptors_total = m.counter(
            "transfer_descriptors",
            "Descriptors (layer, K|V, block regions) in posted KV transfers.",
            ["direction"],
        )
        self.failures_total = m.counter(
            "transfer_failures",
            "KV transfers that ended failed, by cause.",
            ["direction", "cause"],
        )
        self.post_seconds = m.histogram(
            "transfer_post_seconds",
            "Time to create and post one KV transfer.",
            _POST_BUCKETS,
            ["direction"],
        )
        self.transfer_seconds = m.histogram(
            "transfer_seconds",
            "Time from post to completion of successful KV transfers.",
            _XFER_BUCKETS,
            ["direction"],
        )
        self.notifications_total = m.counter(
            "notifications",
            "Transfer-layer notifications, by direction (sent, received).",
            ["direction"],
        )
        self.notifications_refused_total = m.counter(
            "notifications_refused",
            "Received notifications refused: the envelope names another engine than the "
            "delivering agent's (forged_sender), or that agent never connected (unknown_agent).",
            ["reason"],
        )

        self.peers = m.gauge(
            "peers",
            "Peers held, by table: the transport's (connected, each with a loaded agent and a "
            "prepared descriptor list) and the peer directory's (by URL).",
            ["table"],
        )
        self.peers_forgotten_total = m.counter(
            "peers_forgotten",
            "Peers forgotten (agent removed, descriptors released, directory entry dropped), "
            "by reason: refused (handshake refused), failed (a transfer or notification to it "
            "failed), idle (unused past --peer-idle-s), torn_down (a flow had torn it down).",
            ["reason"],
        )

        self.peers_met_total = m.counter(
            "peers_met",
            "Distinct peers connected to: a peer connected again (forgotten and met again, "
            "or reconnected by a flow) counts once while among the latest 1024 met.",
        )

    @classmethod
    def default(cls) -> TransferMetrics:
        """The process-wide set on prometheus_client's default registry."""
        return _DEFAULT

    def on_posted(self, handle: TransferHandle) -> None:
        direction = handle.op.value
        self.transfers_total.labels(direction).inc()
        self.descriptors_total.labels(direction).inc(handle.num_descriptors)
        self.post_seconds.labels(direction).observe(handle.post_time_s)

    def on_done(self, handle: TransferHandle) -> None:
        direction = handle.op.value
        self.bytes_total.labels(direction).inc(handle.num_bytes)
        if handle.duration_s is not None:
            self.transfer_seconds.labels(direction).observe(handle.duration_s)

    def on_failed(self, op: TransferOp, failure: FailureKind) -> None:
        self.failures_total.labels(op.value, failure.value).inc()

    def on_notification(self, direction: str) -> None:
        self.notifications_total.labels(direction).inc()

    def on_notification_refused(self, reason: NotifRefusal) -> None:
        self.notifications_refused_total.labels(reason.value).inc()

    def on_peers(self, num_transport: int, num_directory: int) -> None:
        self.peers.labels("transport").set(num_transport)
        self.peers.labels("directory").set(num_directory)

    def on_peer_forgotten(self, reason: ForgetReason) -> None:
        self.peers_forgotten_total.labels(reason.value).inc()

    def on_peer_met(self) -> None:
        self.peers_met_total.inc()


_DEFAULT = TransferMetrics(REGISTRY)

__all__ = ["TransferMetrics"]
