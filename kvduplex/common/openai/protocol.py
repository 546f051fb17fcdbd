"""OpenAI request bodies (pydantic) and the error format.

Validation happens here, so a bad request turns into a 400 with a message that
names the field, before anything reaches the engine. The router validates with
the same models, so it refuses what an instance would, in the same words.

A body naming a field these models do not declare is refused (400 naming the
field), never silently ignored. A few fields OpenAI clients send are accepted and
ignored, because they change nothing an instance computes: `IGNORED_FIELDS`.
This holds for the body's own fields; nested objects (messages, tools,
``stream_options``) still ignore keys they do not know, because clients send
earlier answers back as they got them (an assistant message's ``refusal``,
``annotations``, ``reasoning_content``...).
"""

from __future__ import annotations

from typing import Annotated
from typing import Any
from typing import Literal

from pydantic import BaseModel
from pydantic import ConfigDict
from pydantic import Field
from pydantic import field_validator
from pydantic import model_validator

from kvduplex.common.sampling import MAX_LOGPROBS
from kvduplex.common.sampling import PENALTY_RANGE
from kvduplex.common.sampling import SEED_RANGE
from kvduplex.common.sampling import SamplingParams

IGNORED_FIELDS = frozenset(
    {"user", "safety_identifier", "metadata", "store", "service_tier", "parallel_tool_calls"}
)
"""Accepted and ignored: who the end user is, labels and storage of OpenAI's own
platform, its processing tier, and (chat) whether tool calls may run in parallel."""


def _check_unicode(text: str) -> str:
    """Text the tokenizer will encode must be valid Unicode: JSON can carry lone
    surrogates (``"\\ud800"``), which no UTF-8 tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"text must be valid Unicode; it has a lone surrogate {text[exc.start]!r} at "
            f"position {exc.start}"
        ) from None
    return text


MAX_NESTING_DEPTH = 64
"""How deep a request body's JSON may nest (the body itself is depth 1): tool schemas
and tool-call arguments reach the chat template, and building a prompt recurses once
per level or more."""


def check_nesting(value: Any, max_depth: int = MAX_NESTING_DEPTH) -> None:
    """ValueError naming the first path (``tools.0.function.parameters...``) at which
    `value` nests deeper than `max_depth` lists and objects; walked without recursion."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, dict):
            children: Any = item.items()
        elif isinstance(item, (list, tuple)):
            children = enumerate(item)
        else:
            continue
        if depth > max_depth:
            where = path or "the body"
            where = where if len(where) <= 160 else where[:160] + "..."
            raise ValueError(
                f"{where} nests too deeply; a request may nest at most {max_depth} levels "
                "of lists and objects"
            )
        for key, child in children:
            if isinstance(child, (dict, list, tuple)):
                stack.append((child, depth + 1, f"{path}.{key}" if path else str(key)))


def check_unicode_tree(value: Any) -> None:
    """`_check_unicode` on every string (dict keys too) of a JSON value, however deep."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            _check_unicode(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema the answer must match."""

    name: Annotated[str, Field(min_length=1, max_length=64)] = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default_factory=dict, alias="schema")
    """JSON Schema of the answer (``{}`` or ``true``: any JSON value)."""
    strict: bool | None = None
    """Accepted; the answer is always held to the schema (constrained decoding)."""


class ResponseFormat(BaseModel):
    """``text`` (free), ``json_object`` (any JSON object) or ``json_schema``, enforced
    by constrained decoding (`kvduplex.engine.structured`)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions; any other field is refused."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI's API takes null for any optional field (clients send it): the default.
        An unknown field stays, null or not, to be refused. First, a body nested deeper
        than `MAX_NESTING_DEPTH` is refused."""
        check_nesting(data)
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data

    model: str | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: int = -1
    seed: Annotated[int, Field(ge=SEED_RANGE[0], lt=SEED_RANGE[1])] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=256)] | None = None
    """At most 256 (each generated token is checked against every one)."""
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    """Only 1: one choice per request (see `_check_n`)."""
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    presence_penalty: Annotated[float, Field(ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])] = 0.0
    frequency_penalty: Annotated[float, Field(ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 1.0
    """Non-standard (vLLM's): > 1 discourages the prompt's and the output's tokens."""
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    """Ignored (`IGNORED_FIELDS`), as are the next four."""
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    return_token_ids: bool = False
    """Non-standard: include prompt and output token ids in the response."""
    kv_transfer_params: dict[str, Any] | None = None
    """Internal: set by the router for disaggregated serving."""
    prompt_cache_key: Annotated[str, Field(max_length=512)] | None = None
    """Names the conversation; the router sends its turns to the same instances."""
    session_id: Annotated[str, Field(max_length=512)] | None = None
    """Non-standard alias of prompt_cache_key (the router also reads X-Session-Id)."""

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        return v

    @field_validator("n")
    @classmethod
    def _check_n(cls, v: int) -> int:
        if v != 1:
            raise ValueError(
                f"n={v} is not supported: this server answers one choice per request; send "
                "n=1 (several requests with different seeds give several choices)"
            )
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings are supported")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def num_logprobs(self) -> int | None:
        """How many alternatives to return per token (0: the token's own logprob only);
        None: no logprobs."""
        return None

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logprobs=self.num_logprobs(),
            seed=self.seed,
            stop=self.stop_strings(),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=min(self.min_tokens, max_tokens),
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] = 16
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    """Each token's logprob and this many most likely alternatives."""
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt_text(
        cls, v: str | list[int] | list[str] | list[list[int]]
    ) -> str | list[int] | list[str] | list[list[int]]:
        for p in [v] if isinstance(v, str) else v:
            if isinstance(p, str):
                _check_unicode(p)
        return v

    @model_validator(mode="after")
    def _check_unsupported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request; a batch of several raises ValueError."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if len(p) == 0:
            raise ValueError("prompt is empty")
        if all(isinstance(x, int) for x in p):
            return [int(x) for x in p]  # type: ignore[arg-type]
        if len(p) != 1:
            raise ValueError("batched prompts are not supported; send one prompt per request")
        only = p[0]
        return only if isinstance(only, str) else [int(x) for x in only]  # type: ignore[union-attr]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _check_text(cls, v: str) -> str:
        return _check_unicode(v)


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict[str, Any]
    """JSON text of the arguments, as the model wrote it (OpenAI sends a string)."""


class ToolCall(BaseModel):
    """A tool call of an earlier assistant turn, sent back as history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """JSON Schema of the arguments."""
    strict: bool | None = None


class ChatTool(BaseModel):
    """A tool the model may call; its definition reaches the chat template."""

    type: Literal["function"]
    function: FunctionDefinition


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    """null (an assistant turn that only called tools) renders as ""."""
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    """Assistant: the tool calls it made."""
    tool_call_id: str | None = None
    """Tool: which call this message answers."""

    @field_validator("content")
    @classmethod
    def _check_content(cls, v: str | list[TextPart] | None) -> str | list[TextPart] | None:
        return _check_unicode(v) if isinstance(v, str) else v

    @model_validator(mode="after")
    def _check_tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not {self.role!r} ones")
        calls = [(c.id, c.function.name, c.function.arguments) for c in self.tool_calls or ()]
        check_unicode_tree([self.name, self.tool_call_id, calls])
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    """Return each output token's logprob."""
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    """With logprobs: this many most likely alternatives per token too."""
    tools: list[ChatTool] | None = None
    """Shown to the model through its chat template; calls are parsed from the answer with
    a tool-call parser and tool_choice auto (`chat_output.py`)."""
    tool_choice: str | dict[str, Any] | None = None
    """auto, none, required (at least one call, constrained to the tools' schemas) or a
    named function (``{"type": "function", "function": {"name": ...}}``: one call)."""
    parallel_tool_calls: bool | None = None

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, v: list[ChatTool] | None) -> list[ChatTool] | None:
        for tool in v or ():
            f = tool.function
            check_unicode_tree([f.name, f.description, f.parameters])
        return v

    @field_validator("tool_choice")
    @classmethod
    def _check_tool_choice(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if v is None or v in ("auto", "none", "required") or named_tool(v) is not None:
            return v
        raise ValueError(
            f"tool_choice {v!r} is not supported; send 'auto', 'none', 'required' or "
            '{"type": "function", "function": {"name": ...}}'
        )

    @model_validator(mode="after")
    def _check_logprobs_and_tools(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        self._check_forced_tool()
        return self

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def _check_forced_tool(self) -> None:
        """A forced tool call (required, named) needs tools, the named one among them, and
        no response_format of its own (both would constrain the same answer)."""
        choice = self.tool_choice
        name = named_tool(choice) if isinstance(choice, dict) else None
        if choice != "required" and name is None:
            return
        names = [t.function.name for t in self.tools or ()]
        if not names:
            raise ValueError(f"tool_choice {choice!r} needs tools; the request has none")
        if name is not None and name not in names:
            raise ValueError(
                f"tool_choice names the function {name!r}, which is not among the tools {names}"
            )
        if self.response_format is not None and self.response_format.type != "text":
            raise ValueError(
                "tool_choice required or named and a json response_format exclude each other"
            )

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def named_tool(tool_choice: Any) -> str | None:
    """The function name of a named tool_choice (``{"type": "function", "function":
    {"name": ...}}``), or None for anything else."""
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        return None
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) and name else None


OpenAIRequest = CompletionRequest | ChatCompletionRequest
"""A validated body of either endpoint."""


def error_body(
    message: str,
    err_type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """The OpenAI error JSON."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}
