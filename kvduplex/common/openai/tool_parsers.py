"""Tool calls in generated text, in the formats of vLLM's ``hermes`` and ``llama3_json``.

* ``hermes`` (Hermes, Qwen2.5, Qwen3): each call is a JSON object between
  ``<tool_call>`` and ``</tool_call>``; text outside the blocks is content::

      Let me look.<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>

* ``llama3_json`` (Llama 3.x): an answer that starts (after whitespace) with
  ``<|python_tag|>`` or ``{`` is calls, ``{"name": ..., "parameters": {...}}``
  objects separated by ``;``; any other answer is content.

One parser per answer, torch-free (the router runs it too): `feed` takes the
answer's text as it arrives, `finish` ends it; each returns the content and the
call deltas that became final. A whole answer is `feed` + `finish` once, so a
stream, however it is cut, adds up to exactly the non-streamed result, but for
a call cut short (below).

Design note: how a call streams. A call is announced (index, id, name) once
its object's head ``{"name": "...", "arguments":`` has arrived; from then on
the call stands, and its arguments stream as the model's own text of the
value, each fragment released once no later text can change it (trailing
whitespace and ``}`` wait: they may close the object). So ``arguments`` is the
JSON text the model wrote, not a re-serialisation of it, and a later turn that
sends the call back renders the same text into its prompt. An object whose
keys come in another order is announced whole once it is complete; a block
that holds no call (not JSON, no name) is content, markup included. Partial
markup (``<tool_c``) is held back, never streamed as content, until the next
text shows what it is. Content is the text outside the calls, but for the
whitespace it ends with when the answer called tools (so an answer that only
called tools has none: ``None``); whitespace waits for the next text to say.

A call cut short: the answer ended inside an announced call's object (its text
is not whole JSON: ``max_tokens``, a stop string, EOS). A stream has sent the
call's announcement and arguments already, so `finish` sends the rest of its
text as arguments and the call stands (`is_call_cut`). A whole answer has sent
nothing: `finish(keeps_cut_call=False)` makes the call's text content, markup
included, as vLLM answers a call that does not parse (the caller keeps it for
``max_tokens``, whose ``length`` already says the answer is partial).
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Protocol


def new_tool_call_id() -> str:
    """A call's id as OpenAI writes them: ``call_`` and 24 random hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    """One fragment of a streamed call: its first has the id and the name."""

    index: int
    """Which call of the answer (0, 1, ...)."""
    id: str | None = None
    name: str | None = None
    arguments: str = ""
    """The next fragment of the arguments' JSON text."""

    def to_json(self) -> dict[str, Any]:
        """``delta.tool_calls[i]`` of a stream chunk."""
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
            out["function"] = {"name": self.name, "arguments": self.arguments}
        else:
            out["function"] = {"arguments": self.arguments}
        return out


@dataclass
class ToolCall:
    """A whole call, as ``message.tool_calls[i]`` carries it."""

    id: str
    name: str
    arguments: str

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }  # fmt: skip


@dataclass
class Parsed:
    """What one `feed` or `finish` released."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallParser(Protocol):
    """One answer's tool-call parser (see the module docstring)."""

    num_calls: int
    """Calls announced so far (a call cut short and kept included)."""
    is_call_cut: bool
    """`finish` kept a call cut short (the last one): its arguments are not whole JSON."""

    def feed(self, text: str) -> Parsed: ...

    def finish(self, keeps_cut_call: bool = True) -> Parsed:
        """The end of the answer; a call cut short stays a call, or (`keeps_cut_call`
        False: none of it was sent) becomes content and is not counted."""
        ...


IdFactory = Callable[[], str]

_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)', re.S
)
"""The head of a call object written in the usual order; the arguments' value starts
at the match's end (its first character must have arrived)."""
_ARGUMENT_KEYS = ("arguments", "parameters")


def held_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (0 if none): markup that
    the next text may complete, so not yet releasable."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _stable_arguments(text: str) -> str:
    """What of an incomplete value's text no later text can change: all of it but the
    trailing whitespace and ``}`` (they may close the call's object)."""
    return text.rstrip(" \t\r\n}")


def _final_arguments(text: str) -> str:
    """The value's text once the call's object ended: less the object's own ``}``."""
    text = text.rstrip()
    return (text[:-1] if text.endswith("}") else text).rstrip()


class _CallObject:
    """One call's JSON object, fed its text as it grows (`update`) until it ends (`close`)."""

    def __init__(self, index: int, new_id: IdFactory) -> None:
        self.index = index
        self._new_id = new_id
        self._args_start = -1  # where the arguments' text starts, once the head arrived
        self._num_args_sent = 0

    @property
    def is_announced(self) -> bool:
        return self._args_start >= 0

    def update(self, text: str) -> list[ToolCallDelta]:
        """`text`: the object so far. The announcement once the head is there, then the
        arguments' newly stable text."""
        out: list[ToolCallDelta] = []
        if not self.is_announced:
            match = _HEAD.match(text)
            name = _json_string(match.group(1)) if match else None
            if match is None or name is None:
                return out
            self._args_start = match.end()
            out.append(ToolCallDelta(self.index, self._new_id(), name))
        stable = _stable_arguments(text[self._args_start :])
        if len(stable) > self._num_args_sent:
            out.append(ToolCallDelta(self.index, arguments=stable[self._num_args_sent :]))
            self._num_args_sent = len(stable)
        return out

    def close(self, text: str) -> list[ToolCallDelta] | None:
        """`text`: the whole object. The call's remaining deltas, or None if it is no call
        (then nothing of it was announced)."""
        out = self.update(text)
        if self.is_announced:
            rest = _final_arguments(text[self._args_start :])[self._num_args_sent :]
            if rest:
                out.append(ToolCallDelta(self.index, arguments=rest))
            return _merged(out)
        call = _call_of_json(text)
        if call is None:
            return None
        name, arguments = call
        return [ToolCallDelta(self.index, self._new_id(), name, arguments)]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _json_string(body: str) -> str | None:
    try:
        value = json.loads(f'"{body}"')
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _call_of_json(text: str) -> tuple[str, str] | None:
    """(name, arguments' JSON text) of a complete call object in any key order, or None."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):  # the model's text: anything, nested however deep
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in _ARGUMENT_KEYS if k in obj), None)
    if key is None:
        return None
    args = obj[key]
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _merged(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Fragments of one call folded together (the announcement keeps its id and name)."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        if out and out[-1].index == d.index and d.id is None:
            out[-1].arguments += d.arguments
        else:
            out.append(ToolCallDelta(d.index, d.id, d.name, d.arguments))
    return out


class _ContentSink:
    """Content text with its trailing whitespace held back: released with the next text,
    dropped at the end of an answer that called tools."""

    def __init__(self) -> None:
        self._space = ""

    def push(self, text: str) -> str:
        if not text:
            return ""
        text = self._space + text
        kept = text.rstrip()
        self._space = text[len(kept) :]
        return kept

    def finish(self, called_tools: bool) -> str:
        space, self._space = self._space, ""
        return "" if called_tools else space


class HermesToolParser:
    """``<tool_call>{...}</tool_call>`` blocks anywhere in the answer."""

    START = "<tool_call>"
    END = "</tool_call>"

    def __init__(self, new_id: IdFactory = new_tool_call_id) -> None:
        self.num_calls = 0
        self.is_call_cut = False
        self._new_id = new_id
        self._buf = ""  # text not yet released; inside a block, the whole block so far
        self._call: _CallObject | None = None
        self._content = _ContentSink()

    def feed(self, text: str) -> Parsed:
        self._buf += text
        out = Parsed()
        while True:
            if self._call is None:
                start = self._buf.find(self.START)
                if start < 0:
                    keep = held_suffix(self._buf, self.START)
                    out.content += self._content.push(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                out.content += self._content.push(self._buf[:start])
                self._buf = self._buf[start + len(self.START) :]
                self._call = _CallObject(self.num_calls, self._new_id)
                continue
            end = self._buf.find(self.END)
            if end < 0:
                keep = held_suffix(self._buf, self.END)
                out.calls += self._call.update(self._buf[: len(self._buf) - keep])
                return out
            self._close(self._buf[:end], self.END, out)
            self._buf = self._buf[end + len(self.END) :]

    def finish(self, keeps_cut_call: bool = True) -> Parsed:
        out = Parsed()
        if self._call is not None:  # a block the answer never closed
            is_cut = self._call.is_announced and not _is_json(self._buf)
            if is_cut and not keeps_cut_call:
                self._call = None
                out.content += self._content.push(self.START + self._buf)
            else:
                self._close(self._buf, "", out)
                self.is_call_cut = is_cut
        else:
            out.content += self._content.push(self._buf)
        self._buf = ""
        out.content += self._content.finish(self.num_calls > 0)
        return out

    def _close(self, body: str, end: str, out: Parsed) -> None:
        assert self._call is not None
        deltas = self._call.close(body)
        self._call = None
        if deltas is None:  # not a call: the block is text
            out.content += self._content.push(self.START + body + end)
            return
        out.calls += deltas
        self.num_calls += 1


class _Stage(enum.Enum):
    """Where a ``llama3_json`` answer is."""

    DECIDING = "deciding"
    """Its start has not shown yet whether it is calls or content."""
    CALLS = "calls"
    CONTENT = "content"
    """The rest of the answer is content."""


class Llama3JsonToolParser:
    """An answer of ``[<|python_tag|>]{call}; {call}...``, or plain content."""

    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, new_id: IdFactory = new_tool_call_id) -> None:
        self.num_calls = 0
        self.is_call_cut = False
        self._new_id = new_id
        self._buf = ""
        self._stage = _Stage.DECIDING
        self._call: _CallObject | None = None
        self._decoder = json.JSONDecoder()
        self._content = _ContentSink()

    def feed(self, text: str) -> Parsed:
        self._buf += text
        out = Parsed()
        if self._stage is _Stage.DECIDING:
            head = self._buf.lstrip()
            if not head or (self.PYTHON_TAG.startswith(head) and head != self.PYTHON_TAG):
                return out
            self._stage = _Stage.CALLS
            if head.startswith(self.PYTHON_TAG):
                self._buf = head[len(self.PYTHON_TAG) :]
            elif head.startswith("{"):
                self._buf = head
            else:
                self._stage = _Stage.CONTENT
        while self._stage is _Stage.CALLS:
            if self._call is None:
                rest = self._buf.lstrip()
                if rest.startswith(";") and self.num_calls > 0:
                    self._buf = rest[1:]
                    continue
                if not rest:
                    return out
                if not rest.startswith("{"):  # what follows the calls is content
                    self._buf = rest
                    self._stage = _Stage.CONTENT
                    break
                self._buf = rest
                self._call = _CallObject(self.num_calls, self._new_id)
            try:
                _, end = self._decoder.raw_decode(self._buf)
            except (ValueError, RecursionError):  # not complete (or never: see `finish`)
                out.calls += self._call.update(self._buf)
                return out
            self._close(self._buf[:end], out)
            self._buf = self._buf[end:]
        out.content += self._content.push(self._buf)
        self._buf = ""
        return out

    def finish(self, keeps_cut_call: bool = True) -> Parsed:
        out = Parsed()
        if self._call is not None:  # an object the answer never completed
            is_cut = self._call.is_announced  # `feed` found no whole JSON value
            if is_cut and not keeps_cut_call:
                self._call = None
                out.content += self._content.push(self._buf)
            else:
                self._close(self._buf, out)
                self.is_call_cut = is_cut
        else:
            out.content += self._content.push(self._buf)
        self._buf = ""
        out.content += self._content.finish(self.num_calls > 0)
        return out

    def _close(self, text: str, out: Parsed) -> None:
        assert self._call is not None
        deltas = self._call.close(text)
        self._call = None
        if deltas is None:  # JSON, but no call: it and the rest of the answer are content
            out.content += self._content.push(text)
            self._stage = _Stage.CONTENT
            return
        out.calls += deltas
        self.num_calls += 1


TOOL_CALL_PARSERS: dict[str, Callable[[IdFactory], ToolCallParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}
"""``--tool-call-parser`` names, as vLLM's."""
