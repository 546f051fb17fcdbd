"""Which parsers take tool calls and reasoning out of chat answers (`ParsingConfig`).

It lives with the parsers, so that a parser's name is checked against the registry
that implements it (`tool_parsers.TOOL_CALL_PARSERS`, `reasoning.REASONING_PARSERS`);
the engine's config never imports them.
"""

from __future__ import annotations

from pydantic import field_validator
from pydantic import model_validator

from kvduplex.common.config import ConfigSection
from kvduplex.common.openai.reasoning import REASONING_PARSERS
from kvduplex.common.openai.tool_parsers import TOOL_CALL_PARSERS


class ParsingConfig(ConfigSection):
    """Tool calls and reasoning parsed out of chat answers (the router's, or an instance's
    for what it serves directly), with vLLM's flag names."""

    tool_call_parser: str = ""
    """Format of the model's tool calls: hermes (Hermes, Qwen2.5, Qwen3) or llama3_json
    (Llama 3.x); empty: none. Calls become the answer's tool_calls."""
    reasoning_parser: str = ""
    """Format of the model's reasoning: deepseek_r1 or qwen3 (<think>...</think>); empty:
    none. The reasoning becomes the answer's reasoning_content."""
    enable_auto_tool_choice: bool = False
    """Parse tool calls when a request gives tools with tool_choice auto (its default);
    needs --tool-call-parser. Without it, tool_choice auto is refused (400)."""

    @field_validator("tool_call_parser")
    @classmethod
    def _check_tool_call_parser(cls, value: str) -> str:
        if value and value not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {sorted(TOOL_CALL_PARSERS)}, got {value!r}"
            )
        return value

    @field_validator("reasoning_parser")
    @classmethod
    def _check_reasoning_parser(cls, value: str) -> str:
        if value and value not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {list(REASONING_PARSERS)}, got {value!r}"
            )
        return value

    @model_validator(mode="after")
    def _check_auto_tool_choice(self) -> ParsingConfig:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        return self

    @property
    def parsing(self) -> ParsingConfig:
        """These fields alone, as their own section: a config that takes the parsing
        fields among its own (`ServerConfig`, `RouterConfig`) hands them on with it."""
        return ParsingConfig(
            tool_call_parser=self.tool_call_parser,
            reasoning_parser=self.reasoning_parser,
            enable_auto_tool_choice=self.enable_auto_tool_choice,
        )
