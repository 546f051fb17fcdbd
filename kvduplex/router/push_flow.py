"""The push flow (`serve_push`): P streams the prompt's KV into D's blocks while both
answer; see the map of the flows in `flows.py`.

P's call and D's request go out at the same time. P's answer (its first token, spliced
into D's stream: `relay.push_stream`) notes the answer hit of a returned turn
(`note_answer_hit`) and where P holds the prompt; a P that fails tells D to compute the
prompt (a cancel sent from P's task's callback), a D that refuses or cannot be reached
tells P to stop. With ``--return-mode pull`` a session's P is told which turn D
retained (`_retained`), to READ it; with the fetch plan P's call first leases D's
history (`fetch.lease_history`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import secrets
from typing import Any

from starlette.responses import Response

from kvduplex.common.config import ReturnMode
from kvduplex.common.openai import render
from kvduplex.common.openai import structured
from kvduplex.common.openai.errors import REQUEST_ID_HEADER
from kvduplex.router.backends import Backend
from kvduplex.router.calls import until_unhealthy
from kvduplex.router.client import CallError
from kvduplex.router.fetch import lease_history
from kvduplex.router.flows import Answer
from kvduplex.router.flows import DecodeUnreachable
from kvduplex.router.flows import Forward
from kvduplex.router.flows import decode_params
from kvduplex.router.flows import open_decode
from kvduplex.router.flows import post_prefill
from kvduplex.router.flows import prefill_body
from kvduplex.router.flows import relay_decode
from kvduplex.router.flows import return_to
from kvduplex.router.relay import FirstToken
from kvduplex.router.relay import push_stream
from kvduplex.router.residency import Plan
from kvduplex.router.state import RouterState
from kvduplex.router.state import json_body

logger = logging.getLogger(__name__)


def note_answer_hit(state: RouterState, fwd: Forward, num_cached_tokens: int) -> None:
    """P had `num_cached_tokens` of this prompt cached: of the previous answer, returned to
    it, count the tokens it could have cached (the answer but its last token, up to the
    last full block) and those it had."""
    prev, p = fwd.route.previous, fwd.route.prefill
    if prev is None or p is None or not fwd.route.reuses_answer or prev.answer_end is None:
        return
    if not prev.is_returning or prev.prefill_url != p.url:
        return
    start, end = prev.num_prompt_tokens, prev.answer_end
    if prev.return_limit is not None:
        end = min(end, prev.return_limit)
    if p.block_size:
        end = end // p.block_size * p.block_size
    num_returnable = end - start
    if num_returnable <= 0:
        return
    num_hit = min(max(num_cached_tokens - start, 0), num_returnable)
    state.policy.sessions.note_answer_hit(fwd.route.session_id, num_hit, num_returnable)
    state.metrics.note_answer_hit(num_hit, num_returnable)


async def _retained(state: RouterState, d: Backend, session_id: str) -> dict[str, Any] | None:
    """``--return-mode pull``: the session's last turn that D retained, for P to READ."""
    url = d.url + "/internal/kv/retained"
    try:
        resp = await until_unhealthy(
            d, state.client.post_whole(url, json_body({"session_id": session_id}))
        )
    except CallError as exc:
        logger.info("session %s: retained turn at %s unavailable: %s", session_id, d.url, exc)
        return None
    if resp.status_code != 200:
        return None
    try:
        info = resp.json()
    except ValueError:
        info = None
    if not isinstance(info, dict):  # not D's answer: P computes the turn over its cache
        logger.warning("session %s: %s answered its retained turn unreadably", session_id, d.url)
        return None
    # D's pin counts from its answer; this goes on to P at once, as a duration.
    pin_s = info.pop("pin_s", None)
    out = {"decode_url": d.url, **info}
    if isinstance(pin_s, int | float):
        out["pin_left_s"] = max(0.0, float(pin_s))
    return out


async def _push_prefill(
    state: RouterState, fwd: Forward, p_req: dict[str, Any], fetch: bool
) -> dict[str, Any] | None:
    """P's push prefill call (`post_prefill`), after D's lease of the history if `fetch`."""
    if fetch:
        route = fwd.route
        pull_from = await lease_history(
            state, route.decode, route.session_id, fwd.ids, p_req["xid"]
        )
        if pull_from is not None:
            p_req = {**p_req, "pull_from": pull_from}
    return await post_prefill(state, fwd, "/internal/push/prefill", p_req)


async def _cancel(state: RouterState, b: Backend, xid: str, reason: str) -> None:
    body = {"xid": xid, "reason": reason}
    with contextlib.suppress(CallError):
        url = b.url + "/internal/push/cancel"
        await until_unhealthy(b, state.client.post_whole(url, json_body(body)))


_CANCELS: set[asyncio.Task[None]] = set()
"""D's cancels after a failed prefill, sent from a callback: held until they end."""


def _on_prefill_failed(
    state: RouterState, d: Backend, xid: str, task: asyncio.Task[dict[str, Any] | None]
) -> None:
    """P failed: D is told to compute the prompt itself (a callback, not a task awaiting
    P: no more turns of the loop), as soon as P fails, before D's head if need be (a
    whole answer's head comes at its end); a cancel that reaches D before the request is
    kept there for it."""
    if task.cancelled() or task.exception() is not None or task.result() is not None:
        return
    cancel = asyncio.ensure_future(_cancel(state, d, xid, "prefill failed"))
    _CANCELS.add(cancel)
    cancel.add_done_callback(_CANCELS.discard)


def _on_prefill_answer(
    state: RouterState, fwd: Forward, plan: Plan, task: asyncio.Task[dict[str, Any] | None]
) -> None:
    """P answered: its hit noted (added once D took the request: a flow routed again to
    another decode instance notes its own), and the tokens it fetched from D counted
    (they are not hits of a returned answer)."""
    if not task.cancelled() and task.exception() is None and (ans := task.result()):
        num_cached = int(ans.get("num_cached_tokens", 0))
        if plan is Plan.PREFILL_FETCH:
            num_read = int(ans.get("num_read_tokens", 0))
            state.metrics.fetched_tokens.inc(num_read)
            num_cached -= num_read
        note_answer_hit(state, fwd, num_cached)
        p = fwd.route.prefill
        assert p is not None
        p.kv_clock.read(ans, state.policy.clock())
        allocated = ans.get("kv_blocks_allocated")
        if isinstance(allocated, int):  # P holds the prompt (released after the push)
            state.policy.sessions.note_held(
                fwd.route.session_id, fwd.ids, is_prefill=True,
                stamp=p.kv_clock.stamp_of(allocated), num_tokens=len(fwd.ids),
            )  # fmt: skip


async def serve_push(state: RouterState, fwd: Forward, plan: Plan = Plan.PUSH) -> Answer:
    """The push flow (`plan`: push, or the fetch plan); see the module docstring."""
    p = fwd.route.prefill
    d = fwd.route.decode
    assert p is not None
    xid = f"push-{secrets.token_hex(16)}"
    body, seed = fwd.body, fwd.request.seed
    if fwd.request.temperature != 0 and seed is None:
        # P samples the first token, D the rest (or all, if it falls back): one seed
        # keeps a fallback's first token equal to the one already streamed.
        seed = random.getrandbits(31)
        body = {**body, "seed": seed}
    # The engine ids the probes last saw: each side uses its connection to the other as it
    # is, or handshakes afresh if the engine changed, without asking its address first.
    p_req = {**prefill_body(fwd, xid, seed), "decode_url": d.url, "decode_engine_id": d.engine_id}
    params: dict[str, Any] = {
        "mode": "push", "xid": xid, "prefill_url": p.url, "engine_id": p.engine_id,
        "session_id": fwd.route.session_id,
    }  # fmt: skip
    # Forced tool calls stream as tool-call deltas that only D renders: not spliced either.
    is_spliced = (
        bool(fwd.request.stream)
        and not fwd.request.stop
        and structured.forced_tool_calls(fwd.request) is None
    )  # see below
    if is_spliced:  # D names its first token's id: P's is spliced in by id, not by text
        params["mark_first_token"] = True
    mode = state.config.return_mode
    params.update(return_to(state, fwd, p, plan))
    is_fetch = plan is Plan.PREFILL_FETCH
    if mode is ReturnMode.PULL:
        params["return_mode"] = "pull"
        if fwd.route.is_session_hit and not is_fetch:
            p_req["pull_from"] = await _retained(state, d, fwd.route.session_id)
    # A fetch goes out in P's task: D's request goes out meanwhile, and D's registration
    # waits on P (kept there) while P reads.
    prefill = asyncio.create_task(_push_prefill(state, fwd, p_req, is_fetch))

    prefill.add_done_callback(functools.partial(_on_prefill_failed, state, d, xid))
    await asyncio.sleep(0)  # P's call goes out first: the first token waits on P's answer
    try:
        upstream = await open_decode(
            state, fwd, {**body, "kv_transfer_params": decode_params(fwd, params)}, {}
        )
    except DecodeUnreachable:
        await _cancel(state, p, xid, "decode unreachable")
        raise
    prefill.add_done_callback(functools.partial(_on_prefill_answer, state, fwd, plan))
    if isinstance(upstream, Response) or upstream.status_code != 200:
        await _cancel(state, p, xid, "decode refused the request")
        if isinstance(upstream, Response):
            return upstream
        return relay_decode(state, fwd, upstream, aiter(upstream))
    if not is_spliced:
        # Stop strings act on text: only D, which sees the whole answer, can apply them.
        return relay_decode(state, fwd, upstream, aiter(upstream))
    # P's token goes out under the id of D's answer, which D's X-Request-ID header names
    # (no X-Request-ID is sent to D, so the header is D's own id, not an echo).
    prefix = "chatcmpl" if fwd.is_chat else "cmpl"
    rid = upstream.header(REQUEST_ID_HEADER.encode()) or f"{prefix}-{secrets.token_hex(16)}"
    head = render.ResponseHead(
        request_id=rid, model=fwd.request.model or state.config.model, is_chat=fwd.is_chat,
        return_token_ids=fwd.request.return_token_ids,
    )  # fmt: skip
    first = FirstToken(head, state.tokenizer, xid, state.metrics.first_token_diverged.inc)
    return relay_decode(state, fwd, upstream, push_stream(upstream, prefill, first))
