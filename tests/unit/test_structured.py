"""Structured output below the API: the token bitmask, grammars over the byte and a BPE
vocabulary, the engine's stop on a complete grammar, and tool-call text parsing."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema_rs
import pytest
import torch
import transformers

from kvduplex.common.engine_config import CacheConfig
from kvduplex.common.engine_config import EngineConfig
from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.common.openai.structured import ForcedToolCalls
from kvduplex.common.openai.structured import ToolCallStream
from kvduplex.common.openai.structured import ToolChoiceMode
from kvduplex.common.sampling import GrammarKind
from kvduplex.common.sampling import GrammarSpec
from kvduplex.common.sampling import SamplingParams
from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.common.tokenizer import HFTokenizer
from kvduplex.common.tokenizer import Tokenizer
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.request import Request
from kvduplex.engine.sampler import apply_token_bitmask
from kvduplex.engine.sampler import sample
from kvduplex.engine.scheduler_output import check_stop
from kvduplex.engine.structured import GrammarCompiler
from kvduplex.engine.structured import StructuredOutputError
from kvduplex.engine.structured import fill_bitmask
from kvduplex.model.loader import LoadedModel
from kvduplex.model.loader import load_model
from tests.unit.test_tokenizer import write_hf_tokenizer

ITEM = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 500},
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "sizes": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "maxItems": 4},
    },
    "required": ["id", "color", "ok", "sizes"],
}  # fmt: skip


def _spec(schema: dict) -> GrammarSpec:
    return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema))


def _unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:  # (n, vocab) bool
    bits = [(bitmask[:, j // 32] >> (j % 32)) & 1 for j in range(vocab)]
    return torch.stack(bits, dim=1).bool()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_token_bitmask_masks_exactly_the_cleared_bits(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    vocab, n = 77, 5
    logits = torch.randn(n, vocab, generator=gen).to(dtype)
    rows = [1, 3, 4]
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), 3), dtype=torch.int32, generator=gen)
    out = logits.clone()
    apply_token_bitmask(out, bitmask, rows)
    allowed = _unpack(bitmask, vocab)
    for j, i in enumerate(rows):
        expected = logits[i].masked_fill(~allowed[j], float("-inf"))
        assert torch.equal(out[i], expected)
    for i in (0, 2):
        assert torch.equal(out[i], logits[i])


def _hf(tmp_path: Path) -> HFTokenizer:
    write_hf_tokenizer(tmp_path, vocab_size=400)
    return HFTokenizer(tmp_path)


def _generate(
    tok: Tokenizer, vocab: int, spec: GrammarSpec, seed: int, temperature: float, steps: int = 400
) -> list[int]:
    """Tokens of a request whose 'model' is random logits, masked by its grammar."""
    grammars = GrammarCompiler(tok, vocab)
    params = SamplingParams(max_tokens=steps, temperature=temperature, seed=seed, ignore_eos=True,
                            extra_eos_token_ids=tuple(tok.eos_token_ids))  # fmt: skip
    req = Request("r", [1], params, grammar=grammars.grammar(spec, "r"))
    logit_gen = torch.Generator().manual_seed(seed)
    sample_gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        logits = torch.randn(1, vocab, generator=logit_gen)
        bitmask = fill_bitmask([req.grammar], vocab)
        assert bitmask is not None
        apply_token_bitmask(logits, bitmask, [0])
        req.append_output_token(sample(logits, [params], [sample_gen])[0])
        if check_stop(req, 10_000) is not None:
            break
    return req.output_token_ids


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bpe_vocabulary_answers_valid_json_and_ends_on_eos(tmp_path: Path, seed: int) -> None:
    tok = _hf(tmp_path)
    vocab = tok.vocab_size + 24  # a padded embedding: ids past the tokenizer never come out
    ids = _generate(tok, vocab, _spec(ITEM), seed, temperature=1.0)
    assert ids[-1] in tok.eos_token_ids
    assert all(t < tok.vocab_size for t in ids)
    hf = transformers.AutoTokenizer.from_pretrained(str(tok.folder), local_files_only=True)
    assert not set(ids[:-1]) & set(hf.all_special_ids)  # never text of a grammar
    jsonschema_rs.validate(ITEM, json.loads(tok.decode(ids)))
    assert len(set(ids)) > 5  # multi-byte BPE pieces, not just single characters


@pytest.mark.parametrize(("seed", "temperature"), [(0, 0.0), (3, 1.0)])
def test_byte_vocabulary_answers_any_json_object(seed: int, temperature: float) -> None:
    tok = ByteTokenizer()
    ids = _generate(tok, 512, GrammarSpec(GrammarKind.JSON_OBJECT), seed, temperature)
    assert ids[-1] in tok.eos_token_ids
    assert isinstance(json.loads(tok.decode(ids)), dict)
    assert not {ByteTokenizer.BOS_ID, ByteTokenizer.IM_START_ID, ByteTokenizer.PAD_ID} & set(ids)


def test_eos_is_allowed_only_where_the_grammar_can_end() -> None:
    compiler = GrammarCompiler(ByteTokenizer(), 512)
    for text, can_end in ((b"", False), (b"[", False), (b"[]", True)):
        grammar = compiler.grammar(_spec({"type": "array", "maxItems": 0}), "r")
        for b in text:
            grammar.accept(b)
        bitmask = fill_bitmask([grammar], 512)
        assert bitmask is not None
        allowed = _unpack(bitmask, 512)[0]
        assert bool(allowed[ByteTokenizer.EOS_ID]) is can_end
        assert bool(allowed[ByteTokenizer.IM_END_ID]) is can_end
        assert grammar.is_active and not grammar.is_terminated
    grammar.accept(ByteTokenizer.EOS_ID)
    assert grammar.is_terminated


def test_a_token_the_grammar_rejects_lifts_the_constraint() -> None:
    grammar = GrammarCompiler(ByteTokenizer(), 512).grammar(
        GrammarSpec(GrammarKind.JSON_OBJECT), "r"
    )
    grammar.accept(ord("x"))  # e.g. a first token sampled elsewhere without the grammar
    assert not grammar.is_active
    assert fill_bitmask([grammar], 512) is None  # nothing is masked any more


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "objectx"}, 'Unsupported type "objectx"'),
        ({"type": "string", "pattern": "(unclosed"}, "Regex"),
        ({"$ref": "#/$defs/missing"}, "missing"),
        ({"anyOf": []}, "no value satisfies it"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum greater than maximum"),
    ],
)
def test_a_bad_schema_is_refused_with_its_reason(schema: dict, words: str) -> None:
    with pytest.raises(StructuredOutputError, match="the schema cannot be used") as info:
        GrammarCompiler(ByteTokenizer(), 512).grammar(_spec(schema), "r")
    assert words in str(info.value)
    assert "/project/cpp" not in str(info.value)  # no C++ source location


def test_length_bounded_strings_never_take_control_characters() -> None:
    """xgrammar's own length-bounded strings would take a raw control character."""
    grammar = GrammarCompiler(ByteTokenizer(), 512).grammar(
        _spec({"type": "string", "minLength": 1, "maxLength": 3}), "r"
    )
    grammar.accept(ord('"'))
    bitmask = fill_bitmask([grammar], 512)
    assert bitmask is not None
    allowed = _unpack(bitmask, 512)[0]
    assert not allowed[:32].any() and not allowed[ord('"')]  # min 1 character
    assert allowed[ord("a")] and allowed[0xC3]


def test_grammar_spec_round_trips_and_refuses_unknown_kinds() -> None:
    spec = _spec(ITEM)
    assert GrammarSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match="unknown grammar kind"):
        GrammarSpec.from_dict({"kind": "yaml"})
    with pytest.raises(ValueError, match="only with it"):
        GrammarSpec.from_dict({"kind": "json_object", "schema": "{}"})


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model(ModelLoadConfig(model="tiny", seed=0))


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_engine_ends_a_complete_grammar_even_under_ignore_eos_and_min_tokens(
    tiny: LoadedModel, ignore_eos: bool
) -> None:
    """Without ignore_eos, min_tokens masks EOS; the complete grammar allows nothing else,
    and the grammar wins (the answer ends, whole)."""
    cfg = EngineConfig(
        model=ModelLoadConfig(model="tiny"), cache=CacheConfig(block_size=4, num_blocks=256)
    )
    engine = LLMEngine(cfg, loaded=tiny)
    grammars = GrammarCompiler(tiny.tokenizer, tiny.config.vocab_size)
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=ignore_eos, min_tokens=50)
    req = Request(
        "r", tiny.tokenizer.encode("x"), params, grammar=grammars.grammar(_spec(schema), "r")
    )
    engine.add_request(req)
    finals = []
    while engine.has_unfinished():
        finals += [o for o in engine.step() if o.finished]
    assert [o.finish_reason for o in finals] == ["stop"]
    text = tiny.tokenizer.decode(req.output_token_ids)
    assert json.loads(text) in ({"a": True}, {"a": False})
    assert req.output_token_ids[-1] in tiny.tokenizer.eos_token_ids  # the stop token ends it
    engine.check_integrity()


REQUIRED_TEXT = (
    '[{"name":"get_weather","parameters":{"city":"Paris","days":{"n":[1,2]}}},'
    '{"name":"se\\"arch","parameters":{"q":"a}b\\"c]","top":true}}]'
)


@pytest.mark.parametrize("seed", range(5))
def test_tool_call_stream_reads_any_split_of_a_required_answer(seed: int) -> None:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(REQUIRED_TEXT)), 12))
    pieces = [
        REQUIRED_TEXT[a:b] for a, b in zip([0, *cuts], [*cuts, len(REQUIRED_TEXT)], strict=True)
    ]
    stream = ToolCallStream(ForcedToolCalls(ToolChoiceMode.REQUIRED))
    deltas = [d for piece in pieces for d in stream.push(piece)]
    calls = stream.calls
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": {"n": [1, 2]}}),
        ('se"arch', {"q": 'a}b"c]', "top": True}),
    ]
    heads = [d for d in deltas if "id" in d]
    assert [(d["index"], d["function"]["name"]) for d in heads] == [
        (0, "get_weather"),
        (1, 'se"arch'),
    ]
    for index, call in enumerate(calls):
        args = "".join(d["function"].get("arguments", "") for d in deltas if d["index"] == index)
        assert args == call["function"]["arguments"]
        assert call["id"] == heads[index]["id"]


def test_tool_call_stream_of_a_named_function_names_it_first() -> None:
    stream = ToolCallStream(ForcedToolCalls(ToolChoiceMode.NAMED, "f"))
    first = stream.push('{"a"')
    assert first[0]["function"] == {"name": "f", "arguments": '{"a"'} and first[0]["id"]
    assert stream.push(":1}") == [{"index": 0, "function": {"arguments": ":1}"}}]
    assert stream.calls[0]["function"] == {"name": "f", "arguments": '{"a":1}'}


def test_preempted_requests_keep_their_grammar_in_step(tiny: LoadedModel) -> None:
    """Preemption recomputes a request's tokens without appending them again: its
    matcher stays where the output is, and the answer is still valid."""
    cfg = EngineConfig(
        model=ModelLoadConfig(model="tiny"), cache=CacheConfig(block_size=4, num_blocks=40)
    )
    engine = LLMEngine(cfg, loaded=tiny)
    grammars = GrammarCompiler(tiny.tokenizer, tiny.config.vocab_size)
    reqs = []
    for i in range(4):
        params = SamplingParams(max_tokens=100, temperature=1.0, seed=i)
        rid = f"r{i}"
        prompt = tiny.tokenizer.encode(f"item {i} " * 3)
        reqs.append(
            engine.add_request(
                Request(rid, prompt, params, grammar=grammars.grammar(_spec(ITEM), rid))
            )
        )
    while engine.has_unfinished():
        engine.step()
    assert sum(r.num_preemptions for r in reqs) > 0
    for req in reqs:
        assert req.finish_reason is not None and req.finish_reason.value == "stop"
        jsonschema_rs.validate(ITEM, json.loads(tiny.tokenizer.decode(req.output_token_ids)))
    engine.check_integrity()
