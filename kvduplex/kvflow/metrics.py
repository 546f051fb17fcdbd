"""Prometheus metrics of the KV flows (push, pull, return), per instance.

The transport's own bytes and transfer times are in
`kvduplex.transport.metrics.TransferMetrics`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvduplex.common.metrics import MetricFactory


class KVFlowMetrics:
    """What the push and pull flows did, per instance (beside `TransferMetrics`' bytes).

    The share of push transfer time hidden behind prefill compute is
    ``1 - exposed_seconds_total / transfer_seconds_total``.
    """

    def __init__(self, registry: CollectorRegistry | None) -> None:
        m = MetricFactory(registry, "kvduplex_kv_")
        self.pushes = m.counter(
            "pushes",
            "Pushes of a prompt's KV that prefill finished, by outcome (done, failed).",
            ["outcome"],
        )
        self.push_transfer_seconds = m.counter(
            "push_transfer_seconds",
            "Seconds from a push's first WRITE post to its last WRITE's completion, summed.",
        )
        self.push_exposed_seconds = m.counter(
            "push_exposed_seconds",
            "Seconds a push still ran after the prefill's first token was sampled, summed "
            "(the part of the transfer not hidden behind compute).",
        )
        self.fallbacks = m.counter(
            "fallbacks",
            "Requests whose remote KV did not come, computed locally instead, by reason.",
            ["reason"],
        )
        self.remote_prefix_hit_tokens = m.counter(
            "remote_prefix_hit_tokens",
            "Prompt tokens of remote-KV requests that decode's own prefix cache held "
            "(not transferred).",
        )
        self.received_tokens = m.counter(
            "received_tokens", "Prompt tokens whose KV arrived from another instance."
        )
        self.received_bytes = m.counter(
            "received_bytes",
            "Bytes of KV that arrived into this instance's pool from another instance, by "
            "the role of the one it came from: prefill (a push or a pull, on decode), "
            "decode (a duplex return, a retained turn or a fetch, on prefill). What the KV "
            "tier or the store loaded: kvduplex_kv_tier_read_bytes_total.",
            ["source"],
        )

        self.returns = m.counter(
            "returns",
            "Duplex returns of a finished turn's blocks, by outcome: on decode done, failed, "
            "declined; on prefill received, receive_deadline, receive_sender_failed, "
            "receive_cancelled.",
            ["outcome"],
        )
        self.return_blocks = m.counter(
            "return_blocks",
            "Blocks moved by duplex returns, by direction (sent on decode, received on prefill).",
            ["direction"],
        )
        self.return_bytes = m.counter(
            "return_bytes", "Bytes WRITten by duplex returns (decode side).", ["direction"]
        )
        self.return_declined = m.counter(
            "return_declined",
            "Return offers prefill declined, by reason (has_all, no_room, prefix_missing, "
            "keys_mismatch, malformed, too_large, busy, unknown_peer).",
            ["reason"],
        )

        self.prompt_mismatches = m.counter(
            "prompt_mismatches",
            "Transfers refused because the two sides named other token ids of one length "
            "(ids digests differ), by flow: push and return (counted by the sender, which "
            "refuses the registration), pull (counted by decode, which reads nothing). "
            "The receiver computes the prompt itself.",
            ["flow"],
        )

    def on_push_sent(self, ok: bool, transfer_s: float, exposed_s: float) -> None:
        self.pushes.labels("done" if ok else "failed").inc()
        if ok:
            self.push_transfer_seconds.inc(transfer_s)
            self.push_exposed_seconds.inc(min(exposed_s, transfer_s) if transfer_s else 0.0)


__all__ = ["KVFlowMetrics"]
