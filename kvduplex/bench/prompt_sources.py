"""Where prompt tokens came from, and how big a prefill pool is, from servers' /metrics.

Sources use vLLM's names (``vllm:prompt_tokens_by_source_total{source}``):

    local_compute          computed by the instance itself
    local_cache_hit        found in its own prefix cache
    external_kv_transfer   arrived from another instance (decode: pushed or pulled from P)

A server that exposes a ``*prompt_tokens_by_source_total`` family with a
``source`` label is read as it is (every source it names, a tier's included).
A kvduplex instance without one is read from its counters:

    local_compute          kvduplex_request_prompt_computed_tokens_sum
    local_cache_hit        kvduplex_prefix_cache_hit_tokens_total
    external_kv_transfer   kvduplex_kv_received_tokens_total

and a kvduplex router adds ``returned_answer_hit`` / ``returned_answer_miss``
(``kvduplex_router_answer_tokens_total{outcome}``): of the answers decode
returned, the tokens the session's next turn found in prefill's cache (a
part of prefill's ``local_cache_hit``), and those it did not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from kvduplex.bench.report import Samples
from kvduplex.bench.report import metric_sum
from kvduplex.bench.report import scrape

BY_SOURCE_SUFFIX = "prompt_tokens_by_source_total"
KVDUPLEX_SOURCES: tuple[tuple[str, str], ...] = (
    ("local_compute", "kvduplex_request_prompt_computed_tokens_sum"),
    ("local_cache_hit", "kvduplex_prefix_cache_hit_tokens_total"),
    ("external_kv_transfer", "kvduplex_kv_received_tokens_total"),
)
ANSWER_TOKENS = "kvduplex_router_answer_tokens_total"
POOL_BLOCKS = "kvduplex_kv_blocks_total"
VLLM_CACHE_INFO = "vllm:cache_config_info"


def try_scrape(url: str, read: Callable[[str], Samples] = scrape) -> Samples:
    """`read(url)`, or no samples where the server has no readable /metrics."""
    try:
        return read(url)
    except (httpx.HTTPError, ValueError):
        return {}


def _delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)


def prompt_sources(before: Samples, after: Samples) -> dict[str, float]:
    """Prompt tokens by source on one server between two of its snapshots (see the module
    docstring); empty where it exposes none of these counters."""
    by_source = sorted({name for name, _ in after if name.endswith(BY_SOURCE_SUFFIX)})
    out: dict[str, float] = {}
    if by_source:
        for name in by_source:
            for source in sorted({dict(ls).get("source", "") for n, ls in after if n == name}):
                if source:
                    out[source] = out.get(source, 0.0) + _delta(before, after, name, source=source)
        return out
    names = {name for name, _ in after}
    for source, name in KVDUPLEX_SOURCES:
        if name in names:
            out[source] = _delta(before, after, name)
    if ANSWER_TOKENS in names:
        for outcome in ("hit", "miss"):
            out[f"returned_answer_{outcome}"] = _delta(before, after, ANSWER_TOKENS, outcome=outcome)
    return out


def sources_by_role(
    roles: dict[str, str], before: dict[str, Samples], after: dict[str, Samples]
) -> dict[str, dict[str, float]]:
    """role -> source -> tokens, summed over the servers (url -> role) of each role."""
    out: dict[str, dict[str, float]] = {}
    for url, role in roles.items():
        got = prompt_sources(before.get(url, {}), after.get(url, {}))
        if got:
            acc = out.setdefault(role or "server", {})
            for source, tokens in got.items():
                acc[source] = acc.get(source, 0.0) + tokens
    return out


def pool_tokens(samples: Samples, block_size: int | None) -> int | None:
    """Tokens one server's KV pool holds: kvduplex's pool blocks times `block_size` (its
    /health says it), or vLLM's ``cache_config_info`` (``num_gpu_blocks`` x ``block_size``
    labels); None where neither is there."""
    blocks = [v for (name, _), v in samples.items() if name == POOL_BLOCKS]
    if blocks and block_size:
        return int(blocks[0]) * block_size
    for (name, labels), _ in samples.items():
        if name == VLLM_CACHE_INFO:
            info = dict(labels)
            try:
                return int(info["num_gpu_blocks"]) * int(info["block_size"])
            except (KeyError, ValueError):
                return None
    return None


def instance_pool_tokens(url: str, timeout_s: float = 10.0) -> int | None:
    """`pool_tokens` of the server at `url` (None where it does not say)."""
    block_size: Any = None
    try:
        resp = httpx.get(url.rstrip("/") + "/health", timeout=timeout_s)
        if resp.status_code == 200:
            block_size = resp.json().get("block_size")
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return pool_tokens(try_scrape(url), block_size if isinstance(block_size, int) else None)
