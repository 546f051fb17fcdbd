"""A chat answer's text parsed into reasoning, content and tool calls, for one request.

Torch-free, shared by the instance (`instance/openai_routes.py`, for what it serves
directly) and the router (`router/parsing.py`, for what it routes): both
build a request's `ChatOutputParser` with `output_parser` and feed it the
answer's text in order. Reasoning (`reasoning.py`) comes first; its content is
what the tool-call parser (`tool_parsers.py`) reads.

Which requests are parsed (``--tool-call-parser``, ``--reasoning-parser``,
``--enable-auto-tool-choice``, as vLLM names them):

* reasoning: every chat request, once a reasoning parser is configured;
* tool calls: a request with ``tools`` and ``tool_choice`` auto (the default
  when tools are given), with ``--enable-auto-tool-choice``. ``tool_choice``
  none renders the tools into the prompt all the same, but the answer is not
  parsed. Asking for auto without the flag is a 400, in vLLM's words; a request
  that gives tools and no ``tool_choice`` is then answered without parsing, as
  before these flags existed.

Without any parser the answer is left as it is (`output_parser` returns None).
With one, an empty content is ``null``, and ``finish_reason`` ``stop`` becomes
``tool_calls`` when the answer holds a whole call (``length`` stays: the call may be
cut short).

A call cut short (the answer ended inside its JSON object): by ``max_tokens``,
it stays a call with the text it has, answer and stream alike (``length`` says
it is partial). By a stop string or EOS, a whole answer returns the call's
text as content, markup included, as vLLM does with a call that does not parse;
a stream has sent the call's deltas before the cut, so it ends the call with the
rest of its text, as for ``length``. Either way ``finish_reason`` stays ``stop``
unless a whole call came before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Protocol

from kvduplex.common.openai.parsing_config import ParsingConfig
from kvduplex.common.openai.protocol import ChatCompletionRequest
from kvduplex.common.openai.reasoning import ThinkParser
from kvduplex.common.openai.reasoning import starts_in_reasoning
from kvduplex.common.openai.tool_parsers import TOOL_CALL_PARSERS
from kvduplex.common.openai.tool_parsers import IdFactory
from kvduplex.common.openai.tool_parsers import ToolCall
from kvduplex.common.openai.tool_parsers import ToolCallDelta
from kvduplex.common.openai.tool_parsers import ToolCallParser
from kvduplex.common.openai.tool_parsers import new_tool_call_id

RAW_OUTPUT_HEADER = "X-KVDuplex-Raw-Output"
"""Sent by the router to decode: answer with the model's raw text (the router parses it).
Harmless from anyone else: it only turns this instance's parsing off for the request."""

PROMPT_TAIL_TOKENS = 32
"""How many of the prompt's last tokens are decoded to see how its template ended."""

AUTO_TOOL_CHOICE_ERROR = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def check_tool_choice(request: ChatCompletionRequest, flags: ParsingConfig) -> None:
    """ValueError (a 400) for ``tool_choice: auto`` where calls cannot be parsed."""
    if request.tool_choice == "auto" and not (
        flags.enable_auto_tool_choice and flags.tool_call_parser
    ):
        raise ValueError(AUTO_TOOL_CHOICE_ERROR)


def parses_tool_calls(request: ChatCompletionRequest, flags: ParsingConfig) -> bool:
    return bool(
        flags.enable_auto_tool_choice and flags.tool_call_parser and request.tools
        and request.tool_choice in (None, "auto")
    )  # fmt: skip


def prompt_tail(tokenizer: Decoder, prompt_ids: Sequence[int]) -> str:
    """The text of the prompt's last tokens, special tokens included."""
    return tokenizer.decode(list(prompt_ids[-PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)


def is_constrained(request: ChatCompletionRequest) -> bool:
    """The answer is constrained by a grammar from its first token."""
    fmt = request.response_format
    forced = request.tool_choice == "required" or isinstance(request.tool_choice, dict)
    return forced or (fmt is not None and fmt.type != "text")


def output_parser(
    request: ChatCompletionRequest,
    flags: ParsingConfig,
    tail: str,
    new_id: IdFactory = new_tool_call_id,
) -> ChatOutputParser | None:
    """The parser of `request`'s answer, or None when nothing is parsed; `tail` is
    `prompt_tail` of its prompt. An answer constrained by a grammar from its first token
    (a json `response_format`, `tool_choice` required or named: `common/openai/structured.py`)
    is never parsed: it has no reasoning, and forced calls are rendered from the grammar."""
    if is_constrained(request):
        return None
    think = None
    if flags.reasoning_parser:
        think = ThinkParser(starts_in_reasoning(flags.reasoning_parser, tail))
    tools = None
    if parses_tool_calls(request, flags):
        tools = TOOL_CALL_PARSERS[flags.tool_call_parser](new_id)
    if think is None and tools is None:
        return None
    return ChatOutputParser(think, tools)


@dataclass
class DeltaMessage:
    """What one step of the answer adds: a stream chunk's ``delta`` (less the role)."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.content or self.reasoning_content or self.tool_calls)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.reasoning_content:
            out["reasoning_content"] = self.reasoning_content
        if self.content:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = [c.to_json() for c in self.tool_calls]
        return out

    def extend(self, other: DeltaMessage) -> None:
        """`other` (what came next) added to this delta."""
        self.content += other.content
        self.reasoning_content += other.reasoning_content
        self.add_calls(other.tool_calls)

    def add_calls(self, calls: list[ToolCallDelta]) -> None:
        """Append `calls`, folding a call's fragments into its entry of this delta."""
        for c in calls:
            last = self.tool_calls[-1] if self.tool_calls else None
            if last is not None and last.index == c.index and c.id is None:
                last.arguments += c.arguments
            else:
                self.tool_calls.append(ToolCallDelta(c.index, c.id, c.name, c.arguments))


@dataclass
class ParsedMessage:
    """A whole answer parsed: the non-streamed ``message`` and ``finish_reason``."""

    content: str | None
    reasoning_content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None
    has_reasoning_parser: bool

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.has_reasoning_parser:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [c.to_json() for c in self.tool_calls]
        return out


class ChatOutputParser:
    """One answer: `feed` its text in order, then `finish` once."""

    def __init__(self, think: ThinkParser | None, tools: ToolCallParser | None) -> None:
        self._think = think
        self._tools = tools

    @property
    def has_reasoning_parser(self) -> bool:
        return self._think is not None

    @property
    def may_start_with_reasoning(self) -> bool:
        """Before the answer: whether it may begin with reasoning (both parsers read
        reasoning only at an answer's start, `reasoning.starts_in_reasoning`)."""
        return self._think is not None and self._think.may_reason

    def feed(self, text: str) -> DeltaMessage:
        """What `text` (the answer's next text) makes final."""
        reasoning, content = self._think.feed(text) if self._think else ("", text)
        return self._delta(reasoning, content, is_final=False)

    def step(
        self, text: str, finish_reason: str | None, is_final: bool
    ) -> tuple[DeltaMessage, str | None]:
        """One step of a stream: what `text` makes final and, on the last step
        (`is_final`), what was held back, with the answer's finish reason."""
        delta = self.feed(text)
        if not is_final:
            return delta, finish_reason
        last, finish_reason = self.finish(finish_reason)
        delta.extend(last)
        return delta, finish_reason

    def finish(self, finish_reason: str | None) -> tuple[DeltaMessage, str | None]:
        """A stream's end: what was still held back, and the answer's finish reason (see
        the module docstring; a call cut short stays a call: its deltas went out)."""
        return self._finish(finish_reason, keeps_cut_call=True)

    def _finish(
        self, finish_reason: str | None, keeps_cut_call: bool
    ) -> tuple[DeltaMessage, str | None]:
        reasoning, content = self._think.finish() if self._think else ("", "")
        delta = self._delta(reasoning, content, is_final=True, keeps_cut_call=keeps_cut_call)
        tools = self._tools
        if tools is not None and finish_reason == "stop":
            num_whole_calls = tools.num_calls - (1 if tools.is_call_cut else 0)
            if num_whole_calls > 0:
                finish_reason = "tool_calls"
        return delta, finish_reason

    def parse(self, text: str, finish_reason: str | None) -> ParsedMessage:
        """A whole answer at once: the same as feeding it in any pieces, but for a call
        cut short by a stop string or EOS, whose text is content (module docstring)."""
        first = self.feed(text)
        last, reason = self._finish(finish_reason, keeps_cut_call=finish_reason == "length")
        content = first.content + last.content
        reasoning = first.reasoning_content + last.reasoning_content
        # `first` announced a call that `last` made content: its index is not counted.
        num_calls = self._tools.num_calls if self._tools is not None else 0
        calls: dict[int, ToolCall] = {}
        for c in [*first.tool_calls, *last.tool_calls]:
            if c.index >= num_calls:
                continue
            if c.id is not None:
                calls[c.index] = ToolCall(c.id, c.name or "", c.arguments)
            else:
                calls[c.index].arguments += c.arguments
        return ParsedMessage(
            content or None, reasoning or None, [calls[i] for i in sorted(calls)], reason,
            self.has_reasoning_parser,
        )  # fmt: skip

    def _delta(
        self, reasoning: str, content: str, is_final: bool, keeps_cut_call: bool = True
    ) -> DeltaMessage:
        out = DeltaMessage(reasoning_content=reasoning)
        if self._tools is None:
            out.content = content
            return out
        parsed = self._tools.feed(content) if content else None
        if parsed is not None:
            out.content += parsed.content
            out.add_calls(parsed.calls)
        if is_final:
            parsed = self._tools.finish(keeps_cut_call)
            out.content += parsed.content
            out.add_calls(parsed.calls)
        return out
