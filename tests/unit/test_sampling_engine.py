"""Sampling parameters through the engine on the tiny preset: each one changes what
it should, against a reference that recomputes the model's logits from scratch
(one whole-sequence forward per token, no KV reuse) and applies the parameter
token by token."""

from __future__ import annotations

import math

import pytest
import torch

from kvduplex.common.sampling import SamplingParams
from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.request import Request
from kvduplex.engine.runner import SeqInput
from kvduplex.instance.kv_routes import PrefillRequest
from kvduplex.instance.kv_routes import _first_token_params
from kvduplex.model.loader import LoadedModel
from tests.unit.test_engine import assert_no_leak
from tests.unit.test_engine import make_engine
from tests.unit.test_engine import random_prompts
from tests.unit.test_engine import run
from tests.unit.test_engine import tiny  # noqa: F401  (the fixture)

NUM_TOKENS = 16
PROMPT = ByteTokenizer().encode("hello hello")
"""A prompt whose greedy answer on the tiny preset repeats one token."""


def greedy(**penalties: float) -> SamplingParams:
    return SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, **penalties)


def reference_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:  # (vocab,) float64
    """The last position's logits of `ids`, prefilled at once in a pool nobody else uses."""
    num_blocks = -(-len(ids) // engine.layout.block_size)
    seq = SeqInput(list(ids), 0, list(range(num_blocks)), True)
    return engine.runner.execute([seq])[0].double()


def naive_penalties(
    row: list[float], prompt: list[int], output: list[int], p: SamplingParams
) -> list[float]:
    out = list(row)
    for tok in range(len(out)):
        if tok in prompt or tok in output:
            r = p.repetition_penalty
            out[tok] = out[tok] / r if out[tok] > 0 else out[tok] * r
        n = output.count(tok)
        out[tok] -= p.frequency_penalty * n + p.presence_penalty * (n > 0)
    return out


def reference_greedy(ref: LLMEngine, prompt: list[int], p: SamplingParams) -> list[int]:
    output: list[int] = []
    for _ in range(p.max_tokens):
        row = naive_penalties(reference_logits(ref, prompt + output).tolist(), prompt, output, p)
        output.append(max(range(len(row)), key=row.__getitem__))
    return output


@pytest.fixture()
def engine(tiny: LoadedModel) -> LLMEngine:  # noqa: F811
    return make_engine(tiny)


@pytest.fixture()
def ref(tiny: LoadedModel) -> LLMEngine:  # noqa: F811
    return make_engine(tiny, caching=False)


def test_the_prompt_repeats_without_penalties(engine: LLMEngine) -> None:
    (plain,), _ = run(engine, [PROMPT], greedy())
    assert len(set(plain)) < len(plain) // 2, plain


@pytest.mark.parametrize(
    "penalties",
    [
        {"repetition_penalty": 2.0},
        {"repetition_penalty": 0.5},
        {"frequency_penalty": 1.0},
        {"presence_penalty": 1.5},
        {"frequency_penalty": 0.4, "presence_penalty": -0.3, "repetition_penalty": 1.3},
    ],
)
def test_penalties_change_a_greedy_answer_as_the_reference_does(
    engine: LLMEngine, ref: LLMEngine, penalties: dict[str, float]
) -> None:
    (plain,), _ = run(engine, [PROMPT], greedy())
    p = greedy(**penalties)
    (penalised,), _ = run(engine, [PROMPT], p)
    assert penalised != plain
    assert penalised == reference_greedy(ref, PROMPT, p)
    assert_no_leak(engine)
    assert len(engine._penalties) == 0 and not engine._penalised, (
        "a finished request kept its counts"
    )


def test_penalised_requests_batched_with_others_give_their_tokens_alone(
    engine: LLMEngine,
    tiny: LoadedModel,  # noqa: F811
) -> None:
    prompts = [PROMPT, *random_prompts(5, seed=11)]
    plist = [
        greedy(repetition_penalty=1.8),
        SamplingParams(max_tokens=10, temperature=0.9, seed=4, frequency_penalty=0.6, min_p=0.05,
                       ignore_eos=True),
        greedy(),
        SamplingParams(max_tokens=10, temperature=1.1, seed=5, presence_penalty=1.2, top_k=30,
                       ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.7, seed=6, ignore_eos=True),
        greedy(frequency_penalty=0.5, presence_penalty=0.5),
    ]  # fmt: skip
    alone = [run(make_engine(tiny), [pr], p)[0][0] for pr, p in zip(prompts, plist, strict=True)]
    batched, _ = run(engine, prompts, plist)
    assert batched == alone
    assert_no_leak(engine)


def test_min_p_one_under_temperature_is_greedy(engine: LLMEngine) -> None:
    prompts = random_prompts(3, seed=12)
    plain, _ = run(engine, prompts, greedy())
    hot = SamplingParams(max_tokens=NUM_TOKENS, temperature=1.5, min_p=1.0, seed=1, ignore_eos=True)
    cold, _ = run(engine, prompts, hot)
    warm, _ = run(engine, prompts, SamplingParams(max_tokens=NUM_TOKENS, temperature=1.5, seed=1,
                                                  ignore_eos=True))  # fmt: skip
    assert cold == plain
    assert warm != plain, "without min_p this temperature leaves the greedy path"


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_logprobs_are_the_models_raw_log_softmax(
    engine: LLMEngine, ref: LLMEngine, temperature: float
) -> None:
    k = 4
    p = SamplingParams(max_tokens=8, temperature=temperature, seed=3, logprobs=k, ignore_eos=True,
                       repetition_penalty=1.5)  # fmt: skip
    rid = "lp"
    engine.add_request(Request(rid, PROMPT, p))
    tokens, entries = [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            assert out.new_logprobs is not None and len(out.new_logprobs) == len(out.new_token_ids)
            entries.extend(out.new_logprobs)
    assert len(tokens) == 8
    for i, (tok, entry) in enumerate(zip(tokens, entries, strict=True)):
        assert entry is not None and entry.token_id == tok
        want = torch.log_softmax(reference_logits(ref, PROMPT + tokens[:i]), dim=-1)
        assert math.isclose(entry.logprob, float(want[tok]), abs_tol=1e-4), i
        assert [t for t, _ in entry.top] == torch.topk(want, k).indices.tolist()
        values = [lp for _, lp in entry.top]
        assert values == sorted(values, reverse=True)
        assert entry.rank == int((want > want[tok]).sum()) + 1
    assert not engine._logprobs, "a finished request kept its logprobs"
    assert_no_leak(engine)


def test_greedy_requests_without_penalties_keep_no_sampling_state(engine: LLMEngine) -> None:
    run(engine, random_prompts(4, seed=13), greedy())
    assert len(engine._penalties) == 0 and not engine._logprobs and not engine._penalised


def _chat_prompt(tiny: LoadedModel) -> list[int]:  # noqa: F811
    """A chat prompt whose greedy answer on the tiny preset is EOS at once."""
    return tiny.tokenizer.encode_chat([{"role": "user", "content": "hi there"}], True)


def test_min_tokens_masks_eos_and_stop_ids_until_they_are_out(
    engine: LLMEngine,
    ref: LLMEngine,
    tiny: LoadedModel,  # noqa: F811
) -> None:
    prompt, eos = _chat_prompt(tiny), engine.eos_token_ids
    plain, _ = run(engine, [prompt], SamplingParams(max_tokens=6, temperature=0.0))
    assert plain == [[eos[0]]]
    stop = SamplingParams(max_tokens=6, temperature=0.0, min_tokens=4, stop_token_ids=(10,))
    (got,), finals = run(engine, [prompt], stop)
    # The reference: each of the first 4 tokens is the argmax with EOS and the stop id masked.
    want: list[int] = []
    for _ in range(4):
        row = reference_logits(ref, prompt + want)
        row[[*eos, 10]] = float("-inf")
        want.append(int(row.argmax()))
    assert got[:4] == want and not set(want) & {*eos, 10}
    assert finals[0].finish_reason == ("stop" if len(got) < 6 else "length")
    # ignore_eos: EOS is no stop, so min_tokens does not mask it (as vLLM).
    (kept,), _ = run(engine, [prompt], SamplingParams(max_tokens=3, temperature=0.0,
                                                      min_tokens=3, ignore_eos=True))  # fmt: skip
    assert kept == [eos[0]] * 3
    assert not engine._with_min_tokens, "a finished request stayed in the min_tokens set"
    assert_no_leak(engine)


@pytest.mark.parametrize("temperature", [0.0, 0.01])  # sampled: EOS has p > 0.99
def test_a_prefills_first_token_respects_min_tokens(
    engine: LLMEngine,
    tiny: LoadedModel,  # noqa: F811
    temperature: float,
) -> None:
    """What a prefill instance samples for the router (push and pull): EOS first only when
    the request allows it."""
    prompt, eos = _chat_prompt(tiny), engine.eos_token_ids

    def first(**fields: object) -> int:
        fixed = {"xid": "x", "prompt_token_ids": prompt, "temperature": temperature, "seed": 0}
        body = PrefillRequest.model_validate({**fixed, **fields})
        (ids,), finals = run(engine, [prompt], _first_token_params(body))
        assert len(ids) == 1 and finals[0].finish_reason == "length"
        return ids[0]

    assert first() in eos and first(min_tokens=3, ignore_eos=True) in eos
    assert first(min_tokens=3, stop_token_ids=[10]) not in (*eos, 10)
    assert_no_leak(engine)
