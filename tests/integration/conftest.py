from __future__ import annotations

import json
import time
from collections.abc import Callable
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from httpx_sse import connect_sse
from prometheus_client.parser import text_string_to_metric_families

from kvduplex.bench.netns import NetnsHost
from kvduplex.bench.netns import netns_unavailable_reason
from kvduplex.cluster import LocalCluster
from kvduplex.cluster import Process
from kvduplex.cluster import free_port
from kvduplex.common.trust import secret_headers


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(log_dir=Path(tmp_path_factory.mktemp("logs")), env={"OMP_NUM_THREADS": "1"})
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def reference(cluster: LocalCluster) -> str:
    """URL of a colocated instance (role both) whose answers the fault tests expect."""
    from tests.integration.faults import start_reference  # faults imports this module

    return start_reference(cluster)


@dataclass
class Deployment:
    """A prefill and a decode instance, a colocated reference, and a router per mode."""

    prefill: str
    decode: str
    reference: str
    routers: dict[str, str]
    """Router URL by ``--mode`` (push, pull)."""

    @property
    def instances(self) -> list[str]:
        return [self.prefill, self.decode, self.reference]


def start_router(cluster: LocalCluster, name: str, mode: str, prefill: str, decode: str) -> Process:
    """A router (``tiny``'s tokenizer) in `mode` over one prefill and one decode instance,
    without the duplex return (each test that wants it says so)."""
    args = ["router", "--mode", mode, "--model", "tiny", "--return-mode", "none"]
    args += ["--prefill", prefill, "--decode", decode]
    return cluster.start(name, args, free_port())


def start_deployment(
    cluster: LocalCluster,
    serve: list[str],
    *,
    modes: tuple[str, ...] = (),
    prefill_flags: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Deployment:
    """Start P (``serve`` flags and `prefill_flags`), D and a colocated reference in
    parallel, then one router per mode over P and D. P and D get `env` (e.g. a cluster
    secret); the reference does not. Waits until every process of `cluster` is healthy."""
    p = cluster.start("prefill", [*serve, "--role", "prefill", *prefill_flags], free_port(), env=env)
    d = cluster.start("decode", [*serve, "--role", "decode"], free_port(), env=env)
    ref = cluster.start("reference", [*serve, "--role", "both"], free_port())
    cluster.wait_healthy(timeout_s=180)
    routers = {}
    for mode in modes:
        routers[mode] = start_router(cluster, f"router-{mode}", mode, p.url, d.url).url
    cluster.wait_healthy(timeout_s=60)
    return Deployment(p.url, d.url, ref.url, routers)


def wait_until(cond: Callable[[], bool], timeout_s: float = 20.0, what: str = "condition") -> None:
    """Poll `cond` until it holds; fail with `what` after the deadline."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def kv_stats(url: str, secret: str | None = None) -> dict:
    """Block-pool accounting of an instance (sending its cluster secret, if it has one)."""
    resp = httpx.get(url + "/internal/kv/stats", timeout=10, headers=secret_headers(secret))
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def metric(server: str, name: str, /, **labels: str) -> float:
    """The sum of the samples of Prometheus metric `name` on `server` whose labels match
    (labels may include ``url``)."""
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(server + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def stream(url: str, path: str, body: dict) -> tuple[list[int], str, list[dict]]:
    """Token ids, text and the chunks of `body` streamed from `url` + `path` (a completion
    or a chat completion); asserts it streamed ``max_tokens`` tokens."""
    ids: list[int] = []
    text: list[str] = []
    chunks: list[dict] = []
    with (
        httpx.Client(timeout=120) as http,
        connect_sse(http, "POST", url + path, json={**body, "stream": True}) as source,
    ):
        assert source.response.status_code == 200
        for event in source.iter_sse():
            if event.data == "[DONE]":
                continue
            chunk = json.loads(event.data)
            chunks.append(chunk)
            for choice in chunk["choices"]:
                ids.extend(choice.get("token_ids") or [])
                text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    assert len(ids) == body["max_tokens"], ids
    return ids, "".join(text), chunks


def assert_pool_clean(url: str, secret: str | None = None, timeout_s: float = 20.0) -> None:
    """The instance's pool is consistent and holds no blocks for requests."""
    wait_until(
        lambda: kv_stats(url, secret)["num_in_use"] == 0, timeout_s, what=f"no blocks in use on {url}"
    )
    st = kv_stats(url, secret)
    assert st["integrity_ok"], st["integrity_error"]
    assert st["num_free"] + st["num_cached"] == st["total"]


def start_duplex_rig(cluster: LocalCluster, serve: list[str]) -> dict[str, Process]:
    """One P and one D (``kvduplex serve`` with `serve`'s flags) and a push router that
    returns finished turns to P; healthy when this returns. Keys: prefill, decode, router."""
    p = cluster.start("prefill", [*serve, "--role", "prefill"], free_port())
    d = cluster.start("decode", [*serve, "--role", "decode"], free_port())
    cluster.wait_healthy(timeout_s=120)
    args = ["router", "--model", "tiny", "--prefill", p.url, "--decode", d.url]
    router = cluster.start("router", [*args, "--return-mode", "push"], free_port())
    cluster.wait_healthy(timeout_s=60)
    return {"prefill": p, "decode": d, "router": router}


@dataclass
class AcrossLink:
    """P in its own network namespace, D and a colocated reference in ours."""

    link: NetnsHost
    cluster: LocalCluster
    p: Process
    d: Process
    reference: Process


@contextmanager
def p_across_link(
    log_dir: Path, serve: list[str], p_flags: list[str], d_flags: list[str],
    ref_flags: list[str], rate_mbit: float | None = None,
) -> Iterator[AcrossLink]:  # fmt: skip
    """P (``serve`` + `p_flags`) behind a veth pair (`NetnsHost`, shaped to `rate_mbit`),
    D listening on the root end's address so that P can reach it, and the reference;
    healthy when it yields. Skips the test where namespaces cannot be made. On exit the
    processes stop before the namespace is removed."""
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with (
        NetnsHost(rate_mbit=rate_mbit) as link,
        LocalCluster(log_dir=log_dir, env={"OMP_NUM_THREADS": "1"}) as cluster,
    ):
        # A fresh namespace has no listeners: a port free here is free there.
        p = cluster.start(
            "prefill", [*serve, *p_flags], free_port(),
            netns=link.inner.netns, host=link.inner.ip, env=link.inner.ucx_env(),
        )  # fmt: skip
        d = cluster.start(
            "decode", [*serve, *d_flags], free_port(), host=link.outer.ip, env=link.outer.ucx_env()
        )
        ref = cluster.start("reference", [*serve, *ref_flags], free_port())
        cluster.wait_healthy(timeout_s=180)
        yield AcrossLink(link, cluster, p, d, ref)


def complete_turn(url: str, prompt: list[int], session: str) -> tuple[list[int], int]:
    """One greedy 16-token completion of `tiny` in `session`: its token ids and cached prompt tokens."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "prompt_cache_key": session}  # fmt: skip
    resp = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    return list(out["choices"][0]["token_ids"]), out["usage"]["prompt_tokens_details"]["cached_tokens"]
