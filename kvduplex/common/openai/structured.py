"""Structured output at the API: which grammar a request asks for, and forced tool calls.

* `grammar_spec_of`: ``response_format`` json_object / json_schema, or a forced
  ``tool_choice``, as the `GrammarSpec` the engine enforces (None: free text).
  The router calls it too, to send the same spec to the prefill instance.
* ``tool_choice: "required"``: the answer is constrained to a JSON array of one
  or more ``{"name": <a tool>, "parameters": <its arguments>}`` (as vLLM does);
  ``parallel_tool_calls: false`` allows one. Returned as ``tool_calls`` with
  finish_reason ``tool_calls``.
* a named function: the answer is that function's arguments object, returned
  as one tool call; finish_reason stays ``stop`` (as OpenAI and vLLM answer).
* Cut by ``max_tokens`` before the grammar completed: finish_reason ``length``
  and the partial text as ordinary content (non-streamed; a stream has sent
  what it parsed so far as tool-call deltas).

`ToolCallStream` turns the growing answer text into tool calls, incrementally.
The grammar makes the text compact and in schema order (see
`kvduplex.engine.structured`), so a call reads exactly::

    [{"name":"get_weather","parameters":{"city":"Paris"}},{"name":...}]   (required)
     ^ call 0 opens     name ^           ^ arguments ... ^ call 0 ends
    {"city":"Paris"}                                                     (named)
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from kvduplex.common.openai.protocol import ChatCompletionRequest
from kvduplex.common.openai.protocol import OpenAIRequest
from kvduplex.common.openai.protocol import named_tool
from kvduplex.common.sampling import GrammarKind
from kvduplex.common.sampling import GrammarSpec

ANY_OBJECT: dict[str, Any] = {"type": "object"}
"""The arguments schema of a tool that declares no parameters."""


class ToolChoiceMode(enum.Enum):
    REQUIRED = "required"
    """One or more calls, each to any of the tools."""
    NAMED = "named"
    """Exactly one call, to the named function."""


@dataclass(frozen=True)
class ForcedToolCalls:
    """A request whose answer must be tool calls."""

    mode: ToolChoiceMode
    name: str | None = None
    """The function (`ToolChoiceMode.NAMED`)."""


def forced_tool_calls(body: OpenAIRequest) -> ForcedToolCalls | None:
    """The forced tool calls of a validated chat request, or None (auto, none, or no tools)."""
    if not isinstance(body, ChatCompletionRequest) or not body.tools:
        return None
    if body.tool_choice == "required":
        return ForcedToolCalls(ToolChoiceMode.REQUIRED)
    name = named_tool(body.tool_choice)
    return ForcedToolCalls(ToolChoiceMode.NAMED, name) if name is not None else None


def _parameters(body: ChatCompletionRequest, name: str | None) -> dict[str, Any]:
    for tool in body.tools or ():
        if tool.function.name == name:
            return tool.function.parameters or ANY_OBJECT
    raise ValueError(f"no tool named {name!r}")  # validation already refused it


def _required_schema(body: ChatCompletionRequest) -> dict[str, Any]:
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "parameters": t.function.parameters or ANY_OBJECT,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in body.tools or ()
    ]
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if body.parallel_tool_calls is False:
        array["maxItems"] = 1
    return array


def grammar_spec_of(body: OpenAIRequest) -> GrammarSpec | None:
    """The grammar a validated request's answer must match, or None for free text."""
    forced = forced_tool_calls(body)
    if forced is not None:
        assert isinstance(body, ChatCompletionRequest)
        if forced.mode is ToolChoiceMode.REQUIRED:
            schema = _required_schema(body)
        else:
            schema = _parameters(body, forced.name)
        return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema, ensure_ascii=False))
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec(GrammarKind.JSON_OBJECT)
    assert fmt.json_schema is not None
    return GrammarSpec(
        GrammarKind.JSON_SCHEMA, json.dumps(fmt.json_schema.schema_, ensure_ascii=False)
    )


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class _Call:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


_CALL_HEAD = re.compile(r'\{"name":("(?:[^"\\]|\\.)*"),"parameters":')
"""How a required-mode call begins, up to its arguments (compact, in schema order)."""


class ToolCallStream:
    """Reads the answer text of a forced tool choice as it grows; reports each call's
    name once known and its arguments text as it arrives.

    `push` returns this text's tool-call deltas in OpenAI's streamed form
    (``{"index", "id", "type", "function": {"name", "arguments"}}`` for a call's first
    delta, ``{"index", "function": {"arguments"}}`` after); `calls` the calls so far;
    `is_complete` whether the answer so far is whole (the grammar ends an answer only
    there: a stop string can cut one short).
    """

    def __init__(self, forced: ForcedToolCalls) -> None:
        self.forced = forced
        self._text: list[str] = []
        self._calls: list[_Call] = []
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._head = ""  # required mode: the current call's text before its arguments
        self._in_arguments = False
        self._args_depth = 0  # depth at which the current arguments value began
        self._announced = False  # named mode: the call's first delta was made
        if forced.mode is ToolChoiceMode.NAMED:
            assert forced.name is not None
            self._calls.append(_Call(new_call_id(), forced.name))
            self._in_arguments = True

    @property
    def calls(self) -> list[dict[str, Any]]:
        """OpenAI ``tool_calls`` of the calls seen so far."""
        return [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": "".join(c.arguments)},
            }
            for c in self._calls
        ]

    def is_complete(self) -> bool:
        """The answer so far is a whole JSON value (its calls, or the named call's
        arguments)."""
        try:
            json.loads("".join(self._text))
        except ValueError:
            return False
        return True

    def push(self, text: str) -> list[dict[str, Any]]:
        """Read `text` (the next piece of the answer); the tool-call deltas it completes."""
        self._text.append(text)
        out: dict[int, dict[str, Any]] = {}
        if self.forced.mode is ToolChoiceMode.NAMED:
            call = self._calls[0]
            if not self._announced:  # the call's first delta names it
                self._announced = True
                self._delta(out, 0).update(
                    id=call.id, type="function", function={"name": call.name}
                )
            if text:
                call.arguments.append(text)
            self._delta(out, 0).setdefault("function", {})["arguments"] = text
            return list(out.values())
        run: list[str] = []  # arguments text of the current call within `text`
        for ch in text:
            if self._in_arguments:
                run.append(ch)
            elif self._depth >= 2:
                self._head += ch
            closed_string = self._scan(ch)
            if self._in_arguments and self._depth == self._args_depth and not self._in_string:
                if ch in "}]" or (closed_string and self._depth == 2):
                    self._end_arguments(out, run)
                    run = []
            elif not self._in_arguments and self._depth >= 2:
                self._try_open_call(out)
        if self._in_arguments and run:
            self._append_arguments(out, run)
        return list(out.values())

    def _scan(self, ch: str) -> bool:
        """Follow strings and nesting; True if `ch` closed a string."""
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
                return True
            return False
        if ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
            if self._depth == 2:
                self._head = ch
        elif ch in "}]":
            self._depth -= 1
        return False

    def _try_open_call(self, out: dict[int, dict[str, Any]]) -> None:
        match = _CALL_HEAD.fullmatch(self._head)
        if match is None:
            return
        call = _Call(new_call_id(), json.loads(match.group(1)))
        self._calls.append(call)
        index = len(self._calls) - 1
        delta = self._delta(out, index)
        delta.update(id=call.id, type="function")
        delta["function"] = {"name": call.name, "arguments": ""}
        self._in_arguments = True
        self._args_depth = 2  # the arguments value is the next one at depth 2
        self._head = ""

    def _end_arguments(self, out: dict[int, dict[str, Any]], run: list[str]) -> None:
        if run:
            self._append_arguments(out, run)
        self._in_arguments = False

    def _append_arguments(self, out: dict[int, dict[str, Any]], run: list[str]) -> None:
        text = "".join(run)
        index = len(self._calls) - 1
        self._calls[index].arguments.append(text)
        function = self._delta(out, index).setdefault("function", {})
        function["arguments"] = function.get("arguments", "") + text

    def _delta(self, out: dict[int, dict[str, Any]], index: int) -> dict[str, Any]:
        return out.setdefault(index, {"index": index})


def tool_call_message(
    forced: ForcedToolCalls, text: str, finish_reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """The assistant message and finish_reason of a whole (non-streamed) forced answer.

    A complete answer becomes ``tool_calls`` (content null); an answer cut short
    (``length``, ``abort``, or ``stop`` at a stop string) stays text content.
    """
    stream = ToolCallStream(forced)
    stream.push(text)
    if finish_reason != "stop" or not stream.is_complete():
        return {"role": "assistant", "content": text}, finish_reason
    message = {"role": "assistant", "content": None, "tool_calls": stream.calls}
    return message, finish_reason_of(forced, finish_reason, stream)


def finish_reason_of(
    forced: ForcedToolCalls, finish_reason: str | None, stream: ToolCallStream
) -> str | None:
    """The finish_reason a forced answer reports: a complete required-mode answer ends
    with ``tool_calls``; the rest (one a stop string cut short included) as the engine
    said. `stream` has read the whole answer."""
    if finish_reason == "stop" and forced.mode is ToolChoiceMode.REQUIRED and stream.is_complete():
        return "tool_calls"
    return finish_reason


def stream_choice(
    deltas: list[dict[str, Any]], finish_reason: str | None, is_first: bool
) -> dict[str, Any]:
    """A chat stream chunk's choice carrying tool-call deltas (and the role, first)."""
    delta: dict[str, Any] = {"role": "assistant", "content": None} if is_first else {}
    if deltas:
        delta["tool_calls"] = deltas
    return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}


__all__ = [
    "ForcedToolCalls",
    "ToolCallStream",
    "ToolChoiceMode",
    "finish_reason_of",
    "forced_tool_calls",
    "grammar_spec_of",
    "stream_choice",
    "tool_call_message",
]
