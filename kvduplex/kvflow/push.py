"""The push flow's facade: its prefill half and its decode half side by side.

What the internal routes call; they only parse bodies and map errors to
statuses::

    router ──► P  POST /internal/push/prefill ─► PushPrefillSide.prefill(request, peer)
                  (``pull_from``: RetainedReader.read_retained first, see return_pull)
    router ──► D  POST /v1/... kv_transfer_params ─► PushDecodeSide.admit(spec)
    router ──► P  POST /internal/push/cancel ─► PushPrefillSide.cancel(xid, reason)
    router ──► D  POST /internal/push/cancel ─► PushDecodeSide.cancel(xid, reason)

The machinery is `push_prefill.PushSender` (streams the prefill's KV layer by
layer) and `push_decode.PushDecode` (a request waits for it); both live on the
engine thread, so each call here goes there as an engine command or a flow
inbox request whose failure comes back to the caller.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from kvduplex.common.sampling import TokenLogprobs
from kvduplex.engine.async_engine import AsyncEngine
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.request import Request
from kvduplex.kvflow.push_decode import PushDecode
from kvduplex.kvflow.push_decode import PushSpec
from kvduplex.kvflow.push_prefill import PushSender
from kvduplex.transport.protocol import PeerHandle

logger = logging.getLogger(__name__)


class PushCancelled(Exception):
    """The push ended before the prefill's first token: decode cancelled it, or its
    deadline passed."""


class NoFirstToken(Exception):
    """The prefill ended without a token (a bug, or an engine that failed it)."""


@dataclass(frozen=True)
class PrefillAnswer:
    """A pushed prefill's first token (its KV streams on to decode)."""

    xid: str
    first_token: int
    text: str
    num_tokens: int
    num_cached_tokens: int
    first_token_logprobs: TokenLogprobs | None


class PushPrefillSide:
    """Prefill's half: run a prompt to its first token while `PushSender` streams its KV
    into the decode instance's registered blocks."""

    def __init__(self, engine: AsyncEngine, sender: PushSender) -> None:
        self.engine = engine
        self.sender = sender

    async def prefill(self, request: Request, peer: PeerHandle) -> PrefillAnswer:
        """Prefill ``request`` (its id is the xid; it holds its blocks on finish) and push
        its KV to ``peer``; the first token as soon as it is sampled.

        The job is added in the same engine-thread turn as the request (no cancel can
        come between). Raises what `AsyncEngine.generate` raises for a refused request
        (RequestRejected, ValueError for an xid in use, EngineDeadError), PushCancelled,
        or NoFirstToken.
        """
        xid = request.request_id
        expected = False

        def admit() -> None:  # engine thread
            nonlocal expected
            self.sender.expect(xid, peer, request.prompt_token_ids)
            expected = True

        last, ids, text = None, [], []
        logprobs: list[TokenLogprobs | None] = []
        try:
            async for out in self.engine.generate(request, on_admit=admit):
                last = out
                ids.extend(out.new_token_ids)
                text.append(out.new_text)
                logprobs.extend(out.new_logprobs or ())
        finally:
            if expected and (last is None or not last.finished):  # the caller left, or the
                self.cancel_soon(xid, "prefill did not finish")  # engine failed
        if last is not None and last.finish_reason == "abort":
            raise PushCancelled(f"xid {xid}: the push was cancelled (by decode, or its deadline)")
        if last is None or not ids:
            raise NoFirstToken(f"xid {xid}: prefill finished without a token")
        return PrefillAnswer(
            xid, ids[0], "".join(text), last.num_prompt_tokens, last.num_cached_tokens,
            logprobs[0] if logprobs else None,
        )  # fmt: skip

    async def cancel(self, xid: str, reason: str) -> bool:
        """Stop pushing ``xid`` (decode hears KVFailed once nothing can land); False if
        no such push is known (it is remembered, so a late job under it is refused)."""
        return bool(await self.engine.run_in_engine(partial(_cancel_send, self.sender, xid, reason)))

    def cancel_soon(self, xid: str, reason: str) -> None:
        """`cancel`, without waiting for it (a failure is logged by the engine)."""
        self.engine.call(partial(_cancel_send, self.sender, xid, reason), label=f"cancel {xid}")


def _cancel_send(sender: PushSender, xid: str, reason: str, _engine: LLMEngine) -> bool:
    return sender.cancel(xid, reason)


class PushDecodeSide:
    """Decode's half: a request waits for its prompt's pushed KV."""

    def __init__(self, engine: AsyncEngine, push: PushDecode) -> None:
        self.engine = engine
        self.push = push

    def admit(self, spec: PushSpec) -> Callable[[], None]:
        """What registers ``spec`` as the request's ``on_admit`` (`AsyncEngine.generate`):
        on the engine thread, in the same turn as the request's add, so that the request
        is scheduled, and its KVRegister sent, in the very next step. The call raises
        XidInUseError (which rejects the request) for an xid another request waits on."""
        return partial(self.push.register, spec)

    async def cancel(self, xid: str, reason: str) -> bool:
        """Stop waiting for ``xid`` (prefill failed); False if unknown (kept a while for
        a request still to come) or over."""
        return bool(await self.engine.run_in_engine(partial(_cancel_wait, self.push, xid, reason)))


def _cancel_wait(push: PushDecode, xid: str, reason: str, _engine: LLMEngine) -> bool:
    return push.cancel(xid, reason)


__all__ = ["NoFirstToken", "PrefillAnswer", "PushCancelled", "PushDecodeSide", "PushPrefillSide"]
