"""What each sampling knob does to the distribution tokens are drawn from."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass
from dataclasses import replace
from typing import Any

import pytest
import torch

from kvduplex.common.sampling import SamplingParams
from kvduplex.engine import sampler
from kvduplex.engine.sampler import PenaltyCounts
from kvduplex.engine.sampler import apply_penalties
from kvduplex.engine.sampler import compute_logprobs
from kvduplex.engine.sampler import sample
from kvduplex.engine.sampler import stop_bans

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
        row = torch.full_like(row, float("-inf")).scatter(
            0, idx, sorted_logits.masked_fill(drop, float("-inf"))
        )
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
    batched = sample(
        logits,
        plist,
        [None if p.is_greedy else torch.Generator().manual_seed(i) for i, p in enumerate(plist)],
    )
    alone = [
        int(logits[i].argmax())
        if p.is_greedy
        else _one_row_reference(logits[i], p, torch.Generator().manual_seed(i))
        for i, p in enumerate(plist)
    ]
    assert batched == alone


def test_greedy_takes_the_first_maximum_in_the_models_dtype() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [3.0, 3.0, 3.0, 3.0]], dtype=torch.bfloat16)
    assert sample(logits, [SamplingParams(temperature=0.0)] * 2, [None, None]) == [1, 0]


# ------------------------------------------------------------ penalties, min_p


def _naive_penalties(
    row: list[float], prompt: list[int], output: list[int], p: SamplingParams
) -> list[float]:
    """vLLM's penalties, one token at a time."""
    out = list(row)
    for tok in range(len(out)):
        if tok in prompt or tok in output:
            r = p.repetition_penalty
            out[tok] = out[tok] / r if out[tok] > 0 else out[tok] * r
        n = output.count(tok)
        out[tok] -= p.frequency_penalty * n + p.presence_penalty * (n > 0)
    return out


@dataclass
class _History:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams


def test_penalties_match_a_token_by_token_reference() -> None:
    g = torch.Generator().manual_seed(5)
    vocab = 40
    logits = torch.randn(4, vocab, generator=g) * 3
    histories = [
        _History("a", [1, 2, 3, 3], [3, 7, 7, 7, 9], SamplingParams(repetition_penalty=1.7)),
        _History("b", [5], [5, 6, 6], SamplingParams(frequency_penalty=0.8, presence_penalty=-0.5)),
        _History("c", [8, 9], [], SamplingParams(repetition_penalty=0.6, presence_penalty=1.0)),
        _History("d", [1], [2, 2], SamplingParams(frequency_penalty=-2.0, repetition_penalty=1.2)),
    ]
    counts = PenaltyCounts(vocab)
    penalties = counts.penalties(histories)
    assert penalties is not None and penalties.rows == [0, 1, 2, 3]
    got = apply_penalties(logits, penalties)
    for i, h in enumerate(histories):
        want = _naive_penalties(
            logits[i].tolist(), h.prompt_token_ids, h.output_token_ids, h.sampling_params
        )
        assert torch.allclose(got[i], torch.tensor(want), atol=1e-5), h.request_id


def test_output_counts_are_kept_incrementally() -> None:
    h = _History("a", [4, 4, 1], [], SamplingParams(frequency_penalty=1.0, repetition_penalty=1.5))
    counts = PenaltyCounts(10)
    for step, tok in enumerate([3, 3, 4, 9, 3]):
        penalties = counts.penalties([h])
        assert penalties is not None
        want = torch.bincount(torch.tensor(h.output_token_ids, dtype=torch.long), minlength=10)
        assert penalties.output_counts[0].tolist() == want.float().tolist(), step
        assert penalties.prompt_mask[0].nonzero().flatten().tolist() == [1, 4]
        h.output_token_ids.append(tok)
    # Counted once: the entry's tensor is only added to, never rebuilt from the whole output.
    h.output_token_ids[0] = 7  # a rewrite of a counted token is not seen
    penalties = counts.penalties([h])
    assert penalties is not None and penalties.output_counts[0, 3] == 3
    counts.drop("a")
    assert len(counts) == 0


def test_rows_without_penalties_have_no_counts() -> None:
    counts = PenaltyCounts(10)
    plain = _History("a", [1], [2], SamplingParams(temperature=0.0, min_p=0.5, logprobs=3))
    assert counts.penalties([plain]) is None and len(counts) == 0


def test_min_p_drops_tokens_below_a_share_of_the_top_one() -> None:
    # p(top) = 0.5: min_p 0.5 keeps p >= 0.25 (tokens 0, 1), min_p 0.2 keeps p >= 0.1.
    assert set(_draws(SamplingParams(min_p=0.5))) == {0, 1}
    assert set(_draws(SamplingParams(min_p=0.2))) == {0, 1, 2}
    assert set(_draws(SamplingParams(min_p=0.0))) == {0, 1, 2, 3}


def test_min_p_one_is_greedy_under_temperature() -> None:
    logits = torch.randn(32, 1000, generator=torch.Generator().manual_seed(2))
    gens = [torch.Generator().manual_seed(i) for i in range(32)]
    got = sample(logits, [SamplingParams(temperature=1.5, min_p=1.0)] * 32, gens)
    assert got == logits.argmax(-1).tolist()


def test_greedy_rows_take_the_argmax_of_the_penalised_logits() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [1.0, 3.0, 2.0, -1.0]])
    params = [
        SamplingParams(temperature=0.0, presence_penalty=2.0),
        SamplingParams(temperature=0.0),
    ]
    histories = [_History("a", [0], [1], params[0]), _History("b", [0], [1], params[1])]
    penalties = PenaltyCounts(4).penalties(histories)
    assert penalties is not None and penalties.rows == [0]
    assert sample(logits, params, [None, None], penalties) == [2, 1]


def _reference_with_penalties(
    logits: torch.Tensor, h: _History, gen: torch.Generator | None
) -> int:
    p = h.sampling_params
    row = torch.tensor(_naive_penalties(logits.tolist(), h.prompt_token_ids, h.output_token_ids, p))
    if p.is_greedy:
        return int(row.argmax())
    row = row / p.temperature
    if p.min_p > 0:
        probs = torch.softmax(row, -1)
        row = row.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    assert gen is not None
    return _one_row_reference(row, replace(p, temperature=1.0), gen)


def test_batched_rows_with_penalties_draw_what_each_row_alone_draws() -> None:
    g = torch.Generator().manual_seed(9)
    vocab = 300
    logits = torch.randn(8, vocab, generator=g) * 3
    plist = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.9, frequency_penalty=0.7, top_k=20),
        SamplingParams(temperature=0.0),
        SamplingParams(min_p=0.1, presence_penalty=1.5, top_p=0.9),
        SamplingParams(temperature=0.5),
        SamplingParams(min_p=0.05, repetition_penalty=0.8),
        SamplingParams(temperature=0.0, frequency_penalty=-1.0),
        SamplingParams(temperature=1.2, min_p=0.3),
    ]  # fmt: skip
    rng = random.Random(0)
    histories = [
        _History(f"r{i}", [rng.randrange(vocab) for _ in range(30)],
                 [rng.randrange(40) for _ in range(20)], p)
        for i, p in enumerate(plist)
    ]  # fmt: skip
    penalties = PenaltyCounts(vocab).penalties(histories)
    gens = [None if p.is_greedy else torch.Generator().manual_seed(i) for i, p in enumerate(plist)]
    batched = sample(logits, plist, gens, penalties)
    alone = [
        _reference_with_penalties(
            logits[i], h, None if h.sampling_params.is_greedy else torch.Generator().manual_seed(i)
        )
        for i, h in enumerate(histories)
    ]
    assert batched == alone


def test_greedy_batch_without_penalties_does_only_the_argmax(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def forbidden(*_: object) -> None:
        raise AssertionError("the greedy fast path did more than one argmax")

    for name in ("apply_penalties", "_filter_min_p", "_filter_top_k", "_filter_top_p"):
        monkeypatch.setattr(sampler, name, forbidden)
    logits = torch.randn(16, 500, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=0.0, min_p=0.5, top_k=3)] * 16
    assert sample(logits, params, [None] * 16, None) == logits.argmax(-1).tolist()


# ------------------------------------------------------------------ min_tokens

EOS = (3,)


def _short(min_tokens: int, num_out: int, **kw: Any) -> _History:
    """A request with `num_out` output tokens and the given `min_tokens` (EOS id 3)."""
    p = SamplingParams(max_tokens=8, min_tokens=min_tokens, extra_eos_token_ids=EOS, **kw)
    return _History("r", [1], [0] * num_out, p)


def test_stop_bans_name_eos_and_stop_ids_until_min_tokens_are_out() -> None:
    histories = [
        _short(0, 0),  # no min_tokens
        _short(2, 1, stop_token_ids=(5, 6)),  # short: EOS and its stop ids
        _short(2, 2, stop_token_ids=(5,)),  # min_tokens reached
        _short(4, 0, ignore_eos=True, stop_token_ids=(6,)),  # EOS may come, not its stop id
        _short(4, 0, ignore_eos=True),  # nothing to ban
    ]
    bans = stop_bans(histories)
    assert bans is not None
    assert bans.rows == [1, 3] and bans.token_ids == [(5, 6, 3), (6,)]
    assert stop_bans([histories[0], histories[2], histories[4]]) is None


def test_banned_ids_are_never_taken_greedy_or_sampled() -> None:
    # Token 3 (EOS) is the most likely by far, token 2 next: a banned greedy row takes 2,
    # banned sampled rows never draw 3 (nor the stop id 1); the rest are unchanged.
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0]] * 4)
    histories = [
        _short(1, 0, temperature=0.0),
        _short(1, 0, temperature=1.0, stop_token_ids=(1,)),
        _short(1, 1, temperature=0.0),  # min_tokens out: EOS is fine
        _short(1, 0, temperature=0.0, ignore_eos=True),  # ignores EOS: not banned
    ]
    params = [h.sampling_params for h in histories]
    before = logits.clone()
    for seed in range(50):
        gens = [None, torch.Generator().manual_seed(seed), None, None]
        tokens = sample(logits, params, gens, None, stop_bans(histories))
        assert tokens[0] == 2 and tokens[1] in (0, 2) and tokens[2:] == [3, 3], seed
    assert torch.equal(logits, before), "the bans wrote the logits (logprobs read them raw)"


def test_a_ban_that_leaves_no_token_keeps_the_grammars_choice() -> None:
    # A complete grammar allows only EOS: a row short of min_tokens still ends.
    only_eos = torch.full((2, 5), float("-inf"))
    only_eos[:, 3] = 0.0
    histories = [_short(4, 0, temperature=0.0), _short(4, 0, temperature=1.0, seed=1)]
    params = [h.sampling_params for h in histories]
    gens = [None, torch.Generator().manual_seed(1)]
    assert sample(only_eos, params, gens, None, stop_bans(histories)) == [3, 3]


def test_bans_compose_with_penalties() -> None:
    # Penalties first (token 2 is in the output: 2.0 - 1.5), then the ban of EOS 3: token 1.
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0]])
    h = _History("r", [0], [2], SamplingParams(
        temperature=0.0, min_tokens=2, presence_penalty=1.5, extra_eos_token_ids=EOS))  # fmt: skip
    penalties = PenaltyCounts(4).penalties([h])
    assert sample(logits, [h.sampling_params], [None], penalties, stop_bans([h])) == [1]


# ------------------------------------------------------------------- logprobs


def test_logprobs_are_the_raw_log_softmax_with_sorted_alternatives() -> None:
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    chosen = [int(logits[0].float().argmax()), 17, 199]
    got = compute_logprobs(logits, chosen, [5, 0, 20])
    ref = torch.log_softmax(logits.double(), dim=-1)
    for row, (entry, tok, k) in enumerate(zip(got, chosen, [5, 0, 20], strict=True)):
        assert entry.token_id == tok
        assert math.isclose(entry.logprob, float(ref[row, tok]), abs_tol=1e-5)
        assert entry.rank == int((ref[row] > ref[row, tok]).sum()) + 1
        assert len(entry.top) == k
        values = [lp for _, lp in entry.top]
        assert values == sorted(values, reverse=True)
        want_top = torch.topk(ref[row], k).values.tolist() if k else []
        assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(values, want_top, strict=True))
        for tid, lp in entry.top:
            assert math.isclose(lp, float(ref[row, tid]), abs_tol=1e-5)
    assert got[0].rank == 1 and got[0].top[0][0] == chosen[0]
