"""The pull flow (`serve_pull`, the baseline): P computes the prompt and leases its
blocks, then D READs them; see the map of the flows in `flows.py`.

The router releases P's lease itself only when no READ will come (D could not be
reached, or refused the request before reading).
"""

from __future__ import annotations

import contextlib
import secrets

from starlette.responses import Response

from kvduplex.router.backends import Backend
from kvduplex.router.calls import until_unhealthy
from kvduplex.router.client import CallError
from kvduplex.router.flows import Answer
from kvduplex.router.flows import DecodeUnreachable
from kvduplex.router.flows import Forward
from kvduplex.router.flows import decode_params
from kvduplex.router.flows import open_decode
from kvduplex.router.flows import post_prefill
from kvduplex.router.flows import prefill_body
from kvduplex.router.flows import relay_decode
from kvduplex.router.state import RouterState
from kvduplex.router.state import json_body


async def _release(state: RouterState, b: Backend, xid: str) -> None:
    with contextlib.suppress(CallError):
        url = b.url + "/internal/release"
        await until_unhealthy(b, state.client.post_whole(url, json_body({"xid": xid})))


async def serve_pull(state: RouterState, fwd: Forward) -> Answer:
    p = fwd.route.prefill
    assert p is not None
    xid = f"pull-{secrets.token_hex(16)}"
    ans = await post_prefill(
        state, fwd, "/internal/prefill", prefill_body(fwd, xid, fwd.request.seed)
    )
    body = {**fwd.body, "kv_transfer_params": decode_params(fwd, {"mode": "local"})}
    if ans is not None:
        params = {
            "mode": "pull", "xid": xid, "prefill_url": p.url, "engine_id": ans.get("engine_id"),
            "block_ids": ans["block_ids"], "num_tokens": ans["num_tokens"],
            "ids_digest": ans.get("ids_digest", ""),
            "lease_s": ans.get("lease_s"), "num_cached_tokens": ans.get("num_cached_tokens", 0),
            "session_id": fwd.route.session_id,
        }  # fmt: skip
        body = {**body, "kv_transfer_params": decode_params(fwd, params)}
    try:
        upstream = await open_decode(state, fwd, body, {})
    except DecodeUnreachable:
        if ans is not None:  # P's blocks are leased for a READ that will not come
            await _release(state, p, xid)
        raise
    if isinstance(upstream, Response):
        return upstream  # D may have read, or be reading: the lease runs out on its own
    if ans is not None and 400 <= upstream.status_code < 500:
        await _release(state, p, xid)  # D refused the request before it read anything
    return relay_decode(state, fwd, upstream, aiter(upstream))
