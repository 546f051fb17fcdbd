"""Calls to an instance that end once the router marks the instance unhealthy.

A call's read waits up to 600 s (a stream's, for ever), so without this a
call to a partitioned or hung instance would hold its client's request for
that long after the router stopped sending the instance work. Each call watches
its instance while in flight (`Backend.watch`); when the instance is presumed
down (``--health-failures`` failed probes in a row; never another call's failure,
nor a 5xx answer) the call is abandoned and raises `InstanceDown`, a
`client.CallError`, so that it ends as a call whose connection failed
ends: a prefill fails (decode computes the prompt), a decode that has not
answered is a 502, a decode stream ends with an error event.

How a call is abandoned. A call still waiting for its response (the head of a
stream, or a whole body) runs in its caller's task, which `until_unhealthy`
cancels once when the instance is marked unhealthy, as `asyncio.timeout` does
at a deadline: the call's connection is then closed, and the cancel becomes
`InstanceDown`. No task of its own: a call's start and end cost no turn of the
event loop each, which under load is what a request's first token waits on. A
stream being read is abandoned by closing its response instead
(`relay.relay`), which ends the read with `client.ReadError`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any
from typing import TypeVar

from kvduplex.router.backends import Backend
from kvduplex.router.backends import Outcome
from kvduplex.router.client import CallError
from kvduplex.router.client import ConnectError

T = TypeVar("T")


class InstanceDown(CallError):
    """The instance was marked unhealthy while a call to it was in flight (or before it
    began): the call was abandoned."""

    def __init__(self, what: str) -> None:
        """`what`: the instance, as a log line names it (its URL, or "decode at URL")."""
        super().__init__(f"{what} was marked unhealthy (failed health probes)")


def failed_outcome(exc: Exception) -> Outcome:
    """How a call that raised `exc` ended for its instance's health: `UNREACHABLE` if it
    never reached it (`ConnectError`), else `FAILED` (the call's own failure)."""
    return Outcome.UNREACHABLE if isinstance(exc, ConnectError) else Outcome.FAILED


async def until_unhealthy(b: Backend, call: Coroutine[Any, Any, T]) -> T:
    """What `call` (a call to `b`) returns, unless `b` is marked unhealthy first: the call
    is then cancelled and `InstanceDown` raised. If `b` is presumed down already, `call`
    never starts. The caller's own cancels reach the call as they would without this."""
    if b.is_down:
        call.close()
        raise InstanceDown(b.url)
    task = asyncio.current_task()
    assert task is not None, "until_unhealthy runs in a task"
    fired = False

    def on_unhealthy() -> None:
        nonlocal fired
        if not fired:
            fired = True
            task.cancel()

    unwatch = b.watch(on_unhealthy)
    try:
        result = await call
    except asyncio.CancelledError:
        if fired and task.uncancel() == 0:  # only this cancel: the instance's, not a caller's
            raise InstanceDown(b.url) from None
        raise
    finally:
        unwatch()
    if fired:  # the call ended on its own all the same: the cancel is withdrawn
        task.uncancel()
    return result
