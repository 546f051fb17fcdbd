"""Generated answers sent back in chat history keep their generated ids
(kvduplex.common.openai.transcript, through openai.prompt), with a byte-level BPE built here and
ChatML- and Llama-3-style templates."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvduplex.common.openai.prompt import answer_placements
from kvduplex.common.openai.prompt import prompt_token_ids
from kvduplex.common.openai.prompt import template_messages
from kvduplex.common.openai.protocol import ChatCompletionRequest
from kvduplex.common.openai.transcript import AnswerBook
from kvduplex.common.openai.transcript import AnswerRecord
from kvduplex.common.openai.transcript import MessageAccumulator
from kvduplex.common.openai.transcript import message_key
from kvduplex.common.openai.transcript import splice_chat_ids
from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.common.tokenizer import HFTokenizer

CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
THINKING = (  # renders reasoning only where a message carries it (as Qwen3 does for the last turn)
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}</think>{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<s>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>"]  # fmt: skip


def _bpe(folder: Path, template: str, eos: str) -> HFTokenizer:
    """A byte-level BPE trained on a few sentences, with `template` and `eos`."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders
    from tokenizers import models
    from tokenizers import pre_tokenizers
    from tokenizers import trainers

    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(
        ["the quick brown fox jumps over the lazy dog", "hello world", "paged attention"] * 3,
        trainer,
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": eos, "chat_template": template}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return HFTokenizer(folder)


def _single_pieces(tok: HFTokenizer, text: str) -> list[int]:
    """`text` as one token per byte-level character: how a model may generate it, never how
    the tokenizer encodes it (its merges join them)."""
    ids = [tok.encode(ch, add_special_tokens=False) for ch in text]
    assert all(len(i) == 1 for i in ids)
    return [i[0] for i in ids]


def count_renders(tok: HFTokenizer) -> Callable[[], int]:
    """Count `tok`'s chat template renders from now on; the count so far, when called."""
    return count_calls(tok, "apply_chat_template")


def count_calls(obj: Any, method: str) -> Callable[[], int]:
    """Count calls of `obj`'s `method` from now on; the count so far, when called."""
    num = 0
    call = getattr(obj, method)

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal num
        num += 1
        return call(*args, **kwargs)

    setattr(obj, method, counting)
    return lambda: num


def _chat(messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages})


@pytest.mark.parametrize(
    ("template", "eos"), [(CHATML, "<|im_end|>"), (LLAMA3, "<|eot_id|>")], ids=["chatml", "llama3"]
)
def test_an_answer_sent_back_unchanged_keeps_its_generated_ids(
    tmp_path: Path, template: str, eos: str
) -> None:
    tok = _bpe(tmp_path, template, eos)
    eos_id = tok.encode(eos, add_special_tokens=False)[0]
    first = [{"role": "user", "content": "hello world"}]
    prompt1 = prompt_token_ids(_chat(first), tok)
    answer = "the quick brown fox"
    generated = [*_single_pieces(tok, answer), eos_id]  # as the model emitted it, end of turn too
    assert tok.encode(answer, add_special_tokens=False) != generated[:-1]  # re-encoding differs
    book = AnswerBook()
    book.add(AnswerRecord(tuple(generated), {"role": "assistant", "content": answer}), now=0.0)

    second = [
        *first,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "paged"},
    ]
    spliced = prompt_token_ids(_chat(second), tok, book)
    # Token for token: the previous prompt, the answer as generated, then the new turn.
    assert spliced[: len(prompt1) + len(generated)] == prompt1 + generated
    text = tok.apply_chat_template(second)
    assert tok.decode(spliced, skip_special_tokens=False) == text
    plain = prompt_token_ids(_chat(second), tok)
    assert plain != spliced and tok.decode(plain, skip_special_tokens=False) == text

    # The third turn continues the second's prompt exactly (its answer spliced too).
    answer2 = "lazy dog"
    generated2 = _single_pieces(tok, answer2)  # cut by max_tokens: no end of turn
    book.add(AnswerRecord(tuple(generated2), {"role": "assistant", "content": answer2}), now=1.0)
    third = [*second, {"role": "assistant", "content": answer2}, {"role": "user", "content": "x"}]
    ids3 = prompt_token_ids(_chat(third), tok, book)
    assert ids3[: len(spliced) + len(generated2)] == spliced + generated2
    assert tok.decode(ids3, skip_special_tokens=False) == tok.apply_chat_template(third)
    # Heads remembered from the turns before (`HeadCache`) change nothing.
    msgs = template_messages(_chat(third).messages)
    placements = answer_placements(_chat(third).messages, book, 1.0)
    assert splice_chat_ids(tok, msgs, None, placements) == ids3


def test_an_edited_answer_is_rendered_as_usual(tmp_path: Path) -> None:
    tok = _bpe(tmp_path, CHATML, "<|im_end|>")
    answer = "the quick brown fox"
    book = AnswerBook()
    book.add(
        AnswerRecord(tuple(_single_pieces(tok, answer)), {"role": "assistant", "content": answer}),
        now=0.0,
    )
    edited = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the quick fox"},
              {"role": "user", "content": "more"}]  # fmt: skip
    assert prompt_token_ids(_chat(edited), tok, book) == prompt_token_ids(_chat(edited), tok)
    # A record whose ids are not the text sent back is never placed, even under its key.
    wrong = AnswerBook()
    wrong.add(
        AnswerRecord(tuple(_single_pieces(tok, "the lazy dog")),
                     {"role": "assistant", "content": answer}), now=0.0,
    )  # fmt: skip
    same = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": answer},
            {"role": "user", "content": "more"}]  # fmt: skip
    assert prompt_token_ids(_chat(same), tok, wrong) == prompt_token_ids(_chat(same), tok)


def test_stripped_reasoning_splices_the_ids_after_it(tmp_path: Path) -> None:
    tok = _bpe(tmp_path, THINKING, "<|im_end|>")
    eos_id = tok.encode("<|im_end|>", add_special_tokens=False)[0]
    reasoning, content = "paged attention", "hello world"
    think = tok.encode("<think>", add_special_tokens=False)
    end_think = tok.encode("</think>", add_special_tokens=False)
    reasoning_ids = [*think, *_single_pieces(tok, reasoning), *end_think]
    content_ids = [*_single_pieces(tok, content), eos_id]
    returned = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    book = AnswerBook()
    book.add(AnswerRecord((*reasoning_ids, *content_ids), returned, len(reasoning_ids)), now=0.0)
    user = {"role": "user", "content": "q"}
    # Sent back with its reasoning: the whole answer as generated.
    full = [user, returned, user]
    placements = [book.place(m, 0.0) if m["role"] == "assistant" else None for m in full]
    ids = splice_chat_ids(tok, full, None, placements)
    assert ids is not None
    head = tok.encode(tok.apply_chat_template([user]), add_special_tokens=False)
    assert (
        ids[: len(head) + len(reasoning_ids) + len(content_ids)]
        == head + reasoning_ids + content_ids
    )
    # Reasoning stripped by the client: the content's ids where the template puts the content.
    stripped = [user, {"role": "assistant", "content": content}, user]
    placements = [book.place(m, 0.0) if m["role"] == "assistant" else None for m in stripped]
    ids = splice_chat_ids(tok, stripped, None, placements)
    assert ids is not None and ids[len(head) : len(head) + len(content_ids)] == content_ids
    assert tok.decode(ids, skip_special_tokens=False) == tok.apply_chat_template(stripped)


def test_byte_tokenizer_unknown_ids_and_hidden_specials_are_kept() -> None:
    """The byte presets: ids past the tokenizer's vocabulary show as stand-in characters,
    and special tokens inside an answer show as nothing; both re-encode to other ids."""
    tok = ByteTokenizer()
    generated = (104, 300, tok.IM_START_ID, 105, tok.IM_END_ID)  # "h", unknown, hidden, "i", eos
    content = tok.decode(generated)  # what the client was given
    book = AnswerBook()
    book.add(AnswerRecord(generated, {"role": "assistant", "content": content}), now=0.0)
    first = [{"role": "user", "content": "q"}]
    msgs = [*first, {"role": "assistant", "content": content}, {"role": "user", "content": "r"}]
    prompt1 = prompt_token_ids(_chat(first), tok)
    ids = prompt_token_ids(_chat(msgs), tok, book)
    assert ids[: len(prompt1) + len(generated)] == prompt1 + list(generated)
    assert ids[len(prompt1) + len(generated) :] == tok.encode(
        "\n<|im_start|>user\nr<|im_end|>\n<|im_start|>assistant\n", False
    )


def test_tool_call_answers_are_keyed_by_what_was_returned() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    returned = {"role": "assistant", "content": None, "tool_calls": [call]}
    sent = _chat([{"role": "user", "content": "q"}, returned]).messages[1]
    assert message_key(sent.model_dump(exclude_none=True)) == message_key(returned)
    other = {**call, "function": {"name": "f", "arguments": '{"a": 2}'}}
    assert message_key({**returned, "tool_calls": [other]}) != message_key(returned)
    acc = MessageAccumulator()
    acc.add_delta({"role": "assistant", "content": None})
    acc.add_delta(
        {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": '{"a"'}}]}
    )
    acc.add_delta({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]})
    assert message_key(acc.message()) == message_key(returned)


def test_book_bounds_and_owners() -> None:
    book = AnswerBook(max_answers=2, max_tokens=10, ttl_s=5.0)
    for i in range(3):
        book.add(AnswerRecord((1, 2, 3), {"content": f"a{i}"}), now=float(i), owner="s")
    assert len(book) == 2 and book.place({"content": "a0"}, 2.0) is None
    book.add(AnswerRecord(tuple(range(8)), {"content": "big"}), now=2.0, owner="t")
    assert book.num_tokens <= 10
    assert book.place({"content": "big"}, 2.0) is not None
    assert book.place({"content": "big"}, 8.0) is None  # past the TTL
    book.add(AnswerRecord((1,), {"content": "x"}), now=9.0, owner="u")
    book.drop_owner("u")
    assert book.place({"content": "x"}, 9.0) is None and len(book) == 0


TOOLS_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_tool_call_answer_sent_back_as_parsed_keeps_its_ids(tmp_path: Path) -> None:
    """The answer's text was parsed into a tool call (content ""); the client sends the
    call back as it got it, content null: the template renders the call as the model wrote
    it, so the generated ids go back in."""
    tok = _bpe(tmp_path, TOOLS_CHATML, "<|im_end|>")
    eos_id = tok.encode("<|im_end|>", add_special_tokens=False)[0]
    written = '<tool_call>{"name": "ls", "arguments": {"path": "/tmp"}}</tool_call>'
    generated = [*_single_pieces(tok, written), eos_id]
    call = {"id": "call_1", "type": "function",
            "function": {"name": "ls", "arguments": '{"path": "/tmp"}'}}  # fmt: skip
    book = AnswerBook()
    book.add(AnswerRecord(tuple(generated), {"role": "assistant", "content": "",
                                             "tool_calls": [call]}), now=0.0)  # fmt: skip
    first = [{"role": "user", "content": "list"}]
    msgs = [*first, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "a b"}]  # fmt: skip
    prompt1 = prompt_token_ids(_chat(first), tok)
    ids = prompt_token_ids(_chat(msgs), tok, book)
    assert ids[: len(prompt1) + len(generated)] == prompt1 + generated
    assert tok.decode(ids, skip_special_tokens=False) == tok.apply_chat_template(
        template_messages(_chat(msgs).messages)
    )


def _calls_template(head: str, end: str) -> str:
    """A template that renders a past call its own way (never the text the model wrote)."""
    return (
        "{{ bos_token }}{% for m in messages %}" + head.replace("ROLE", "{{ m['role'] }}")
        + "{% if m.get('tool_calls') %}<tool_calls>{{ m['tool_calls'] | tojson }}</tool_calls>"
        "{% else %}{{ m['content'] }}{% endif %}" + end + "{% endfor %}"
        "{% if add_generation_prompt %}" + head.replace("ROLE", "assistant") + "{% endif %}"
    )


CALLS_CHATML = _calls_template("<|im_start|>ROLE\n", "<|im_end|>\n")
CALLS_LLAMA3 = _calls_template("<|start_header_id|>ROLE<|end_header_id|>\n\n", "<|eot_id|>")


@pytest.mark.parametrize(
    ("template", "eos"),
    [(CALLS_CHATML, "<|im_end|>"), (CALLS_LLAMA3, "<|eot_id|>")],
    ids=["chatml", "llama3"],
)
def test_a_forced_call_sent_back_unchanged_keeps_its_generated_ids(
    tmp_path: Path, template: str, eos: str
) -> None:
    """The grammar made the model write ``[{"name": ..., "parameters": ...}]``; the template
    renders the call otherwise. Sent back as returned (parallel calls, the router's ids),
    the next prompt is the previous prompt + the generated ids + the template's end of turn
    and what follows; an edited call is rendered as usual."""
    tok = _bpe(tmp_path, template, eos)
    eos_id = tok.encode(eos, add_special_tokens=False)[0]
    written = '[{"name": "ls", "parameters": {"path": "/tmp"}}, {"name": "ls", "parameters": {}}]'
    generated = [*_single_pieces(tok, written), eos_id]
    calls = [
        {"id": "chatcmpl-tool-1", "type": "function",
         "function": {"name": "ls", "arguments": '{"path": "/tmp"}'}},
        {"id": "chatcmpl-tool-2", "type": "function", "function": {"name": "ls", "arguments": "{}"}},
    ]  # fmt: skip
    book = AnswerBook()
    returned = {"role": "assistant", "content": "", "tool_calls": calls}
    book.add(AnswerRecord(tuple(generated), returned), now=0.0)
    first = [{"role": "user", "content": "list"}]
    prompt1 = prompt_token_ids(_chat(first), tok)
    tools = [{"role": "tool", "tool_call_id": c["id"], "content": "a b"} for c in calls]
    second = [*first, {"role": "assistant", "content": None, "tool_calls": calls}, *tools]
    ids = prompt_token_ids(_chat(second), tok, book)
    assert ids[: len(prompt1) + len(generated)] == prompt1 + generated
    rest = tok.apply_chat_template(template_messages(_chat(second).messages))
    rest = rest[rest.index("</tool_calls>") + len("</tool_calls>") + len(eos) :]
    assert tok.decode(ids[len(prompt1) + len(generated) :], skip_special_tokens=False) == rest

    # The next turn continues this prompt exactly (the earlier call spliced too).
    book.add(AnswerRecord(tuple(generated), {**returned, "tool_calls": calls[:1]}), now=1.0)
    third = [*second, {"role": "assistant", "content": None, "tool_calls": calls[:1]},
             tools[0]]  # fmt: skip
    ids3 = prompt_token_ids(_chat(third), tok, book)
    assert ids3[: len(ids) + len(generated)] == ids + generated

    plain = prompt_token_ids(_chat(second), tok)
    text = tok.apply_chat_template(template_messages(_chat(second).messages))
    assert tok.decode(plain, skip_special_tokens=False) == text
    edits = [
        {**calls[0], "function": {"name": "ls", "arguments": '{"path": "/"}'}},  # arguments
        {**calls[0], "id": "call_x"},  # id
    ]
    for edited in edits:
        changed = [*first, {"role": "assistant", "content": None, "tool_calls": [edited, calls[1]]},
                   *tools]  # fmt: skip
        got = prompt_token_ids(_chat(changed), tok, book)
        assert got == prompt_token_ids(_chat(changed), tok)
    with_content = [*first, {"role": "assistant", "content": "ok", "tool_calls": calls}, *tools]
    assert prompt_token_ids(_chat(with_content), tok, book) == prompt_token_ids(
        _chat(with_content), tok
    )


@pytest.mark.parametrize(
    ("template", "eos"),
    [(CALLS_CHATML, "<|im_end|>"), (CALLS_LLAMA3, "<|eot_id|>")],
    ids=["chatml", "llama3"],
)
def test_an_agent_loops_renders_do_not_grow_with_its_turns(
    tmp_path: Path, template: str, eos: str
) -> None:
    """A long tool loop (forced calls sent back, tool results, content answers, stripped
    reasoning): once the book has seen a turn's heads, the next turn renders the template a
    fixed number of times, however many calls and answers it places, and builds the very
    ids that a book without remembered heads builds."""
    tok = _bpe(tmp_path, template, eos)
    eos_id = tok.encode(eos, add_special_tokens=False)[0]
    renders = count_renders(tok)
    book = AnswerBook()
    records: list[AnswerRecord] = []
    messages: list[dict[str, Any]] = [{"role": "user", "content": "fix the build"}]
    per_turn = []
    for turn in range(12):
        before = renders()
        ids = prompt_token_ids(_chat(messages), tok, book, now=float(turn))
        per_turn.append(renders() - before)
        fresh = AnswerBook()  # the same records, no heads remembered
        for record in records:
            fresh.add(record, now=float(turn))
        assert prompt_token_ids(_chat(messages), tok, fresh, now=float(turn)) == ids, turn
        if turn % 3 == 0:  # a forced call, sent back as returned
            args = json.dumps({"path": f"/tmp/{turn}"})
            call = {"id": f"call-{turn}", "type": "function",
                    "function": {"name": "ls", "arguments": args}}  # fmt: skip
            written = json.dumps([{"name": "ls", "parameters": {"path": f"/tmp/{turn}"}}])
            records.append(AnswerRecord(tuple([*_single_pieces(tok, written), eos_id]),
                                        {"role": "assistant", "content": "", "tool_calls": [call]}))
            book.add(records[-1], now=float(turn))
            messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": call["id"], "content": "a b"}]  # fmt: skip
        else:  # a content answer; every other one loses its reasoning on the way back
            text = "hello world"
            reasoning = "the lazy dog" if turn % 3 == 2 else ""
            thought = _single_pieces(tok, reasoning) if reasoning else []
            returned = {"role": "assistant", "content": text, "reasoning_content": reasoning or None}
            records.append(AnswerRecord(tuple([*thought, *_single_pieces(tok, text), eos_id]),
                                        returned, num_reasoning_ids=len(thought)))
            book.add(records[-1], now=float(turn))
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": f"step {turn}"}]  # fmt: skip
    assert max(per_turn[1:]) <= 6, per_turn  # 12 turns: 11 answers placed in the last
