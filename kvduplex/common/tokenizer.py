"""Tokenizers: a Hugging Face folder's own, or a built-in byte-level one.

Both subclass the `Tokenizer` protocol, which implements `encode_chat` for
them; neither imports torch (the router loads them too). Conventions follow transformers: ``apply_chat_template`` returns the
prompt string (the template adds BOS if the model wants one), and `encode_chat`
encodes it without adding special tokens again. Special-token strings inside
a text (``<|im_start|>``) encode as their ids. Messages reach the template as
transformers passes them: ``role`` and string ``content``, plus ``tool_calls``
(assistant) and ``tool_call_id`` (tool) when present; ``tools`` is the
request's list of OpenAI tool definitions.

Ids the tokenizer does not know. A model's vocabulary is often larger than its
tokenizer's (padded embeddings; presets with random weights sample anywhere in
it). `decode` maps every id ``>= vocab_size`` to one printable ASCII character,
``chr(32 + id % 95)``: deterministic, harmless in any output channel, and one
visible character per token. Negative ids raise ValueError.

Streaming: `decode` is a pure function of the id list, so decoding a growing
list is always consistent; `IncrementalDecoder` turns that into text deltas
that never end inside a multi-byte character.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from typing import Protocol
from typing import runtime_checkable

from kvduplex.common.chat_template import ChatTemplates
from kvduplex.common.chat_template import read_chat_templates

_REPLACEMENT = "\ufffd"

Messages = list[dict[str, Any]]
"""A conversation as transformers passes it to a chat template (see the module docstring)."""
Tools = list[dict[str, Any]] | None
"""The request's OpenAI tool definitions, if any."""


def unknown_id_text(token_id: int) -> str:
    """What `decode` renders for an id outside the tokenizer's vocabulary."""
    return chr(32 + token_id % 95)


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine and the server need from a tokenizer.

    A subclass sets the three attributes and implements `encode`, `_decode_known`
    and `_chat_text`; `decode`, `apply_chat_template` and `encode_chat` are
    implemented here for it.
    """

    vocab_size: int
    """Ids ``[0, vocab_size)`` are known (special tokens included)."""
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    """Every id that ends a generation."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, the BOS (etc.) the model expects."""
        ...

    def _decode_known(self, ids: list[int], skip_special_tokens: bool) -> str:
        """Text of a run of ids that are all in ``[0, vocab_size)``."""
        ...

    def _chat_text(self, messages: Messages, add_generation_prompt: bool, tools: Tools) -> str:
        """`apply_chat_template` once the messages are checked."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; unknown ids as `unknown_id_text`; ValueError for a negative id."""
        pieces: list[str] = []
        run: list[int] = []
        for t in ids:
            t = int(t)
            if t < 0:
                raise ValueError(f"token id must be >= 0, got {t}")
            if t < self.vocab_size:
                run.append(t)
                continue
            if run:
                pieces.append(self._decode_known(run, skip_special_tokens))
                run = []
            pieces.append(unknown_id_text(t))
        if run:
            pieces.append(self._decode_known(run, skip_special_tokens))
        return "".join(pieces)

    def apply_chat_template(
        self, messages: Messages, add_generation_prompt: bool = True, tools: Tools = None
    ) -> str:
        """The prompt string of a conversation (and the tools it may call); ValueError if
        the messages are malformed, the model has no template or the template refuses them."""
        _check_messages(messages)
        return self._chat_text(messages, add_generation_prompt, tools)

    def encode_chat(
        self, messages: Messages, add_generation_prompt: bool = True, tools: Tools = None
    ) -> list[int]:
        """Token ids of `apply_chat_template` (no special tokens added on top)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools), False)


def _check_messages(messages: list[dict[str, Any]]) -> None:
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(
            m.get("content"), str
        ):
            raise ValueError(f"message {i} must be a dict with string 'role' and 'content'")
        if not isinstance(m.get("tool_calls", []), list):
            raise ValueError(f"message {i}: 'tool_calls' must be a list")


class ByteTokenizer(Tokenizer):
    """Bytes 0..255 are ids 0..255; a handful of special tokens follow.

    Chat template (ChatML with a leading BOS)::

        <|bos|><|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n

    Tools, tool calls and tool results render as JSON in plain text (the
    vocabulary has no tool tokens); a conversation without them renders as above::

        <|bos|><|im_start|>tools\\n[{"type": "function", "function": {...}}]<|im_end|>\\n
        <|im_start|>assistant\\n<tool_calls>[{"id": "c1", "name": "f", "arguments": {...}}]</tool_calls><|im_end|>\\n
        <|im_start|>tool\\n<tool_call_id>c1</tool_call_id>42<|im_end|>\\n
    """

    BOS_ID = 256
    EOS_ID = 257
    IM_START_ID = 258
    IM_END_ID = 259
    PAD_ID = 260
    EOS_IDS: tuple[int, ...] = (EOS_ID, IM_END_ID)
    SPECIAL_TOKENS: tuple[str, ...] = ("<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|pad|>")

    def __init__(self) -> None:
        self.vocab_size = 256 + len(self.SPECIAL_TOKENS)
        self.bos_token_id = self.BOS_ID
        self.eos_token_ids = self.EOS_IDS
        self._special_ids = {tok: 256 + i for i, tok in enumerate(self.SPECIAL_TOKENS)}
        self._split = re.compile("(" + "|".join(re.escape(t) for t in self.SPECIAL_TOKENS) + ")")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.BOS_ID] if add_special_tokens else []
        for part in self._split.split(text):
            special = self._special_ids.get(part)
            if special is not None:
                ids.append(special)
            elif part:
                ids.extend(part.encode("utf-8"))
        return ids

    def _decode_known(self, ids: list[int], skip_special_tokens: bool) -> str:
        pieces: list[str] = []
        pending = bytearray()
        for t in ids:
            if t < 256:
                pending.append(t)
                continue
            if pending:
                pieces.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
            if not skip_special_tokens:
                pieces.append(self.SPECIAL_TOKENS[t - 256])
        if pending:
            pieces.append(pending.decode("utf-8", errors="replace"))
        return "".join(pieces)

    def _chat_text(self, messages: Messages, add_generation_prompt: bool, tools: Tools) -> str:
        parts = ["<|bos|>"]
        if tools:
            parts.append(f"<|im_start|>tools\n{json.dumps(tools, ensure_ascii=False)}<|im_end|>\n")
        parts.extend(f"<|im_start|>{m['role']}\n{_byte_content(m)}<|im_end|>\n" for m in messages)
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)


def _byte_content(message: dict[str, Any]) -> str:
    """A message's text in the byte tokenizer's template, tool calls and result ids included."""
    text = str(message["content"])
    if message.get("tool_call_id") is not None:
        text = f"<tool_call_id>{message['tool_call_id']}</tool_call_id>{text}"
    calls = message.get("tool_calls")
    if calls:
        rendered = [
            {"id": c.get("id"), **{k: c["function"][k] for k in ("name", "arguments")}}
            for c in calls
        ]
        text += f"<tool_calls>{json.dumps(rendered, ensure_ascii=False)}</tool_calls>"
    return text


class HFTokenizer(Tokenizer):
    """A Hugging Face folder's tokenizer: tokenizer.json run by `tokenizers`, the chat
    template rendered as transformers renders it (`chat_template`); torch-free.

    Read as transformers' fast tokenizer reads the folder: special tokens by name from
    ``tokenizer_config.json`` (overridden by ``special_tokens_map.json``), ``len`` counting
    added tokens, BOS and the like added by tokenizer.json's post-processor, and
    ``clean_up_tokenization_spaces`` applied on decode where the config asks for it.
    Not read: transformers' per-class overrides of that post-processor (a Llama
    tokenizer_config's ``add_bos_token``/``add_eos_token`` that disagree with its
    tokenizer.json), and slow (sentencepiece-only) tokenizers.
    """

    def __init__(self, folder: str | Path, extra_eos_token_ids: Sequence[int] = ()) -> None:
        """Load from `folder`; `extra_eos_token_ids` (e.g. config.json's) also end generation.

        EOS ids are the union of the tokenizer's eos token, `extra_eos_token_ids`
        and ``generation_config.json``'s ``eos_token_id`` when present.
        """
        from tokenizers import Tokenizer as RustTokenizer

        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(f"{folder} has no tokenizer.json; only fast (tokenizers) files are supported")
        self._folder = folder
        self._tok = RustTokenizer.from_file(str(folder / "tokenizer.json"))
        config = _read_json(folder / "tokenizer_config.json")
        specials = _special_tokens({**config, **_read_json(folder / "special_tokens_map.json")})
        self._clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._id_of(specials.get("bos_token"))
        eos: list[int] = []
        eos_id = self._id_of(specials.get("eos_token"))
        if eos_id is not None:
            eos.append(eos_id)
        eos.extend(int(e) for e in extra_eos_token_ids)
        eos.extend(_generation_eos(folder))
        self.eos_token_ids = tuple(dict.fromkeys(eos))
        self._templates = ChatTemplates(read_chat_templates(folder, config), specials)

    def _id_of(self, token: object) -> int | None:
        if not isinstance(token, str):
            return None
        token_id = self._tok.token_to_id(token)
        return None if token_id is None else int(token_id)

    @property
    def folder(self) -> Path:
        """The Hugging Face folder this tokenizer was read from."""
        return self._folder

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def _decode_known(self, ids: list[int], skip_special_tokens: bool) -> str:
        text = str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))
        return _clean_up_spaces(text) if self._clean_up_spaces else text

    def _chat_text(self, messages: Messages, add_generation_prompt: bool, tools: Tools) -> str:
        if not self._templates:
            raise ValueError("this model's tokenizer has no chat template; send a plain prompt")
        return self._templates.render(messages, add_generation_prompt, tools)


_SPECIAL_TOKEN_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip


def _special_tokens(config: dict[str, Any]) -> dict[str, Any]:
    """The special tokens by name as a chat template sees them (their text; a token saved
    as an AddedToken object gives its ``content``)."""
    out: dict[str, Any] = {}
    for name in _SPECIAL_TOKEN_NAMES:
        text = _token_text(config.get(name))
        if text is not None:
            out[name] = text
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list):
        texts = [_token_text(t) for t in extra]
        out["additional_special_tokens"] = [t for t in texts if t is not None]
    return out


def _token_text(token: object) -> str | None:
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _clean_up_spaces(text: str) -> str:
    """transformers' ``clean_up_tokenization``: no space before punctuation and clitics."""
    for before, after in (
        (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
        (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
    ):  # fmt: skip
        text = text.replace(before, after)
    return text


def _generation_eos(folder: Path) -> list[int]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]


class IncrementalDecoder:
    """Text deltas of a growing id list, for streaming.

    Each `push` returns only new text; a delta never ends in an incomplete
    character (U+FFFD is held back until the next ids complete it, or until
    `flush`). Decoding restarts a few tokens back (``prefix_offset``), so
    tokenizers whose pieces depend on their left neighbour (leading spaces)
    still produce the text a full decode would.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        context_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        """`context_ids` (e.g. the prompt) are decoded as left context only, never emitted."""
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(context_ids[-6:])
        self._prefix_offset = max(len(self._ids) - 5, 0)
        self._read_offset = len(self._ids)

    def push(self, new_ids: Sequence[int]) -> str:
        """Append `new_ids`; return the text they complete (possibly "")."""
        self._ids.extend(int(t) for t in new_ids)
        prefix = self._tok.decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        text = self._tok.decode(self._ids[self._prefix_offset:], self._skip)
        if len(text) <= len(prefix) or text.endswith(_REPLACEMENT):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return text[len(prefix):]

    def flush(self) -> str:
        """Whatever is still held back (at the end of a generation)."""
        prefix = self._tok.decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        text = self._tok.decode(self._ids[self._prefix_offset:], self._skip)
        self._prefix_offset = self._read_offset = len(self._ids)
        return text[len(prefix):] if len(text) > len(prefix) else ""
