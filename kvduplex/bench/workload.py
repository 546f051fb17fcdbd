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

A shape may also draw what a workload otherwise fixes: the system prompt's
length (once per workload), the number of turns (per session) and the think
time (per turn). The coding-agent shape does: a long system prompt listing tool
definitions, tool outputs of a few thousand tokens, tens of turns, and the
seconds a tool takes to run between them.

    turn t of a session (token-id form):

    | system prompt | in 0 | answer 0 | in 1 | answer 1 | ... | in t |  -> answer t
    '---- 1,000 ---'                                              new input
    '------------------- history: prompt of turn t-1 + answer t-1 -'
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
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
    system_tokens: tuple[int, int] | None = None
    """Length range of the shared system prompt, drawn once per workload (`system_tokens_of`);
    None: the workload's ``system_tokens``."""
    turns: tuple[int, int] | None = None
    """Turns per session, drawn per session; None: the workload's ``num_turns``."""
    think_s: tuple[float, float] | None = None
    """Seconds before each later turn, drawn per turn; None: the workload's ``think_time_s``."""
    tools_in_system: bool = False
    """The system prompt lists tool definitions (JSON) after its instructions."""

    def __post_init__(self) -> None:
        ranges = [("input_tokens", self.input_tokens), ("answer_tokens", self.answer_tokens)]
        ranges += [(what, rng) for what, rng in (("system_tokens", self.system_tokens),
                                                 ("turns", self.turns)) if rng is not None]  # fmt: skip
        for what, (lo, hi) in ranges:
            if not 1 <= lo <= hi:
                raise ValueError(f"{self.name}: {what} must be a range 1 <= lo <= hi, got {(lo, hi)}")
        if self.think_s is not None and not 0.0 <= self.think_s[0] <= self.think_s[1]:
            raise ValueError(f"{self.name}: think_s must be a range 0 <= lo <= hi, got {self.think_s}")

    def scaled(self, input_scale: float = 1.0, answer_scale: float = 1.0,
               system_scale: float = 1.0) -> Shape:  # fmt: skip
        """This shape with its token ranges multiplied (rounded, at least 1 token); turn
        counts and think times stay."""

        def scale(rng: tuple[int, int], s: float) -> tuple[int, int]:
            return (max(1, round(rng[0] * s)), max(1, round(rng[1] * s)))

        return replace(
            self,
            input_tokens=scale(self.input_tokens, input_scale),
            answer_tokens=scale(self.answer_tokens, answer_scale),
            system_tokens=None if self.system_tokens is None else scale(self.system_tokens, system_scale),
        )


AGENTIC = Shape("agentic", input_tokens=(100, 400), answer_tokens=(100, 300))
"""A coding agent: each turn's input is a tool output, answers are tool calls and notes."""
REASONING = Shape("reasoning", input_tokens=(60, 160), answer_tokens=(400, 800))
"""Short questions, long answers: vLLM's ``benchmarks/multi_turn`` shape, scaled down."""
CODING_AGENT = Shape(
    "coding_agent", input_tokens=(500, 4000), answer_tokens=(100, 600),
    system_tokens=(8000, 16000), turns=(20, 40), think_s=(2.0, 30.0), tools_in_system=True,
)  # fmt: skip
"""A coding agent at full size: instructions and tool definitions of 8k-16k tokens shared
by every session, tool outputs of 500-4k tokens, 20-40 turns, 2-30 s of tool time between
turns; a session ends near 90k tokens of context."""
SHAPES: Mapping[str, Shape] = MappingProxyType({s.name: s for s in (AGENTIC, REASONING, CODING_AGENT)})


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
    """Turns per session (a shape with a ``turns`` range draws them instead)."""
    system_tokens: int = 1000
    """Tokens of the system prompt that every session starts with."""
    think_time_s: tuple[float, float] = (0.5, 2.0)
    """Seeded pause before each turn after the first (uniform in this range; a shape with a
    ``think_s`` range uses that instead)."""
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
    sessions = iter_sessions(config)
    return [next(sessions) for _ in range(config.num_sessions)]


def iter_sessions(config: WorkloadConfig) -> Iterator[SessionPlan]:
    """Session plans 0, 1, 2, ... without end: session s is the same whatever the number of
    sessions, so a workload can be sized by adding sessions until their lengths suffice."""
    rng = random.Random(f"plan:{config.seed}:{config.shape.name}")
    shape = config.shape
    think_range = shape.think_s or config.think_time_s
    s = 0
    while True:
        num_turns = rng.randint(*shape.turns) if shape.turns is not None else config.num_turns
        turns = []
        for t in range(num_turns):
            think = rng.uniform(*think_range) if t > 0 else 0.0
            turns.append(
                TurnPlan(
                    index=t,
                    think_s=think,
                    input_tokens=rng.randint(*shape.input_tokens),
                    answer_tokens=rng.randint(*shape.answer_tokens),
                )
            )
        yield SessionPlan(index=s, turns=tuple(turns))
        s += 1


def max_turns(config: WorkloadConfig) -> int:
    """The most turns a session of `config` can have."""
    return config.shape.turns[1] if config.shape.turns is not None else config.num_turns


def system_tokens_of(shape: Shape, seed: int) -> int | None:
    """The system prompt's length a shape with a ``system_tokens`` range draws for `seed`
    (the same for every session and mode); None for a shape without one."""
    if shape.system_tokens is None:
        return None
    return random.Random(f"system-tokens:{seed}:{shape.name}").randint(*shape.system_tokens)


def describe(config: WorkloadConfig) -> str:
    """One line saying what `config` runs: sessions, turns, system prompt, think time, lengths."""
    s = config.shape
    turns = f"{s.turns[0]}-{s.turns[1]}" if s.turns else str(config.num_turns)
    think = s.think_s or config.think_time_s
    tools = " with tool definitions" if s.tools_in_system else ""
    return (
        f"{s.name}: {config.num_sessions} sessions x {turns} turns, system prompt "
        f"{config.system_tokens} tokens{tools}, think {think[0]:g}-{think[1]:g} s, inputs "
        f"{s.input_tokens[0]}-{s.input_tokens[1]}, answers {s.answer_tokens[0]}-"
        f"{s.answer_tokens[1]} tokens"
    )


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
    """The system prompt every session shares: `system_tokens` ASCII characters (instructions,
    then tool definitions where the shape has them)."""
    if config.shape.tools_in_system:
        return _tools_system_prompt(config)
    rng = random.Random(f"system:{config.seed}")
    head = "You are a coding agent. Use the tools to inspect and change the repository. "
    return (head + seeded_text(rng, config.system_tokens))[: config.system_tokens]


def _tools_system_prompt(config: WorkloadConfig) -> str:
    """Instructions, then seeded tool definitions, one JSON object per line, cut to length."""
    rng = random.Random(f"system-tools:{config.seed}")
    parts = [
        "You are a coding agent working in a git repository. Call one tool per turn; its "
        "output comes back as the next message. Keep edits small and run the tests.\n"
        + seeded_text(rng, 400) + "\n# Tools\n"
    ]  # fmt: skip
    size = len(parts[0])
    while size < config.system_tokens:
        params = {
            rng.choice(_WORDS): {"type": rng.choice(("string", "integer", "boolean")),
                                 "description": seeded_text(rng, rng.randint(20, 80))}
            for _ in range(rng.randint(1, 4))
        }  # fmt: skip
        tool = {
            "type": "function",
            "function": {
                "name": f"{rng.choice(_WORDS)}_{rng.choice(_WORDS)}_{rng.randrange(100)}",
                "description": seeded_text(rng, rng.randint(60, 300)),
                "parameters": {"type": "object", "properties": params, "required": sorted(params)[:1]},
            },
        }
        line = json.dumps(tool) + "\n"
        parts.append(line)
        size += len(line)
    return "".join(parts)[: config.system_tokens]


def input_texts(config: WorkloadConfig, session: SessionPlan, salt: str) -> list[str]:
    """The new input of each turn of `session`; `salt` (e.g. the mode) picks the words."""
    rng = random.Random(f"text:{config.seed}:{salt}:{config.shape.name}:{session.index}")
    return [seeded_text(rng, turn.input_tokens) for turn in session.turns]


def session_id(salt: str, config: WorkloadConfig, session: SessionPlan) -> str:
    """A session id unique per (salt, shape, seed, session)."""
    return f"{config.shape.name}-{salt}-{config.seed}-s{session.index}"
