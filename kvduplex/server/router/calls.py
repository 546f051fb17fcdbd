"""Calls to an instance that end once the router marks the instance unhealthy.

The router's HTTP client waits up to 600 s for a read, so without this a call
to a partitioned or hung instance would hold its client's request for that
long after the router stopped sending the instance work. Each call watches
its instance while in flight (`Backend.watch`); when the instance is presumed
down (a failed connection, or ``--health-failures`` failed probes in a row;
never a 5xx answer) the call is abandoned and raises `InstanceDown`, an
`httpx.TransportError`, so that it ends as a call whose connection failed
ends: a prefill fails (decode computes the prompt), a decode that has not
answered is a 502, a decode stream ends with an error event.

How a call is abandoned. A call still waiting for its response (the head of a
stream, or a whole body) runs in a task of its own (`until_unhealthy`), which
is cancelled once; the client then closes the connection. The caller's own
cancels never reach that task (it waits with `asyncio.wait`, which passes
none on): a cancel repeated while httpcore closes a connection leaves the
connection open (see `relay.push_stream`). A stream being read is abandoned
by closing its response instead (`relay.relay`), which ends the read with
`httpx.ReadError`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any
from typing import TypeVar

import httpx

from kvduplex.server.router.policy import Backend

T = TypeVar("T")


class InstanceDown(httpx.TransportError):
    """The instance was marked unhealthy while a call to it was in flight (or before it
    began): the call was abandoned."""

    def __init__(self, what: str) -> None:
        """`what`: the instance, as a log line names it (its URL, or "decode at URL")."""
        super().__init__(f"{what} was marked unhealthy (failed health probes or a failed call)")


async def until_unhealthy(b: Backend, call: Coroutine[Any, Any, T]) -> T:
    """What `call` (a call to `b`) returns, unless `b` is marked unhealthy first: the call
    is then cancelled, its end awaited, and `InstanceDown` raised. If `b` is presumed down
    already, `call` never starts. If the caller is cancelled, the call is cancelled once
    and left to end on its own."""
    if b.is_down:
        call.close()
        raise InstanceDown(b.url)
    task = asyncio.ensure_future(call)
    down: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def on_unhealthy() -> None:
        if not down.done():
            down.set_result(None)

    unwatch = b.watch(on_unhealthy)
    try:
        await asyncio.wait((task, down), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        _abandon(task)
        raise
    finally:
        unwatch()
    if task.done():
        return task.result()
    _abandon(task)
    await asyncio.wait((task,))  # the cancelled call closes its connection
    raise InstanceDown(b.url)


def _abandon(task: asyncio.Future[Any]) -> None:
    """Cancel `task` once; its exception, if any, is nobody's to handle."""
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
