"""A short report of what moved between a prefill and a decode instance (from /metrics)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(
    url: str, timeout_s: float = 10.0
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an instance's ``/metrics``: (name, sorted labels) -> value."""
    text = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout_s).text
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def metric_sum(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    """Sum of the samples named `name` whose labels include `labels`."""
    return sum(
        v for (n, ls), v in samples.items()
        if n == name and all(dict(ls).get(k) == want for k, want in labels.items())
    )  # fmt: skip


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def kv_snapshot(instances: dict[str, str]) -> dict[str, Samples]:
    """The /metrics of a P/D pair, by role, to take differences of later."""
    return {role: scrape(url) for role, url in instances.items()}


def format_kv_report(instances: dict[str, str], since: dict[str, Samples] | None = None) -> str:
    """KV moved each way, pushes, hidden share, decode prefix hits and fallbacks of a P/D
    pair (since the snapshot `since`, if given)."""
    now = kv_snapshot(instances)

    def m(role: str, name: str, **labels: str) -> float:
        base = metric_sum(since[role], name, **labels) if since is not None else 0.0
        return metric_sum(now[role], name, **labels) - base

    pushed = m("prefill", "kvduplex_kv_transfer_bytes_total", direction="write")
    read = m("decode", "kvduplex_kv_transfer_bytes_total", direction="read")
    returned = m("decode", "kvduplex_kv_return_bytes_total", direction="sent")
    transfer = m("prefill", "kvduplex_kv_push_transfer_seconds_total")
    exposed = m("prefill", "kvduplex_kv_push_exposed_seconds_total")
    hidden = f"{1 - exposed / transfer:.0%}" if transfer > 0 else "n/a"
    lines = [
        f"KV pushed by prefill (P->D): {pushed / 2**20:.2f} MiB in "
        f"{m('prefill', 'kvduplex_kv_pushes_total', outcome='done'):.0f} pushes "
        f"({m('prefill', 'kvduplex_kv_pushes_total', outcome='failed'):.0f} failed); "
        f"transfer time hidden behind prefill compute: {hidden}",
        f"KV returned by decode (D->P): {returned / 2**20:.2f} MiB in "
        f"{m('decode', 'kvduplex_kv_returns_total', outcome='done'):.0f} returns "
        f"({m('decode', 'kvduplex_kv_returns_total', outcome='declined'):.0f} declined, "
        f"{m('decode', 'kvduplex_kv_returns_total', outcome='failed'):.0f} failed); "
        f"KV pulled by decode: {read / 2**20:.2f} MiB",
        f"decode: {m('decode', 'kvduplex_kv_received_tokens_total'):.0f} prompt tokens received, "
        f"{m('decode', 'kvduplex_kv_remote_prefix_hit_tokens_total'):.0f} already in its prefix "
        f"cache, {m('decode', 'kvduplex_kv_fallbacks_total'):.0f} fallbacks to local prefill",
    ]
    return "\n".join(lines)
