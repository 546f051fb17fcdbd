"""Prometheus metrics of the KV flows (push, pull, return), per instance.

The transport's own bytes and transfer times are in
`kvduplex.transport.metrics.TransferMetrics`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client import Counter


class KVFlowMetrics:
    """What the push and pull flows did, per instance (beside `TransferMetrics`' bytes).

    The share of push transfer time hidden behind prefill compute is
    ``1 - exposed_seconds_total / transfer_seconds_total``.
    """

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.pushes = Counter(
            "kvduplex_kv_pushes",
            "Pushes of a prompt's KV that prefill finished, by outcome (done, failed).",
            ["outcome"],
            registry=registry,
        )
        self.push_transfer_seconds = Counter(
            "kvduplex_kv_push_transfer_seconds",
            "Seconds from a push's first WRITE post to its last WRITE's completion, summed.",
            registry=registry,
        )
        self.push_exposed_seconds = Counter(
            "kvduplex_kv_push_exposed_seconds",
            "Seconds a push still ran after the prefill's first token was sampled, summed "
            "(the part of the transfer not hidden behind compute).",
            registry=registry,
        )
        self.fallbacks = Counter(
            "kvduplex_kv_fallbacks",
            "Requests whose remote KV did not come, computed locally instead, by reason.",
            ["reason"],
            registry=registry,
        )
        self.remote_prefix_hit_tokens = Counter(
            "kvduplex_kv_remote_prefix_hit_tokens",
            "Prompt tokens of remote-KV requests that decode's own prefix cache held "
            "(not transferred).",
            registry=registry,
        )
        self.received_tokens = Counter(
            "kvduplex_kv_received_tokens",
            "Prompt tokens whose KV arrived from another instance.",
            registry=registry,
        )

        self.returns = Counter(
            "kvduplex_kv_returns",
            "Duplex returns of a finished turn's blocks, by outcome: on decode done, failed, "
            "declined; on prefill received, receive_deadline, receive_sender_failed, "
            "receive_cancelled.",
            ["outcome"],
            registry=registry,
        )
        self.return_blocks = Counter(
            "kvduplex_kv_return_blocks",
            "Blocks moved by duplex returns, by direction (sent on decode, received on prefill).",
            ["direction"],
            registry=registry,
        )
        self.return_bytes = Counter(
            "kvduplex_kv_return_bytes",
            "Bytes WRITten by duplex returns (decode side).",
            ["direction"],
            registry=registry,
        )
        self.return_declined = Counter(
            "kvduplex_kv_return_declined",
            "Return offers prefill declined, by reason (has_all, no_room, prefix_missing, "
            "keys_mismatch, malformed, too_large, unknown_peer).",
            ["reason"],
            registry=registry,
        )

    def on_push_sent(self, ok: bool, transfer_s: float, exposed_s: float) -> None:
        self.pushes.labels("done" if ok else "failed").inc()
        if ok:
            self.push_transfer_seconds.inc(transfer_s)
            self.push_exposed_seconds.inc(min(exposed_s, transfer_s) if transfer_s else 0.0)


__all__ = ["KVFlowMetrics"]
