"""Turn logits into next tokens, one request's parameters per row.

Each request with a seed owns a `torch.Generator`, so its tokens depend only on
its own seed and logits, never on which other requests shared the batch.
"""

from __future__ import annotations

import functools
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


def _filter_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Mask each row outside its top-k with -inf; k <= 0 or >= vocab keeps the row. logits: (n, vocab)."""
    vocab = logits.shape[-1]
    k = torch.tensor([t if 0 < t < vocab else vocab for t in top_k])  # (n,)
    if bool((k == vocab).all()):
        return logits
    kth = torch.topk(logits, int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])  # (n, 1)
    kth[k == vocab] = float("-inf")
    return logits.masked_fill(logits < kth, float("-inf"))


def _filter_top_p(logits: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Keep each row's smallest nucleus reaching its top_p (rows with top_p 1 untouched)."""
    rows = [i for i, p in enumerate(top_p) if p < 1.0]
    if not rows:
        return logits
    sub = logits[rows]  # (m, vocab)
    sorted_logits, sorted_idx = torch.sort(sub, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    cum = torch.cumsum(probs, dim=-1)
    # Drop a token when the mass before it already reaches top_p. The most likely
    # token always stays: a top_p below float32's smallest subnormal (5e-324) rounds
    # to 0, and 0 >= 0 would drop every token.
    drop = (cum - probs) >= torch.tensor([top_p[i] for i in rows])[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    logits = logits.clone()
    logits[rows] = torch.full_like(sub, float("-inf")).scatter(1, sorted_idx, sorted_logits)
    return logits


@torch.inference_mode()
def apply_token_bitmask(
    logits: torch.Tensor,  # (num_seqs, vocab), written in place
    bitmask: torch.Tensor,  # (len(rows), ceil(vocab / 32)) int32
    rows: list[int],
) -> None:
    """Set to -inf the logits of tokens that `rows`' bitmasks disallow (structured output).

    Bit ``i`` of word ``j`` set allows token ``32*j + i`` (xgrammar's layout). Each
    mask byte expands through a (256, 8) table of 0 / -inf added to the logits: one
    gather and one add, several times faster on CPU than a masked fill.
    """
    vocab = logits.shape[-1]
    table = _mask_table(logits.dtype, logits.device)
    mask_bytes = bitmask.to(logits.device, non_blocking=True).view(torch.uint8).long()
    penalty = table[mask_bytes].flatten(1)[:, :vocab]  # (len(rows), vocab): 0 or -inf
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        logits.add_(penalty)
    else:
        index = torch.tensor(rows, device=logits.device)
        logits.index_add_(0, index, penalty)


@functools.cache
def _mask_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(256, 8): entry [b, i] is 0 where bit i of byte b is set, else -inf (a constant,
    made once per dtype and device)."""
    bits = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1
    return torch.where(bits.bool(), 0.0, float("-inf")).to(dtype=dtype, device=device)


def sample(
    logits: torch.Tensor,  # (num_seqs, vocab), any float dtype
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """Pick one token per row: greedy rows by the first maximum, the others by seeded sampling.

    All rows are picked greedily in one reduction over the logits as they are
    (no float32 copy of a large vocabulary); only the sampled rows are upcast,
    scaled and filtered together, then drawn one by one, each with its own
    request's generator (None is fine for a greedy row).
    """
    assert logits.shape[0] == len(params) == len(generators)
    tokens: list[int] = logits.max(dim=-1).indices.tolist()
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    if not sampled:
        return tokens
    rows = logits[sampled].float().cpu()  # (n, vocab)
    temps = torch.tensor([params[i].temperature for i in sampled], dtype=torch.float32)
    rows = _filter_top_k(rows / temps[:, None], [params[i].top_k for i in sampled])
    rows = _filter_top_p(rows, [params[i].top_p for i in sampled])
    probs = torch.softmax(rows, dim=-1)
    finite = torch.isfinite(probs).all(dim=-1).tolist()
    for j, i in enumerate(sampled):
        if not finite[j]:
            # NaN logits (e.g. an overflow in the model): one request degrades to
            # greedy over the finite logits instead of the engine loop dying.
            logger.warning("row %d: logits are not finite; taking the argmax of the finite ones", i)
            row = logits[i].float().cpu()
            tokens[i] = int(torch.argmax(torch.nan_to_num(row, nan=float("-inf"))).item())
            continue
        gen = generators[i]
        assert gen is not None, f"row {i} samples but has no generator"
        tokens[i] = int(torch.multinomial(probs[j], 1, generator=gen).item())
    return tokens
