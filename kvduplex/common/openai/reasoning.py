"""Reasoning in generated text: ``<think>...</think>``, as vLLM's ``deepseek_r1`` and ``qwen3``.

The text inside the think block is ``reasoning_content``; what follows
``</think>`` is content (for the tool-call parser, if any, to read). Where the
answer starts depends on the prompt, whose end the chat template wrote:

* it ends with ``<think>`` (a template that opens the block, as DeepSeek-R1's
  and Qwen3-thinking's do): the answer starts inside the block;
* it ends with ``</think>`` (an empty block, Qwen3's ``enable_thinking=False``):
  the answer is content;
* otherwise ``deepseek_r1`` starts inside the block (R1 may begin its answer
  with reasoning, no tag) and ``qwen3`` only if the answer opens one.

Inside the block a ``<think>`` the model writes first is dropped. A block never
closed (``max_tokens`` cut it) is reasoning to the end, as in vLLM. One parser
per answer, torch-free: `feed` text as it arrives, `finish` at the end; each
returns the (reasoning, content) text that became final, partial tags held back
until the next text shows what they are, so any cutting of a stream adds up to
the whole answer's result.
"""

from __future__ import annotations

import enum

from kvduplex.common.openai.tool_parsers import held_suffix

THINK_START = "<think>"
THINK_END = "</think>"

REASONING_PARSERS = ("deepseek_r1", "qwen3")
"""``--reasoning-parser`` names, as vLLM's."""


class _Phase(enum.Enum):
    UNDECIDED = "undecided"
    """Reasoning only if the answer opens a block."""
    OPENING = "opening"
    """Reasoning; a ``<think>`` the answer starts with is dropped."""
    REASONING = "reasoning"
    CONTENT = "content"


def starts_in_reasoning(parser: str, prompt_tail: str) -> bool | None:
    """Whether an answer to a prompt ending in `prompt_tail` starts inside a think block:
    True, False, or None (only if the answer opens one). See the module docstring."""
    if parser not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r}; known: {list(REASONING_PARSERS)}")
    tail = prompt_tail.rstrip()
    if tail.endswith(THINK_START):
        return True
    if tail.endswith(THINK_END):
        return False
    return True if parser == "deepseek_r1" else None


class ThinkParser:
    """One answer's reasoning/content split."""

    def __init__(self, starts_inside: bool | None) -> None:
        """`starts_inside`: from `starts_in_reasoning`."""
        self._phase = {True: _Phase.OPENING, False: _Phase.CONTENT, None: _Phase.UNDECIDED}[
            starts_inside
        ]
        self._buf = ""

    @property
    def may_reason(self) -> bool:
        """Whether the answer may still reason from here (before any text: whether it may
        begin with reasoning)."""
        return self._phase is not _Phase.CONTENT

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) text newly final."""
        self._buf += text
        reasoning = ""
        if self._phase in (_Phase.UNDECIDED, _Phase.OPENING):
            head = self._buf.lstrip()
            if THINK_START.startswith(head) and head != THINK_START:
                return "", ""  # an opening tag may be on its way
            if head.startswith(THINK_START):
                self._buf = head[len(THINK_START) :]
                self._phase = _Phase.REASONING
            else:
                is_undecided = self._phase is _Phase.UNDECIDED
                self._phase = _Phase.CONTENT if is_undecided else _Phase.REASONING
        if self._phase is _Phase.REASONING:
            end = self._buf.find(THINK_END)
            if end < 0:
                keep = held_suffix(self._buf, THINK_END)
                reasoning, self._buf = (
                    self._buf[: len(self._buf) - keep],
                    self._buf[len(self._buf) - keep :],
                )
                return reasoning, ""
            reasoning, self._buf = self._buf[:end], self._buf[end + len(THINK_END) :]
            self._phase = _Phase.CONTENT
        content, self._buf = self._buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held back: text, since no tag can complete it any more."""
        rest, self._buf = self._buf, ""
        if self._phase in (_Phase.UNDECIDED, _Phase.CONTENT):
            return "", rest
        return rest, ""
