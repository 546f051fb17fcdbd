"""Tokenizers: the built-in byte tokenizer and a Hugging Face folder's tokenizer."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvduplex.common.detokenizer import IncrementalDetokenizer
from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.common.tokenizer import HFTokenizer
from kvduplex.common.tokenizer import IncrementalDecoder
from kvduplex.common.tokenizer import Tokenizer
from kvduplex.common.tokenizer import unknown_id_text

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")


def write_hf_tokenizer(folder: Path, vocab_size: int = 300, chat_template: str | None = CHAT_TEMPLATE) -> None:
    """A byte-level BPE trained on a few sentences, saved as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders
    from tokenizers import models
    from tokenizers import pre_tokenizers
    from tokenizers import processors
    from tokenizers import trainers

    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(
        ["the quick brown fox jumps over the lazy dog", "hello world", "paged attention moves kv"],
        trainer,
    )
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config: dict[str, str] = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                              "eos_token": "<|im_end|>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


# ---------------------------------------------------------------- byte tokenizer


def test_byte_round_trip_and_bos() -> None:
    tok = ByteTokenizer()
    text = "héllo, wörld ✓"
    ids = tok.encode(text)
    assert ids[0] == tok.BOS_ID
    assert ids[1:] == list(text.encode("utf-8"))
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == "<|bos|>" + text
    assert isinstance(tok, Tokenizer)


def test_byte_chat_template_encodes_specials_as_ids() -> None:
    tok = ByteTokenizer()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs)
    assert text == (
        "<|bos|><|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.encode_chat(msgs)
    assert ids[:2] == [tok.BOS_ID, tok.IM_START_ID]
    assert ids.count(tok.BOS_ID) == 1
    assert ids.count(tok.IM_END_ID) == 2
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert not tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("assistant\n")
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])


def test_byte_out_of_range_ids_are_printable_and_deterministic() -> None:
    tok = ByteTokenizer()
    ids = [ord("a"), 1000, 49151, ord("b")]
    out = tok.decode(ids)
    assert out == "a" + unknown_id_text(1000) + unknown_id_text(49151) + "b"
    assert all(c.isprintable() for c in out)
    assert tok.eos_token_ids == (tok.EOS_ID, tok.IM_END_ID)
    with pytest.raises(ValueError):
        tok.decode([-1])


def test_incremental_decoder_holds_back_partial_characters() -> None:
    tok = ByteTokenizer()
    text = "a✓b€"
    ids = tok.encode(text, add_special_tokens=False)
    dec = IncrementalDecoder(tok)
    deltas = [dec.push([t]) for t in ids]
    assert "".join(deltas) + dec.flush() == text
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[1] == "" and deltas[2] == ""  # first two bytes of ✓


def test_incremental_decoder_flushes_invalid_tail() -> None:
    tok = ByteTokenizer()
    dec = IncrementalDecoder(tok, context_ids=tok.encode("prompt"))
    assert dec.push([ord("x")]) == "x"
    assert dec.push([0xE2]) == ""
    assert dec.flush() == "\ufffd"


# ---------------------------------------------------------------- HF tokenizer


def test_hf_tokenizer_encode_decode_and_chat(tmp_path: Path) -> None:
    write_hf_tokenizer(tmp_path)
    tok = HFTokenizer(tmp_path, extra_eos_token_ids=[1])
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 300
    bos = tok.bos_token_id
    assert bos == 0
    assert tok.eos_token_ids == (3, 1)  # <|im_end|> from the tokenizer, then </s> from the config

    ids = tok.encode("hello world")
    assert ids[0] == bos
    assert tok.decode(ids) == "hello world"
    assert tok.encode("hello world", add_special_tokens=False) == ids[1:]

    msgs = [{"role": "user", "content": "the lazy dog"}]
    text = tok.apply_chat_template(msgs)
    assert text == "<s><|im_start|>user\nthe lazy dog<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = tok.encode_chat(msgs)
    assert chat_ids[:2] == [0, 2]  # <s> once (from the template), <|im_start|> as its id
    assert chat_ids.count(0) == 1 and chat_ids.count(3) == 1
    assert tok.decode(chat_ids, skip_special_tokens=False) == text

    # unknown ids render like the byte tokenizer's, between correctly decoded runs
    mixed = tok.decode([*ids[1:], 5000, *ids[1:]])
    assert mixed == "hello world" + unknown_id_text(5000) + "hello world"

    dec = IncrementalDecoder(tok)
    streamed = "".join(dec.push([t]) for t in ids) + dec.flush()
    assert streamed == "hello world"


def test_hf_tokenizer_generation_config_eos_and_missing_template(tmp_path: Path) -> None:
    write_hf_tokenizer(tmp_path, chat_template=None)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    tok = HFTokenizer(tmp_path)
    assert tok.eos_token_ids == (3, 1)
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_hf_tokenizer_template_refusal_is_a_value_error(tmp_path: Path) -> None:
    strict = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('system messages are not supported') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    write_hf_tokenizer(tmp_path, chat_template=strict)
    tok = HFTokenizer(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], False) == "hi"
    with pytest.raises(ValueError, match="system messages are not supported"):
        tok.apply_chat_template([{"role": "system", "content": "be brief"}])


def test_hf_tokenizer_requires_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        HFTokenizer(tmp_path)


# ---------------------------------------------------------------- engine detokenizer


class FullDecodeDetokenizer:
    """The detokenizer as it was: re-decode the whole output every step (the reference)."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.text, self.num_released = "", 0
        self.stopped_by: str | None = None
        self.max_stop_len = max((len(s) for s in stop), default=0)

    def update(self, output_ids: list[int], is_final: bool) -> str:
        if self.stopped_by is not None:
            return ""
        prev_len = len(self.text)
        self.text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        if self.stop:
            search_from = max(0, min(prev_len, self.num_released) - self.max_stop_len)
            hits = [(p, s) for s in self.stop if (p := self.text.find(s, search_from)) != -1]
            if hits:
                pos, s = min(hits)
                self.text, self.stopped_by, is_final = self.text[:pos], s, True
        end = len(self.text)
        if not is_final:
            while end > self.num_released and self.text[end - 1] == "\ufffd":
                end -= 1
            end = max(self.num_released, end - max(0, self.max_stop_len - 1))
        delta = self.text[self.num_released:end]
        self.num_released = end
        return delta


MULTIBYTE = "aé✓€ 😀 日本語 ü\n"


def random_output(rng: random.Random, tok: Tokenizer, length: int) -> list[int]:
    """Whole multi-byte characters, stray bytes (invalid UTF-8), specials and unknown ids."""
    ids: list[int] = []
    while len(ids) < length:
        r = rng.random()
        if r < 0.6:
            ids.extend(tok.encode(rng.choice(MULTIBYTE) * rng.randint(1, 2), add_special_tokens=False))
        elif r < 0.75:
            ids.append(rng.randrange(0x80, 0x100))  # a continuation or lead byte alone
        elif r < 0.85:
            ids.append(rng.randrange(tok.vocab_size))
        elif r < 0.95:
            ids.append(tok.vocab_size + rng.randrange(1000))  # rendered as one ASCII character
        else:
            ids.extend(tok.encode("<|im_end|>", add_special_tokens=False))
    return ids[:length]


def check_same_as_full_decode(tok: Tokenizer, ids: list[int], stop: tuple[str, ...], chunks: list[int]) -> str:
    """Feed `ids` in `chunks` to both detokenizers; every step's delta must match."""
    new, ref = IncrementalDetokenizer(tok, stop), FullDecodeDetokenizer(tok, stop)
    out, n = [], 0
    for i, size in enumerate(chunks):
        n = min(len(ids), n + size)
        final = i == len(chunks) - 1 or n == len(ids)
        got, want = new.update(ids[:n], final), ref.update(ids[:n], final)
        assert got == want, (i, n, ids[:n], stop)
        assert new.stopped_by == ref.stopped_by
        out.append(got)
        if final or new.stopped_by is not None:
            break
    assert new.num_released == ref.num_released
    return "".join(out)


@pytest.mark.parametrize("seed", range(40))
def test_detokenizer_matches_full_decode_on_random_byte_outputs(seed: int) -> None:
    rng = random.Random(seed)
    tok = ByteTokenizer()
    ids = random_output(rng, tok, rng.randint(1, 120))
    full = tok.decode(ids)
    stop: tuple[str, ...] = ()
    if seed % 4 and len(full) > 3:  # stop strings cut from the text, multi-byte ones included
        a = rng.randrange(len(full) - 2)
        stop = (full[a:a + rng.randint(1, 3)], rng.choice(["✓€", "日本", "zz", "😀 "]))
    chunks = [rng.choice([1, 1, 1, 2, 5]) for _ in range(len(ids))]
    text = check_same_as_full_decode(tok, ids, stop, chunks)
    if not stop:
        assert text == full


def test_detokenizer_releases_a_split_character_whole_and_stops_inside_multibyte_text() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("x日本語y", add_special_tokens=False)  # 1 + 3 * 3 + 1 bytes
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.update(ids[:n], is_final=False) for n in range(1, len(ids) + 1)]
    assert deltas == ["x", "", "", "日", "", "", "本", "", "", "語", "y"]

    detok = IncrementalDetokenizer(tok, stop=("本語",))
    released = [detok.update(ids[:n], is_final=False) for n in range(1, len(ids) + 1)]
    assert "".join(released) == "x日" and detok.stopped_by == "本語"
    assert detok.update(ids, is_final=True) == ""


def test_detokenizer_looks_for_stop_strings_only_past_min_tokens() -> None:
    """As vLLM's: no stop string ends an output of at most `min_tokens` ids; one that
    lies in their text is passed over, a later one stops it."""
    tok = ByteTokenizer()
    ids = tok.encode("ab.cd.ef", add_special_tokens=False)
    for min_tokens, text in ((0, "ab"), (3, "ab.cd"), (6, "ab.cd.ef")):
        detok = IncrementalDetokenizer(tok, stop=(".",), min_tokens=min_tokens)
        released = [detok.update(ids[:n], is_final=n == len(ids)) for n in range(1, len(ids) + 1)]
        assert "".join(released) == text, min_tokens
        assert detok.stopped_by == ("." if text != "ab.cd.ef" else None)
    # A character that the first min_tokens ids leave split is new text once whole.
    ids = tok.encode("éx", add_special_tokens=False)  # é: two byte tokens
    detok = IncrementalDetokenizer(tok, stop=("é",), min_tokens=1)
    released = [detok.update(ids[:n], is_final=n == len(ids)) for n in range(1, len(ids) + 1)]
    assert "".join(released) == "" and detok.stopped_by == "é"


def test_detokenizer_matches_full_decode_with_hf_byte_level_bpe(tmp_path: Path) -> None:
    write_hf_tokenizer(tmp_path)
    tok = HFTokenizer(tmp_path)
    rng = random.Random(7)
    for _ in range(10):
        ids = tok.encode("the lazy dog ✓ hello wörld 日本 fox", add_special_tokens=False)
        ids = [t if rng.random() < 0.8 else rng.randrange(tok.vocab_size + 10) for t in ids]
        text = check_same_as_full_decode(tok, ids, (), [1] * len(ids))
        assert text == tok.decode(ids)


def test_detokenizer_decodes_a_bounded_window_per_step() -> None:
    class Counting(ByteTokenizer):
        def __init__(self) -> None:
            super().__init__()
            self.decoded = 0

        def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
            self.decoded += len(ids)
            return super().decode(ids, skip_special_tokens)

    tok = Counting()
    ids = tok.encode("é✓ab" * 500, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=("never",))
    for n in range(1, len(ids) + 1):
        detok.update(ids[:n], is_final=False)
    assert tok.decoded < 6 * len(ids)  # a full decode per step would be ~len(ids)**2 / 2


TOOL_USE_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|im_start|>tools\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}<call>{{ c.function.name }}"
    "({{ c.function.arguments | tojson }})</call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, TOOL_USE_TEMPLATE])
def test_hf_tokenizer_matches_transformers(tmp_path: Path, template: str) -> None:
    """The torch-free tokenizer gives what transformers' own gives the same folder."""
    from transformers import AutoTokenizer

    write_hf_tokenizer(tmp_path, chat_template=template)
    ours, ref = HFTokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert (ours.vocab_size, ours.bos_token_id) == (len(ref), ref.bos_token_id)
    assert ours.eos_token_ids == (ref.eos_token_id,)
    texts = ["hello world", "the lazy dog , ok <|im_end|>", "<s> x\n\u00e9\u4e2d <|im_start|>", ""]
    for text in texts:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special)
            for skip in (True, False):
                assert ours.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": "\u00e9"}}}
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "the fox <|im_end|>"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    for with_tools in (None, tools):
        for gen in (True, False):
            want = ref.apply_chat_template(
                messages, tools=with_tools, add_generation_prompt=gen, tokenize=False
            )
            assert ours.apply_chat_template(messages, gen, with_tools) == want


def test_hf_tokenizer_templates_from_files_and_by_name(tmp_path: Path) -> None:
    """chat_template.jinja overrides the config's; with tools, ``tool_use`` is chosen."""
    write_hf_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("A{{ messages[0]['content'] }}")
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("T{{ tools | length }}")
    tok = HFTokenizer(tmp_path)
    msgs = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(msgs) == "Ax"
    assert tok.apply_chat_template(msgs, tools=[{"type": "function"}]) == "T1"
