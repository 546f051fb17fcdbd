"""Readiness and graceful drain of one instance (``kvduplex serve``).

The first SIGTERM (or SIGINT) starts a drain; the instance then exits 0 once it owes
nothing, or when ``--drain-timeout-s`` ends first (logged; exit 1). A second signal
exits at once::

    SIGTERM ─► draining: /ready 503 {"status": "draining"}
               new work (/v1/*, /internal/push/prefill, /internal/prefill) ─► 503 "draining"
               everything else serves on (pushes, returns, cancels, releases, stats)
        │ every DRAIN_POLL_S: anything owed?  HTTP requests in flight, engine requests
        │ running, waiting or held for a peer, KV flows (pushes, returns, waits)
        ▼ nothing, or the deadline
    uvicorn stops ─► engine thread and transport close ─► exit 0 (1 after the deadline)

What counts as owed (`owed_work`): a decode instance finishing a turn still returns it
to prefill (the return's send job); a prefill instance still pushes the KV of requests it
accepted, and keeps a pull's blocks until decode released them or the lease ended.
Turns retained for ``--return-mode pull`` are not owed (a later turn may never come).

``GET /ready`` is readiness (may this instance get new work?): 200 ``{"status":
"ready"}`` with /health's body while the engine is healthy and not draining, else 503
with ``status`` ``draining`` or ``unavailable`` and the reason. ``GET /health`` stays
liveness (is the engine making progress?) and is unchanged by a drain.

uvicorn's own handlers would stop the server at the first signal and re-raise it after,
so `DrainingServer` replaces them (`handle_exit`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field
from types import FrameType
from typing import Any
from typing import Protocol
from typing import TypeVar

import uvicorn
from starlette.types import ASGIApp
from starlette.types import Message
from starlette.types import Receive
from starlette.types import Scope
from starlette.types import Send

from kvduplex.common.openai.errors import APIError

T = TypeVar("T")


class _SchedulerCounts(Protocol):
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_held(self) -> int: ...


class DrainEngine(Protocol):
    """What a drain reads of an instance's engine (on the engine thread)."""

    @property
    def scheduler(self) -> _SchedulerCounts: ...


class DrainLoop(Protocol):
    """What a drain asks of an instance's engine loop (`kvduplex.engine.async_engine`)."""

    def dead_reason(self) -> str | None: ...
    async def run_in_engine(self, fn: Callable[[DrainEngine], T]) -> T: ...

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.1
"""How often a drain checks what the instance still owes."""
UNCOUNTED_PATHS = frozenset({"/health", "/ready", "/metrics"})
"""Probes and scrapes: never refused, never waited for."""
ADMITTING_PATHS = frozenset({"/internal/push/prefill", "/internal/prefill"})
"""Internal routes that take new requests (besides /v1/*): refused while draining."""
NOT_OWED_TABLES = frozenset({"send_cancelled_tombstones", "retained_turns", "retained_pins"})
"""Flow tables a drain does not wait for (remembered ids; turns kept for a next turn)."""


@dataclass
class DrainState:
    """Whether the instance drains, and what it serves meanwhile (event-loop thread)."""

    timeout_s: float = 60.0
    """``--drain-timeout-s``."""
    is_draining: bool = False
    num_in_flight: int = 0
    """HTTP requests being served, probes and scrapes aside."""
    owed_checks: list[Callable[[DrainEngine], dict[str, int]]] = field(default_factory=list)
    """What the roles still owe peers, read on the engine thread: sizes of tables."""


def admits_work(path: str) -> bool:
    """Whether a request to `path` brings the instance new work."""
    return path == "/v1" or path.startswith("/v1/") or path in ADMITTING_PATHS


def draining_response() -> APIError:
    return APIError(
        503,
        "this instance is draining (shutting down): send the request to another one",
        code="draining",
    )


class DrainGuard:
    """ASGI middleware: refuses new work while draining, and counts requests in flight."""

    def __init__(self, app: ASGIApp, drain: DrainState) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.drain.is_draining:
            send = _closing(send)
        if scope["type"] != "http" or scope["path"] in UNCOUNTED_PATHS:
            await self.app(scope, receive, send)
            return
        if self.drain.is_draining and admits_work(scope["path"]):
            await draining_response().response()(scope, receive, send)
            return
        self.drain.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.num_in_flight -= 1


def _closing(send: Send) -> Send:
    """`send` for a request that came while draining: its response asks the client to close
    the connection (``connection: close``; uvicorn closes it once the response is sent), so
    that the client's next request opens a connection to a server that takes work rather
    than meeting this one's 503 again, or its close when the drain ends."""

    async def send_closing(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
            message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await send(message)

    return send_closing


def owed_work(engine: DrainEngine, drain: DrainState) -> dict[str, int]:
    """What the instance still owes, by kind (engine thread); empty when nothing is."""
    sched = engine.scheduler
    owed = {"engine_running": sched.num_running, "engine_waiting": sched.num_waiting}
    tables: dict[str, int] = {}
    for check in drain.owed_checks:
        tables.update(check(engine))
    owed["engine_held"] = sched.num_held - tables.get("retained_turns", 0)
    owed.update({k: v for k, v in tables.items() if k not in NOT_OWED_TABLES})
    return {k: v for k, v in owed.items() if v > 0}


async def wait_drained(engine: DrainLoop | None, drain: DrainState) -> bool:
    """Poll until nothing is owed (True) or ``drain.timeout_s`` passed (False, logged).
    Without an `engine` (the router) only HTTP requests in flight are owed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + drain.timeout_s
    while True:
        owed: dict[str, int] = {}
        if drain.num_in_flight:
            owed["http_requests"] = drain.num_in_flight
        if engine is not None and engine.dead_reason() is None:
            try:
                owed.update(await engine.run_in_engine(lambda e: owed_work(e, drain)))
            except Exception as exc:  # the engine died meanwhile: nothing more will finish
                logger.warning("drain: cannot read the engine's work (%s)", exc)
        if not owed:
            return True
        if loop.time() >= deadline:
            logger.warning(
                "drain: --drain-timeout-s %.1f s passed with work still owed (%s); exiting",
                drain.timeout_s, owed,
            )  # fmt: skip
            return False
        await asyncio.sleep(DRAIN_POLL_S)


def uvicorn_config(
    app: ASGIApp, host: str, port: int, keep_alive_s: int, **kwargs: Any
) -> uvicorn.Config:
    """uvicorn's config for a kvduplex server (`DrainingServer`): idle connections kept
    `keep_alive_s` (``--keep-alive-s``; uvicorn's default is 5 s), 5 s to close the
    connections left once a drain ended, uvicorn's own log lines at warning; `kwargs` as
    uvicorn takes them (its loop and HTTP parser).

    Why keep-alive is long: the client of a connection must be the one to close it when it
    is idle. A request written on a connection just as its server closes it fails on the
    wire, and the router's client never sends a POST again, so a router's call to decode
    would end in a 502. The router
    reuses an idle connection for at most `config.ROUTER_POOL_IDLE_S` (60 s), under the
    75 s an instance keeps it by default."""
    return uvicorn.Config(
        app, host=host, port=port, log_level="warning", timeout_keep_alive=keep_alive_s,
        timeout_graceful_shutdown=5, **kwargs,
    )  # fmt: skip


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT drains the instance (or the router, which has
    no `engine`) before it stops, and a second one exits the process at once."""

    def __init__(
        self, config: uvicorn.Config, drain: DrainState, engine: DrainLoop | None = None
    ) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain = drain
        self.is_drained = True
        """False when the drain ended at its deadline with work still owed."""
        self._task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler (main thread, which runs the event loop)."""
        if self.drain.is_draining or self.should_exit:
            logger.warning("signal %d during shutdown: exiting now", sig)
            logging.shutdown()
            os._exit(128 + sig)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not serving yet: stop as uvicorn would
            self.should_exit = True
            return
        self.drain.is_draining = True
        logger.warning(
            "signal %d: draining (no new work; up to %.1f s for the work in flight; a second "
            "signal exits at once)", sig, self.drain.timeout_s,
        )  # fmt: skip
        loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        started = time.monotonic()
        self.is_drained = await wait_drained(self.engine, self.drain)
        if self.is_drained:
            logger.warning("drained in %.2f s; stopping", time.monotonic() - started)
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Our handler for SIGTERM and SIGINT while serving; the old ones restored after,
        and the signal not raised again (uvicorn's would end the process by it)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        saved = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)


def exit_code(server: DrainingServer) -> int:
    """0 after a complete drain (or a stop without one), 1 after a drain's deadline."""
    return 0 if server.is_drained else 1


__all__ = [
    "DrainGuard",
    "DrainState",
    "DrainingServer",
    "admits_work",
    "exit_code",
    "owed_work",
    "uvicorn_config",
]
