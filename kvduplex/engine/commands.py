"""What other threads send the engine thread, and how the engine's end is told.

Every thread but the engine's reaches the engine through one of these typed commands
in `AsyncEngine`'s inbox: a request to add (`AddRequest`), one to abort
(`AbortRequest`), or a function to run between steps (`EngineCall`). Once the loop
ended, queued and later ones fail with `EngineDeadError`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.request import Request


class EngineDeadError(RuntimeError):
    """The engine loop stopped (crashed or shut down); the instance cannot serve."""


@dataclass
class AddRequest:
    request: Request
    on_admit: Callable[[], None] | None = None


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class EngineCall:
    fn: Callable[[LLMEngine], Any]
    future: Future[Any]
    label: str
    """The function's name, for logs."""


EngineCommand = AddRequest | AbortRequest | EngineCall


def describe_call(fn: Callable[..., Any]) -> str:
    """A name for `fn` in logs: its qualified name, with a partial's arguments (which
    usually carry the request or transfer id)."""
    if isinstance(fn, functools.partial):
        args = [repr(a) for a in fn.args] + [f"{k}={v!r}" for k, v in fn.keywords.items()]
        return f"{describe_call(fn.func)}({', '.join(args)[:200]})"
    return str(getattr(fn, "__qualname__", None) or repr(fn))
