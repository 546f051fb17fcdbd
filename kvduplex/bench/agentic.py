"""Run a planned multi-turn workload against one OpenAI-compatible endpoint.

Every session runs as its own task: send a turn, stream the answer, append it
to the history, think, send the next turn. All sessions start together. A
session whose request fails stops there (its history cannot grow without the
answer); the failure is recorded like any other result.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm import tqdm

from kvduplex.bench.client import RequestResult
from kvduplex.bench.client import stream_request
from kvduplex.bench.conversation import PromptForm
from kvduplex.bench.conversation import new_conversation
from kvduplex.bench.conversation import tool_definitions
from kvduplex.bench.workload import SessionPlan
from kvduplex.bench.workload import WorkloadConfig
from kvduplex.bench.workload import input_texts
from kvduplex.bench.workload import plan_sessions
from kvduplex.bench.workload import session_id
from kvduplex.bench.workload import system_prompt


@dataclass
class TurnRecord:
    """One request of the workload as the client saw it."""

    mode: str
    shape: str
    repetition: int
    session: int
    turn: int
    think_s: float
    input_tokens: int
    """Planned new input tokens (byte-tokenizer tokens)."""
    max_tokens: int
    start_s: float
    """When the request was sent, seconds after the run began."""
    result: RequestResult
    returned_blocks: int | None = None
    """Blocks of this turn that decode WROTE back to prefill (None: not known)."""
    returned_bytes: int | None = None
    previous_sent_back: bool = True
    """This turn's prompt holds the previous turn's answer as it was generated (False: the
    client rewrote it, or stripped its reasoning, so that the answer is not history)."""


@dataclass(frozen=True)
class RunTarget:
    """Where a workload runs and how its requests look."""

    url: str
    model: str
    mode: str
    """Label of this endpoint in the report (a mode, or the system's name)."""
    form: PromptForm = PromptForm.TOKENS
    chat_plain: bool = False
    """Chat form without tools: assistant text and user messages only."""


def _http_client() -> httpx.AsyncClient:
    timeout = httpx.Timeout(1800.0, connect=10.0)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    return httpx.AsyncClient(timeout=timeout, limits=limits)


async def _run_session(
    client: httpx.AsyncClient,
    target: RunTarget,
    config: WorkloadConfig,
    plan: SessionPlan,
    *,
    salt: str,
    repetition: int,
    t0: float,
    on_done: tqdm,
) -> list[TurnRecord]:
    sid = session_id(salt, config, plan)
    conv = new_conversation(
        target.form, target.model, sid, system_prompt(config),
        shape=config.shape.name, chat_plain=target.chat_plain,
    )  # fmt: skip
    records = []
    sent_back = True
    for turn, text in zip(plan.turns, input_texts(config, plan, salt), strict=True):
        if turn.think_s > 0:
            await asyncio.sleep(turn.think_s)
        req = conv.next_request(text, turn.answer_tokens)
        start = time.perf_counter() - t0
        res = await stream_request(client, target.url, req.path, req.body, req.headers)
        records.append(
            TurnRecord(
                mode=target.mode, shape=config.shape.name, repetition=repetition,
                session=plan.index, turn=turn.index, think_s=turn.think_s,
                input_tokens=turn.input_tokens, max_tokens=turn.answer_tokens,
                start_s=start, result=res, previous_sent_back=sent_back,
            )
        )  # fmt: skip
        on_done.update(1)
        if not res.ok:
            on_done.update(len(plan.turns) - turn.index - 1)
            break
        sent_back = conv.add_answer(res.text, res.token_ids, res.message)
    return records


async def run_workload(
    target: RunTarget,
    config: WorkloadConfig,
    *,
    salt: str,
    repetition: int = 0,
    progress: bool = True,
) -> tuple[list[TurnRecord], float]:
    """Run every session of `config` against `target` at once; (records, wall seconds).

    `salt` picks the input words (the plan's lengths and think times do not
    depend on it); use a different salt per mode and repetition.
    """
    plans = plan_sessions(config)
    total = sum(len(p.turns) for p in plans)
    bar = tqdm(
        total=total, desc=f"{config.shape.name} {target.mode} rep {repetition}", unit="req",
        leave=False, file=sys.stderr, disable=not (progress and sys.stderr.isatty()),
    )  # fmt: skip
    t0 = time.perf_counter()
    with bar:
        async with _http_client() as client:
            per_session = await asyncio.gather(
                *(
                    _run_session(
                        client,
                        target,
                        config,
                        plan,
                        salt=salt,
                        repetition=repetition,
                        t0=t0,
                        on_done=bar,
                    )
                    for plan in plans
                )
            )
    wall = time.perf_counter() - t0
    records = [r for recs in per_session for r in recs]
    records.sort(key=lambda r: (r.session, r.turn))
    return records, wall


async def check_tools_accepted(url: str, model: str) -> str | None:
    """None if `url` takes a chat request with ``tools``; the server's refusal otherwise."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "ls"}],
        "tools": tool_definitions(),
        "max_tokens": 1,
        "temperature": 0.0,
    }
    async with _http_client() as client:
        resp = await client.post(url + "/v1/chat/completions", json=body)
    if resp.status_code == 200:
        return None
    return f"HTTP {resp.status_code}: {resp.text[:300]}"


async def served_models(url: str) -> list[dict[str, Any]]:
    """The entries of `url`'s /v1/models (id, and for kvduplex max_model_len)."""
    async with _http_client() as client:
        resp = await client.get(url + "/v1/models")
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise ValueError(f"{url}/v1/models lists no model; pass --model")
    return [dict(d) for d in data]
