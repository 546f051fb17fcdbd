"""Clients that leave: a few hundred streaming requests whose clients disconnect at
seeded random moments, through a push router and directly to D.

Moments: before any answer (while the request waits or P prefills and pushes),
right after the first token, mid-decode, and after the whole answer (for the
direct requests, which name a session and ``return_to`` P, the duplex return is
then in flight). Afterwards P and D pass their integrity checks and hold no
block of any request, and a following batch is served with the colocated
instance's tokens.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import httpx
import pytest

from kvduplex.cluster import LocalCluster
from tests.integration.faults import Outcome
from tests.integration.faults import Victim
from tests.integration.faults import blocks_left
from tests.integration.faults import body
from tests.integration.faults import poll
from tests.integration.faults import prompt_ids
from tests.integration.faults import reference_tokens
from tests.integration.faults import start_rig
from tests.integration.faults import stats
from tests.skips import skip_module_without_nixl

pytestmark = pytest.mark.integration

skip_module_without_nixl()

NUM_ROUTED = 200
NUM_DIRECT = 100
CONCURRENCY = 24
SEED = 20261204
P_FAST = ["--role", "prefill", "--num-blocks", "640", "--max-num-batched-tokens", "16"]
KINDS = ("before the answer", "after the first token", "mid-decode", "after the answer")


@dataclass
class Client:
    """One streaming request and when its client leaves."""

    url: str
    body: dict[str, Any]
    kind: str
    delay_s: float = 0.0
    """``before the answer``: leave this long after sending."""
    leave_after: int = 0
    """``mid-decode``: leave once this many tokens arrived."""
    tokens: list[int] = field(default_factory=list)
    saw_done: bool = False
    error: str | None = None


def _clients(rng: random.Random, router: str, decode: str, prefill: str) -> list[Client]:
    out = []
    for i in range(NUM_ROUTED + NUM_DIRECT):
        direct = i >= NUM_ROUTED
        max_tokens = rng.randrange(8, 40)
        b = body(prompt_ids(rng.randrange(4, 90), SEED + i), max_tokens, stream=True)
        if direct:  # D computes the prompt and returns the finished turn to P
            b["kv_transfer_params"] = {
                "mode": "local",
                "session_id": f"abort-{i}",
                "return_to": prefill,
            }
        c = Client(decode if direct else router, b, rng.choice(KINDS))
        c.delay_s = rng.uniform(0.0, 0.05)
        c.leave_after = rng.randrange(2, max_tokens)
        out.append(c)
    return out


async def _run(client: httpx.AsyncClient, c: Client) -> None:
    async def read() -> None:
        async with client.stream("POST", c.url + "/v1/completions", json=c.body) as resp:
            if resp.status_code != 200:
                c.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    c.saw_done = True
                    return
                if line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        c.error = str(chunk["error"])
                        return
                    for choice in chunk.get("choices", []):
                        c.tokens.extend(choice.get("token_ids") or [])
                if c.kind == "after the first token" and c.tokens:
                    return  # leaving closes the connection
                if c.kind == "mid-decode" and len(c.tokens) >= c.leave_after:
                    return

    if c.kind == "before the answer":
        task = asyncio.ensure_future(read())
        await asyncio.sleep(c.delay_s)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    else:
        await read()


async def _storm(clients: list[Client]) -> float:
    limit = asyncio.Semaphore(CONCURRENCY)
    timeout = httpx.Timeout(60.0, connect=10.0)
    limits = httpx.Limits(max_connections=2 * CONCURRENCY)
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def one(c: Client) -> None:
            async with limit:
                await _run(client, c)

        await asyncio.gather(*(one(c) for c in clients))
    return time.monotonic() - start


def test_clients_leaving_at_random_moments_leave_no_blocks_behind(
    cluster: LocalCluster, reference: str, request: pytest.FixtureRequest
) -> None:
    rig = start_rig(cluster, reference, "aborts", p_flags=P_FAST)
    try:
        clients = _clients(random.Random(SEED), rig.url, rig.d.url, rig.p.url)
        elapsed = asyncio.run(_storm(clients))
        assert not [c.error for c in clients if c.error], "a request failed instead of leaving"
        finished = [c for c in clients if c.kind == "after the answer"]
        assert all(c.saw_done for c in finished)
        wrong = [c for c in finished if c.tokens != reference_tokens(reference, c.body)]
        assert not wrong, f"{len(wrong)} whole answers differ from the colocated instance's"
        leaked = {proc.name: blocks_left(proc.url) for proc in (rig.p, rig.d)}
        assert leaked == {rig.p.name: 0, rig.d.name: 0}
        # Every flow table is empty too, on both (cancelled-xid tombstones aside: they
        # are kept a while on purpose; retained turns: this rig returns by push).
        for proc in (rig.p, rig.d):
            poll(lambda proc=proc: not _busy_flow_tables(proc.url), f"{proc.name}'s flow tables")
        returns = stats(rig.d.url, "/internal/kv/return/stats")
        # A following batch, through the router and directly, is served exactly.
        after = [
            Victim(url, body(prompt_ids(n, SEED - n), 12, stream=n % 2 == 0)).start()
            for url in (rig.url, rig.d.url) for n in (5, 33, 70)
        ]  # fmt: skip
        for v in after:
            v.done.wait(60)
            assert v.outcome(reference_tokens(reference, v.body)) is Outcome.COMPLETED, v.error
        _report(request, clients, elapsed, returns)
    finally:
        rig.stop()


def _busy_flow_tables(url: str) -> dict[str, int]:
    tables = stats(url, "/internal/kv/flows")
    return {k: v for k, v in tables.items() if v and not k.endswith("tombstones")}


def _stage(c: Client) -> str:
    """When the client actually left (a planned early leave may come after a short answer)."""
    if c.saw_done:
        return "after the answer"
    return (
        ("before any token", "after the first token")[len(c.tokens)]
        if len(c.tokens) < 2
        else "mid-decode"
    )


def _report(
    request: pytest.FixtureRequest, clients: list[Client], elapsed: float, returns: dict
) -> None:
    counts = Counter(
        ("direct to D" if "kv_transfer_params" in c.body else "push router", _stage(c))
        for c in clients
    )
    lines = [
        f"Aborts: {len(clients)} streaming requests in {elapsed:.1f} s; every pool clean after"
    ]
    lines += [f"  {via:12} left {stage:22} {n}" for (via, stage), n in sorted(counts.items())]
    lines.append(f"  duplex returns from D: {returns}")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line("\n" + "\n".join(lines))
