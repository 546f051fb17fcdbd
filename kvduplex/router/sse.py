"""An answer's body as parts of a server-sent-events stream: regrouped in whole events,
an event's data, closed at once when its reader stops."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator


async def whole_events(parts: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`parts` regrouped at SSE event ends (a blank line), so that a stream cut mid-event
    never leaves half an event before the error event; a cut event is dropped."""
    buf = b""
    try:
        async for part in parts:
            buf += part
            end = buf.rfind(b"\n\n")
            if end >= 0:
                yield buf[: end + 2]
                buf = buf[end + 2 :]
    finally:
        await aclose_parts(parts)
    if buf:
        yield buf


async def aclose_parts(parts: AsyncIterator[bytes]) -> None:
    """Close `parts` now if it is a generator (else the garbage collector would, later)."""
    aclose = getattr(parts, "aclose", None)
    if aclose is not None:
        await aclose()


def event_data(event: bytes) -> str | None:
    """The data of one whole SSE event, its ``data:`` lines joined as the SSE spec joins
    them; None if it has none (a comment, say)."""
    text = event.decode("utf-8", "replace")
    lines = [
        line[5:].removeprefix(" ") for line in _SSE_LINE.split(text) if line.startswith("data:")
    ]
    return "\n".join(lines) if lines else None


_SSE_LINE = re.compile(r"\r\n|\r|\n")
"""Where an SSE line ends."""
