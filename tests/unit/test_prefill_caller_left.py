"""A pull's prefill whose caller left before the answer: prefill releases the lease it
took (no READ will come for it) instead of holding the blocks until the lease ends."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI

from kvduplex.instance.kv_routes import make_prefill_router
from kvduplex.instance.server import Instance


def _scope(path: str) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
        "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
    }  # fmt: skip


async def _post(app: FastAPI, path: str, body: dict[str, Any], caller_left: bool) -> int:
    """POST `body` to `app` at `path`; `caller_left`: the client is gone once its body is
    read (its next receive says so at once), else it stays. The answer's status."""
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    stays = asyncio.Event()  # never set: a client that stays never sends more

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        if not caller_left:
            await stays.wait()
        return {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(_scope(path), receive, send)
    return int(sent[0]["status"])


@pytest.mark.parametrize("caller_left", [False, True])
def test_a_prefill_whose_caller_left_releases_its_lease(
    instance: Instance, caller_left: bool
) -> None:
    app = FastAPI()
    app.include_router(make_prefill_router(instance.state, SimpleNamespace(engine_id="e"), 30.0))
    xid = f"x-left-{caller_left}"

    async def run() -> tuple[int, int]:
        body = {"xid": xid, "prompt_token_ids": list(range(1, 40))}
        status = await _post(app, "/internal/prefill", body, caller_left)
        release = await _post(app, "/internal/release", {"xid": xid}, caller_left=False)
        return status, release

    status, release = asyncio.run(run())
    assert status == 200
    # Held for the READ while its caller stays (released here); released at once if it left.
    assert release == (404 if caller_left else 200)
