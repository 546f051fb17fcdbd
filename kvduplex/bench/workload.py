"""Seeded multi-turn workloads: sessions of turns over a shared system prompt.

A workload is planned before it runs, from its seed alone: how many new input
tokens each turn brings, how many tokens each answer has (fixed with
``ignore_eos`` and ``max_tokens``), and how long the client thinks before each
turn. The text of the inputs comes from a second seed, the *salt*, so that
the same plan can run in several modes side by side without one mode's
sessions hitting another's prefix cache; only the system prompt is the same
everywhere (as a deployment's system prompt is).

Lengths are in tokens of the built-in byte tokenizer (one token per byte):
every generated text is ASCII, so a text of n characters is n tokens there.

    turn t of a session (token-id form):

    | system prompt | in 0 | answer 0 | in 1 | answer 1 | ... | in t |  -> answer t
    '---- 1,000 ---'                                              new input
    '------------------- history: prompt of turn t-1 + answer t-1 -'
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import replace
from types import MappingProxyType

_WORDS = (
    "tool", "result", "file", "path", "error", "line", "value", "list", "query", "index",
    "table", "cache", "block", "token", "layer", "prefix", "model", "shard", "vector",
    "batch", "stream", "request", "answer", "plan", "step", "check", "patch", "commit",
)  # fmt: skip


@dataclass(frozen=True)
class Shape:
    """How big a session's turns are: inclusive token ranges drawn per turn."""

    name: str
    input_tokens: tuple[int, int]
    """New input per turn (a tool output, or the user's next question)."""
    answer_tokens: tuple[int, int]
    """Tokens of each answer (the request's ``max_tokens``, with ``ignore_eos``)."""

    def __post_init__(self) -> None:
        for what, (lo, hi) in (
            ("input_tokens", self.input_tokens),
            ("answer_tokens", self.answer_tokens),
        ):
            if not 1 <= lo <= hi:
                raise ValueError(
                    f"{self.name}: {what} must be a range 1 <= lo <= hi, got {(lo, hi)}"
                )

    def scaled(self, input_scale: float = 1.0, answer_scale: float = 1.0) -> Shape:
        """This shape with its ranges multiplied (rounded, at least 1 token)."""

        def scale(rng: tuple[int, int], s: float) -> tuple[int, int]:
            return (max(1, round(rng[0] * s)), max(1, round(rng[1] * s)))

        return replace(
            self,
            input_tokens=scale(self.input_tokens, input_scale),
            answer_tokens=scale(self.answer_tokens, answer_scale),
        )


AGENTIC = Shape("agentic", input_tokens=(100, 400), answer_tokens=(100, 300))
"""A coding agent: each turn's input is a tool output, answers are tool calls and notes."""
REASONING = Shape("reasoning", input_tokens=(60, 160), answer_tokens=(400, 800))
"""Short questions, long answers: vLLM's ``benchmarks/multi_turn`` shape, scaled down."""
SHAPES: Mapping[str, Shape] = MappingProxyType({s.name: s for s in (AGENTIC, REASONING)})


def shape_named(name: str) -> Shape:
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown shape {name!r}; choose from {sorted(SHAPES)}") from None


@dataclass(frozen=True)
class WorkloadConfig:
    """One multi-turn workload: N concurrent sessions of T turns."""

    shape: Shape = AGENTIC
    """Token ranges of inputs and answers."""
    num_sessions: int = 6
    """Sessions running at once (each waits for its answer, thinks, sends the next turn)."""
    num_turns: int = 8
    """Turns per session."""
    system_tokens: int = 1000
    """Tokens of the system prompt that every session starts with."""
    think_time_s: tuple[float, float] = (0.5, 2.0)
    """Seeded pause before each turn after the first (uniform in this range)."""
    seed: int = 0
    """Seeds the plan (lengths, think times) and the system prompt."""

    def __post_init__(self) -> None:
        if self.num_sessions < 1 or self.num_turns < 1:
            raise ValueError("num_sessions and num_turns must be >= 1")
        if self.system_tokens < 1:
            raise ValueError("system_tokens must be >= 1")
        lo, hi = self.think_time_s
        if not 0.0 <= lo <= hi:
            raise ValueError(f"think_time_s must be a range 0 <= lo <= hi, got {self.think_time_s}")


@dataclass(frozen=True)
class TurnPlan:
    """One turn of a planned session."""

    index: int
    think_s: float
    """Seconds the client waits after the previous answer before sending this turn."""
    input_tokens: int
    answer_tokens: int


@dataclass(frozen=True)
class SessionPlan:
    index: int
    turns: tuple[TurnPlan, ...]


def plan_sessions(config: WorkloadConfig) -> list[SessionPlan]:
    """The sessions' lengths and think times; a function of the config (and its seed) alone."""
    rng = random.Random(f"plan:{config.seed}:{config.shape.name}")
    sessions = []
    for s in range(config.num_sessions):
        turns = []
        for t in range(config.num_turns):
            think = rng.uniform(*config.think_time_s) if t > 0 else 0.0
            turns.append(
                TurnPlan(
                    index=t,
                    think_s=think,
                    input_tokens=rng.randint(*config.shape.input_tokens),
                    answer_tokens=rng.randint(*config.shape.answer_tokens),
                )
            )
        sessions.append(SessionPlan(index=s, turns=tuple(turns)))
    return sessions


def seeded_text(rng: random.Random, num_chars: int) -> str:
    """Exactly `num_chars` ASCII characters of seeded words (one byte-tokenizer token each)."""
    out: list[str] = []
    size = 0
    while size <= num_chars:  # size is the joined length + 1
        word = rng.choice(_WORDS)
        if rng.random() < 0.15:
            word = f"{word}={rng.randrange(10_000)}"
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:num_chars]


def system_prompt(config: WorkloadConfig) -> str:
    """The system prompt every session shares: `system_tokens` ASCII characters."""
    rng = random.Random(f"system:{config.seed}")
    head = "You are a coding agent. Use the tools to inspect and change the repository. "
    return (head + seeded_text(rng, config.system_tokens))[: config.system_tokens]


def input_texts(config: WorkloadConfig, session: SessionPlan, salt: str) -> list[str]:
    """The new input of each turn of `session`; `salt` (e.g. the mode) picks the words."""
    rng = random.Random(f"text:{config.seed}:{salt}:{config.shape.name}:{session.index}")
    return [seeded_text(rng, turn.input_tokens) for turn in session.turns]


def session_id(salt: str, config: WorkloadConfig, session: SessionPlan) -> str:
    """A session id unique per (salt, shape, seed, session)."""
    return f"{config.shape.name}-{salt}-{config.seed}-s{session.index}"
