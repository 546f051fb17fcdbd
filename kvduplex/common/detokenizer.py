"""Incremental detokenization with stop strings.

Text is released to the client only once it is final: never a dangling partial
UTF-8 character (U+FFFD at the end), and never the first characters of what may
turn out to be a stop string.

Design note. Each step decodes only a short window of ids, not the whole output
(prefix-offset decoding, as vLLM and HF TGI do)::

    ids        t0 t1 t2 t3 | t4 t5 | t6 t7      (t6 t7 arrived this step)
                           prefix  read
    window     decode(t4..t7) minus decode(t4..t5) = the text t6 t7 add

The window starts one committed chunk back (``prefix``), so a tokenizer whose
pieces depend on their left neighbour (a leading space) decodes the new ids as
a full decode would. While the new text ends in U+FFFD (a character split over
tokens: one byte per token with the byte presets) the window is not committed
and grows with the next ids until the character is complete. Byte tokenizers,
byte-level BPE and SentencePiece decode a prefix-consistent text this way, so
the released text equals a full decode of the ids, stop strings included. Per
step the work is the window's decode and the stop-string search over the text
not yet released (plus the longest stop string before it), not the whole output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Tracks one request's output text; `update` returns the newly released text.

    One instance per request, fed the request's growing list of output ids.
    """

    def __init__(self, tokenizer: Decoder, stop: tuple[str, ...] = (), min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.min_tokens = min_tokens
        """Stop strings are looked for once more output ids than this are out (vLLM's
        ``min_tokens``): one that ends within the first ids' text is passed over."""
        self._stops_from = 0  # offset in the output text where a stop string may end, past
        self.num_released = 0
        """Characters of the output text already handed out."""
        self.stopped_by: str | None = None
        """The stop string that ended the output, if any."""
        self._max_stop_len = max((len(s) for s in stop), default=0)
        self._num_ids = 0  # output ids seen so far
        self._window: list[int] = []  # the ids from `prefix` on
        self._read = 0  # index in `_window` of the first id whose text is not committed
        self._prefix_text = ""  # decode(_window[:_read])
        self._text_start = 0  # offset in the output text of `_text`
        self._text = ""  # committed output text from `_text_start` on

    def update(self, output_ids: Sequence[int], is_final: bool) -> str:
        """Take the ids appended to `output_ids` since the last call; return the text
        newly safe to release (with `is_final`, everything left).

        `output_ids` is the same growing list on every call (earlier ids unchanged).
        After a stop string is found, `stopped_by` is set, the text ends before it and
        later calls return "".
        """
        if self.stopped_by is not None:
            return ""
        new_ids = output_ids[self._num_ids:]
        self._num_ids = len(output_ids)
        self._window.extend(new_ids)
        pending = ""
        if new_ids or self._read < len(self._window):
            decoded = self.tokenizer.decode(self._window, skip_special_tokens=True)
            if len(decoded) > len(self._prefix_text):
                pending = decoded[len(self._prefix_text):]
        complete = bool(pending) and not pending.endswith(_REPLACEMENT)
        if complete:
            self._commit(pending)
            text, pending = self._text, ""
        else:
            text = self._text + pending  # not committed: the window decodes it again next time
        base = self._text_start  # `text` is the output text from `base` on
        if self.stop and self._num_ids <= self.min_tokens:
            self._stops_from = base + len(self._text)  # what is whole: a split character is new
        elif self.stop:
            # a stop string starting earlier would lie in released text: found back then
            search_from = max(0, self.num_released - self._max_stop_len - base)
            ends_past = self._stops_from - base
            hits = [
                (pos, s) for s in self.stop
                if (pos := text.find(s, max(search_from, ends_past - len(s) + 1))) != -1
            ]  # fmt: skip
            if hits:
                pos, s = min(hits)
                text = text[:pos]
                self.stopped_by = s
                is_final = True
        end = len(text)
        released = self.num_released - base
        if not is_final:
            while end > released and text[end - 1] == _REPLACEMENT:
                end -= 1
            end = max(released, end - max(0, self._max_stop_len - 1))
        delta = text[released:end]
        self.num_released = base + end
        self._trim()
        return delta

    def _commit(self, new_text: str) -> None:
        """The window's new text is final: it joins the committed text and the window
        restarts at the last commit."""
        self._text += new_text
        self._window = self._window[self._read:]
        self._read = len(self._window)
        self._prefix_text = self.tokenizer.decode(self._window, skip_special_tokens=True)

    def _trim(self) -> None:
        """Keep only the committed text a later stop-string search or release can touch."""
        committed_end = self._text_start + len(self._text)
        keep_from = max(self._text_start, min(self.num_released - self._max_stop_len, committed_end))
        if keep_from > self._text_start:
            self._text = self._text[keep_from - self._text_start:]
            self._text_start = keep_from
