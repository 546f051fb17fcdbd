"""What the router's calls to the instances return and raise, and the client that makes them.

`InstanceClient` is the one client the router has: the flows' calls (P's prefill,
D's answer, cancels, releases, a retained turn), the health probes, the DNS
discovery's first look at an address, and ``/v1/models``. `wire.WirePool` is the
network's; a test passes its own (`tests/support/fake_instances.py`).

An answer is read whole (`WholeAnswer`) or as it arrives (`StreamedAnswer`).
Errors are `CallError`s, told apart as the flows act on them::

    ConnectError        the call never reached the instance (refused, no route, DNS):
      ConnectTimeout    a request to D is then routed to another decode instance
      ClosedBeforeWrite the connection was closed, or failed, before the call was
                        written on it
    RemoteProtocolError the instance closed the connection, or answered what is not
                        HTTP, once the call was written
    ReadError           a read on an answer that was closed (the router's own close)
    ReadTimeout         a whole answer later than its deadline
    LocalProtocolError  a URL or header that cannot be sent (nothing was sent)
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Protocol


class CallError(Exception):
    """A call to an instance failed (see the module docstring for which way)."""


class ConnectError(CallError):
    """The call never reached the instance: it did not see the request."""


class ConnectTimeout(ConnectError):
    """The connection was not made within the connect deadline."""


class ClosedBeforeWrite(ConnectError):
    """The instance closed the connection (or it failed) before the call was written on
    it: nothing was sent, so the instance did not see the request."""


class RemoteProtocolError(CallError):
    """The instance closed the connection, or answered with what is not HTTP."""


class ReadError(CallError):
    """A read on an answer that was closed."""


class ReadTimeout(CallError):
    """A whole answer did not come within its deadline."""


class LocalProtocolError(CallError):
    """A URL or header that cannot be sent as it is; nothing was sent."""


Headers = list[tuple[bytes, bytes]]
"""An answer's headers as they came: names and values as bytes, names in any case."""


def find_header(headers: Headers, name: bytes) -> str | None:
    """The first header named `name` (lowercase), as latin-1 text; None if there is none."""
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


@dataclass(frozen=True, slots=True)
class WholeAnswer:
    """An instance's whole answer: its status, body and headers. The body is as it came
    (the router asks for no content coding, and instances send none); `text` reads it as
    UTF-8, as JSON is."""

    status_code: int
    content: bytes
    headers: Headers = field(default_factory=list)

    def json(self) -> Any:
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def header(self, name: bytes) -> str | None:
        return find_header(self.headers, name)


class Body(Protocol):
    """An answer's body as it arrives on its connection."""

    async def next_part(self) -> bytes | None:
        """What came since the last part, once there is some; None at the end. Raises a
        `CallError` if the connection fails, `ReadError` once closed."""
        ...

    async def aclose(self) -> None:
        """Let go of the answer: its connection goes back to its pool if the answer was
        read to its end, else closes (a read in flight then ends with `ReadError`)."""
        ...


class StreamedAnswer:
    """An instance's answer whose head came and whose body is read as it arrives: iterate
    it for the parts (what came since the last one), or `read` it whole. The caller
    closes it (`aclose`), whatever happened."""

    __slots__ = ("_body", "_content", "headers", "status_code")

    def __init__(self, status_code: int, headers: Headers, body: Body) -> None:
        self.status_code = status_code
        self.headers = headers
        self._body = body
        self._content: bytes | None = None

    def header(self, name: bytes) -> str | None:
        return find_header(self.headers, name)

    def __aiter__(self) -> AsyncIterator[bytes]:
        """The body's parts from here on; once `read`, its content as one part."""
        if self._content is not None:
            return _One(self._content)
        return _Parts(self._body)

    async def read(self) -> bytes:
        """The rest of the body, whole; the answer is closed after."""
        if self._content is None:
            parts = []
            try:
                while (part := await self._body.next_part()) is not None:
                    parts.append(part)
            finally:
                await self._body.aclose()
            self._content = b"".join(parts)
        return self._content

    def json(self) -> Any:
        """A body `read` already, as JSON."""
        assert self._content is not None, "read the answer first"
        return json.loads(self._content)

    async def aclose(self) -> None:
        await self._body.aclose()


class _Parts:
    """A body's parts (a class, not an async generator: no generator to close)."""

    __slots__ = ("_body",)

    def __init__(self, body: Body) -> None:
        self._body = body

    def __aiter__(self) -> _Parts:
        return self

    async def __anext__(self) -> bytes:
        part = await self._body.next_part()
        if part is None:
            raise StopAsyncIteration
        return part


class _One:
    __slots__ = ("_part",)

    def __init__(self, part: bytes) -> None:
        self._part: bytes | None = part

    def __aiter__(self) -> _One:
        return self

    async def __anext__(self) -> bytes:
        part, self._part = self._part, None
        if part is None:
            raise StopAsyncIteration
        return part


class InstanceClient(Protocol):
    """The router's calls to its instances. No cap on connections: every request in
    flight holds one to its P and one to its D."""

    async def post_whole(
        self, url: str, content: bytes, headers: dict[str, str] | None = None
    ) -> WholeAnswer:
        """POST `content` (JSON) to `url` with the cluster secret and API key (`headers`
        in place of those of the same names): the answer read whole within the read
        deadline."""
        ...

    async def post_stream(
        self, url: str, content: bytes, headers: dict[str, str] | None = None
    ) -> StreamedAnswer:
        """As `post_whole`, but returned once the answer's head came, its body to be read
        and closed by the caller, with no read deadline (a stream's read ends when its
        instance is marked unhealthy: `calls.py`)."""
        ...

    async def get(self, url: str, timeout_s: float, *, credentials: bool = False) -> WholeAnswer:
        """GET `url`, the answer read whole within `timeout_s` (connect included;
        `ReadTimeout` or `ConnectTimeout` after). `credentials`: with the cluster secret
        and API key (``/v1/models``); without, as a probe of an address not yet known to
        be a cluster member."""
        ...

    def close(self) -> None:
        """Close the idle connections (the app's lifespan, at its end)."""
        ...
