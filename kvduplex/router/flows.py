"""The router's flows: how one routed request reaches its prefill (P) and decode (D).

This module holds the map below, what every flow shares (`Forward`, `DecodeUnreachable`,
P's prefill call, D's request opened and its answer relayed, the turn's return
params) and the flows that call D alone (decode, short append). The push flow is in
`push_flow.py` (`serve_push`), the pull flow in `pull_flow.py` (`serve_pull`).

* **push** (default): ``POST /internal/push/prefill`` on P and the OpenAI
  request with ``kv_transfer_params: {mode: push, xid, prefill_url,
  session_id}`` on D, at the same time. P streams the prompt's KV into D's
  blocks layer by layer and answers with its first token as soon as it is
  sampled; a streaming client gets that token at once, then D's tokens (D's
  own copy of the first token is dropped, matched by token id: see
  `relay.push_stream`). If P fails, D is told to stop
  waiting and computes the prompt itself; if D refuses the request, P is told
  to stop.
* **push, fetch plan** (`residency.Plan.PREFILL_FETCH`): as push, but P's call first
  asks D to lease the prompt's prefix it holds (`fetch.lease_history`, while D's
  request goes out), and names those blocks in P's body (``pull_from``): P READs what
  it lacks, computes the rest and releases D's lease. If D leases nothing (or answers
  late, or fails), P computes the history.
* **pull** (baseline): ``POST /internal/prefill`` on P, then the request with
  ``kv_transfer_params: {mode: pull, ...}`` on D, which READs P's blocks; D's
  answer is relayed unchanged. If P fails, D computes the prompt itself.
* **decode** (no prefill instance): the request goes to D unchanged.

Either way the client never sees a transfer fault, only a slower answer.
P's bodies carry ``session_id`` too; instances may ignore it.

D always gets ``kv_transfer_params`` (mode ``local`` where no prefill takes
part): ``report_answer`` (D ends the answer with its generated ids, which
`relay.tap_answer` takes out and the session table records) and, for chat,
``prompt_token_ids`` (the ids the router built, answers sent back spliced: D
computes exactly what P was given). With ``--return-mode push`` the turn is
returned to P (``return_to``) while the session's client sends its answers back
as returned (`sessions` module docstring), up to what the next prompt will hold
(``return_max_tokens``: `answers.return_limit`); at the next turn P's cached-token
count says how much of the returned answer it still held (the answer hit,
`push_flow.note_answer_hit`).

A D that cannot be reached (the connection was refused or timed out: D never
saw the request), or that the router marked unhealthy before the request was
sent, raises `DecodeUnreachable` once P's part is undone (push: cancelled;
pull: its lease released), so the app can route the request again; any other
failure before D's answer begins is a 502.

Every call to an instance is abandoned once the router marks the instance
unhealthy (`calls.until_unhealthy`, and `relay` for D's stream): a P that
hangs or is partitioned fails its prefill then (D computes the prompt), a D
that does the same ends its answer with an error.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse
from starlette.responses import Response

from kvduplex.common.config import ReturnMode
from kvduplex.common.openai import structured
from kvduplex.common.openai.chat_output import RAW_OUTPUT_HEADER
from kvduplex.common.openai.chat_output import ChatOutputParser
from kvduplex.common.openai.protocol import OpenAIRequest
from kvduplex.common.openai.protocol import error_body
from kvduplex.router.answers import RelayedAnswer
from kvduplex.router.answers import return_limit
from kvduplex.router.answers import tap_answer
from kvduplex.router.backends import Backend
from kvduplex.router.backends import Outcome
from kvduplex.router.calls import InstanceDown
from kvduplex.router.calls import failed_outcome
from kvduplex.router.calls import until_unhealthy
from kvduplex.router.client import CallError
from kvduplex.router.client import ConnectError
from kvduplex.router.client import StreamedAnswer
from kvduplex.router.parsing import parse_body
from kvduplex.router.parsing import parse_stream
from kvduplex.router.plans import is_return_kept
from kvduplex.router.plans import note_turn_held
from kvduplex.router.policy import Route
from kvduplex.router.relay import RelayedResponse
from kvduplex.router.relay import relay
from kvduplex.router.residency import Plan
from kvduplex.router.state import RouterState
from kvduplex.router.state import json_body

Answer = Response | RelayedResponse
"""What a flow answers the client with: a response of the router's own, or a relayed one."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Forward:
    """One validated request on its way to the instances."""

    path: str
    """/v1/completions or /v1/chat/completions."""
    request: OpenAIRequest
    """The validated body."""
    body: dict[str, Any]
    """The body as the client sent it (less any kv_transfer_params): what D gets."""
    ids: list[int]
    """The prompt's token ids, as the instances compute them."""
    route: Route
    parser: ChatOutputParser | None = None
    """A chat answer's tool-call and reasoning parser, by the router's flags (decode is
    asked for raw text: see `parsing.py`); None: relayed as it is."""

    @property
    def is_chat(self) -> bool:
        return self.path.endswith("/chat/completions")


class InstanceDraining(CallError):
    """The instance refused new work: it is draining (shutting down)."""

    def __init__(self, url: str) -> None:
        super().__init__(f"{url} is draining")


async def is_draining_answer(resp: StreamedAnswer) -> bool:
    """Whether a 503 answer is an instance's "draining" refusal (its body is then read
    and the answer closed)."""
    await resp.read()
    try:
        err = resp.json().get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(err, dict) and err.get("code") == "draining"


class DecodeUnreachable(Exception):
    """The route's decode instance could not be reached; it never saw the request."""

    def __init__(self, url: str, exc: CallError) -> None:
        super().__init__(f"decode at {url} failed: {exc!r}")
        self.url = url


def _outcome(status: int) -> Outcome:
    return Outcome.OK if status < 400 else Outcome.REFUSED if status < 500 else Outcome.ERROR


def prefill_body(fwd: Forward, xid: str, seed: int | None) -> dict[str, Any]:
    """P samples the first token with the request's own parameters (D's, on a fallback),
    and under its grammar (structured output) when it has one (with ``min_tokens`` it
    is neither EOS nor a stop id); it computes the token's logprobs when the request
    asks for them (D never sees the logits they come from)."""
    req = fwd.request
    body = {
        "xid": xid, "prompt_token_ids": fwd.ids, "temperature": req.temperature,
        "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p,
        "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty, "seed": seed,
        "min_tokens": req.min_tokens, "stop_token_ids": req.stop_token_ids or [],
        "ignore_eos": req.ignore_eos,
        "session_id": fwd.route.session_id, "logprobs": req.num_logprobs(),
    }  # fmt: skip
    spec = structured.grammar_spec_of(req)
    if spec is not None:
        body["grammar"] = spec.to_dict()
    return body


def decode_params(fwd: Forward, params: dict[str, Any]) -> dict[str, Any]:
    """D's ``kv_transfer_params``: `params`, and what every request asks of D (see the
    module docstring)."""
    out = {**params, "report_answer": True}
    if fwd.is_chat:
        out["prompt_token_ids"] = fwd.ids
    return out


def return_to(state: RouterState, fwd: Forward, p: Backend, plan: Plan) -> dict[str, Any]:
    """The duplex return's params, if this turn is returned to `p` (else none): limited to
    what the next prompt will hold (`answers.return_limit`)."""
    if state.config.return_mode is not ReturnMode.PUSH:
        return {}
    if not fwd.route.is_returning:
        state.metrics.returns_skipped.inc()
        return {}
    if state.config.return_only_if_kept and not is_return_kept(
        fwd.route, plan, state.policy.clock()
    ):
        state.metrics.returns_skipped_room.inc()
        return {}
    params: dict[str, Any] = {"return_to": p.url, "return_engine_id": p.engine_id}
    may_reason = fwd.parser is not None and fwd.parser.may_start_with_reasoning
    limit = return_limit(may_reason, fwd.route.sends_reasoning, len(fwd.ids))
    state.policy.sessions.note_return_limit(fwd.route.session_id, limit)
    if limit is not None:
        params["return_max_tokens"] = limit
    return params


async def post_prefill(
    state: RouterState, fwd: Forward, path: str, req: dict[str, Any]
) -> dict[str, Any] | None:
    """POST to the route's P; its JSON answer, or None (logged) if it failed, or P was
    marked unhealthy before it answered."""
    p = fwd.route.prefill
    assert p is not None
    outcome = Outcome.REFUSED  # until the call ends one way or the other
    try:
        resp = await until_unhealthy(p, state.client.post_whole(p.url + path, json_body(req)))
        outcome = _outcome(resp.status_code)
        if resp.status_code != 200:
            logger.warning(
                "xid=%s: prefill at %s answered %d: %s",
                req["xid"], p.url, resp.status_code, resp.text[:200],
            )  # fmt: skip
            return None
        ans: dict[str, Any] = resp.json()
        return ans
    except (CallError, ValueError) as exc:  # unreachable, or an answer that is not JSON
        outcome = failed_outcome(exc)
        logger.warning(
            "xid=%s: prefill at %s failed: %s; decode computes the prompt", req["xid"], p.url, exc
        )
        return None
    finally:
        state.policy.prefill_done(fwd.route, outcome)


async def open_decode(
    state: RouterState, fwd: Forward, body: dict[str, Any], headers: dict[str, str]
) -> StreamedAnswer | Response:
    """D's streaming answer, or a 502 if D failed (or was marked unhealthy) before
    answering; raises `DecodeUnreachable` if D could not be reached at all, or was marked
    unhealthy before the request was sent."""
    d = fwd.route.decode
    if not d.is_healthy:
        state.policy.decode_done(fwd.route, Outcome.REFUSED)
        raise DecodeUnreachable(d.url, InstanceDown(d.url))
    if fwd.is_chat:  # the router parses chat answers (`parsing.py`), never decode
        headers = {**headers, RAW_OUTPUT_HEADER: "1"}
    try:
        resp = await until_unhealthy(
            d, state.client.post_stream(d.url + fwd.path, json_body(body), headers)
        )
        if resp.status_code == 503 and await is_draining_answer(resp):
            # D got SIGTERM after the route was chosen, before a probe saw it: no new work
            # for it, and this request goes to another decode instance.
            state.policy.decode.mark_failed(d, state.policy.clock(), is_down=False)
            state.policy.decode_done(fwd.route, Outcome.REFUSED)
            raise DecodeUnreachable(d.url, InstanceDraining(d.url))
        return resp
    except CallError as exc:
        state.policy.decode_done(fwd.route, failed_outcome(exc))
        if isinstance(exc, ConnectError):
            raise DecodeUnreachable(d.url, exc) from exc
        logger.warning("decode at %s failed before answering: %r", d.url, exc)
        message = f"decode at {d.url} failed: {exc!r}"
        return JSONResponse(error_body(message, "server_error", code="decode_failed"), 502)


def relay_decode(
    state: RouterState, fwd: Forward, upstream: StreamedAnswer, parts: AsyncIterator[bytes]
) -> RelayedResponse:
    outcome = _outcome(upstream.status_code)
    if fwd.parser is not None and upstream.status_code == 200:
        parse = parse_stream if fwd.request.stream else parse_body
        parts = parse(parts, fwd.parser)
    if upstream.status_code == 200:
        # The session's next turn: how much of it decode holds (a short append?), whether
        # it sends this answer back as returned, and the answer's ids to splice if so.
        sessions, sid = state.policy.sessions, fwd.route.session_id

        def on_answer(answer: RelayedAnswer) -> None:
            now = state.policy.clock()
            sessions.note_answer(
                sid, fwd.ids, answer.num_tokens, answer.token_ids, answer.message, now
            )
            note_turn_held(sessions, fwd.route, fwd.ids, answer.num_tokens, now)

        # After parsing: the message is recorded as the client receives it.
        parts = tap_answer(parts, bool(fwd.request.stream), fwd.is_chat, on_answer)

    def close(failed: bool) -> None:
        if failed:
            state.metrics.stream_errors.inc()
        state.policy.decode_done(fwd.route, Outcome.FAILED if failed else outcome)

    d = fwd.route.decode
    tapped = upstream.status_code == 200  # `tap_answer` relays whole events only
    return relay(upstream, parts, close, f"decode at {d.url}", d.watch, in_whole_events=tapped)


async def serve_short_append(state: RouterState, fwd: Forward) -> Answer:
    """Decode alone computes the turn over its cached history, then returns it to prefill
    (a short append)."""
    p = fwd.route.prefill
    assert p is not None
    state.policy.prefill_done(fwd.route, Outcome.OK)  # not called: nothing to say of it
    params: dict[str, Any] = {"mode": "local", "session_id": fwd.route.session_id}
    params.update(return_to(state, fwd, p, Plan.DECODE_LOCAL))
    body = {**fwd.body, "kv_transfer_params": decode_params(fwd, params)}
    upstream = await open_decode(state, fwd, body, {})
    if isinstance(upstream, Response):
        return upstream
    return relay_decode(state, fwd, upstream, aiter(upstream))


async def serve_decode_only(state: RouterState, fwd: Forward) -> Answer:
    body = {**fwd.body, "kv_transfer_params": decode_params(fwd, {"mode": "local"})}
    upstream = await open_decode(state, fwd, body, {})
    if isinstance(upstream, Response):
        return upstream
    return relay_decode(state, fwd, upstream, aiter(upstream))
