"""Turn logits into next tokens, one request's parameters per row.

Each request with a seed owns a `torch.Generator`, so its tokens depend only on
its own seed and logits, never on which other requests shared the batch.
"""

from __future__ import annotations

import logging
import random

import torch

from kvduplex.engine.sampling import SamplingParams

logger = logging.getLogger(__name__)


class RequestGenerators:
    """The random generators of live requests, keyed by request id."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def get(self, request_id: str, params: SamplingParams) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
            self._generators[request_id] = gen
        return gen

    def skip(self, request_id: str, params: SamplingParams, vocab_size: int) -> None:
        """Advance the request's generator past one token sampled elsewhere (e.g. a
        prefill instance's first token), so the next draw is the one a single
        instance would make. A draw consumes the same state whatever the probabilities."""
        if params.is_greedy:
            return
        uniform = torch.full((vocab_size,), 1.0 / vocab_size)
        torch.multinomial(uniform, 1, generator=self.get(request_id, params))

    def drop(self, request_id: str) -> None:
        self._generators.pop(request_id, None)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits outside top-k / the top-p nucleus with -inf. logits: (vocab,)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        # Drop a token when the mass before it already reaches top_p. The most likely
        # token always stays: a top_p below float32's smallest subnormal (5e-324) rounds
        # to 0, and 0 >= 0 would drop every token.
        drop = (cum - probs) >= top_p
        drop[0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, sorted_idx, sorted_logits)
    return logits


def sample(
    logits: torch.Tensor,  # (num_seqs, vocab) float32
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> list[int]:
    """Pick one token per row: greedy rows by argmax, others by seeded sampling."""
    assert logits.shape[0] == len(params) == len(generators)
    logits = logits.float().cpu()
    tokens = torch.argmax(logits, dim=-1).tolist()
    for i, p in enumerate(params):
        if p.is_greedy:
            continue
        row = _filter_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(row, dim=-1)
        if not bool(torch.isfinite(probs).all()):
            # NaN logits (e.g. an overflow in the model): one request degrades to
            # greedy over the finite logits instead of the engine loop dying.
            logger.warning("row %d: logits are not finite; taking the argmax of the finite ones", i)
            tokens[i] = int(torch.argmax(torch.nan_to_num(logits[i], nan=float("-inf"))).item())
            continue
        tokens[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return [int(t) for t in tokens]
