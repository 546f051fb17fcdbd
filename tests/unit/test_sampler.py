"""What each sampling knob does to the distribution tokens are drawn from."""

from __future__ import annotations

import math
from collections import Counter

import torch

from kvduplex.engine.sampler import sample
from kvduplex.engine.sampling import SamplingParams

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def _draws(params: SamplingParams, n: int = 400, logits: torch.Tensor = LOGITS) -> Counter[int]:
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    return Counter(sample(logits.expand(n, -1).clone(), [params] * n, gens))


def test_top_k_one_is_argmax() -> None:
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0))
    gens = [torch.Generator().manual_seed(i) for i in range(64)]
    got = sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 64, gens)
    assert got == logits.argmax(-1).tolist()


def test_top_k_keeps_only_the_k_most_likely() -> None:
    counts = _draws(SamplingParams(top_k=2))
    assert set(counts) == {0, 1}
    assert math.isclose(counts[0] / sum(counts.values()), 0.5 / 0.8, abs_tol=0.08)


def test_top_p_keeps_the_smallest_nucleus() -> None:
    # 0.5 + 0.3 = 0.8 reaches 0.75: tokens 2 and 3 are outside the nucleus.
    assert set(_draws(SamplingParams(top_p=0.75))) == {0, 1}
    # 0.5 alone reaches 0.5.
    assert set(_draws(SamplingParams(top_p=0.5))) == {0}
    assert set(_draws(SamplingParams(top_p=1.0))) == {0, 1, 2, 3}


def test_temperature_sharpens_and_flattens() -> None:
    n = 400
    cold = _draws(SamplingParams(temperature=0.2), n)[0] / n
    warm = _draws(SamplingParams(temperature=1.0), n)[0] / n
    hot = _draws(SamplingParams(temperature=2.0), n)[0] / n
    assert cold > 0.9 and math.isclose(warm, 0.5, abs_tol=0.08) and hot < warm - 0.1


def test_same_seed_same_tokens_different_seed_differs() -> None:
    logits = torch.randn(1, 5000, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0)

    def draw(seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return [sample(logits, [p], [g])[0] for _ in range(8)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_non_finite_logits_degrade_one_row_to_greedy() -> None:
    logits = torch.stack([LOGITS, torch.tensor([0.0, float("nan"), 3.0, 1.0]), LOGITS])
    params = [SamplingParams(top_k=1), SamplingParams(temperature=1.0), SamplingParams(top_k=1)]
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    assert sample(logits, params, gens) == [0, 2, 0]


def _one_row_reference(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """The per-row sampler the batched one must match draw for draw."""
    row = logits.float() / p.temperature
    if 0 < p.top_k < row.shape[-1]:
        row = row.masked_fill(row < torch.topk(row, p.top_k).values[-1], float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, idx = torch.sort(row, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
        drop[0] = False
        row = torch.full_like(row, float("-inf")).scatter(0, idx, sorted_logits.masked_fill(drop, float("-inf")))
    return int(torch.multinomial(torch.softmax(row, dim=-1), 1, generator=gen).item())


def test_batched_rows_draw_what_each_row_alone_draws() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(12, 3000, generator=g) * 3
    plist = [
        SamplingParams(temperature=0.0), SamplingParams(temperature=0.7),
        SamplingParams(top_k=5), SamplingParams(top_p=0.9), SamplingParams(top_k=50, top_p=0.5),
        SamplingParams(temperature=1.3, top_k=1), SamplingParams(temperature=0.0, top_k=3),
        SamplingParams(top_p=0.3, temperature=0.5), SamplingParams(), SamplingParams(top_k=2999),
        SamplingParams(top_k=3000), SamplingParams(temperature=2.0, top_p=0.99),
    ]  # fmt: skip
    batched = sample(logits, plist, [None if p.is_greedy else torch.Generator().manual_seed(i)
                                     for i, p in enumerate(plist)])
    alone = [
        int(logits[i].argmax()) if p.is_greedy
        else _one_row_reference(logits[i], p, torch.Generator().manual_seed(i))
        for i, p in enumerate(plist)
    ]
    assert batched == alone


def test_greedy_takes_the_first_maximum_in_the_models_dtype() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [3.0, 3.0, 3.0, 3.0]], dtype=torch.bfloat16)
    assert sample(logits, [SamplingParams(temperature=0.0)] * 2, [None, None]) == [1, 0]
