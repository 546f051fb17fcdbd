"""An in-process fake of a distributed KV store (the `StoreClient` calls of
`kvduplex.engine.kv_store_client`), for the store tier's tests where Mooncake is not
installed, and to script its failures, which a real store cannot be made to do on cue.

One `FakeStore` holds the entries; each `connect` makes a client of it, as each
instance joins the one store. Faults:

* ``store.is_down = True``: every call answers an error code (a dead master), and
  `connect` raises.
* ``store.gate.clear()``: every call blocks until ``store.gate.set()`` (a hung store);
  ``store.num_blocked`` says how many are waiting (`wait_blocked` waits for a number).
* ``store.delay_s``: every call takes that long (a slow store).
* `corrupt`: flip a byte of an entry's value.

Not Mooncake: no leases, no eviction, no transfer engine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import TypeVar

from kvduplex.engine.kv_store_client import StoreWorker

T = TypeVar("T")

RPC_FAIL = -900
"""Mooncake's error code for a call the master did not answer."""


@dataclass
class FakeStore:
    """The entries and the faults, shared by every client."""

    entries: dict[str, bytes] = field(default_factory=dict)
    is_down: bool = False
    gate: threading.Event = field(default_factory=threading.Event)
    calls: list[str] = field(default_factory=list)
    """Each call's name, in order (``put``, ``upsert``, ``get``, ...)."""
    delay_s: float = 0.0
    num_blocked: int = 0
    num_connects: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _blocked_changed: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.gate.set()
        self._blocked_changed = threading.Condition(self._lock)

    def wait_blocked(self, num_blocked: int, timeout_s: float) -> bool:
        """Wait at most `timeout_s` until `num_blocked` calls wait at the gate; whether
        they do."""
        with self._blocked_changed:
            return self._blocked_changed.wait_for(
                lambda: self.num_blocked == num_blocked, timeout_s
            )

    def connect(self) -> FakeStoreClient:
        """A client joined to this store (what `StoreTier`'s `connect` returns)."""
        self._enter("connect")
        if self.is_down:
            raise ConnectionError("the fake store is down")
        self.num_connects += 1
        return FakeStoreClient(self)

    def corrupt(self, name: str, offset: int) -> None:
        """Flip one bit of the value under `name` at byte `offset`."""
        value = bytearray(self.entries[name])
        value[offset] ^= 0x01
        self.entries[name] = bytes(value)

    def _enter(self, call: str) -> None:
        with self._lock:
            self.calls.append(call)
            self.num_blocked += 1
            self._blocked_changed.notify_all()
        self.gate.wait()
        with self._lock:
            self.num_blocked -= 1
            self._blocked_changed.notify_all()
        if self.delay_s:
            time.sleep(self.delay_s)  # the store's latency


@dataclass
class FakeStoreClient:
    """One instance's client of a `FakeStore`."""

    store: FakeStore
    is_closed: bool = False

    def put(self, key: str, value: memoryview) -> int:
        self.store._enter("put")
        if self.store.is_down:
            return RPC_FAIL
        self.store.entries.setdefault(key, bytes(value))
        return 0

    def upsert(self, key: str, value: memoryview) -> int:
        self.store._enter("upsert")
        if self.store.is_down:
            return RPC_FAIL
        self.store.entries[key] = bytes(value)
        return 0

    def get(self, key: str) -> bytes:
        self.store._enter("get")
        if self.store.is_down:
            return b""
        return self.store.entries.get(key, b"")

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.store._enter("batch_is_exist")
        if self.store.is_down:
            return [RPC_FAIL] * len(keys)
        return [int(key in self.store.entries) for key in keys]

    def remove(self, key: str, force: bool = False) -> int:
        self.store._enter("remove")
        if self.store.is_down:
            return RPC_FAIL
        return 0 if self.store.entries.pop(key, None) is not None else -704

    def close(self) -> int:
        self.is_closed = True
        return 0


class StoreCalls:
    """The store calls of the tiers' threads (their `make_worker`): `wait_idle` waits
    until every call submitted so far has ended (its future is done)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._num_running = 0

    def make_worker(self, name: str) -> StoreWorker:
        return _WatchedWorker(name, self)

    def wait_idle(self, timeout_s: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self._num_running == 0, timeout_s)

    def _started(self) -> None:
        with self._changed:
            self._num_running += 1

    def _ended(self, _future: Future[Any]) -> None:
        with self._changed:
            self._num_running -= 1
            self._changed.notify_all()


class _WatchedWorker(StoreWorker):
    def __init__(self, name: str, calls: StoreCalls) -> None:
        super().__init__(name)
        self._calls = calls

    def submit(self, call: Callable[[], T]) -> Future[T]:
        self._calls._started()
        future = super().submit(call)
        future.add_done_callback(self._calls._ended)
        return future
