"""Per-request sampling parameters, the grammar a request's output must match, and the
logprobs sampling reports: plain data, torch-free (the router builds and reads them too;
the sampler and `structured` act on them)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from dataclasses import field
from typing import Any

GREEDY_BELOW_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily (logits / t would overflow float32)."""
SEED_RANGE = (-(2**63), 2**64)
"""Seeds a torch.Generator accepts: [lo, hi)."""
MAX_LOGPROBS = 20
"""Most alternatives a request may ask for per token (OpenAI's top_logprobs bound)."""
PENALTY_RANGE = (-2.0, 2.0)
"""presence_penalty and frequency_penalty: [lo, hi], as OpenAI's API."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 (or below `GREEDY_BELOW_TEMPERATURE`) means greedy. A request
    with a seed is reproducible: its tokens depend only on its own seed and
    logits, never on the batch it ran in.

    Penalties follow vLLM: presence and frequency count the request's output
    tokens (a first token sampled by another instance included), repetition
    counts prompt and output tokens; greedy requests take the argmax of the
    penalised logits. Logprobs describe the model's raw distribution
    (log-softmax of its logits, before penalties, temperature and filters:
    vLLM's default ``raw_logprobs``).
    """

    max_tokens: int = 16
    """Most tokens to generate."""
    temperature: float = 1.0
    """Softmax temperature; 0 picks the most likely token."""
    top_p: float = 1.0
    """Nucleus sampling: smallest set of tokens whose probability reaches top_p."""
    top_k: int = -1
    """Keep only the k most likely tokens; -1 keeps all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely one's (after
    temperature); 0 keeps all."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the output holds already."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the output holds it."""
    repetition_penalty: float = 1.0
    """Tokens of the prompt or the output: positive logits divided by it, negative ones
    multiplied; 1 leaves them."""
    logprobs: int | None = None
    """Return each output token's logprob and its `logprobs` most likely alternatives
    (0: the token's own only); None returns none."""
    seed: int | None = None
    """Seed of this request's random generator."""
    stop: tuple[str, ...] = ()
    """Strings that end the output (not included in it)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the output (in addition to EOS)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token."""
    min_tokens: int = 0
    """Tokens to generate before EOS or `stop_token_ids` can be: the sampler masks them
    until the output holds this many."""
    extra_eos_token_ids: tuple[int, ...] = field(default=(), repr=False)
    """EOS ids of the model, set by the engine."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        lo, hi = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not lo <= value <= hi:
                raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def all_stop_token_ids(self) -> tuple[int, ...]:
        """The ids that end the output once ``min_tokens`` are out: `stop_token_ids` and,
        unless `ignore_eos`, the model's EOS ids. Before that, the sampler masks them."""
        if self.ignore_eos:
            return self.stop_token_ids
        return self.stop_token_ids + self.extra_eos_token_ids

    @property
    def has_penalties(self) -> bool:
        """Whether the logits depend on the tokens seen so far."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


class GrammarKind(enum.Enum):
    """What a `GrammarSpec` constrains the output to."""

    JSON_OBJECT = "json_object"
    """Any JSON object."""
    JSON_SCHEMA = "json_schema"
    """A JSON value valid against `GrammarSpec.schema`."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match; hashable, and sent as is to a prefill instance."""

    kind: GrammarKind
    schema: str | None = None
    """JSON text of the schema (`GrammarKind.JSON_SCHEMA` only)."""

    def __post_init__(self) -> None:
        if (self.kind is GrammarKind.JSON_SCHEMA) != (self.schema is not None):
            raise ValueError("GrammarSpec: a schema goes with kind json_schema, and only with it")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "schema": self.schema}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GrammarSpec:
        """ValueError for an unknown kind or a schema that does not fit it."""
        kind = data.get("kind")
        try:
            grammar_kind = GrammarKind(kind)
        except ValueError:
            raise ValueError(f"unknown grammar kind {kind!r}") from None
        schema = data.get("schema")
        if schema is not None and not isinstance(schema, str):
            raise ValueError("grammar schema must be JSON text")
        return cls(grammar_kind, schema)


@dataclass(frozen=True)
class TokenLogprobs:
    """One output token's logprob and the most likely alternatives at its position (plain data: it
    travels with a first token sampled on another instance)."""

    token_id: int
    logprob: float
    """log-softmax of the model's raw logits at the token (may be -inf)."""
    rank: int
    """1 for the most likely token; ties share the better rank."""
    top: tuple[tuple[int, float], ...]
    """The most likely (token id, logprob) pairs, most likely first."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe form (JSON has no -inf: a logprob below `JSON_LOGPROB_FLOOR` is
        written as it, which is what every response writes for it)."""
        return {
            "token_id": self.token_id, "logprob": json_logprob(self.logprob), "rank": self.rank,
            "top": [[t, json_logprob(lp)] for t, lp in self.top],
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: Any) -> TokenLogprobs:
        """`to_json`'s form back; ValueError if `data` is not one."""
        try:
            top = tuple((int(t), float(lp)) for t, lp in data["top"])
            return cls(int(data["token_id"]), float(data["logprob"]), int(data["rank"]), top)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a token's logprobs: {data!r}") from exc


JSON_LOGPROB_FLOOR = -9999.0
"""What a logprob of -inf (or NaN) is written as in JSON (which has neither), as vLLM
writes it."""


def json_logprob(value: float) -> float:
    """`value`, or `JSON_LOGPROB_FLOOR` where JSON cannot hold it."""
    return value if math.isfinite(value) else JSON_LOGPROB_FLOOR
