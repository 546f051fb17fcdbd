"""Incremental detokenization with stop strings.

The text of a request's output is re-decoded from its ids as they grow
(byte-level tokenizers may split one character over several tokens). Text is
released to the client only once it is final: never a dangling partial UTF-8
character (U+FFFD at the end), and never the first characters of what may turn
out to be a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field
from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class IncrementalDetokenizer:
    """Tracks one request's output text; `update` returns the newly released text."""

    tokenizer: Decoder
    stop: tuple[str, ...] = ()
    text: str = ""
    """Output text so far (truncated before a stop string once one is found)."""
    num_released: int = 0
    """Characters of `text` already handed out."""
    stopped_by: str | None = None
    """The stop string that ended the output, if any."""
    _max_stop_len: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._max_stop_len = max((len(s) for s in self.stop), default=0)

    def update(self, output_ids: list[int], is_final: bool) -> str:
        """Re-decode `output_ids`; return the text newly safe to release.

        After a stop string is found, `stopped_by` is set, `text` ends before it
        and later calls return "".
        """
        if self.stopped_by is not None:
            return ""
        prev_len = len(self.text)
        self.text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        if self.stop:
            search_from = max(0, min(prev_len, self.num_released) - self._max_stop_len)
            hits = [
                (pos, s) for s in self.stop if (pos := self.text.find(s, search_from)) != -1
            ]
            if hits:
                pos, s = min(hits)
                self.text = self.text[:pos]
                self.stopped_by = s
                is_final = True
        end = len(self.text)
        if not is_final:
            while end > self.num_released and self.text[end - 1] == "\ufffd":
                end -= 1
            end = max(self.num_released, end - max(0, self._max_stop_len - 1))
        delta = self.text[self.num_released : end]
        self.num_released = end
        return delta
