"""The session table: which prefill and decode instance served a conversation.

A session is named by the client (OpenAI's ``prompt_cache_key``, or an
``X-Session-Id`` header) or recognised by its prompt: a conversation's next
prompt starts with its whole previous prompt (the template renders the
history, the answer, then the new message), which a new conversation that
only shares a system prompt never does.

`PrefixIndex` finds, for a prompt, the session whose latest prompt is a
strict prefix of it. Each session's latest prompt is filed under the hash
chain of its full chunks, with the tokens after them kept for an exact check::

    latest prompt  |-- chunk 0 --|-- chunk 1 --|- tail -|
    filed under    (2, h(h(0, chunk 0), chunk 1)) + tail
    next prompt    |-- chunk 0 --|-- chunk 1 --|- tail -|-- answer, new message --|

A lookup hashes the new prompt's chunks once and walks its chain from the
longest full-chunk prefix down, so it costs one hash per chunk, not per token.

`SessionTable` holds at most `max_sessions` sessions, each forgotten `ttl_s`
after its last turn (least recently used first when full), and the chat answers
relayed for them (`answers`, an `AnswerBook` whose entries each session owns:
they are forgotten with it).

Adaptive return. A session's turns are returned to prefill while its client
sends its answers back as they were returned: a turn whose prompt holds the
previous answer's tokens where that answer left them (the previous prompt, then
the answer but for its last token, which has no KV) shows that the returned
blocks will be hit (`reuses_answer`). A turn that does not (the answer was
edited, stripped, or the conversation branched) stops the return for the
session; the next turn that does resumes it. The first turn of a session, and
a turn after an answer whose ids were not learnt, keep the session's state.

Reasoning. A client that follows the OpenAI convention sends an answer back
without its ``reasoning_content``, so the next prompt leaves the answer where
its reasoning began: the return of such a turn is limited to its prompt
(`return_limit`, decided by the router's flows), and whether the next prompt
then keeps the answer does not stop the return (the part returned is kept
either way). A session shows that it sends reasoning back when a prompt holds a
previous answer that had reasoning (`sends_reasoning`); its turns are then
returned whole.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvduplex.common.openai.transcript import AnswerBook
from kvduplex.common.openai.transcript import AnswerRecord

PromptKey = tuple[int, int]
"""(number of full chunks, hash chain over them): where a prompt is filed."""


class PrefixIndex:
    """Latest prompt of each session, looked up by a longer prompt that starts with it."""

    def __init__(self, chunk: int = 16, max_per_key: int = 8) -> None:
        """`chunk` tokens per hashed chunk; at most `max_per_key` sessions (the most recent)
        are filed under one key (prompts that differ only in their last < `chunk` tokens)."""
        if chunk < 1 or max_per_key < 1:
            raise ValueError("chunk and max_per_key must be >= 1")
        self.chunk = chunk
        self.max_per_key = max_per_key
        self._files: dict[PromptKey, list[tuple[str, tuple[int, ...]]]] = {}

    def _chain(self, ids: Sequence[int]) -> list[int]:
        """h_0 = 0, h_k = hash(h_{k-1}, chunk k-1): one entry per full-chunk prefix."""
        chain = [0]
        for start in range(0, len(ids) - self.chunk + 1, self.chunk):
            chain.append(hash((chain[-1], tuple(ids[start : start + self.chunk]))))
        return chain

    def add(self, session_id: str, ids: Sequence[int]) -> PromptKey:
        """File `ids` as `session_id`'s latest prompt; the key `remove` needs later."""
        chain = self._chain(ids)
        num_chunks = len(chain) - 1
        key = (num_chunks, chain[-1])
        entries = self._files.setdefault(key, [])
        entries.append((session_id, tuple(ids[num_chunks * self.chunk :])))
        if len(entries) > self.max_per_key:
            del entries[0]
        return key

    def remove(self, session_id: str, key: PromptKey) -> None:
        entries = self._files.get(key)
        if entries is None:
            return
        entries[:] = [e for e in entries if e[0] != session_id]
        if not entries:
            del self._files[key]

    def find(self, ids: Sequence[int]) -> str | None:
        """The session whose latest prompt is the longest strict prefix of `ids`, if any."""
        chain = self._chain(ids)
        for num_chunks in range(len(chain) - 1, -1, -1):
            entries = self._files.get((num_chunks, chain[num_chunks]))
            if not entries:
                continue
            start = num_chunks * self.chunk
            best, best_len = None, -1
            for session_id, tail in entries:
                end = start + len(tail)
                if end < len(ids) and len(tail) > best_len and tuple(ids[start:end]) == tail:
                    best, best_len = session_id, len(tail)
            if best is not None:
                return best
        return None

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._files.values())


@dataclass(frozen=True)
class Session:
    """Where a session's last turn went."""

    session_id: str
    prefill_url: str | None
    """None when the turn went to decode alone."""
    decode_url: str
    last_used: float
    """Clock time of the last turn."""
    num_turns: int
    prompt_key: PromptKey
    """Where its latest prompt is filed in the prefix index."""
    num_prompt_tokens: int = 0
    """The latest turn's prompt length."""
    num_answer_tokens: int | None = None
    """The latest turn's answer length, once its response ended (None: not known)."""
    answer_end: int | None = None
    """Prompt + answer tokens whose KV a return can give (the answer's last token has
    none), once the answer's ids are known."""
    answer_digest: int | None = None
    """Hash of those `answer_end` tokens: a next prompt that starts with them reuses the
    answer."""
    is_returning: bool = True
    """Whether this turn is returned to prefill (see the module docstring)."""
    num_answer_tokens_hit: int = 0
    """Over the session, tokens of returned answers that prefill had cached next turn."""
    num_answer_tokens_returnable: int = 0
    """Over the session, tokens of returned answers that prefill could have cached."""
    answer_has_reasoning: bool = False
    """The latest answer, as the client received it, had ``reasoning_content``."""
    sends_reasoning: bool = False
    """A prompt of this session held a previous answer with its reasoning."""
    return_limit: int | None = None
    """The latest turn's return covers at most this many tokens (None: all of it)."""
    is_returned: bool = False
    """The latest turn is returned to prefill."""
    prefill_stamp: int | None = None
    """`prefill_url`'s pool clock when it last took this session's KV (computed its prompt,
    or was returned a turn), for `residency` (None: it holds none that the router knows)."""
    prefill_tokens: int = 0
    """Tokens of the session's history prefill took then."""
    decode_stamp: int | None = None
    """`decode_url`'s pool clock when it last took this session's KV (its latest answer)."""
    decode_tokens: int = 0
    """Tokens of the session's history decode took then."""
    answered_at: float | None = None
    """Clock time the latest answer ended (None: not yet)."""
    gap_s: float | None = None
    """Time from the previous answer's end to this turn: the client's think time (None:
    not known)."""

    @property
    def answer_hit_rate(self) -> float | None:
        if not self.num_answer_tokens_returnable:
            return None
        return self.num_answer_tokens_hit / self.num_answer_tokens_returnable

    def reuses_answer(self, ids: Sequence[int]) -> bool | None:
        """Whether the prompt `ids` of the next turn holds this turn's answer where it left
        it (None: the answer's ids are not known)."""
        if self.answer_end is None or self.answer_digest is None:
            return None
        end = self.answer_end
        return len(ids) > end and hash(tuple(ids[:end])) == self.answer_digest


def _updated(session: Session, **changes: Any) -> Session:
    """`dataclasses.replace(session, **changes)`, as a copy of its fields: `replace` walks
    every field and runs the frozen `__init__` again, the largest piece of Python in a
    routed request (two a turn). A `Session` has no `__post_init__`, init-only or
    derived field that a copy would skip."""
    if not changes.keys() <= session.__dict__.keys():
        raise TypeError(f"not fields of a Session: {changes.keys() - session.__dict__.keys()}")
    new = object.__new__(Session)
    new.__dict__.update(session.__dict__)
    new.__dict__.update(changes)
    return new


class SessionTable:
    """Sessions by id, bounded in number and age; see the module docstring."""

    def __init__(
        self,
        ttl_s: float,
        max_sessions: int,
        index: PrefixIndex | None = None,
        answers: AnswerBook | None = None,
    ) -> None:
        if ttl_s <= 0 or max_sessions < 1:
            raise ValueError("ttl_s must be > 0 and max_sessions >= 1")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.index = index if index is not None else PrefixIndex()
        self.answers = answers if answers is not None else AnswerBook(ttl_s=ttl_s)
        """The chat answers relayed, each owned by its session."""
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        """Least recently used first (insertion order: `record` re-inserts)."""

    def __len__(self) -> int:
        return len(self._sessions)

    def sessions(self) -> list[Session]:
        """The live sessions, least recently used first."""
        return list(self._sessions.values())

    def get(self, session_id: str, now: float) -> Session | None:
        """The live session of this id, if any."""
        self._expire(now)
        return self._sessions.get(session_id)

    def find_by_prompt(self, ids: Sequence[int], now: float) -> Session | None:
        """The live session that `ids` continues (its latest prompt is a strict prefix)."""
        self._expire(now)
        session_id = self.index.find(ids)
        return None if session_id is None else self._sessions.get(session_id)

    def record(
        self,
        session_id: str,
        prefill_url: str | None,
        decode_url: str,
        ids: Sequence[int],
        now: float,
        reuses_answer: bool | None = None,
    ) -> Session:
        """Remember that a turn of `session_id` with prompt `ids` went to these instances;
        `reuses_answer`: whether `ids` holds the previous turn's answer (None: unknown)."""
        old = self._sessions.pop(session_id, None)
        if old is not None:
            self.index.remove(session_id, old.prompt_key)
        returning = old.is_returning if old is not None else True
        sends_reasoning = old.sends_reasoning if old is not None else False
        if reuses_answer is not None and old is not None:
            if old.return_limit is None:  # a limited return is kept whatever the answer
                returning = reuses_answer
            if old.answer_has_reasoning:
                sends_reasoning = reuses_answer
        held: dict[str, Any] = {}
        if old is not None:
            if old.prefill_url == prefill_url:
                held.update(prefill_stamp=old.prefill_stamp, prefill_tokens=old.prefill_tokens)
            if old.decode_url == decode_url:
                held.update(decode_stamp=old.decode_stamp, decode_tokens=old.decode_tokens)
            held["gap_s"] = old.gap_s if old.answered_at is None else now - old.answered_at
        session = Session(
            session_id=session_id, prefill_url=prefill_url, decode_url=decode_url, last_used=now,
            num_turns=1 if old is None else old.num_turns + 1,
            prompt_key=self.index.add(session_id, ids), num_prompt_tokens=len(ids),
            is_returning=returning, sends_reasoning=sends_reasoning,
            num_answer_tokens_hit=old.num_answer_tokens_hit if old else 0,
            num_answer_tokens_returnable=old.num_answer_tokens_returnable if old else 0,
            **held,
        )  # fmt: skip
        self._sessions[session_id] = session
        while len(self._sessions) > self.max_sessions:
            self._drop_oldest()
        return session

    def move(self, session_id: str, prefill_url: str | None, decode_url: str) -> None:
        """The current turn of `session_id` went to these instances instead (a retry)."""
        session = self._sessions.get(session_id)
        if session is not None:
            self._sessions[session_id] = _updated(
                session, prefill_url=prefill_url, decode_url=decode_url
            )

    def note_answer(
        self,
        session_id: str,
        prompt_ids: Sequence[int],
        num_tokens: int,
        answer_ids: Sequence[int] | None = None,
        message: Mapping[str, Any] | None = None,
        now: float = 0.0,
    ) -> None:
        """The turn of `session_id` with prompt `prompt_ids` answered with `num_tokens`
        tokens: `answer_ids` and, for a chat answer, the `message` as the client received it,
        where known (ignored if a later turn was recorded meanwhile)."""
        session = self._sessions.get(session_id)
        if session is None or session.num_prompt_tokens != len(prompt_ids):
            return
        update: dict[str, Any] = {
            "num_answer_tokens": num_tokens,
            "answered_at": now,
            "answer_has_reasoning": bool(message and message.get("reasoning_content")),
        }
        if answer_ids:
            end = len(prompt_ids) + len(answer_ids) - 1
            update["answer_end"] = end
            update["answer_digest"] = hash((*prompt_ids, *answer_ids[:-1]))
            if message is not None:
                self.answers.add(AnswerRecord(tuple(answer_ids), message), now, owner=session_id)
        self._sessions[session_id] = _updated(session, **update)

    def note_held(
        self, session_id: str, prompt_ids: Sequence[int], *, is_prefill: bool,
        stamp: int | None, num_tokens: int,
    ) -> None:  # fmt: skip
        """The instance of `session_id`'s turn with prompt `prompt_ids` on one side took
        `num_tokens` of its history when its pool clock read `stamp` (None: tokens that
        extend what it took at its current stamp, or will). Ignored if a later turn was
        recorded meanwhile."""
        session = self._sessions.get(session_id)
        if session is None or session.num_prompt_tokens != len(prompt_ids):
            return
        old_stamp = session.prefill_stamp if is_prefill else session.decode_stamp
        old_tokens = session.prefill_tokens if is_prefill else session.decode_tokens
        # Both notes of one turn's side (P's answer, the return at the answer's end) may
        # come in either order: the longer part stands (a later prompt is longer still).
        num_tokens = max(old_tokens, num_tokens)
        if stamp is None:
            stamp = old_stamp
        if is_prefill:
            change = {"prefill_stamp": stamp, "prefill_tokens": num_tokens}
        else:
            change = {"decode_stamp": stamp, "decode_tokens": num_tokens}
        self._sessions[session_id] = _updated(session, **change)

    def note_return_limit(self, session_id: str, limit: int | None) -> None:
        """`session_id`'s latest turn is returned up to `limit` tokens (None: whole)."""
        session = self._sessions.get(session_id)
        if session is not None:
            self._sessions[session_id] = _updated(session, return_limit=limit, is_returned=True)

    def note_answer_hit(self, session_id: str, num_hit: int, num_returnable: int) -> None:
        """At `session_id`'s latest turn, prefill had `num_hit` of the `num_returnable`
        tokens of the previous (returned) answer cached."""
        session = self._sessions.get(session_id)
        if session is not None:
            self._sessions[session_id] = _updated(
                session,
                num_answer_tokens_hit=session.num_answer_tokens_hit + num_hit,
                num_answer_tokens_returnable=session.num_answer_tokens_returnable + num_returnable,
            )

    def _expire(self, now: float) -> None:
        while self._sessions:
            oldest = next(iter(self._sessions.values()))
            if now - oldest.last_used <= self.ttl_s:
                return
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        session_id, session = self._sessions.popitem(last=False)
        self.index.remove(session_id, session.prompt_key)
        self.answers.drop_owner(session_id)
