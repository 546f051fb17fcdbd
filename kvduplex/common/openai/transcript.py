"""Generated answers sent back as chat history: their prompt tokens are the ids generated.

A chat client sends each answer back in the next request's ``messages``; the
chat template renders it as text, and encoding that text again seldom gives the
ids the model generated (BPE merges differently, special tokens the answer
showed as nothing, ids the tokenizer maps to stand-in characters). The prompt
then departs from the previous turn's prompt + answer at the answer, and every
block from there on misses the prefix cache. So whoever generated an answer
keeps a record of it (`AnswerBook`: the ids, and the message as it was
returned), and a later prompt that carries the same message gets those ids
back in its place (`splice_chat_ids`).

Where the ids go. The model generated them right after the prompt it was given,
``render(messages[:i], add_generation_prompt=True)`` (the head). If today's
rendering of the whole conversation starts with that head and continues with
the text of the ids, the ids take that span::

    text   |-- head: render(messages[:i], gen prompt) --|-- decode(ids) --|-- rest --|
    ids    encode(head text)                            generated ids     encode(rest)

A record may also hold ids after a reasoning part (``reasoning_content``, once
answers carry it): a client that strips the reasoning sends the message without
it, and those ids are placed where the template puts the message's content
(found by rendering the message once with a sentinel content) if its text
follows there. Anything else (content edited, a template that re-renders the
history differently, a message no record knows) is rendered and encoded as
usual: its blocks simply miss. Never a wrong token: the spliced prompt is kept
only if it decodes to exactly the template's text (special tokens that the
model generated but the returned text never showed, e.g. an end-of-turn inside
the answer, are the one thing allowed to be extra; they are the model's own),
otherwise the whole prompt is rendered normally.

Tool calls. A template renders a past call its own way (e.g.
``<tool_calls>[{"id": ..., "name": ..., "arguments": ...}]</tool_calls>``), never
as the text the model wrote, so a call's ids are never found in the template's
text. A tool-call message whose record matches (same content, call ids, names,
arguments: an edited call has no record) is then placed structurally: the
conversation is rendered with that message as a content message holding the
ids' text, and the ids go there if what precedes them is exactly their head
(`_splice_with_calls`). That prompt is the previous prompt, the generated ids,
then the template's end of turn and what follows; the check is against that text.

Cost. Every text a placement is checked against (an answer's head, the text
before a stripped answer's content, a call's head with earlier calls as their
ids) is rendered once and remembered as (length, sha256) in the book's
`HeadCache`, keyed by a hash chained over the tools and the messages before it:
a conversation's next turn renders the template a fixed number of times (the
whole conversation, once or twice, and the heads that are new), not once per
message placed. A remembered head is only ever compared with today's text, and
the spliced prompt must decode to that text, so a stale or colliding entry can
lose a hit, never place a wrong token.

The same function runs on the router and on every instance that answers chat
requests, each with its own book, so given the same messages and the same
records they build the same ids. The router also hands decode the ids it built
(``kv_transfer_params.prompt_token_ids``), so prefill and decode never disagree
even when their books do.

Torch-free: the router imports it.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from kvduplex.common.tokenizer import Messages
from kvduplex.common.tokenizer import Tokenizer
from kvduplex.common.tokenizer import Tools

ANSWER_IDS_FIELD = "kvduplex_answer_token_ids"
"""Not OpenAI's: the answer's generated ids, asked for by the router
(``kv_transfer_params.report_answer``) in a last stream event (or a field of the
whole body), which the router removes before the client sees the answer."""

_SENTINEL = "\u2063kvduplex-answer-content\u2063"
"""A content no client sends (invisible separators around a name): where a template puts
a message's content."""


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


@dataclass(frozen=True)
class Placement:
    """Ids to place for one assistant message, and where."""

    token_ids: tuple[int, ...]
    at_head: bool
    """True: right after the head (the prompt the ids were generated from); False: where
    the template puts the message's content (ids after a stripped reasoning)."""


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


class HeadCache:
    """Where heads end, so that a conversation's next turn does not render each past
    answer's head again: (length, sha256) of ``render(messages[:i], add_generation_prompt
    =True, tools)``, keyed by a hash chained over the tools and the messages. Bounded (least
    recently used go first). One tokenizer (one template) per cache. Thread-safe: the
    router builds prompts in a pool of threads."""

    def __init__(self, max_entries: int = 65536) -> None:
        self.max_entries = max_entries
        self._heads: OrderedDict[bytes, tuple[int, bytes]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes) -> tuple[int, bytes] | None:
        with self._lock:
            head = self._heads.get(key)
            if head is not None:
                self._heads.move_to_end(key)
            return head

    def put(self, key: bytes, head: str) -> None:
        entry = (len(head), _sha(head))
        with self._lock:
            self._heads[key] = entry
            while len(self._heads) > self.max_entries:
                self._heads.popitem(last=False)


class _Prefixes:
    """Digests of a text's prefixes, as `HeadCache` keeps them: prefixes asked for in
    increasing length hash the text once in all (each span hashed once), not once each."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._hash = hashlib.sha256()
        self._end = 0

    def starts_with(self, end: int, digest: bytes) -> bool:
        """Whether the text begins with the text of length `end` and sha256 `digest`."""
        if end > len(self.text):
            return False
        if end < self._end:
            return _sha(self.text[:end]) == digest
        self._hash.update(self.text[self._end : end].encode("utf-8", "surrogatepass"))
        self._end = end
        return self._hash.copy().digest() == digest


def _known_prefix(
    heads: HeadCache | None, key: bytes, render: Callable[[], str | None]
) -> tuple[int, bytes] | None:
    """(length, digest) of the text `render` makes (None: it cannot), from `heads` under
    `key` if there, else rendered and remembered."""
    cached = heads.get(key) if heads is not None else None
    if cached is not None:
        return cached
    text = render()
    if text is None:
        return None
    if heads is not None:
        heads.put(key, text)
    return len(text), _sha(text)


def _sha(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def _head_keys(messages: Messages, tools: Tools) -> list[bytes]:
    """keys[i]: the chained hash of the tools and ``messages[:i]``."""
    key = hashlib.sha256(json.dumps(tools, sort_keys=True, default=str).encode()).digest()
    keys = [key]
    for m in messages:
        key = hashlib.sha256(key + _message_blob(m)).digest()
        keys.append(key)
    return keys


def _message_blob(message: Mapping[str, Any]) -> bytes:
    return json.dumps(message, sort_keys=True, default=str).encode("utf-8", "surrogatepass")


def splice_chat_ids(
    tokenizer: Tokenizer,
    messages: Messages,
    tools: Tools,
    placements: Sequence[Placement | None],
    heads: HeadCache | None = None,
) -> list[int] | None:
    """The prompt ids of `messages` (as the template gets them) with the ids of
    ``placements[i]`` in message i's place where the text allows (see the module
    docstring); None when none could be placed (render as usual). ValueError if the
    template refuses the messages. `heads` remembers where heads end, across calls."""
    calls = _placed_calls(tokenizer, messages, tools, placements)
    keys = _head_keys(messages, tools)
    placed: set[int] = set()
    specials: dict[int, str | None] = {}
    ids = _splice_rendered(tokenizer, messages, tools, placements, heads, keys, placed, specials)
    if calls and not set(calls) <= placed:  # the template re-rendered a call its own way
        spliced = _splice_with_calls(
            tokenizer, messages, tools, placements, calls, heads, keys, specials
        )
        return spliced or ids
    return ids


def _splice_rendered(
    tokenizer: Tokenizer,
    messages: Messages,
    tools: Tools,
    placements: Sequence[Placement | None],
    heads: HeadCache | None,
    keys: Sequence[bytes],
    placed: set[int],
    specials: dict[int, str | None],
) -> list[int] | None:
    """`splice_chat_ids` where each message's ids are found in the template's own text;
    adds to `placed` the messages whose ids were placed (`specials`: `_match`'s)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    prefixes = _Prefixes(text)
    spans: list[tuple[int, int, tuple[int, ...], list[bool]]] = []
    pos = 0
    for i, placement in enumerate(placements):
        if placement is None:
            continue
        start = _span_start(tokenizer, messages, tools, i, placement.at_head, prefixes,
                            heads, keys[i])  # fmt: skip
        if start is None or start < pos:
            continue
        matched = _match(tokenizer, placement.token_ids, text, start, specials)
        if matched is None:
            continue
        end, visible = matched
        spans.append((start, end, placement.token_ids, visible))
        placed.add(i)
        pos = end
    return _join(tokenizer, text, spans)


def _join(
    tokenizer: Tokenizer, text: str, spans: Sequence[tuple[int, int, tuple[int, ...], list[bool]]]
) -> list[int] | None:
    """`text` encoded, with each span's ids in its place; None if there is no span or the
    result does not show exactly `text`."""
    if not spans:
        return None
    ids: list[int] = []
    shown: list[int] = []
    cur = 0
    for start, end, gen, visible in spans:
        between = tokenizer.encode(text[cur:start], add_special_tokens=False) if start > cur else []
        ids += between
        shown += between
        ids += gen
        shown += [t for t, v in zip(gen, visible, strict=True) if v]
        cur = end
    tail = tokenizer.encode(text[cur:], add_special_tokens=False) if cur < len(text) else []
    ids += tail
    shown += tail
    if tokenizer.decode(shown, skip_special_tokens=False) != text:
        return None
    return ids


def _calls_sentinel(i: int) -> str:
    return f"{_SENTINEL}{i}\u2063"


def _placed_calls(
    tokenizer: Tokenizer, messages: Messages, tools: Tools, placements: Sequence[Placement | None]
) -> dict[int, tuple[str, str]]:
    """The tool-call messages whose generated ids are placed after their head: index ->
    (the text of the ids, the text of their last id where it is a special token, else "")."""
    calls: dict[int, tuple[str, str]] = {}
    for i, placement in enumerate(placements):
        if placement is None or not placement.at_head or not messages[i].get("tool_calls"):
            continue
        ids = list(placement.token_ids)
        last = tokenizer.decode(ids[-1:], skip_special_tokens=False)
        hidden = bool(last) and not tokenizer.decode(ids[-1:], skip_special_tokens=True)
        calls[i] = (tokenizer.decode(ids, skip_special_tokens=False), last if hidden else "")
    return calls


def _render_with_calls(
    tokenizer: Tokenizer,
    messages: Messages,
    tools: Tools,
    calls: Mapping[int, tuple[str, str]],
    add_generation_prompt: bool,
) -> tuple[str, dict[int, int]]:
    """The template's text of `messages` with each message of `calls` rendered as a content
    message (no tool calls) whose content is the text of its generated ids, and where each
    such text begins. The template's end of turn after it is dropped where the ids end with
    that very special token (as a content answer's ids do). ValueError if a message's
    place cannot be found."""
    marked = [
        {"role": m.get("role", "assistant"), "content": _calls_sentinel(i)} if i in calls else m
        for i, m in enumerate(messages)
    ]
    text = tokenizer.apply_chat_template(
        marked, add_generation_prompt=add_generation_prompt, tools=tools
    )
    starts: dict[int, int] = {}
    for i in sorted(calls):
        sentinel = _calls_sentinel(i)
        at = text.find(sentinel)
        if at < 0 or text.find(sentinel, at + 1) >= 0:
            raise ValueError("the template does not show a message's content once")
        generated, last = calls[i]
        after = text[at + len(sentinel) :]
        if last and after.startswith(last):
            after = after[len(last) :]
        text = text[:at] + generated + after
        starts[i] = at
    return text, starts


def _splice_with_calls(
    tokenizer: Tokenizer,
    messages: Messages,
    tools: Tools,
    placements: Sequence[Placement | None],
    calls: dict[int, tuple[str, str]],
    heads: HeadCache | None,
    keys: Sequence[bytes],
    specials: dict[int, str | None],
) -> list[int] | None:
    """`splice_chat_ids` where some placed messages are tool calls. The template renders a
    past call its own way, never as the text the model wrote, so such a message's span is
    found structurally: the conversation is rendered with the message as a content message,
    and its generated ids go there if what precedes them is exactly the head they were
    generated after (itself rendered so: earlier calls as their ids). A message whose head
    differs (a template that gives a call turn another header) is rendered normally, and so
    is everything after it. Heads are remembered in `heads`, as content answers' are."""
    found = _calls_in_place(tokenizer, messages, tools, calls, heads, keys)
    if found is None:
        return None
    text, starts, calls = found
    prefixes = _Prefixes(text)
    spans: list[tuple[int, int, tuple[int, ...], list[bool]]] = []
    pos = 0
    for i, placement in enumerate(placements):
        if placement is None or (i not in calls and not placement.at_head):
            continue
        if i in calls:
            end = starts[i] + len(calls[i][0])
            spans.append((starts[i], end, placement.token_ids, [True] * len(placement.token_ids)))
            pos = end
            continue
        head = _head_with_calls(tokenizer, messages, tools, calls, i, heads, keys)
        if head is None or head[0] < pos or not prefixes.starts_with(*head):
            continue
        matched = _match(tokenizer, placement.token_ids, text, head[0], specials)
        if matched is not None:
            spans.append((head[0], matched[0], placement.token_ids, matched[1]))
            pos = matched[0]
    return _join(tokenizer, text, spans)


def _calls_in_place(
    tokenizer: Tokenizer, messages: Messages, tools: Tools, calls: dict[int, tuple[str, str]],
    heads: HeadCache | None, keys: Sequence[bytes],
) -> tuple[str, dict[int, int], dict[int, tuple[str, str]]] | None:  # fmt: skip
    """The text with `calls` as their ids, where each begins, and the calls kept: those
    (from the first on) whose ids follow exactly their head; None if none."""
    calls = dict(calls)
    while calls:
        try:
            text, starts = _render_with_calls(tokenizer, messages, tools, calls, True)
        except ValueError:
            return None
        prefixes = _Prefixes(text)
        bad = next(
            (i for i in sorted(calls) if not _follows(prefixes, starts[i], _head_with_calls(
                tokenizer, messages, tools, calls, i, heads, keys
            ))),
            None,
        )  # fmt: skip
        if bad is None:
            return text, starts, calls
        calls = {i: c for i, c in calls.items() if i < bad}
    return None


def _follows(text: _Prefixes, start: int, head: tuple[int, bytes] | None) -> bool:
    """Whether a span at `start` follows exactly a (non-empty) `head` of `text`."""
    return head is not None and 0 < head[0] == start and text.starts_with(*head)


def _head_with_calls(
    tokenizer: Tokenizer, messages: Messages, tools: Tools,
    calls: Mapping[int, tuple[str, str]], i: int, heads: HeadCache | None,
    keys: Sequence[bytes],
) -> tuple[int, bytes] | None:  # fmt: skip
    """(length, digest) of the head of message `i`, earlier `calls` as their ids (None if
    the template refuses it), remembered in `heads`."""
    earlier = {j: c for j, c in calls.items() if j < i}
    blob = json.dumps(sorted(earlier.items())).encode("utf-8", "surrogatepass")
    key = hashlib.sha256(keys[i] + b"calls:" + blob).digest()

    def render() -> str | None:
        try:
            return _render_with_calls(tokenizer, messages[:i], tools, earlier, True)[0]
        except ValueError:
            return None

    return _known_prefix(heads, key, render)


def _span_start(
    tokenizer: Tokenizer, messages: Messages, tools: Tools, i: int, at_head: bool,
    text: _Prefixes, heads: HeadCache | None, key: bytes,
) -> int | None:  # fmt: skip
    """Where message `i`'s ids begin in `text`: after the head, or where its content is
    (the text before that remembered in `heads` under `key`, the chained hash of the
    messages before `i`, so that a conversation's next turn renders it again only if it
    is new)."""
    if at_head:
        known = _known_prefix(heads, key, lambda: _try_render(tokenizer, messages[:i], tools))
    else:
        content_key = hashlib.sha256(key + b"content:" + _message_blob(messages[i])).digest()
        known = _known_prefix(
            heads, content_key, lambda: _before_content(tokenizer, messages, tools, i)
        )
    if known is None or not text.starts_with(*known):
        return None
    return known[0]


def _try_render(tokenizer: Tokenizer, messages: Messages, tools: Tools) -> str | None:
    """`messages` rendered with the generation prompt; None if the template refuses them."""
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    except ValueError:
        return None


def _before_content(
    tokenizer: Tokenizer, messages: Messages, tools: Tools, i: int
) -> str | None:
    """The template's text before message `i`'s content (None: it does not show the
    content exactly once)."""
    marked = [*messages[:i], {**messages[i], "content": _SENTINEL}, *messages[i + 1 :]]
    rendered = _try_render(tokenizer, marked, tools)
    if rendered is None:
        return None
    at = rendered.find(_SENTINEL)
    if at < 0 or rendered.find(_SENTINEL, at + 1) >= 0:
        return None
    return rendered[:at]


def _match(
    tokenizer: Tokenizer, ids: Sequence[int], text: str, start: int,
    special: dict[int, str | None],
) -> tuple[int, list[bool]] | None:  # fmt: skip
    """Where the text of `ids` ends if `text` shows it from `start` on, and which ids it
    shows (a special token the text does not show there is skipped: the model generated it,
    the returned text never showed it); None if `text` shows something else. `special`
    remembers, per id, its text if it is a special token (else None), for the next calls."""
    whole = tokenizer.decode(list(ids), skip_special_tokens=False)
    if text.startswith(whole, start):  # the usual case: every id shows as generated
        return start + len(whole), [True] * len(ids)
    pos = start
    visible: list[bool] = []
    run: list[int] = []

    def flush() -> bool:
        nonlocal pos
        if run:
            piece = tokenizer.decode(run, skip_special_tokens=False)
            if not text.startswith(piece, pos):
                return False
            pos += len(piece)
            visible.extend([True] * len(run))
            run.clear()
        return True

    for t in ids:
        if t not in special:
            shown = tokenizer.decode([t], skip_special_tokens=False)
            hidden = bool(shown) and not tokenizer.decode([t], skip_special_tokens=True)
            special[t] = shown if hidden else None
        shown_special = special[t]
        if shown_special is None:
            run.append(t)  # an ordinary token (its text may need its neighbours)
            continue
        shown = shown_special
        if not flush():
            return None
        if text.startswith(shown, pos):
            pos += len(shown)
            visible.append(True)
        else:
            visible.append(False)
    if not flush():
        return None
    return pos, visible


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
