"""What the router's routes and flows share: config, tokenizer, policy, metrics, HTTP client."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport
from httpx_aiohttp.transport import AiohttpResponseStream
from prometheus_client import CollectorRegistry

from kvduplex.common.auth import api_key_headers
from kvduplex.common.auth import resolve_api_key
from kvduplex.common.config import ROUTER_POOL_IDLE_S
from kvduplex.common.config import Environment
from kvduplex.common.drain import DrainState
from kvduplex.common.guard import load_cluster_secret
from kvduplex.common.tokenizer import Tokenizer
from kvduplex.common.trust import secret_headers
from kvduplex.router.calls import instance_errors
from kvduplex.router.config import RouterConfig
from kvduplex.router.discovery import Discovery
from kvduplex.router.discovery import Resolve
from kvduplex.router.metrics import RouterMetrics
from kvduplex.router.policy import RoutingPolicy
from kvduplex.router.wire import WholeAnswer
from kvduplex.router.wire import WirePool
from kvduplex.router.wire import is_wire_url


@dataclass
class RouterState:
    config: RouterConfig
    """The router's flags (mode, return mode, short appends, health, limits)."""
    tokenizer: Tokenizer
    """The served model's tokenizer and chat template (see `load_tokenizer`)."""
    policy: RoutingPolicy
    registry: CollectorRegistry
    metrics: RouterMetrics
    client: httpx.AsyncClient
    """To the instances: sends the cluster secret and the API key. No cap on connections:
    every request in flight holds one to P and one to D for as long as it runs. Its read
    deadline (600 s) is a last resort: a call ends sooner when its instance is marked
    unhealthy (`calls.py`). It sends through aiohttp (`instance_session`): httpcore's
    pool walks all its connections on every request and release (quadratically in its
    keep-alive check), which at 64 streams took a third of the router's CPU."""
    calls: InstanceCalls
    """The flows' POSTs to the instances (prefill, decode's stream, cancels): over the
    router's own pool (`wire.WirePool`), with `client`'s headers and timeouts."""
    probe_client: httpx.AsyncClient
    """The health probes' client, with their own timeout, over `client`'s transport and so
    its pool, which has no cap: a busy router never makes a probe wait for a connection,
    and so never takes that wait for an instance's failure."""
    prompts: ThreadPoolExecutor
    """Where prompts are built (``--prompt-threads``; `app.build_prompt`): rendering and
    tokenizing hold a thread for milliseconds (a long conversation: tens), which the
    event loop does not wait on. Shut down with the app."""
    api_key: str | None = None
    """What clients must send on /v1/* (see `kvduplex.common.auth`); None: open."""
    num_probe_rounds: int = 0
    """Health probe rounds done; the router is not ready before the first."""
    drain: DrainState = field(default_factory=DrainState)
    """The drain on SIGTERM (`kvduplex.common.drain`): requests in flight, whether it drains."""
    discovery: Discovery | None = None
    """Instances by DNS (``--prefill-dns``, ``--decode-dns``); None: URLs only."""

    async def aclose(self) -> None:
        """Close the clients to the instances (their idle connections)."""
        self.calls.close()
        await self.client.aclose()
        await self.probe_client.aclose()

    def note_probe_round(self) -> None:
        self.num_probe_rounds += 1

    def unready_reason(self) -> str | None:
        """Why the router cannot serve now (its /ready answers 503), or None."""
        if self.drain.is_draining:
            return "draining: shutting down"
        if self.num_probe_rounds == 0:
            return "the instances have not been probed yet"
        if self.discovery is not None and self.discovery.num_rounds == 0:
            return "the instances' DNS names have not been resolved yet"
        if not self.policy.decode.healthy():
            return "no healthy decode instance"
        has_prefill = self.policy.prefill.backends or self.config.prefill_dns
        if has_prefill and not self.policy.prefill.healthy():
            return "no healthy prefill instance"
        return None

    @classmethod
    def create(
        cls,
        config: RouterConfig,
        tokenizer: Tokenizer,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
        resolve: Resolve | None = None,
    ) -> RouterState:
        """`transport` replaces the network (tests); `clock` the policy's clock; `resolve`
        DNS (tests)."""
        policy = RoutingPolicy.from_config(config, clock)
        registry = CollectorRegistry()
        env = Environment.read()
        api_key = resolve_api_key(config.api_key, env.api_key)
        secret = load_cluster_secret(config.cluster_secret_file, env.cluster_secret)
        timeout = httpx.Timeout(600.0, connect=5.0)
        headers = {**secret_headers(secret), **api_key_headers(api_key)}
        transport = transport or InstanceTransport(client=instance_session)
        client = httpx.AsyncClient(timeout=timeout, transport=transport, headers=headers)
        calls = InstanceCalls(transport, headers, timeout)
        probe_client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.health_timeout_s), transport=transport
        )
        prompts = ThreadPoolExecutor(config.prompt_threads, thread_name_prefix="kvduplex-prompt")
        return cls(
            config, tokenizer, policy, registry, RouterMetrics(registry, policy), client,
            calls, probe_client, prompts, api_key, drain=DrainState(timeout_s=config.drain_timeout_s),
            discovery=Discovery.try_from_config(config, policy, probe_client, resolve),
        )  # fmt: skip


class InstanceTransport(AiohttpTransport):
    """httpx over aiohttp, its errors told apart as the router needs.

    httpx-aiohttp raises `httpx.ConnectTimeout` for every aiohttp connection error; the
    router takes a connect error or timeout for an instance that never saw the request
    (`flows.DecodeUnreachable`: the request is routed again). So only a refused or failed
    connect (`httpx.ConnectError`) and a connect timeout keep that meaning; a connection
    that the instance closed after the request was sent is `httpx.RemoteProtocolError`, as
    httpcore raises it.
    """

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            with instance_errors():
                response = await super().handle_async_request(request)
        except httpx.ConnectTimeout as exc:
            raise _told_apart(exc, request) from exc.__cause__
        stream = response.stream
        if isinstance(stream, AiohttpResponseStream):
            response.stream = InstanceStream(stream._aiohttp_response)
        return response

    async def post(
        self, url: str, content: bytes, headers: dict[str, str], timeout: aiohttp.ClientTimeout
    ) -> httpx.Response:
        """POST `content` to `url` over aiohttp without an `httpx.Request` (the router's own
        calls, `InstanceCalls`): the response as `handle_async_request` returns it (its
        body to be read, from aiohttp's stream), its errors as that raises them."""
        if not isinstance(self.client, aiohttp.ClientSession):
            self.client = self.get_client()
        try:
            with instance_errors():
                response = await self.client.request(
                    "POST", url, data=content, headers=headers, allow_redirects=False,
                    auto_decompress=False, timeout=timeout,
                ).__aenter__()  # fmt: skip
        except httpx.ConnectTimeout as exc:
            raise _told_apart(exc, None) from exc.__cause__
        extensions = {"http_version": b"HTTP/1.1"}
        if response.reason:  # as aiohttp decoded it (bytes not UTF-8 kept as they came)
            extensions["reason_phrase"] = response.reason.encode("utf-8", "surrogateescape")
        return httpx.Response(
            response.status, headers=response.raw_headers,
            stream=InstanceStream(response), extensions=extensions,
        )  # fmt: skip


class InstanceStream(AiohttpResponseStream):
    """An instance's answer read from aiohttp, every error of the read an httpx one
    (`instance_errors`)."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with instance_errors():
            async for chunk in self._aiohttp_response.content.iter_chunked(self.CHUNK_SIZE):
                yield chunk

    async def aclose(self) -> None:
        with instance_errors():
            await self._aiohttp_response.__aexit__(None, None, None)


def client_timeout(timeout: httpx.Timeout, *, read: bool = True) -> aiohttp.ClientTimeout:
    """`timeout` as httpx-aiohttp gives it to aiohttp (`read`: False, no read deadline)."""
    return aiohttp.ClientTimeout(
        sock_connect=timeout.connect, sock_read=timeout.read if read else None,
        connect=timeout.pool,
    )  # fmt: skip


def _told_apart(exc: httpx.ConnectTimeout, request: httpx.Request | None) -> httpx.HTTPError:
    """httpx-aiohttp's `ConnectTimeout` for any connection error, told apart (see
    `InstanceTransport`)."""
    cause = exc.__cause__
    if isinstance(cause, aiohttp.ConnectionTimeoutError):
        return exc
    if isinstance(cause, aiohttp.ClientConnectorError):
        return httpx.ConnectError(str(exc), request=request)
    return httpx.RemoteProtocolError(str(exc), request=request)


def instance_session() -> aiohttp.ClientSession:
    """The aiohttp session under `RouterState.client` (made in the event loop, at its first
    call): no cap on connections (aiohttp's default is 100); an idle one is reused for up
    to `ROUTER_POOL_IDLE_S` (60 s: a session's next turn after a pause, an agent running
    its tools, finds it open), never after, so never as the instance, which keeps it open
    longer (``--keep-alive-s``), closes it (`drain.uvicorn_config`); httpx's client gives
    the timeouts, headers and errors."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=ROUTER_POOL_IDLE_S)
    return aiohttp.ClientSession(connector=connector)


class InstanceCalls:
    """POSTs of JSON to the instances, answered as httpx's `Response` (the relay reads the
    response as it would any, and errors are httpx's), or read whole as a
    `wire.WholeAnswer` (`post_whole`), without `httpx.AsyncClient`'s
    layers (URL merging and parsing, auth and redirect handling, cookies, default
    headers), which cost the router ~0.4 ms of its core per call
    (`benchmarks/bench_http_clients.py`), two calls on each request's first token's path.
    Over the router's own transport a plain http URL goes to `wire.WirePool` (two thirds of
    aiohttp's CPU a call, two Python calls a part where aiohttp made five: `bench_http_clients.py`, `bench_router_capacity.py
    --compare`), any other (https) to aiohttp (`InstanceTransport.post`), neither making
    an `httpx.Request`; any other transport (a test's) gets an `httpx.Request`, each URL
    parsed once."""

    def __init__(
        self, transport: httpx.AsyncBaseTransport, headers: dict[str, str], timeout: httpx.Timeout
    ) -> None:
        self.transport = transport
        self.headers = {"content-type": "application/json", **headers}
        self.extensions = {"timeout": timeout.as_dict()}
        # A stream's parts are waited for without a deadline (aiohttp would move a timer at
        # each part): its instance marked unhealthy ends it (`relay.relay`).
        self.stream_extensions = {"timeout": {**timeout.as_dict(), "read": None}}
        self.timeout = client_timeout(timeout)
        self.stream_timeout = client_timeout(timeout, read=False)
        self._urls: dict[str, httpx.URL] = {}
        self.wire: WirePool | None = None
        if isinstance(transport, InstanceTransport):
            self.wire = WirePool(self.headers, timeout)

    def close(self) -> None:
        """Close the idle connections (the app's lifespan, at its end)."""
        if self.wire is not None:
            self.wire.close()

    async def post(
        self, url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
        *, stream: bool = False,
    ) -> httpx.Response:  # fmt: skip
        """POST `body` as JSON to `url`; the response read whole, or (`stream`) its head
        only, the body to be read and closed by the caller. Lone surrogates (valid in a
        request a client sent us, e.g. in ``user``) are escaped, as `json.dumps` writes
        them. Over `InstanceTransport` the response has no `httpx.Request` (its
        ``request``, ``url`` and ``raise_for_status`` are not for these calls)."""
        content = json.dumps(body).encode()
        if self.wire is not None and is_wire_url(url):
            return await self.wire.post(url, content, headers, stream=stream)
        return await self._post_content(url, content, headers, stream)

    async def post_whole(
        self, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> WholeAnswer:
        """`post`'s whole answer, its status and body only: over `WirePool` no
        `httpx.Response` is made (see `WholeAnswer`)."""
        content = json.dumps(body).encode()
        if self.wire is not None and is_wire_url(url):
            return await self.wire.post_whole(url, content, headers)
        response = await self._post_content(url, content, headers, stream=False)
        return WholeAnswer(response.status_code, response.content, response.headers.raw)

    async def _post_content(
        self, url: str, content: bytes, headers: dict[str, str] | None, stream: bool
    ) -> httpx.Response:
        all_headers = {**self.headers, **headers} if headers else self.headers
        if isinstance(self.transport, InstanceTransport):
            timeout = self.stream_timeout if stream else self.timeout
            response = await self.transport.post(url, content, all_headers, timeout)
        else:
            response = await self._send(url, content, all_headers, stream)
        if not stream:
            try:
                await response.aread()
            finally:
                await response.aclose()
        return response

    async def _send(
        self, url: str, content: bytes, headers: dict[str, str], stream: bool
    ) -> httpx.Response:
        parsed = self._urls.get(url)
        if parsed is None:
            if len(self._urls) >= 4096:  # instances come and go: keep the table bounded
                self._urls.clear()
            parsed = self._urls[url] = httpx.URL(url)
        request = httpx.Request(
            "POST", parsed, content=content, headers=headers,
            extensions=self.stream_extensions if stream else self.extensions,
        )  # fmt: skip
        response = await self.transport.handle_async_request(request)
        response.request = request
        return response
