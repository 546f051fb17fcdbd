"""Decode's `prepare` hook registers a push or pull spec on the engine thread, in the same
turn as the request's add (`Generation.on_admit`): the route waits for no engine step of
its own, so the request is scheduled, and its KVRegister sent, in the step that admits it."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any
from typing import cast

import pytest

from kvduplex.common.sampling import SamplingParams
from kvduplex.engine.request import Request as EngineRequest
from kvduplex.instance.decode_routes import DecodePreparer
from kvduplex.instance.state import AdmitRefused
from kvduplex.instance.state import Generation
from kvduplex.kvflow.inbox import XidInUseError
from kvduplex.kvflow.pull_flow import PullDecodeSide
from kvduplex.kvflow.push import PushDecodeSide


class _Table:
    """A push or pull table whose engine thread never drains (each step is in a forward)."""

    def __init__(self) -> None:
        self.specs: dict[str, Any] = {}

    def submit(self, spec: Any) -> Future[None]:
        return Future()  # resolved only by a drain, which this engine never does

    def register(self, spec: Any) -> None:
        if spec.xid in self.specs:
            raise XidInUseError(f"xid {spec.xid!r} is in use by another request")
        self.specs[spec.xid] = spec


class _Raw:
    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    async def json(self) -> Any:
        return self.body


def _prepare(mode: str, table: _Table) -> Generation:
    peer = SimpleNamespace(engine_id="p-engine", layout=SimpleNamespace(num_blocks=64))
    directory = SimpleNamespace(get_peer=lambda url, engine_id: peer)
    push = PushDecodeSide(cast(Any, None), cast(Any, table))
    pull = PullDecodeSide(cast(Any, table))
    preparer = DecodePreparer(cast(Any, None), push, pull, cast(Any, directory), lambda u, x: None)
    params = {"mode": mode, "xid": "x1", "prefill_url": "http://p", "block_ids": [1, 2],
              "num_tokens": 20}  # fmt: skip
    gen = Generation(EngineRequest("d-x1", list(range(20)), SamplingParams()), cast(Any, None))
    # Before, prepare waited for an engine drain to register the spec: it never returned here.
    asyncio.run(asyncio.wait_for(preparer(cast(Any, _Raw({"kv_transfer_params": params})), gen), 2))
    return gen


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_the_spec_is_registered_with_the_requests_add(mode: str) -> None:
    table = _Table()
    gen = _prepare(mode, table)
    assert table.specs == {}  # nothing registered until the engine thread admits it
    assert gen.on_admit is not None and gen.request.remote_kv is not None
    gen.on_admit()  # the engine thread, just before add_request
    assert list(table.specs) == ["x1"]
    assert gen.request.remote_kv.transfer_id == "x1"


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_duplicate_xid_refuses_the_request_with_409(mode: str) -> None:
    table = _Table()
    table.specs["x1"] = object()
    gen = _prepare(mode, table)
    assert gen.on_admit is not None
    with pytest.raises(AdmitRefused) as refused:
        gen.on_admit()
    assert refused.value.status == 409 and "in use" in str(refused.value)
