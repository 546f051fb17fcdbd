"""Generated ids placed in a template's text: what to place (`Placement`), where a run
of ids shows (`match_span`), and the prompt with each run in its place (`join_spans`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvduplex.common.tokenizer import Tokenizer

CONTENT_SENTINEL = "\u2063kvduplex-answer-content\u2063"
"""A content no client sends (invisible separators around a name): where a template puts
a message's content."""


@dataclass(frozen=True)
class Placement:
    """Ids to place for one assistant message, and where."""

    token_ids: tuple[int, ...]
    at_head: bool
    """True: right after the head (the prompt the ids were generated from); False: where
    the template puts the message's content (ids after a stripped reasoning)."""


def match_span(
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


def join_spans(
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
