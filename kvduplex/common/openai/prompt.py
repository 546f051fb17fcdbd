"""A request's prompt as token ids: one function for the instance and the router.

* Completions: a text prompt is encoded with the model's special tokens (BOS);
  a token-id prompt is taken as it is; a batch of one prompt is unwrapped.
* Chat: the messages and tools go through the model's chat template the way
  transformers' ``apply_chat_template`` takes them (as vLLM passes them too):
  ``content`` as one string (text parts joined; null is ""), an assistant's
  ``tool_calls`` with their ``function.arguments`` parsed into an object when
  they are JSON text of one, a tool message's ``tool_call_id``, and
  ``tools=[{"type": "function", "function": {...}}]``. The template's text is
  encoded without adding special tokens again.

Because the router computes exactly the ids an instance would, it can route by
them (prefix, session) and hand them to the prefill instance.

With an `AnswerBook` (the answers this process generated or relayed), an
assistant message sent back as it was returned keeps the ids the model
generated (`transcript_splice.splice_chat_ids`); everything else is rendered as usual.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvduplex.common.openai.protocol import MAX_NESTING_DEPTH
from kvduplex.common.openai.protocol import ChatCompletionRequest
from kvduplex.common.openai.protocol import ChatMessage
from kvduplex.common.openai.protocol import ChatTool
from kvduplex.common.openai.protocol import CompletionRequest
from kvduplex.common.openai.protocol import OpenAIRequest
from kvduplex.common.openai.protocol import check_nesting
from kvduplex.common.openai.protocol import check_unicode_tree
from kvduplex.common.openai.transcript import AnswerBook
from kvduplex.common.openai.transcript_heads import HeadCache
from kvduplex.common.openai.transcript_spans import Placement
from kvduplex.common.openai.transcript_splice import splice_chat_ids
from kvduplex.common.tokenizer import Tokenizer


class PromptError(ValueError):
    """A prompt that cannot be built; `param` names the request field to fix."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def prompt_token_ids(
    request: OpenAIRequest,
    tokenizer: Tokenizer,
    answers: AnswerBook | None = None,
    now: float = 0.0,
) -> list[int]:
    """The prompt's token ids; PromptError if there is none to build. `answers` (read at
    clock time `now`) gives a chat prompt the generated ids of the answers it sends back.

    The same in two steps, `placed_answers` then `build_prompt_ids`, where only the
    second may run off the thread that owns `answers` (the router renders in a pool).
    """
    placements = placed_answers(request, answers, now)
    return build_prompt_ids(request, tokenizer, placements, answers.heads if answers else None)


def placed_answers(
    request: OpenAIRequest, answers: AnswerBook | None, now: float
) -> list[Placement | None] | None:
    """A chat prompt's answers found in `answers` (`answer_placements`), or None where there
    are none to place. Cheap (a dict lookup per assistant message), but it touches the
    book: call it where the book is updated (the router's event loop)."""
    if answers is None or not isinstance(request, ChatCompletionRequest):
        return None
    try:
        placements = answer_placements(request.messages, answers, now)
    except RecursionError:
        raise _too_deep(request) from None
    except ValueError as exc:
        raise PromptError(str(exc), "messages") from None
    return placements if any(p is not None for p in placements) else None


def build_prompt_ids(
    request: OpenAIRequest,
    tokenizer: Tokenizer,
    placements: Sequence[Placement | None] | None = None,
    heads: HeadCache | None = None,
) -> list[int]:
    """The prompt's token ids, with `placements` (of `placed_answers`) spliced in; the
    template's work (rendering, tokenizing), safe in any thread. PromptError if there is no
    prompt to build.

    Validation bounds how deep a body nests (`MAX_NESTING_DEPTH`); should building the
    prompt still recurse too deep (a template's own recursion), that is a PromptError
    too, never a server error.
    """
    try:
        if isinstance(request, ChatCompletionRequest):
            ids = chat_prompt_ids(request, tokenizer, placements, heads)
        else:
            ids = completion_prompt_ids(request, tokenizer)
    except RecursionError:
        raise _too_deep(request) from None
    if not ids:
        raise PromptError("the prompt is empty", "prompt")
    return ids


def _too_deep(request: OpenAIRequest) -> PromptError:
    param = "prompt"
    if isinstance(request, ChatCompletionRequest):
        param = "tools" if request.tools else "messages"
    return PromptError(
        f"the request nests too deeply to build its prompt; keep {param} within "
        f"{MAX_NESTING_DEPTH} levels of lists and objects",
        param,
    )


def completion_prompt_ids(request: CompletionRequest, tokenizer: Tokenizer) -> list[int]:
    try:
        prompt = request.single_prompt()
    except ValueError as exc:
        raise PromptError(str(exc), "prompt") from None
    if isinstance(prompt, str):
        if not prompt:
            raise PromptError("prompt is empty", "prompt")
        return list(tokenizer.encode(prompt, add_special_tokens=True))
    return prompt


def chat_prompt_ids(
    request: ChatCompletionRequest,
    tokenizer: Tokenizer,
    placements: Sequence[Placement | None] | None = None,
    heads: HeadCache | None = None,
) -> list[int]:
    messages = template_messages(request.messages)
    tools = template_tools(request.tools)
    try:
        if placements is not None and any(p is not None for p in placements):
            spliced = splice_chat_ids(tokenizer, messages, tools, placements, heads)
            if spliced is not None:
                return spliced
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    except ValueError as exc:
        raise PromptError(str(exc), "messages") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def answer_placements(
    messages: Sequence[ChatMessage], answers: AnswerBook | None, now: float
) -> list[Placement | None]:
    """For each message, the generated ids `answers` holds for it (assistant messages sent
    back as they were returned: the key is taken from the message as sent, tool-call
    arguments as text)."""
    if answers is None:
        return [None] * len(messages)
    return [
        answers.place(m.model_dump(exclude_none=True), now) if m.role == "assistant" else None
        for m in messages
    ]


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as a chat template reads them (see the module docstring)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {
                        "name": c.function.name,
                        "arguments": _arguments(c.function.arguments),
                    },
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def template_tools(tools: Sequence[ChatTool] | None) -> list[dict[str, Any]] | None:
    """The tool definitions as a chat template reads them; None without tools."""
    if not tools:
        return None
    out: list[dict[str, Any]] = []
    for tool in tools:
        function: dict[str, Any] = {"name": tool.function.name}
        if tool.function.description is not None:
            function["description"] = tool.function.description
        if tool.function.parameters is not None:
            function["parameters"] = tool.function.parameters
        out.append({"type": tool.type, "function": function})
    return out


def _arguments(arguments: str | dict[str, Any]) -> str | dict[str, Any]:
    """Arguments as an object when they are JSON text of one (templates expect a mapping);
    otherwise unchanged (a model may have written invalid JSON, or JSON nested deeper than
    a body may be; the history keeps it as text)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
        check_unicode_tree(parsed)  # "\\ud800" in JSON text is a lone surrogate once parsed
        check_nesting(parsed)
    except (ValueError, RecursionError):
        return arguments
    return parsed if isinstance(parsed, dict) else arguments
