"""How much KV a multi-turn workload needs, and how many sessions oversubscribe a pool.

A workload's KV at its end::

    | system prompt |  one copy: every session shares it, the prefix cache holds it once
    | s0: in 0, answer 0, in 1, ... answer T-1 |   each session's own history,
    | s1: ... |                                     at its last turn
    ...

A workload oversubscribes prefill's pool `factor` times when that total reaches
``factor x`` the tokens the pool holds. Sessions are added in plan order until it
does; session s's plan does not depend on how many sessions there are
(`workload.iter_sessions`), so the sessions counted are those that run.

The pool's tokens: a local deployment's from its size in MiB and the preset's
KV bytes per token, in whole blocks as the engine sizes it; an endpoint's from
its /metrics (`kvmetrics.pool_tokens`) or given.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import replace

from kvduplex.bench.kvmetrics import instance_role
from kvduplex.bench.prompt_sources import instance_pool_tokens
from kvduplex.bench.workload import SessionPlan
from kvduplex.bench.workload import WorkloadConfig
from kvduplex.bench.workload import iter_sessions
from kvduplex.bench.workload import plan_sessions

MAX_SESSIONS = 10_000
"""Most sessions `size_for_oversubscription` adds before it gives up."""


def history_tokens(plan: SessionPlan) -> int:
    """Tokens a session adds to the system prompt by its last answer (inputs and answers)."""
    return sum(t.input_tokens + t.answer_tokens for t in plan.turns)


def session_tokens(config: WorkloadConfig) -> list[int]:
    """Context each session of `config` needs at its last turn (prompt and answer)."""
    return [config.system_tokens + history_tokens(p) for p in plan_sessions(config)]


def max_session_tokens(config: WorkloadConfig) -> int:
    """Context the longest session of `config` needs at its last turn."""
    return max(session_tokens(config))


def workload_kv_tokens(config: WorkloadConfig) -> int:
    """Distinct tokens of KV the whole workload leaves: the system prompt once, then every
    session's history."""
    return config.system_tokens + sum(history_tokens(p) for p in plan_sessions(config))


def expected_history_tokens(config: WorkloadConfig) -> float:
    """A session's history on average over the shape's ranges (the mean of each draw)."""
    shape = config.shape
    turns = sum(shape.turns) / 2 if shape.turns is not None else config.num_turns
    return turns * (sum(shape.input_tokens) / 2 + sum(shape.answer_tokens) / 2)


def pool_tokens_for_mb(kv_cache_mb: int, kv_bytes_per_token: int, block_size: int) -> int:
    """Tokens a pool of `kv_cache_mb` MiB holds: the whole blocks of `block_size` tokens
    that fit, as the engine sizes its pool."""
    if kv_bytes_per_token < 1 or block_size < 1:
        raise ValueError("kv_bytes_per_token and block_size must be >= 1")
    return (kv_cache_mb * 2**20) // (kv_bytes_per_token * block_size) * block_size


@dataclass(frozen=True)
class Oversubscribed:
    """A workload sized against a pool."""

    config: WorkloadConfig
    """The workload with its number of sessions set."""
    factor: float
    pool_tokens: int
    kv_tokens: int
    """The KV the sized workload leaves (`workload_kv_tokens`)."""

    def note(self) -> str:
        c = self.config
        return (
            f"{c.shape.name}: {c.num_sessions} sessions, whose KV ({self.kv_tokens} tokens: the "
            f"{c.system_tokens}-token system prompt once, each session's history, on average "
            f"{expected_history_tokens(c):.0f}) is {self.kv_tokens / self.pool_tokens:.2f}x the "
            f"prefill pool's {self.pool_tokens} tokens (asked: {self.factor:g}x)"
        )


def size_for_oversubscription(
    config: WorkloadConfig, factor: float, pool_tokens: int
) -> Oversubscribed:
    """`config` with the fewest sessions (at least one) whose KV reaches `factor` times
    `pool_tokens`. ValueError if `MAX_SESSIONS` do not."""
    if factor <= 0 or pool_tokens < 1:
        raise ValueError(f"oversubscription must be > 0 and the pool >= 1 token, got {factor}, {pool_tokens}")
    target = factor * pool_tokens
    total = config.system_tokens
    for n, plan in enumerate(itertools.islice(iter_sessions(config), MAX_SESSIONS), start=1):
        total += history_tokens(plan)
        if total >= target:
            sized = replace(config, num_sessions=n)
            return Oversubscribed(sized, factor, pool_tokens, total)
    raise ValueError(
        f"{MAX_SESSIONS} sessions of {config.shape.name} hold {total} tokens of KV, less than "
        f"{factor:g}x the pool's {pool_tokens}; lower --oversubscription or the pool size"
    )


def oversubscribe(configs: list[WorkloadConfig], factor: float, pool_tokens: int,
                  notes: list[str]) -> list[WorkloadConfig]:  # fmt: skip
    """Each config with the sessions whose KV is `factor` times `pool_tokens`; `notes` get a
    line per config saying so."""
    sized = [size_for_oversubscription(c, factor, pool_tokens) for c in configs]
    notes += [s.note() for s in sized]
    return [s.config for s in sized]


def endpoint_pool_tokens(given: int, url: str, metrics_urls: Sequence[str]) -> int:
    """The prefill pool's tokens behind an endpoint: `given` unless 0, else what the first
    prefill (or colocated) instance of `metrics_urls` says, else the endpoint `url` itself."""
    if given:
        return given
    urls = [u.rstrip("/") for u in metrics_urls]
    prefill = [u for u in urls if instance_role(u) in ("prefill", "both")]
    for candidate in [*prefill, url.rstrip("/")]:
        tokens = instance_pool_tokens(candidate)
        if tokens:
            return tokens
    raise ValueError(
        "--oversubscription needs the prefill pool's size: pass --pool-tokens, or "
        "--metrics-url of a prefill instance whose /metrics tell it"
    )
