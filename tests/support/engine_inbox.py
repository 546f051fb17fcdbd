"""What enters an `AsyncEngine`'s inbox, seen by a test as it happens: the commands the
engine thread will apply, in order (a call sent after one is applied after it)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvduplex.engine.async_engine import AsyncEngine
from kvduplex.engine.commands import EngineCommand


def watch_inbox(
    monkeypatch: pytest.MonkeyPatch, engine: AsyncEngine, seen: Callable[[EngineCommand], None]
) -> None:
    """Call ``seen(command)`` on the sending thread for every command queued for `engine`
    from now until the test ends (not those refused once the loop ended). `seen` must not
    block: it runs in the sender's thread, the server's event loop among them."""
    send = engine._send

    def watched(command: EngineCommand) -> bool:
        is_queued = send(command)
        if is_queued:
            seen(command)
        return is_queued

    monkeypatch.setattr(engine, "_send", watched)
