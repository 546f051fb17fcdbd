"""Where the heads of placed answers end, remembered across turns.

A head is the prompt an answer was generated from, ``render(messages[:i],
add_generation_prompt=True, tools)``. `splice_chat_ids` checks each placement
against its head's text; `HeadCache` keeps each head as (length, sha256) under a
hash chained over the tools and the messages before it (`head_keys`), so a
conversation's next turn renders only the heads that are new, and `Prefixes`
checks a text against several of them hashing it once.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from kvduplex.common.tokenizer import Messages
from kvduplex.common.tokenizer import Tools


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


class Prefixes:
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


def known_prefix(
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


def head_keys(messages: Messages, tools: Tools) -> list[bytes]:
    """keys[i]: the chained hash of the tools and ``messages[:i]``."""
    key = hashlib.sha256(json.dumps(tools, sort_keys=True, default=str).encode()).digest()
    keys = [key]
    for m in messages:
        key = hashlib.sha256(key + message_blob(m)).digest()
        keys.append(key)
    return keys


def message_blob(message: Mapping[str, Any]) -> bytes:
    return json.dumps(message, sort_keys=True, default=str).encode("utf-8", "surrogatepass")
