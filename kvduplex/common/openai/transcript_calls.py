"""Tool-call answers placed structurally: a template renders a past call its own way.

A template renders a past call its own way (e.g.
``<tool_calls>[{"id": ..., "name": ..., "arguments": ...}]</tool_calls>``), never
as the text the model wrote, so a call's ids are never found in the template's
text. A tool-call message whose record matches (same content, call ids, names,
arguments: an edited call has no record) is then placed structurally: the
conversation is rendered with that message as a content message holding the
ids' text, and the ids go there if what precedes them is exactly their head
(`splice_with_calls`). That prompt is the previous prompt, the generated ids,
then the template's end of turn and what follows; the check is against that text.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from collections.abc import Sequence

from kvduplex.common.openai.transcript_heads import HeadCache
from kvduplex.common.openai.transcript_heads import Prefixes
from kvduplex.common.openai.transcript_heads import known_prefix
from kvduplex.common.openai.transcript_spans import CONTENT_SENTINEL
from kvduplex.common.openai.transcript_spans import Placement
from kvduplex.common.openai.transcript_spans import join_spans
from kvduplex.common.openai.transcript_spans import match_span
from kvduplex.common.tokenizer import Messages
from kvduplex.common.tokenizer import Tokenizer
from kvduplex.common.tokenizer import Tools


def _calls_sentinel(i: int) -> str:
    return f"{CONTENT_SENTINEL}{i}\u2063"


def placed_calls(
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


def splice_with_calls(
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
    prefixes = Prefixes(text)
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
        matched = match_span(tokenizer, placement.token_ids, text, head[0], specials)
        if matched is not None:
            spans.append((head[0], matched[0], placement.token_ids, matched[1]))
            pos = matched[0]
    return join_spans(tokenizer, text, spans)


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
        prefixes = Prefixes(text)
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


def _follows(text: Prefixes, start: int, head: tuple[int, bytes] | None) -> bool:
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

    return known_prefix(heads, key, render)
