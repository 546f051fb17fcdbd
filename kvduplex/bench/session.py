"""A seeded multi-turn session, the shape of the main job.

Each turn appends seeded random words (a tool result, a question) to the whole
history, answer included, and asks for an answer; the history grows turn by
turn, which is what prefix caching and the duplex return are for.
"""

from __future__ import annotations

import asyncio
import random
import statistics
from dataclasses import dataclass

import httpx

from kvduplex.bench.client import RequestResult
from kvduplex.bench.client import stream_request

_WORDS = [
    "tool",
    "result",
    "file",
    "path",
    "error",
    "line",
    "value",
    "list",
    "query",
    "index",
    "table",
    "cache",
    "block",
    "token",
    "layer",
    "prefix",
    "model",
    "shard",
    "vector",
    "batch",
    "stream",
    "request",
    "answer",
    "plan",
    "step",
    "check",
    "patch",
]


def seeded_text(rng: random.Random, num_chars: int) -> str:
    """About `num_chars` characters of seeded pseudo-text."""
    out: list[str] = []
    size = 0
    while size < num_chars:
        w = rng.choice(_WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:num_chars]


@dataclass
class TurnResult:
    turn: int
    result: RequestResult


async def run_token_session(
    base_url: str,
    model: str,
    *,
    num_turns: int = 4,
    first_turn_chars: int = 600,
    turn_chars: int = 120,
    max_tokens: int = 32,
    think_s: float = 0.0,
    seed: int = 0,
    session_id: str | None = None,
    timeout_s: float = 300.0,
) -> list[TurnResult]:
    """Run one session over /v1/completions with token-id prompts; one result per turn.

    Each turn's prompt is the previous prompt, the answer's token ids as generated, and
    the new input's bytes (the byte tokenizer's ids). Unlike chat, nothing re-renders
    the answer, so the history the next turn sends is exactly the KV decode computed.
    `think_s`: the client's pause before each later turn (an agent running its tool,
    a user reading), in which a duplex return reaches prefill."""
    rng = random.Random(seed)
    ids = list(("You are a coding agent. " + seeded_text(rng, first_turn_chars)).encode())
    results: list[TurnResult] = []
    headers = {"X-Session-Id": session_id} if session_id else None
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        for turn in range(num_turns):
            if turn > 0 and think_s > 0:
                await asyncio.sleep(think_s)  # the workload's think time
            ids = ids + list(("\n" + seeded_text(rng, turn_chars)).encode())
            body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
                    "ignore_eos": True}  # fmt: skip
            res = await stream_request(client, base_url, "/v1/completions", body, headers)
            results.append(TurnResult(turn=turn, result=res))
            if not res.ok:
                break
            ids = ids + res.token_ids
    return results


def format_session(results: list[TurnResult]) -> str:
    """A Markdown table of one session."""
    lines = [
        "| turn | prompt tokens | cached | output tokens | TTFT ms | TPOT ms | e2e ms |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in results:
        r = t.result
        if not r.ok:
            lines.append(f"| {t.turn} | error: {r.error} | | | | | |")
            continue
        lines.append(
            f"| {t.turn} | {r.prompt_tokens} | {r.cached_tokens} | {r.completion_tokens} | "
            f"{r.ttft_s * 1e3:.1f} | {r.tpot_s * 1e3:.2f} | {r.e2e_s * 1e3:.1f} |"
        )
    return "\n".join(lines)


def format_side_by_side(runs: dict[str, list[TurnResult]]) -> str:
    """One row per turn: each run's TTFT and the prompt tokens its prefill computed."""
    names = list(runs)
    head = (
        "| turn | prompt tokens | "
        + " | ".join(f"{n} TTFT ms | {n} prefilled | {n} cached" for n in names)
        + " |"
    )
    lines = [head, "|---:|---:|" + "---:|---:|---:|" * len(names)]
    for turn in range(max(len(r) for r in runs.values())):
        cells: list[str] = []
        prompt = ""
        for n in names:
            if turn >= len(runs[n]) or not runs[n][turn].result.ok:
                cells += ["error", "", ""]
                continue
            r = runs[n][turn].result
            prompt = str(r.prompt_tokens)
            prefilled = r.prompt_tokens - r.cached_tokens
            cells += [f"{r.ttft_s * 1e3:.1f}", str(prefilled), str(r.cached_tokens)]
        lines.append(f"| {turn} | {prompt} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def later_turns_ttft_ratio(
    runs: dict[str, list[TurnResult]], num: str, den: str, first_turn: int
) -> tuple[float, float, float] | None:
    """p50 TTFT of `num` and `den` over turns >= `first_turn` (both answered), and their
    ratio; None if either has no such turn."""
    a = [t.result.ttft_s for t in runs[num][first_turn:] if t.result.ok]
    b = [t.result.ttft_s for t in runs[den][first_turn:] if t.result.ok]
    if not a or not b:
        return None
    pa, pb = statistics.median(a), statistics.median(b)
    return pa, pb, pa / pb
