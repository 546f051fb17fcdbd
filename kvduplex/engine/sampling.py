"""Per-request sampling parameters."""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field

GREEDY_BELOW_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily (logits / t would overflow float32)."""
SEED_RANGE = (-(2**63), 2**64)
"""Seeds a torch.Generator accepts: [lo, hi)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 (or below `GREEDY_BELOW_TEMPERATURE`) means greedy. A request
    with a seed is reproducible: its tokens depend only on its own seed and
    logits, never on the batch it ran in.
    """

    max_tokens: int = 16
    """Most tokens to generate."""
    temperature: float = 1.0
    """Softmax temperature; 0 picks the most likely token."""
    top_p: float = 1.0
    """Nucleus sampling: smallest set of tokens whose probability reaches top_p."""
    top_k: int = -1
    """Keep only the k most likely tokens; -1 keeps all."""
    seed: int | None = None
    """Seed of this request's random generator."""
    stop: tuple[str, ...] = ()
    """Strings that end the output (not included in it)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the output (in addition to EOS)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token."""
    min_tokens: int = 0
    """Stop conditions are ignored before this many tokens."""
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
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE
