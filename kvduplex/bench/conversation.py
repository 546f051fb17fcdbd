"""A session's history as requests: token-id prompts or chat messages.

Token-id form (``/v1/completions``): the prompt of turn t is the prompt of
turn t-1, then the answer's token ids as the server returned them
(``return_token_ids``), then the new input's ids. The history is exactly what
the server computed, so a prefix cache (or KV returned by decode) can cover all
of it but the new input.

Chat form (``/v1/chat/completions``): system, then user / assistant / tool
messages. In the agentic shape an answer becomes an assistant message with a
``tool_calls`` entry (content null) followed by a ``tool`` message carrying the
next input, and the request lists the tool; ``plain`` turns those into
assistant text and user messages for servers that refuse tools. The server
renders the messages with its chat template, so the answer's tokens in the
next prompt are the text's, which need not equal the ids generated.

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


TOOL_NAME = "run_shell"


def tool_definitions() -> list[dict[str, Any]]:
    """The ``tools`` of an agentic chat request: one shell tool (a fresh copy each call)."""
    return [
        {
            "type": "function",
            "function": {
                "name": TOOL_NAME,
                "description": "Run a shell command in the repository and return its output.",
                "parameters": {
                    "type": "object",
                    "properties": {"command": {"type": "string"}},
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

    def add_answer(self, text: str, token_ids: list[int]) -> None:
        """Append the answer the server gave to the last request."""
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

    def add_answer(self, text: str, token_ids: list[int]) -> None:
        self.ids.extend(token_ids)


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
        last = self.messages[-1]
        if self.use_tools and last["role"] == "assistant" and last.get("tool_calls"):
            call_id = last["tool_calls"][0]["id"]
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": new_input})
        else:
            self.messages.append({"role": "user", "content": new_input})
        body = {**_common(self.model, self.session, max_tokens), "messages": list(self.messages)}
        if self.use_tools:
            body["tools"] = tool_definitions()
        return Request("/v1/chat/completions", body, {"X-Session-Id": self.session})

    def add_answer(self, text: str, token_ids: list[int]) -> None:
        if not self.use_tools:
            self.messages.append({"role": "assistant", "content": text})
            return
        self.num_calls += 1
        call = {
            "id": f"call-{self.session}-{self.num_calls}",
            "type": "function",
            "function": {"name": TOOL_NAME, "arguments": json.dumps({"command": text})},
        }
        self.messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def new_conversation(
    form: PromptForm, model: str, session: str, system: str, *, shape: str, chat_plain: bool
) -> Conversation:
    """The history of one session in `form`; tools only in the agentic shape, unless plain."""
    if form is PromptForm.TOKENS:
        return TokenConversation(model, session, system)
    return ChatConversation(model, session, system, use_tools=shape == "agentic" and not chat_plain)
