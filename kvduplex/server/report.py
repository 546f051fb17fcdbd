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


def format_kv_report(instances: dict[str, str]) -> str:
    """KV moved, pushes, hidden share, decode prefix hits and fallbacks of a P/D pair."""
    p = scrape(instances["prefill"])
    d = scrape(instances["decode"])
    written = metric_sum(p, "kvduplex_kv_transfer_bytes_total", direction="write")
    read = metric_sum(d, "kvduplex_kv_transfer_bytes_total", direction="read")
    transfer = metric_sum(p, "kvduplex_kv_push_transfer_seconds_total")
    exposed = metric_sum(p, "kvduplex_kv_push_exposed_seconds_total")
    hidden = f"{1 - exposed / transfer:.0%}" if transfer > 0 else "n/a"
    lines = [
        f"KV pushed by prefill: {written / 2**20:.2f} MiB in "
        f"{metric_sum(p, 'kvduplex_kv_pushes_total', outcome='done'):.0f} pushes "
        f"({metric_sum(p, 'kvduplex_kv_pushes_total', outcome='failed'):.0f} failed); "
        f"transfer time hidden behind prefill compute: {hidden}",
        f"KV pulled by decode: {read / 2**20:.2f} MiB",
        f"decode: {metric_sum(d, 'kvduplex_kv_received_tokens_total'):.0f} prompt tokens received, "
        f"{metric_sum(d, 'kvduplex_kv_remote_prefix_hit_tokens_total'):.0f} already in its prefix "
        f"cache, {metric_sum(d, 'kvduplex_kv_fallbacks_total'):.0f} fallbacks to local prefill",
    ]
    return "\n".join(lines)
