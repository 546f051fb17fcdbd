"""What the store tier (`kvduplex.engine.kv_tier_store`) needs of a distributed KV store,
and the parts that keep a failing one from costing the engine more than a deadline.

* `StoreClient`: the calls used, a subset of Mooncake's ``MooncakeDistributedStore``
  (`connect_mooncake` makes one); tests pass an in-process fake.
* `StoreWorker`: one daemon thread that runs store calls in order, so the engine can
  stop waiting for a call (its deadline) and go on; a call stuck in a hung store holds
  only that thread, and never keeps the process from exiting.
* `StoreHealth`: whether the store is used now. A failure marks it down for a while
  (doubling while it keeps failing); one warning per outage, one line when it is back.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol
from typing import TypeVar

from kvduplex.common.config import host_and_port
from kvduplex.common.kv_store import mooncake_import_problem

logger = logging.getLogger(__name__)

T = TypeVar("T")

MAX_RETRY_S = 30.0
"""The longest a failing store is left alone before it is tried again."""


class StoreClient(Protocol):
    """The calls of a KV store client the store tier makes. Return codes as Mooncake's:
    0 is success, a negative number an error."""

    def put(self, key: str, value: memoryview) -> int:
        """Store `value` under `key`; a key present already keeps its value."""
        ...

    def upsert(self, key: str, value: memoryview) -> int:
        """Store `value` under `key`, replacing a present value."""
        ...

    def get(self, key: str) -> bytes:
        """The value under `key`; empty if absent (or on an error)."""
        ...

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        """Per key: 1 present, 0 absent, negative an error."""
        ...

    def remove(self, key: str, force: bool = False) -> int:
        """Drop `key` (`force`: even while a reader holds a lease on it)."""
        ...

    def close(self) -> int:
        """Leave the store."""
        ...


class StoreError(Exception):
    """A store call answered an error code."""


class StoreWorker:
    """Runs submitted calls one at a time, in order, on one daemon thread."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], object], Future[object]] | None]
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], T]) -> Future[T]:
        """Queue `call`; its future holds what it returned or raised."""
        future: Future[T] = Future()
        self._queue.put((call, future))  # type: ignore[arg-type]
        return future

    def stop(self) -> None:
        """End the thread after the calls queued so far (not waited for)."""
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            call, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as exc:  # the caller sees it, through the future
                future.set_exception(exc)


class StoreHealth:
    """Up, or down until a retry time. Told by the engine thread and the writer thread
    (a lock guards its fields); starts down (not connected), to be tried at once."""

    def __init__(self, retry_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.retry_s = retry_s
        self._clock = clock
        self._lock = threading.Lock()
        self._is_up = False
        self._down_since = clock()
        self._retry_at = self._down_since
        self._backoff = retry_s
        self._warned = False

    def is_up(self) -> bool:
        """The last call succeeded."""
        return self._is_up

    def can_try(self) -> bool:
        """Up, or down and its retry time has come."""
        with self._lock:
            return self._is_up or self._clock() >= self._retry_at

    def succeeded(self, what: str = "reachable again") -> None:
        """A call succeeded: up (logged if it was down and said so)."""
        with self._lock:
            if self._is_up:
                return
            was_warned, down_s = self._warned, self._clock() - self._down_since
            self._is_up, self._warned, self._backoff = True, False, self.retry_s
        if was_warned:
            logger.warning(
                "KV store: %s after %.1f s down; the store tier is used again", what, down_s
            )
        else:
            logger.info("KV store: %s", what)

    def failed(self, problem: str) -> None:
        """A call failed or outlived its deadline: down until a retry time (warned once
        per outage). A failure of a retry doubles the wait, up to `MAX_RETRY_S`."""
        with self._lock:
            now = self._clock()
            if self._is_up:
                self._is_up, self._down_since = False, now
            if not self._warned:  # the first failure of an outage
                self._backoff = self.retry_s
            elif now >= self._retry_at:
                self._backoff = min(self._backoff * 2, MAX_RETRY_S)
            self._retry_at = max(self._retry_at, now + self._backoff)
            warn, self._warned, backoff = not self._warned, True, self._backoff
        if warn:
            logger.warning(
                "KV store: %s; the store tier answers miss (prompts are computed) and drops "
                "demoted blocks, trying the store again in %.1f s (longer while it fails)",
                problem, backoff,
            )  # fmt: skip
        else:
            logger.debug("KV store: %s (next try in %.1f s)", problem, backoff)


def exist_flags(client: StoreClient, names: list[str]) -> list[bool]:
    """Whether the store holds each of `names` (one call); StoreError on an error code."""
    codes = client.batch_is_exist(names)
    if len(codes) != len(names) or any(code < 0 for code in codes):
        raise StoreError(f"batch_is_exist answered {min(codes, default=None)}")
    return [code == 1 for code in codes]


def wait_at_most(future: Future[T], timeout_s: float) -> None:
    """Wait for `future` at most `timeout_s`, whatever it ends with."""
    with contextlib.suppress(TimeoutError):
        future.exception(timeout=timeout_s)


@dataclass(frozen=True)
class MooncakeSettings:
    """Where the Mooncake store is and how this instance joins it."""

    master: str
    """HOST:PORT of the master's RPC."""
    metadata_url: str
    """The HTTP metadata server, http://HOST:PORT/metadata."""
    local_host: str = ""
    """This instance's address as the store's nodes reach it (empty: `address_towards`
    the master)."""
    local_buffer_bytes: int = 64 * 2**20
    """The client's transfer buffer (a value put or got passes through it)."""


def connect_mooncake(settings: MooncakeSettings) -> StoreClient:
    """A Mooncake client joined to the store, mounting none of its own memory (blocks live
    on the storage nodes). Blocks while the master is unreachable (Mooncake retries for
    about 90 s): call it off the engine thread. StoreError if it cannot join."""
    from mooncake.store import MooncakeDistributedStore

    local_host = settings.local_host or address_towards(settings.master)
    client = MooncakeDistributedStore()
    code = client.setup(
        local_host, settings.metadata_url, 0, settings.local_buffer_bytes, "tcp", "",
        settings.master,
    )  # fmt: skip
    if code != 0:
        raise StoreError(
            f"cannot join the Mooncake store (setup returned {code}; master "
            f"{settings.master}, metadata {settings.metadata_url}, this host {local_host})"
        )
    client_: StoreClient = client
    return client_


def require_mooncake() -> None:
    """ValueError saying what to install if Mooncake's client does not import here."""
    problem = mooncake_import_problem()
    if problem is not None:
        raise ValueError(f"kv_tier store: {problem}")


def address_towards(master: str) -> str:
    """The local address of the interface that routes to `master` (HOST:PORT); no packet
    is sent. The host name's address if there is no such route."""
    host, port = host_and_port(master, "kv_store_master")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


__all__ = [
    "MAX_RETRY_S",
    "MooncakeSettings",
    "StoreClient",
    "StoreError",
    "StoreHealth",
    "StoreWorker",
    "address_towards",
    "connect_mooncake",
    "exist_flags",
    "require_mooncake",
    "wait_at_most",
]
