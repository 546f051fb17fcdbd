"""What the engine hands back for each request at each step (`RequestOutput`), and how
it is read off the request (`OutputTracker`).

Per live request the tracker keeps its detokenizer and how many of its output
ids were handed out already; each output carries the ids since then, their text
(held back where it may still become a stop string), the finish and its reason,
the token counts and, when asked for, the logprobs by output position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvduplex.common.detokenizer import Decoder
from kvduplex.common.detokenizer import IncrementalDetokenizer
from kvduplex.common.sampling import SamplingParams
from kvduplex.common.sampling import TokenLogprobs
from kvduplex.engine.request import FinishReason
from kvduplex.engine.request import Request
from kvduplex.engine.request import RequestStatus


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    """"stop", "length" or "abort" once finished."""
    num_prompt_tokens: int
    num_cached_tokens: int
    """Prompt tokens nobody computed for this request: the prefix-cache hits of the
    instance that computed its prompt (this one, or the sender of its KV)."""
    num_local_cached_tokens: int
    """Prompt tokens served from this instance's prefix cache."""
    num_output_tokens: int
    num_prompt_computed_here: int = 0
    """Prompt tokens this instance computed for the request."""
    num_prompt_computed_remotely: int = 0
    """Prompt tokens the instance that sent the prompt's KV computed."""
    num_remote_kv_bytes: int = 0
    """Bytes of prompt KV that arrived from that instance."""
    new_logprobs: list[TokenLogprobs | None] | None = None
    """With ``SamplingParams.logprobs``: one entry per new token (a first token sampled
    by another instance has the logprobs that instance sent; None for a token whose
    logits no instance reported)."""


_FINISH_NAMES = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class OutputTracker:
    """Each live request's detokenizer and the number of its output ids handed out.

    Single-threaded: the engine's.
    """

    def __init__(self, tokenizer: Decoder, finish: Callable[[str, FinishReason], object]) -> None:
        """`finish(request_id, reason)` finishes an unfinished request now (the
        scheduler's `finish_request`): called when a stop string ends its text."""
        self._tokenizer = tokenizer
        self._finish = finish
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._num_emitted: dict[str, int] = {}

    def add(self, request_id: str, params: SamplingParams) -> None:
        """Track a request just added (its stop strings and ``min_tokens`` from `params`)."""
        self._detok[request_id] = IncrementalDetokenizer(
            self._tokenizer, params.stop, params.min_tokens
        )
        self._num_emitted[request_id] = 0

    def forget(self, request_id: str) -> None:
        self._detok.pop(request_id, None)
        self._num_emitted.pop(request_id, None)

    def next_output(self, req: Request, logprobs: dict[int, TokenLogprobs]) -> RequestOutput | None:
        """What changed for `req` since its last output; None if nothing did, or if it is
        not tracked (gone already). `logprobs`: those computed here by output position,
        taken out as they are handed out. The caller forgets a finished request."""
        rid = req.request_id
        detok = self._detok.get(rid)
        if detok is None:
            return None
        emitted = self._num_emitted[rid]
        new_ids = req.output_token_ids[emitted:]
        finished = req.is_finished
        new_text = detok.update(req.output_token_ids, is_final=finished)
        if detok.stopped_by is not None and not finished:
            self._finish(rid, FinishReason.STOP)
            finished = True
        if not new_ids and not finished:
            return None
        self._num_emitted[rid] = len(req.output_token_ids)
        reason = _FINISH_NAMES.get(req.status) if finished else None
        if detok.stopped_by is not None:
            reason = "stop"
        output = RequestOutput(
            request_id=rid,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=(
                req.num_cached_tokens
                if req.num_remote_cached_tokens is None
                else req.num_remote_cached_tokens
            ),
            num_local_cached_tokens=req.num_cached_tokens,
            num_output_tokens=len(req.output_token_ids),
            num_prompt_computed_here=req.num_prompt_computed_here,
            num_prompt_computed_remotely=(
                0
                if req.num_remote_cached_tokens is None
                else req.num_prompt_tokens - req.num_remote_cached_tokens
            ),
            num_remote_kv_bytes=req.num_remote_kv_bytes,
        )
        if req.sampling_params.logprobs is not None:
            output.new_logprobs = [
                logprobs.pop(i, None) for i in range(emitted, len(req.output_token_ids))
            ]
            if emitted == 0 and output.new_logprobs and output.new_logprobs[0] is None:
                output.new_logprobs[0] = req.first_token_logprobs  # sampled elsewhere
        return output
