"""Generated answers sent back as chat history: their prompt tokens are the ids generated.

A chat answer sent back is rendered by the chat template as text, and encoding
that text again seldom gives the ids the model generated (see `transcript.py`,
whose `AnswerBook` keeps them). `splice_chat_ids` puts the recorded ids back in
the message's place.

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

Tool calls. A template renders a past call its own way, never as the text the
model wrote; such a message is placed structurally (`transcript_calls.py`).

Cost. Every text a placement is checked against (an answer's head, the text
before a stripped answer's content, a call's head with earlier calls as their
ids) is rendered once and remembered as (length, sha256) in the book's
`HeadCache` (`transcript_heads.py`), keyed by a hash chained over the tools and
the messages before it: a conversation's next turn renders the template a fixed
number of times (the whole conversation, once or twice, and the heads that are
new), not once per message placed. A remembered head is only ever compared with
today's text, and the spliced prompt must decode to that text, so a stale or
colliding entry can lose a hit, never place a wrong token.

The same function runs on the router and on every instance that answers chat
requests, each with its own book, so given the same messages and the same
records they build the same ids. The router also hands decode the ids it built
(``kv_transfer_params.prompt_token_ids``), so prefill and decode never disagree
even when their books do.

Torch-free: the router imports it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kvduplex.common.openai.transcript_calls import placed_calls
from kvduplex.common.openai.transcript_calls import splice_with_calls
from kvduplex.common.openai.transcript_heads import HeadCache
from kvduplex.common.openai.transcript_heads import Prefixes
from kvduplex.common.openai.transcript_heads import head_keys
from kvduplex.common.openai.transcript_heads import known_prefix
from kvduplex.common.openai.transcript_heads import message_blob
from kvduplex.common.openai.transcript_spans import CONTENT_SENTINEL
from kvduplex.common.openai.transcript_spans import Placement
from kvduplex.common.openai.transcript_spans import join_spans
from kvduplex.common.openai.transcript_spans import match_span
from kvduplex.common.tokenizer import Messages
from kvduplex.common.tokenizer import Tokenizer
from kvduplex.common.tokenizer import Tools


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
    calls = placed_calls(tokenizer, messages, tools, placements)
    keys = head_keys(messages, tools)
    placed: set[int] = set()
    specials: dict[int, str | None] = {}
    ids = _splice_rendered(tokenizer, messages, tools, placements, heads, keys, placed, specials)
    if calls and not set(calls) <= placed:  # the template re-rendered a call its own way
        spliced = splice_with_calls(
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
    adds to `placed` the messages whose ids were placed (`specials`: `match_span`'s)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    prefixes = Prefixes(text)
    spans: list[tuple[int, int, tuple[int, ...], list[bool]]] = []
    pos = 0
    for i, placement in enumerate(placements):
        if placement is None:
            continue
        start = _span_start(tokenizer, messages, tools, i, placement.at_head, prefixes,
                            heads, keys[i])  # fmt: skip
        if start is None or start < pos:
            continue
        matched = match_span(tokenizer, placement.token_ids, text, start, specials)
        if matched is None:
            continue
        end, visible = matched
        spans.append((start, end, placement.token_ids, visible))
        placed.add(i)
        pos = end
    return join_spans(tokenizer, text, spans)


def _span_start(
    tokenizer: Tokenizer, messages: Messages, tools: Tools, i: int, at_head: bool,
    text: Prefixes, heads: HeadCache | None, key: bytes,
) -> int | None:  # fmt: skip
    """Where message `i`'s ids begin in `text`: after the head, or where its content is
    (the text before that remembered in `heads` under `key`, the chained hash of the
    messages before `i`, so that a conversation's next turn renders it again only if it
    is new)."""
    if at_head:
        known = known_prefix(heads, key, lambda: _try_render(tokenizer, messages[:i], tools))
    else:
        content_key = hashlib.sha256(key + b"content:" + message_blob(messages[i])).digest()
        known = known_prefix(
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


def _before_content(tokenizer: Tokenizer, messages: Messages, tools: Tools, i: int) -> str | None:
    """The template's text before message `i`'s content (None: it does not show the
    content exactly once)."""
    marked = [*messages[:i], {**messages[i], "content": CONTENT_SENTINEL}, *messages[i + 1 :]]
    rendered = _try_render(tokenizer, marked, tools)
    if rendered is None:
        return None
    at = rendered.find(CONTENT_SENTINEL)
    if at < 0 or rendered.find(CONTENT_SENTINEL, at + 1) >= 0:
        return None
    return rendered[:at]
