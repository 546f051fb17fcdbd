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
