"""Fake instances for the router's tests: `client.InstanceClient` over a handler of httpx
requests, as `httpx.MockTransport` takes one (sync or async, answering an
`httpx.Response`, its content bytes or an async iterator of parts).

    state = RouterState.create(config, tokenizer, make_client=mock_instances(fake.handle))

The handler sees each call as an `httpx.Request` (method, URL, headers, content) with the
headers the router's own client sends (the cluster secret and API key on POSTs and
``/v1/models``, none on probes). What it raises, or what its streamed content raises
mid-body, reaches the router as the router's client raises it (`httpx.ConnectError` as
`client.ConnectError`, and so on); a streamed answer is read in a task of its own, which
closing the answer cancels (the handler's generator sees its close, as an instance sees
the router let go of a connection).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from collections.abc import Callable
from typing import Any

import httpx

from kvduplex.router import client as rc

Handler = Callable[[httpx.Request], httpx.Response | Awaitable[httpx.Response]]

_ERRORS: list[tuple[type[Exception], type[rc.CallError]]] = [
    (httpx.ConnectTimeout, rc.ConnectTimeout),
    (httpx.ConnectError, rc.ConnectError),
    (httpx.ReadTimeout, rc.ReadTimeout),
    (httpx.TimeoutException, rc.ReadTimeout),
    (httpx.ReadError, rc.ReadError),
    (httpx.LocalProtocolError, rc.LocalProtocolError),
    (httpx.HTTPError, rc.RemoteProtocolError),
]


def call_error(exc: Exception) -> Exception:
    """`exc` as the router's client would raise it (an httpx error mapped; any other as
    it is)."""
    if isinstance(exc, rc.CallError):
        return exc
    for theirs, ours in _ERRORS:
        if isinstance(exc, theirs):
            return ours(str(exc))
    return exc


def mock_instances(handler: Handler) -> Callable[[dict[str, str]], MockInstances]:
    """`RouterState.create`'s ``make_client`` for fake instances served by `handler`."""
    return lambda headers: MockInstances(handler, headers)


class MockInstances:
    """`client.InstanceClient` whose calls `handler` answers (see the module docstring)."""

    def __init__(self, handler: Handler, headers: dict[str, str] | None = None) -> None:
        self.handler = handler
        self.headers = {"content-type": "application/json", **(headers or {})}
        self.credentials = dict(headers or {})
        self.is_closed = False

    async def _call(
        self, method: str, url: str, content: bytes | None, headers: dict[str, str]
    ) -> httpx.Response:
        request = httpx.Request(method, url, content=content, headers=headers)
        try:
            answer = self.handler(request)
            if inspect.isawaitable(answer):
                answer = await answer
        except Exception as exc:
            raise call_error(exc) from exc
        assert isinstance(answer, httpx.Response)
        answer.request = request
        return answer

    async def post_whole(
        self, url: str, content: bytes, headers: dict[str, str] | None = None
    ) -> rc.WholeAnswer:
        resp = await self._call("POST", url, content, {**self.headers, **(headers or {})})
        return await _whole(resp)

    async def post_stream(
        self, url: str, content: bytes, headers: dict[str, str] | None = None
    ) -> rc.StreamedAnswer:
        resp = await self._call("POST", url, content, {**self.headers, **(headers or {})})
        return rc.StreamedAnswer(resp.status_code, list(resp.headers.raw), _Body(resp))

    async def get(
        self, url: str, timeout_s: float, *, credentials: bool = False
    ) -> rc.WholeAnswer:
        headers = self.credentials if credentials else {}
        try:
            async with asyncio.timeout(timeout_s):
                return await _whole(await self._call("GET", url, None, headers))
        except TimeoutError:
            raise rc.ReadTimeout(f"{url} did not answer in {timeout_s} s") from None

    def close(self) -> None:
        self.is_closed = True


async def _whole(resp: httpx.Response) -> rc.WholeAnswer:
    try:
        content = await resp.aread()
    except Exception as exc:
        raise call_error(exc) from exc
    finally:
        await resp.aclose()
    return rc.WholeAnswer(resp.status_code, content, list(resp.headers.raw))


async def _parts(resp: httpx.Response) -> AsyncIterator[bytes]:
    if resp.is_stream_consumed:  # made with its content whole
        yield resp.content
        return
    async for part in resp.aiter_raw():
        yield part


class _Body:
    """A streamed answer's body, read in a task of its own into a queue."""

    def __init__(self, resp: httpx.Response) -> None:
        self._resp = resp
        self._queue: asyncio.Queue[bytes | Exception | None] = asyncio.Queue()
        self._closed = False
        self._pump = asyncio.ensure_future(self._read(_parts(resp)))

    async def _read(self, parts: AsyncIterator[bytes]) -> None:
        try:
            async for part in parts:
                if part:
                    self._queue.put_nowait(part)
            self._queue.put_nowait(None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._queue.put_nowait(call_error(exc))
        finally:
            await self._resp.aclose()

    async def next_part(self) -> bytes | None:
        if self._closed and self._queue.empty():
            raise rc.ReadError("the answer was closed")
        got: Any = await self._queue.get()
        if isinstance(got, Exception):
            self._queue.put_nowait(got)  # every later read fails alike
            raise got
        if got is None:
            self._queue.put_nowait(None)
        return got  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._pump.done():
            self._pump.cancel()
            self._queue.put_nowait(rc.ReadError("the answer was closed"))
            await asyncio.wait([self._pump])
