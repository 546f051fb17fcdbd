"""Turn logits into next tokens, one request's parameters per row.

One step's rows go through these stages, each batched over the rows it concerns
(never a Python loop over the vocabulary)::

    logits ─► penalties (rows with any) ─► stop bans (rows short of min_tokens)
           ─► greedy rows: argmax
           └► sampled rows: temperature ─► min_p ─► top_k ─► top_p ─► draw

A batch of greedy rows without penalties or bans takes one argmax over the
logits as they are and nothing else. A grammar's token mask (structured output)
is applied by the engine to the logits before they get here
(`apply_token_bitmask`); the stop bans compose with it: a row the two would
leave without any token keeps the grammar's choice (a complete grammar ends the
output, as `kvduplex.engine.structured` says).

Stop bans are vLLM's ``min_tokens``: while a request has fewer than
``min_tokens`` output tokens, its ``stop_token_ids`` and (unless ``ignore_eos``)
the model's EOS ids are masked to -inf, so the answer holds at least that many
real tokens (`StopBans`, `stop_bans`).

Each request with a seed owns a `torch.Generator`, so its tokens depend only on
its own seed and logits, never on which other requests shared the batch.

Penalties need, per request, how often each token appears in its output and
which tokens its prompt holds: `PenaltyCounts` keeps both and counts only the
output tokens appended since the step before. Logprobs (`compute_logprobs`)
describe the model's raw distribution, the log-softmax of its logits before any
penalty, ban, temperature or filter (vLLM's default).
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvduplex.common.sampling import SamplingParams
from kvduplex.common.sampling import TokenLogprobs

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


# ------------------------------------------------------------------ penalties


class TokenHistory(Protocol):
    """What `PenaltyCounts` reads of a request (`Request` is one)."""

    @property
    def request_id(self) -> str: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def output_token_ids(self) -> list[int]: ...
    @property
    def sampling_params(self) -> SamplingParams: ...


@dataclass
class Penalties:
    """The penalised rows of one step's batch and what their penalties need."""

    rows: list[int]
    """Row indices in the batch (ascending)."""
    output_counts: torch.Tensor  # (len(rows), vocab) float32: times each id is in the output
    prompt_mask: torch.Tensor  # (len(rows), vocab) bool: the prompt holds the id
    presence: torch.Tensor  # (len(rows),) float32
    frequency: torch.Tensor  # (len(rows),) float32
    repetition: torch.Tensor  # (len(rows),) float32


@dataclass
class _Counts:
    output_counts: torch.Tensor  # (vocab,) float32
    prompt_mask: torch.Tensor | None  # (vocab,) bool; only with a repetition penalty
    num_counted: int = 0
    """Output tokens already in `output_counts`."""


class PenaltyCounts:
    """Per request with penalties: its output's token counts and its prompt's tokens.

    Owned by the engine thread. A request's entry is made the first time it is
    sampled with penalties; each later call adds only the output tokens appended
    since (one per decode step, whoever sampled it: a first token that came from
    another instance counts like any other). `drop` when the request ends.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._counts: dict[str, _Counts] = {}
        self._no_prompt_mask = torch.zeros(vocab_size, dtype=torch.bool)
        """The prompt mask of a request without a repetition penalty (read only)."""

    def penalties(self, requests: Sequence[TokenHistory]) -> Penalties | None:
        """The penalties of a batch whose rows are `requests` (None if no row has any)."""
        rows = [i for i, r in enumerate(requests) if r.sampling_params.has_penalties]
        if not rows:
            return None
        counts, masks = [], []
        for i in rows:
            entry = self._update(requests[i])
            counts.append(entry.output_counts)
            masks.append(
                entry.prompt_mask if entry.prompt_mask is not None else self._no_prompt_mask
            )
        params = [requests[i].sampling_params for i in rows]
        return Penalties(
            rows=rows,
            output_counts=torch.stack(counts),
            prompt_mask=torch.stack(masks),
            presence=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32),
            frequency=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32),
            repetition=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32),
        )

    def _update(self, req: TokenHistory) -> _Counts:
        entry = self._counts.get(req.request_id)
        if entry is None:
            mask = None
            if req.sampling_params.repetition_penalty != 1.0:
                mask = torch.zeros(self.vocab_size, dtype=torch.bool)
                mask[torch.tensor(req.prompt_token_ids, dtype=torch.long)] = True
            entry = _Counts(torch.zeros(self.vocab_size, dtype=torch.float32), mask)
            self._counts[req.request_id] = entry
        new = req.output_token_ids[entry.num_counted :]
        if new:
            ids = torch.tensor(new, dtype=torch.long)
            entry.output_counts.index_put_((ids,), torch.ones(len(new)), accumulate=True)
            entry.num_counted += len(new)
        return entry

    def drop(self, request_id: str) -> None:
        self._counts.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._counts)


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """vLLM's penalties on `logits` (one row per penalised request, float32):
    repetition over prompt and output tokens (positive logits divided, negative ones
    multiplied), then frequency (times the count) and presence (once) over output tokens."""
    seen = p.prompt_mask | (p.output_counts > 0)  # (m, vocab)
    rep = torch.where(seen, p.repetition[:, None], 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - p.frequency[:, None] * p.output_counts
    return logits - p.presence[:, None] * (p.output_counts > 0).float()


# ----------------------------------------------------------------- stop bans


@dataclass
class StopBans:
    """The rows of one step's batch still short of their ``min_tokens``, and the ids
    each may not take yet."""

    rows: list[int]
    """Row indices in the batch (ascending)."""
    token_ids: list[tuple[int, ...]]
    """Per row: its stop_token_ids and, unless it ignores EOS, the model's EOS ids."""


def stop_bans(requests: Sequence[TokenHistory]) -> StopBans | None:
    """The stop bans of a batch whose rows are `requests` (None if no row has any): a row
    whose output holds fewer than ``min_tokens`` tokens may not take a token that would
    end it (vLLM's MinTokensLogitsProcessor)."""
    rows: list[int] = []
    token_ids: list[tuple[int, ...]] = []
    for i, req in enumerate(requests):
        sp = req.sampling_params
        if len(req.output_token_ids) < sp.min_tokens and (ids := sp.all_stop_token_ids):
            rows.append(i)
            token_ids.append(ids)
    return StopBans(rows, token_ids) if rows else None


def apply_stop_bans(logits: torch.Tensor, token_ids: list[tuple[int, ...]]) -> torch.Tensor:
    """`logits` (one row per banned request, float32) with each row's `token_ids` at -inf;
    a row this would leave without a finite logit (a grammar that allows only EOS) is
    kept as it was."""
    row_idx = [j for j, ids in enumerate(token_ids) for _ in ids]
    tok_idx = [t for ids in token_ids for t in ids]
    vocab = logits.shape[-1]
    keep = [k for k, t in enumerate(tok_idx) if 0 <= t < vocab]
    banned = logits.clone()
    banned[[row_idx[k] for k in keep], [tok_idx[k] for k in keep]] = float("-inf")
    is_empty = ~torch.isfinite(banned).any(dim=-1)  # (m,)
    if bool(is_empty.any()):
        banned[is_empty] = logits[is_empty]
    return banned


# ------------------------------------------------------------------- filters


def _filter_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Mask each row's tokens less likely than min_p times its most likely one (rows with
    min_p 0 untouched). logits: (n, vocab), already scaled by temperature."""
    if not any(m > 0.0 for m in min_p):
        return logits
    probs = torch.softmax(logits, dim=-1)
    threshold = (
        torch.tensor(min_p, dtype=probs.dtype)[:, None] * probs.max(dim=-1, keepdim=True).values
    )
    return logits.masked_fill(probs < threshold, float("-inf"))


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


# -------------------------------------------------------------------- sample


def sample(
    logits: torch.Tensor,  # (num_seqs, vocab), any float dtype
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    penalties: Penalties | None = None,
    bans: StopBans | None = None,
) -> list[int]:
    """Pick one token per row: greedy rows by the first maximum, the others by seeded sampling.

    All rows are picked greedily in one reduction over the logits as they are
    (no float32 copy of a large vocabulary). Rows that sample, carry penalties or
    have stop bans are then upcast together; penalised rows get their `penalties`,
    banned rows their `bans` (greedy ones take the argmax of the result); sampled
    rows are scaled and filtered together, then drawn one by one, each with its own
    request's generator (None is fine for a greedy row). `logits` are not written.
    """
    assert logits.shape[0] == len(params) == len(generators)
    tokens: list[int] = logits.max(dim=-1).indices.tolist()
    penalised = penalties.rows if penalties is not None else []
    banned = bans.rows if bans is not None else []
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    if not sampled and not penalised and not banned:
        return tokens
    work = sorted(set(sampled) | set(penalised) | set(banned))  # in batch order
    pos = {i: j for j, i in enumerate(work)}
    rows = logits[work].float().cpu()  # (len(work), vocab)
    if penalties is not None:
        at = [pos[i] for i in penalised]
        rows[at] = apply_penalties(rows[at], penalties)
    if bans is not None:
        at = [pos[i] for i in banned]
        rows[at] = apply_stop_bans(rows[at], bans.token_ids)
    greedy_worked = [i for i in work if params[i].is_greedy]
    if greedy_worked:
        picked = rows[[pos[i] for i in greedy_worked]].max(dim=-1).indices.tolist()
        for i, tok in zip(greedy_worked, picked, strict=True):
            tokens[i] = tok
    if not sampled:
        return tokens
    worked = rows  # penalised and banned, before temperature and filters
    rows = rows[[pos[i] for i in sampled]]
    temps = torch.tensor([params[i].temperature for i in sampled], dtype=torch.float32)
    rows = _filter_min_p(rows / temps[:, None], [params[i].min_p for i in sampled])
    rows = _filter_top_k(rows, [params[i].top_k for i in sampled])
    rows = _filter_top_p(rows, [params[i].top_p for i in sampled])
    probs = torch.softmax(rows, dim=-1)
    finite = torch.isfinite(probs).all(dim=-1).tolist()
    for j, i in enumerate(sampled):
        if not finite[j]:
            # NaN logits (e.g. an overflow in the model): one request degrades to
            # greedy over the finite logits instead of the engine loop dying.
            logger.warning("row %d: logits are not finite; taking the argmax of the finite ones", i)
            row = worked[pos[i]]
            tokens[i] = int(torch.argmax(torch.nan_to_num(row, nan=float("-inf"))).item())
            continue
        gen = generators[i]
        assert gen is not None, f"row {i} samples but has no generator"
        tokens[i] = int(torch.multinomial(probs[j], 1, generator=gen).item())
    return tokens


# ------------------------------------------------------------------- logprobs


def compute_logprobs(
    logits: torch.Tensor,  # (n, vocab), any float dtype: the model's raw logits
    token_ids: list[int],
    num_top: list[int],
) -> list[TokenLogprobs]:
    """Each row's chosen token's logprob, rank and its `num_top` most likely alternatives,
    from one log-softmax over the rows (in float32, on the logits' device)."""
    assert logits.shape[0] == len(token_ids) == len(num_top)
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (n, vocab)
    chosen = torch.tensor(token_ids, dtype=torch.long, device=logits.device)[:, None]
    chosen_lp = logprobs.gather(1, chosen)  # (n, 1)
    ranks = ((logprobs > chosen_lp).sum(dim=-1) + 1).tolist()
    k = max(num_top, default=0)
    top_ids: list[list[int]] = [[] for _ in token_ids]
    top_lps: list[list[float]] = [[] for _ in token_ids]
    if k > 0:
        top = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
        top_ids, top_lps = top.indices.tolist(), top.values.tolist()
    return [
        TokenLogprobs(tok, lp, rank, tuple(zip(top_ids[j][:n], top_lps[j][:n], strict=True)))
        for j, (tok, lp, rank, n) in enumerate(
            zip(token_ids, chosen_lp[:, 0].tolist(), ranks, num_top, strict=True)
        )
    ]
