"""The fetch plan's call to decode: lease the history prefill will READ.

Where decode holds a session's history that prefill lacks (`residency.Plan.PREFILL_FETCH`),
prefill's call first asks decode to lease the prompt's cached prefix (``POST
/internal/kv/fetch``); what decode answers goes into prefill's body as ``pull_from``
(`flows.serve_push`). Prefill READs the blocks it lacks and releases the lease itself,
once its READ ended: the router never does, since it cannot know whether a READ is
still under way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from kvduplex.router.backends import Backend
from kvduplex.router.calls import until_unhealthy
from kvduplex.router.client import CallError
from kvduplex.router.state import RouterState
from kvduplex.router.state import json_body

logger = logging.getLogger(__name__)

FETCH_PATH = "/internal/kv/fetch"


async def lease_history(
    state: RouterState, d: Backend, session_id: str | None, ids: list[int], xid: str
) -> dict[str, Any] | None:
    """Prefill's ``pull_from`` for the prompt `ids` of the push `xid`: the blocks decode `d`
    leased (under ``{xid}-fetch``), or None, counted, if it leased none (it held none of
    the prompt, had no room, failed, or did not answer within ``--fetch-timeout-s``);
    prefill then computes the history. A lease granted after the router gave up runs
    out on decode: prefill never hears of it, so no READ of it can be under way."""
    lease_xid = f"{xid}-fetch"
    body = {"xid": lease_xid, "session_id": session_id, "prompt_token_ids": ids}
    try:
        async with asyncio.timeout(state.config.fetch_timeout_s):
            resp = await until_unhealthy(
                d, state.client.post_whole(d.url + FETCH_PATH, json_body(body))
            )
    except (CallError, TimeoutError) as exc:
        logger.info("xid=%s: fetch from %s failed (%r); prefill computes", xid, d.url, exc)
        state.metrics.fetch_misses.inc()
        return None
    info: Any = None
    if resp.status_code == 200:
        with contextlib.suppress(ValueError):
            info = resp.json()
    else:
        logger.info("xid=%s: %s lent nothing (%d): %s", xid, d.url, resp.status_code,
                    resp.text[:200])  # fmt: skip
    if not (
        isinstance(info, dict) and isinstance(info.get("num_tokens"), int)
        and isinstance(info.get("block_ids"), list) and isinstance(info.get("keys"), list)
    ):  # fmt: skip
        state.metrics.fetch_misses.inc()
        return None
    out = {
        "decode_url": d.url, "engine_id": info.get("engine_id"), "block_ids": info["block_ids"],
        "keys": info["keys"], "num_tokens": info["num_tokens"], "lease_xid": lease_xid,
    }  # fmt: skip
    lease_s = info.get("lease_s")
    if isinstance(lease_s, int | float):  # from decode's answer: it goes on to prefill at once
        out["pin_left_s"] = max(0.0, float(lease_s))
    return out
