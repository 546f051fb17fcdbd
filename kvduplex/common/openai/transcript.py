"""Generated answers sent back as chat history: the record of each answer generated.

A chat client sends each answer back in the next request's ``messages``; the
chat template renders it as text, and encoding that text again seldom gives the
ids the model generated (BPE merges differently, special tokens the answer
showed as nothing, ids the tokenizer maps to stand-in characters). The prompt
then departs from the previous turn's prompt + answer at the answer, and every
block from there on misses the prefix cache. So whoever generated an answer
keeps a record of it (`AnswerBook`: the ids, and the message as it was
returned), and a later prompt that carries the same message gets those ids
back in its place (`transcript_splice.splice_chat_ids`, which says where they
go). `MessageAccumulator` rebuilds a streamed answer's message as the client
received it.

Torch-free: the router imports it.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from kvduplex.common.openai.transcript_heads import HeadCache
from kvduplex.common.openai.transcript_spans import Placement
from kvduplex.common.openai.transcript_splice import splice_chat_ids

ANSWER_IDS_FIELD = "kvduplex_answer_token_ids"
"""Not OpenAI's: the answer's generated ids, asked for by the router
(``kv_transfer_params.report_answer``) in a last stream event (or a field of the
whole body), which the router removes before the client sees the answer."""


def message_key(message: Mapping[str, Any]) -> str:
    """The identity of an assistant message as returned or sent back: its content (null as
    ""), its ``reasoning_content`` (if any) and its tool calls (id, name, arguments text)."""
    content = message.get("content")
    if isinstance(content, list):  # text parts, as a client may send them
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    calls = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function") or {}
        args = fn.get("arguments")
        if not isinstance(args, str):
            args = json.dumps(args, sort_keys=True, ensure_ascii=False)
        calls.append([call.get("id"), fn.get("name"), args])
    reasoning = message.get("reasoning_content") or None
    canon = json.dumps([content or "", reasoning, calls], ensure_ascii=False)
    return hashlib.sha256(canon.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class AnswerRecord:
    """One generated answer: its ids and the message as it was returned."""

    token_ids: tuple[int, ...]
    """Every id generated, the end-of-turn token the model emitted included."""
    message: Mapping[str, Any]
    """The assistant message as the client received it (content, and reasoning_content or
    tool_calls where the answer was parsed into them)."""
    num_reasoning_ids: int = 0
    """The leading ids that are the reasoning (0: none); the rest follow it."""


@dataclass
class _Entry:
    record: AnswerRecord
    added_at: float
    owner: str | None


@dataclass
class AnswerBook:
    """Answers by message key, bounded in number, tokens and age (least recently used go
    first). An `owner` (the router's session id) lets a whole session's answers be forgotten
    with it (`drop_owner`)."""

    max_answers: int = 65536
    max_tokens: int = 1 << 20
    """About 36 bytes a token in Python: 36 MiB at most."""
    ttl_s: float = 600.0
    _entries: OrderedDict[str, _Entry] = field(default_factory=OrderedDict)
    _by_owner: dict[str, set[str]] = field(default_factory=dict)
    _num_tokens: int = 0

    heads: HeadCache = field(default_factory=lambda: HeadCache())
    """Where the heads of the answers placed end (one template: the book's user's)."""

    def __post_init__(self) -> None:
        if self.max_answers < 1 or self.max_tokens < 1 or not self.ttl_s > 0:
            raise ValueError("max_answers and max_tokens must be >= 1 and ttl_s > 0")

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def add(self, record: AnswerRecord, now: float, owner: str | None = None) -> None:
        """Remember `record` under its message's key (and, with reasoning, under the key
        of the message without it)."""
        if not record.token_ids or len(record.token_ids) > self.max_tokens:
            return
        self._expire(now)
        keys = [message_key(record.message)]
        if record.num_reasoning_ids and record.message.get("reasoning_content"):
            keys.append(message_key({**record.message, "reasoning_content": None}))
        for key in keys:
            self._pop(key)
            self._entries[key] = _Entry(record, now, owner)
            self._num_tokens += len(record.token_ids)
            if owner is not None:
                self._by_owner.setdefault(owner, set()).add(key)
        while len(self._entries) > self.max_answers or self._num_tokens > self.max_tokens:
            self._pop(next(iter(self._entries)))

    def place(self, message: Mapping[str, Any], now: float) -> Placement | None:
        """The ids for `message` (an assistant message sent back), if a record has them."""
        self._expire(now)
        key = message_key(message)
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        record = entry.record
        if message_key(record.message) == key:
            return Placement(record.token_ids, at_head=True)
        return Placement(record.token_ids[record.num_reasoning_ids :], at_head=False)

    def drop_owner(self, owner: str) -> None:
        for key in self._by_owner.pop(owner, set()):
            self._pop(key)

    def _pop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self._num_tokens -= len(entry.record.token_ids)
        if entry.owner is not None:
            keys = self._by_owner.get(entry.owner)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_owner[entry.owner]

    def _expire(self, now: float) -> None:
        while self._entries:
            key, oldest = next(iter(self._entries.items()))
            if now - oldest.added_at <= self.ttl_s:
                return
            self._pop(key)


class MessageAccumulator:
    """The assistant message a stream returned, rebuilt from its chunks' deltas (content,
    reasoning_content, tool_calls fragments by index) as an OpenAI client rebuilds it."""

    def __init__(self) -> None:
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}

    def add_delta(self, delta: Mapping[str, Any]) -> None:
        if isinstance(delta.get("content"), str):
            self._content.append(delta["content"])
        if isinstance(delta.get("reasoning_content"), str):
            self._reasoning.append(delta["reasoning_content"])
        for frag in delta.get("tool_calls") or ():
            if not isinstance(frag, Mapping):
                continue
            call = self._calls.setdefault(
                int(frag.get("index", len(self._calls))),
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
            )
            if frag.get("id"):
                call["id"] = frag["id"]
            fn = frag.get("function") or {}
            call["function"]["name"] += fn.get("name") or ""
            call["function"]["arguments"] += fn.get("arguments") or ""

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(self._content)}
        if self._reasoning:
            msg["reasoning_content"] = "".join(self._reasoning)
        if self._calls:
            msg["tool_calls"] = [self._calls[k] for k in sorted(self._calls)]
        return msg


# `splice_chat_ids` is imported from here too (with the book it places answers of).
__all__ = [
    "ANSWER_IDS_FIELD",
    "AnswerBook",
    "AnswerRecord",
    "MessageAccumulator",
    "message_key",
    "splice_chat_ids",
]
