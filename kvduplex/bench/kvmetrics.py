"""KV bytes moved each way between prefill and decode, from the instances' /metrics.

Each instance counts the bytes of the transfers it posted or served in
``kvduplex_kv_transfer_bytes_total{direction=write|read}``. Which way they went
follows from the instance's role (``/health``):

    on P:  write = P -> D (push)          read = D -> P (return by pull)
    on D:  read  = P -> D (pull)          write = D -> P (duplex return, push)

The ``kvduplex_kv_return_*`` counters (returns, blocks, bytes, declines) are
kept as they are, per instance. A counter no instance exposes stays unknown
(None), which is not the same as 0.

The prompt-computing instances' own time to first token (``ENGINE_TTFT``:
arrival at the engine to the first token, summed and counted by its
histogram) is kept too: on P (and on a colocated instance) it is the part of
a client's TTFT that no transfer design can remove, the floor under it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from types import MappingProxyType
from typing import Any

import httpx

from kvduplex.bench.report import metric_sum
from kvduplex.bench.report import scrape
from kvduplex.common.config import Environment
from kvduplex.common.trust import secret_headers

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

BYTES = "kvduplex_kv_transfer_bytes_total"
ENGINE_TTFT = "kvduplex_time_to_first_token_seconds"
_COMPUTES_PROMPTS = ("prefill", "both")
"""Roles whose engine TTFT is a prompt's prefill (a decode instance's is its first
token after P's, or after its own recompute)."""
RETURN_PREFIX = "kvduplex_kv_return_"
RETURN_RECORDS = "/internal/kv/return/records"

# (role, direction label) -> which way the bytes went
_WAY: Mapping[tuple[str, str], str] = MappingProxyType(
    {
        ("prefill", "write"): "p_to_d",
        ("prefill", "read"): "d_to_p",
        ("decode", "read"): "p_to_d",
        ("decode", "write"): "d_to_p",
    }
)


@dataclass(frozen=True)
class Instance:
    url: str
    role: str
    """prefill, decode, both, or '' when the process did not say."""


def instance_role(url: str, timeout_s: float = 10.0) -> str:
    try:
        resp = httpx.get(url.rstrip("/") + "/health", timeout=timeout_s)
        return str(resp.json().get("role", "")) if resp.status_code == 200 else ""
    except (httpx.HTTPError, ValueError, AttributeError):
        return ""


def snapshot(
    instances: list[Instance], read: Callable[[str], Samples] = scrape
) -> dict[str, Samples]:
    """Every instance's samples now (url -> samples)."""
    return {inst.url: read(inst.url) for inst in instances}


@dataclass
class KVMoved:
    """What moved between two snapshots."""

    p_to_d_bytes: float | None = None
    d_to_p_bytes: float | None = None
    per_instance: dict[str, dict[str, float]] = field(default_factory=dict)
    """url -> counter deltas (transfer bytes by direction, every return counter)."""
    engine_ttft_s: float | None = None
    """Sum of the prompt-computing instances' engine TTFTs (None: none exposes it)."""
    engine_ttft_count: float | None = None
    """How many requests `engine_ttft_s` sums."""


def _has(samples: Samples, name: str) -> bool:
    return any(n == name for n, _ in samples)


def _label_text(name: str, labels: tuple[tuple[str, str], ...]) -> str:
    inner = ",".join(f"{k}={v}" for k, v in labels)
    return f"{name}{{{inner}}}" if inner else name


def kv_moved(
    instances: list[Instance], before: dict[str, Samples], after: dict[str, Samples]
) -> KVMoved:
    """Bytes P->D and D->P (None where no instance counts them) and the return counters."""
    out = KVMoved()
    for inst in instances:
        b, a = before.get(inst.url, {}), after.get(inst.url, {})
        deltas: dict[str, float] = {}
        for key in sorted(a):
            name, labels = key
            if name == BYTES or (name.startswith(RETURN_PREFIX) and name.endswith("_total")):
                deltas[_label_text(name, labels)] = a[key] - b.get(key, 0.0)
        out.per_instance[inst.url] = deltas
        if inst.role in _COMPUTES_PROMPTS and _has(a, ENGINE_TTFT + "_count"):
            for attr, suffix in (("engine_ttft_s", "_sum"), ("engine_ttft_count", "_count")):
                delta = metric_sum(a, ENGINE_TTFT + suffix) - metric_sum(b, ENGINE_TTFT + suffix)
                setattr(out, attr, (getattr(out, attr) or 0.0) + delta)
        if not _has(a, BYTES):
            continue
        for direction in ("write", "read"):
            way = _WAY.get((inst.role, direction))
            if way is None:
                continue
            moved = metric_sum(a, BYTES, direction=direction) - metric_sum(
                b, BYTES, direction=direction
            )
            current = getattr(out, f"{way}_bytes")
            setattr(out, f"{way}_bytes", (current or 0.0) + moved)
    return out


def return_records(instances: list[Instance], timeout_s: float = 10.0) -> dict[str, dict[str, Any]]:
    """The decode instances' recent duplex returns by request id (empty where none says)."""
    out: dict[str, dict[str, Any]] = {}
    headers = secret_headers(Environment.read().cluster_secret)
    for inst in instances:
        if inst.role != "decode":
            continue
        try:
            resp = httpx.get(
                inst.url.rstrip("/") + RETURN_RECORDS, headers=headers, timeout=timeout_s
            )
        except httpx.HTTPError:
            continue
        if resp.status_code == 200:
            out.update(resp.json())
    return out


def settle(
    instances: list[Instance],
    read: Callable[[str], Samples] = scrape,
    *,
    quiet_s: float = 0.5,
    timeout_s: float = 15.0,
) -> dict[str, Samples]:
    """Snapshots until two in a row `quiet_s` apart agree on the KV counters (or the timeout).

    Duplex returns run after the answer, off the critical path; waiting for
    the counters to stop moving attributes them to the run that caused them.
    """
    deadline = time.monotonic() + timeout_s
    last = _kv_view(snapshot(instances, read))
    while True:
        time.sleep(quiet_s)  # waiting for other processes' background transfers to finish
        now_full = snapshot(instances, read)
        now = _kv_view(now_full)
        if now == last or time.monotonic() > deadline:
            return now_full
        last = now


def _kv_view(snap: dict[str, Samples]) -> dict[str, Samples]:
    return {
        url: {k: v for k, v in samples.items() if k[0] == BYTES or k[0].startswith(RETURN_PREFIX)}
        for url, samples in snap.items()
    }
