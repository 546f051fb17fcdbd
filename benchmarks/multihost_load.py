"""A steady agentic load over two router replicas: a session's turns alternate them.

`run_load` keeps `LoadConfig.num_sessions` clients busy until a deadline. Each
client runs seeded sessions one after another (the agentic shape: a shared system
prompt, then per turn a tool output and an answer, with think time before each
later turn), as token-id prompts that name their session, so every replica sends
a session's turns to the same instances (rendezvous) and each prompt can be
checked token by token. The turns of a session alternate the routers::

    session (client c, its n-th): turn 0 → router (c + n) % 2, turn 1 → the other, ...

A turn that fails below HTTP (refused, reset, the stream cut off:
`RequestResult.is_transport_error`) is sent once more, whole, to the other
router, as a client with two router addresses would; an HTTP error is not
retried. A session ends at a turn that failed both ways.

`check_exact` then sends every completed turn's prompt to a colocated reference
(greedy, same preset and seed) and compares the answers' token ids.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import httpx

from kvduplex.bench.client import RequestResult
from kvduplex.bench.client import stream_request
from kvduplex.bench.conversation import TokenConversation
from kvduplex.bench.workload import AGENTIC
from kvduplex.bench.workload import Shape
from kvduplex.bench.workload import WorkloadConfig
from kvduplex.bench.workload import seeded_text
from kvduplex.bench.workload import system_prompt

SMALL_AGENTIC = AGENTIC.scaled(0.25, 0.25)
"""The agentic shape scaled to a quarter: 25-100 new input tokens and 25-75 answer tokens
a turn, so that five instances and two routers share two cores."""


@dataclass(frozen=True)
class LoadConfig:
    """The session mix of the load."""

    num_sessions: int = 6
    """Clients at once; each runs its sessions one after another until the deadline."""
    num_turns: int = 6
    """Turns of a session."""
    shape: Shape = SMALL_AGENTIC
    """New input and answer tokens per turn."""
    system_tokens: int = 300
    """Tokens of the system prompt every session starts with."""
    think_time_s: tuple[float, float] = (0.5, 2.0)
    """The client's pause before each later turn, uniform in this range."""
    seed: int = 0
    request_timeout_s: float = 120.0
    """An attempt that takes longer fails (a transport error: sent to the other router)."""

    def __post_init__(self) -> None:
        if self.num_sessions < 1 or self.num_turns < 1:
            raise ValueError("num_sessions and num_turns must be >= 1")
        lo, hi = self.think_time_s
        if not 0.0 <= lo <= hi:
            raise ValueError(f"think_time_s must be a range 0 <= lo <= hi, got {self.think_time_s}")


@dataclass
class Attempt:
    """One try of a turn: the router it went to and when (seconds from the load's start)."""

    router: int
    start_s: float
    end_s: float
    result: RequestResult


@dataclass
class TurnRecord:
    session: str
    turn: int
    prompt: list[int]
    max_tokens: int
    attempts: list[Attempt] = field(default_factory=list)
    is_exact: bool | None = None
    """Set by `check_exact` for a completed turn: its answer equals the reference's."""

    @property
    def result(self) -> RequestResult:
        return self.attempts[-1].result

    @property
    def ok(self) -> bool:
        return bool(self.attempts) and self.result.ok

    @property
    def router(self) -> int:
        """The router of the last attempt (the one that answered, if any)."""
        return self.attempts[-1].router


@dataclass
class LoadState:
    """What the load is doing now, for whoever times events by it (in the same event loop)."""

    t0: float
    """Monotonic time the load started; attempts' times count from it."""
    in_flight: list[int]
    """Attempts in flight per router."""
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    """Notified whenever `in_flight` changes."""

    async def add(self, router: int, n: int) -> None:
        """`n` more attempts in flight on `router`."""
        async with self.changed:
            self.in_flight[router] += n
            self.changed.notify_all()

    async def wait_in_flight(self, router: int, timeout_s: float) -> bool:
        """Until an attempt is in flight on `router`; False if none within `timeout_s`."""
        async with self.changed:
            try:
                await asyncio.wait_for(
                    self.changed.wait_for(lambda: self.in_flight[router] > 0), timeout_s
                )
            except TimeoutError:
                return False
        return True


async def _attempt(
    client: httpx.AsyncClient, routers: list[str], router: int, body: dict[str, Any],
    headers: dict[str, str], state: LoadState,
) -> Attempt:  # fmt: skip
    start = time.monotonic() - state.t0
    await state.add(router, 1)
    try:
        res = await stream_request(client, routers[router], "/v1/completions", body, headers)
    finally:
        await state.add(router, -1)
    return Attempt(router, start, time.monotonic() - state.t0, res)


async def _session(
    client: httpx.AsyncClient, routers: list[str], model: str, cfg: LoadConfig, name: str,
    first_router: int, deadline: float, state: LoadState, out: list[TurnRecord],
) -> None:  # fmt: skip
    rng = random.Random(f"{cfg.seed}:{name}")
    system = system_prompt(WorkloadConfig(system_tokens=cfg.system_tokens, seed=cfg.seed))
    conv = TokenConversation(model, name, system)
    for turn in range(cfg.num_turns):
        if turn > 0:
            await asyncio.sleep(rng.uniform(*cfg.think_time_s))  # the workload's think time
        if time.monotonic() >= deadline:
            return
        req = conv.next_request(
            seeded_text(rng, rng.randint(*cfg.shape.input_tokens)),
            rng.randint(*cfg.shape.answer_tokens),
        )
        rec = TurnRecord(name, turn, list(req.body["prompt"]), int(req.body["max_tokens"]))
        out.append(rec)
        router = (first_router + turn) % len(routers)
        rec.attempts.append(await _attempt(client, routers, router, req.body, req.headers, state))
        if not rec.ok and rec.result.is_transport_error:
            router = (router + 1) % len(routers)
            rec.attempts.append(
                await _attempt(client, routers, router, req.body, req.headers, state)
            )
        if not rec.ok:
            return
        conv.add_answer(rec.result.text, rec.result.token_ids)


async def run_load(
    routers: list[str], model: str, cfg: LoadConfig, duration_s: float, state: LoadState
) -> list[TurnRecord]:
    """Run the load against `routers` from `state.t0` for `duration_s` seconds, keeping
    `state` current; every turn sent, in the order sent. Turns that began before the
    deadline finish."""
    if len(routers) < 2:
        raise ValueError("run_load alternates routers: give at least two")
    out: list[TurnRecord] = []
    deadline = state.t0 + duration_s
    limits = httpx.Limits(max_connections=cfg.num_sessions * 2)

    async def client_loop(c: int) -> None:
        n = 0
        while time.monotonic() < deadline:
            name = f"mh-{cfg.seed}-c{c}-s{n}"
            await _session(http, routers, model, cfg, name, (c + n) % 2, deadline, state, out)
            n += 1

    async with httpx.AsyncClient(timeout=cfg.request_timeout_s, limits=limits) as http:
        await asyncio.gather(*(client_loop(c) for c in range(cfg.num_sessions)))
    return out


async def check_exact(
    reference: str, model: str, turns: list[TurnRecord], concurrency: int = 4,
    timeout_s: float = 300.0,
) -> None:  # fmt: skip
    """Set `is_exact` on every completed turn: the reference's greedy answer to the same
    prompt ids has the same token ids."""
    gate = asyncio.Semaphore(concurrency)

    async def one(http: httpx.AsyncClient, rec: TurnRecord) -> None:
        body = {"model": model, "prompt": rec.prompt, "max_tokens": rec.max_tokens,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        async with gate:
            resp = await http.post(reference + "/v1/completions", json=body)
        resp.raise_for_status()
        rec.is_exact = resp.json()["choices"][0]["token_ids"] == rec.result.token_ids

    async with httpx.AsyncClient(timeout=timeout_s) as http:
        await asyncio.gather(*(one(http, r) for r in turns if r.ok))
