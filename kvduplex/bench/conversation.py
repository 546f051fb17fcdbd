"""A session's history as requests: token-id prompts or chat messages.

Token-id form (``/v1/completions``): the prompt of turn t is the prompt of
turn t-1, then the answer's token ids as the server returned them
(``return_token_ids``), then the new input's ids. The history is exactly what
the server computed, so a prefix cache (or KV returned by decode) can cover all
of it but the new input.

Chat form (``/v1/chat/completions``): system, then user / assistant / tool
messages. In the agentic shapes an answer becomes an assistant message with a
``tool_calls`` entry (content null) followed by a ``tool`` message carrying the
next input, and the request lists the tool; ``plain`` turns those into
assistant text and user messages for servers that refuse tools. The server
renders the messages with its chat template, so the answer's tokens in the
next prompt are the text's, which need not equal the ids generated.

Agent form (``/v1/chat/completions``, `AgentConversation`): an agent's tool
loop whose calls the model makes itself. Turns alternate: a forced call
(``tool_choice: required``: grammar-constrained decoding makes even random
weights write a valid call of the shell tool), sent back exactly as received,
then its result as a ``tool`` message; and a free answer (``tool_choice:
none``) that the server's reasoning parser splits, sent back without its
``reasoning_content`` as OpenAI's convention has clients do, then a user
message. A forced call's length is the call's (the grammar ends it), not the
workload's. The server is meant to run ``--reasoning-parser deepseek_r1``
(`AGENT_SERVER_FLAGS`): that parser reads an answer as reasoning until it
writes ``</think>``, as DeepSeek-R1 begins its answers inside the think block,
so a random model's free answer is all reasoning, and the client strips all of
it.

Every request names its session twice: OpenAI's ``prompt_cache_key`` field and
the ``X-Session-Id`` header.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Protocol


class PromptForm(enum.Enum):
    TOKENS = "tokens"
    CHAT = "chat"
    AGENT = "agent"

    @property
    def is_chat(self) -> bool:
        return self is not PromptForm.TOKENS


TOOL_NAME = "run_shell"

TOOL_CALL_SHAPES = frozenset({"agentic", "coding_agent"})
"""Shapes whose answers are tool calls and inputs tool results in chat form."""

AGENT_SERVER_FLAGS = ("--reasoning-parser", "deepseek_r1")
"""What the agent form needs of the server (router, or colocated instance)."""

AGENT_COMMAND_CHARS = 48
"""The longest command a forced call may write (so that its grammar ends the call)."""

AGENT_CALL_TOKENS = 128
"""``max_tokens`` of a forced call, at least: room for a whole call (its name, up to
`AGENT_COMMAND_CHARS` of command, the JSON around them; the grammar ends it sooner)."""


def tool_definitions(max_command_chars: int | None = None) -> list[dict[str, Any]]:
    """The ``tools`` of an agentic chat request: one shell tool (a fresh copy each call),
    its command at most `max_command_chars` long if given."""
    command: dict[str, Any] = {"type": "string"}
    if max_command_chars is not None:
        command["maxLength"] = max_command_chars
    return [
        {
            "type": "function",
            "function": {
                "name": TOOL_NAME,
                "description": "Run a shell command in the repository and return its output.",
                "parameters": {
                    "type": "object",
                    "properties": {"command": command},
                    "required": ["command"],
                },
            },
        }
    ]


def text_ids(text: str) -> list[int]:
    """Token ids of ASCII `text` under the byte tokenizer: its bytes."""
    return list(text.encode("utf-8"))


@dataclass(frozen=True)
class Request:
    """One turn's request: where it goes and what it carries."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str]


class Conversation(Protocol):
    def next_request(self, new_input: str, max_tokens: int) -> Request:
        """The request of the next turn: the history so far plus `new_input`."""
        ...

    def add_answer(
        self, text: str, token_ids: list[int], message: dict[str, Any] | None = None
    ) -> bool:
        """Append the answer the server gave to the last request (`message`: a chat
        answer's assistant message as the client built it); whether the history now holds
        it as it was generated (False: the client rewrote it, or stripped its reasoning)."""
        ...


def _common(model: str, session: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "prompt_cache_key": session,
    }


@dataclass
class TokenConversation:
    """Token-id prompts; the history grows by answer ids and new input ids."""

    model: str
    session: str
    system: str
    ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.ids:
            self.ids = text_ids(self.system)

    def next_request(self, new_input: str, max_tokens: int) -> Request:
        self.ids.extend(text_ids(new_input))
        body = {**_common(self.model, self.session, max_tokens), "prompt": list(self.ids)}
        return Request("/v1/completions", body, {"X-Session-Id": self.session})

    def add_answer(
        self, text: str, token_ids: list[int], message: dict[str, Any] | None = None
    ) -> bool:
        self.ids.extend(token_ids)
        return True


@dataclass
class ChatConversation:
    """Chat messages; with `use_tools` answers are tool calls and inputs tool results."""

    model: str
    session: str
    system: str
    use_tools: bool
    messages: list[dict[str, Any]] = field(default_factory=list)
    num_calls: int = 0

    def __post_init__(self) -> None:
        if not self.messages:
            self.messages = [{"role": "system", "content": self.system}]

    def next_request(self, new_input: str, max_tokens: int) -> Request:
        body = self._next_body(new_input, max_tokens)
        return Request("/v1/chat/completions", body, {"X-Session-Id": self.session})

    def _next_body(self, new_input: str, max_tokens: int) -> dict[str, Any]:
        """The next request's body; `new_input` is a tool's result after a call, else the
        user's message."""
        last = self.messages[-1]
        if last["role"] == "assistant" and last.get("tool_calls"):
            call_id = last["tool_calls"][0]["id"]
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": new_input})
        else:
            self.messages.append({"role": "user", "content": new_input})
        body = {**_common(self.model, self.session, max_tokens), "messages": list(self.messages)}
        if self.use_tools:
            body["tools"] = tool_definitions()
        return body

    def add_answer(
        self, text: str, token_ids: list[int], message: dict[str, Any] | None = None
    ) -> bool:
        if not self.use_tools:
            self.messages.append({"role": "assistant", "content": text})
            return True
        self.num_calls += 1
        call = {
            "id": f"call-{self.session}-{self.num_calls}",
            "type": "function",
            "function": {"name": TOOL_NAME, "arguments": json.dumps({"command": text})},
        }
        self.messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        return False


@dataclass
class AgentConversation(ChatConversation):
    """An agent's tool loop (see the module docstring): even turns force a call, sent back
    as received with its result; odd turns answer freely, sent back without reasoning."""

    use_tools: bool = True
    num_turns: int = 0

    def _next_body(self, new_input: str, max_tokens: int) -> dict[str, Any]:
        body = super()._next_body(new_input, max_tokens)
        body["tools"] = tool_definitions(AGENT_COMMAND_CHARS)
        if self.num_turns % 2 == 0:  # one call, written under the tool's grammar
            body.update(tool_choice="required", parallel_tool_calls=False)
            body["max_tokens"] = max(max_tokens, AGENT_CALL_TOKENS)
        else:
            body["tool_choice"] = "none"
        self.num_turns += 1
        return body

    def add_answer(
        self, text: str, token_ids: list[int], message: dict[str, Any] | None = None
    ) -> bool:
        if message is None:
            message = {"role": "assistant", "content": text}
        if message.get("tool_calls"):
            self.messages.append(dict(message))  # as received
            return True
        # Reasoning stripped, as OpenAI's convention has clients do.
        self.messages.append({"role": "assistant", "content": message.get("content") or ""})
        return not message.get("reasoning_content")


def new_conversation(
    form: PromptForm, model: str, session: str, system: str, *, shape: str, chat_plain: bool
) -> Conversation:
    """The history of one session in `form`; tools only in the shapes of `TOOL_CALL_SHAPES`,
    unless plain (the agent form always has them)."""
    if form is PromptForm.TOKENS:
        return TokenConversation(model, session, system)
    if form is PromptForm.AGENT:
        return AgentConversation(model, session, system)
    use_tools = shape in TOOL_CALL_SHAPES and not chat_plain
    return ChatConversation(model, session, system, use_tools=use_tools)
