"""The decode instance's connector: pulled and pushed requests side by side.

Each remote-KV request belongs to the flow its ``kv_transfer_params`` named
(`PullConnector` or `PushReceiver` registered it before admission); one
that neither knows is computed locally.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from kvduplex.engine.request import Request
from kvduplex.engine.scheduler import SchedulerOutput
from kvduplex.transfer.pull import PullConnector
from kvduplex.transfer.push import PushReceiver

logger = logging.getLogger(__name__)


class DecodeConnector:
    def __init__(self, pull: PullConnector, push: PushReceiver) -> None:
        self.pull = pull
        self.push = push

    def on_scheduled(self, out: SchedulerOutput) -> None:
        if not out.remote_kv_allocated:
            return
        pulled: list[Request] = []
        pushed: list[Request] = []
        for req in out.remote_kv_allocated:
            assert req.remote_kv is not None
            xid = req.remote_kv.transfer_id
            if self.push.owns(xid):
                pushed.append(req)
            else:
                pulled.append(req)  # the pull flow computes unknown ones locally
        if pulled:
            self.pull.on_scheduled(replace(out, remote_kv_allocated=pulled))
        if pushed:
            self.push.on_scheduled(replace(out, remote_kv_allocated=pushed))

    def layer_hook(self, out: SchedulerOutput) -> Callable[[int], None] | None:
        return None

    def on_step_done(
        self, out: SchedulerOutput, sampled: dict[str, int], finished: list[Request]
    ) -> None:
        return None

    def take_updated_requests(self) -> list[Request]:
        return self.push.take_updated_requests()

    def has_pending_work(self) -> bool:
        return self.pull.has_pending_work()
