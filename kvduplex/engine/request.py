"""A request as the scheduler sees it: tokens, progress, blocks, state; and whether a
request of its size can be served at all (`check_request_size`, torch-free: the router
checks with it too).

Token layout of one request (``num_computed_tokens`` = tokens whose KV is in
the cache; the rest is computed by the next steps)::

    all_token_ids:  [ prompt ........................ | output ...... ]
                    0                    num_prompt_tokens      num_tokens
    KV in cache:    [ computed ............... )
                    0             num_computed_tokens

Lifecycle::

    WAITING ──admit──► RUNNING ──stop/length──► FINISHED_STOPPED / FINISHED_LENGTH
       │  ▲               │
       │  └──PREEMPTED ◄──┘ (out of blocks: KV dropped, recomputed on re-admission)
       │
       └─(remote_kv)─► WAITING_FOR_REMOTE_KV ──done──► RUNNING (decodes)
                                            └─failed─► RUNNING (prefills locally)

    any unfinished state ──abort──► FINISHED_ABORTED
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import TYPE_CHECKING

from kvduplex.common.sampling import SamplingParams
from kvduplex.common.sampling import TokenLogprobs

if TYPE_CHECKING:
    from kvduplex.engine.block_pool import BlockHash
    from kvduplex.engine.structured import RequestGrammar


class RequestStatus(enum.Enum):
    """Where a request is in its lifecycle (see the module diagram)."""

    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


class FinishReason(enum.Enum):
    """Why a request finished; the value is the OpenAI ``finish_reason``."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"

    @property
    def status(self) -> RequestStatus:
        """The final status a request finished for this reason ends in."""
        return _STATUS_OF_REASON[self]


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)
_STATUS_OF_REASON = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
}


@dataclass(frozen=True)
class RemoteKVSpec:
    """The prompt's KV will be written into this request's blocks by another instance."""

    transfer_id: str
    """Transfer id chosen by the router, shared by sender and receiver."""
    source_engine_id: str | None = None
    """Engine id of the sending instance, when known at admission."""

    def __post_init__(self) -> None:
        if not self.transfer_id:
            raise ValueError("RemoteKVSpec.transfer_id must be a non-empty string")


@dataclass(eq=False)
class Request:
    """One generation request. Mutated only by the scheduler (and its KV manager).

    ``eq=False``: two requests are the same only if they are the same object.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    """Monotonic seconds; orders admission and picks preemption victims."""
    remote_kv: RemoteKVSpec | None = None
    """Set when the prompt's KV will arrive from another instance."""
    hold_blocks_on_finish: bool = False
    """Keep the blocks after finishing until `Scheduler.release_held` (a sender's lease)."""
    connector_meta: object | None = None
    """Opaque to the engine: what a connector attached before admission (e.g. where the
    finished turn's KV is returned); the connector reads it when the request finishes."""
    grammar: RequestGrammar | None = None
    """Structured output: the grammar every output token must fit (`engine.structured`);
    the engine masks this request's logits with it and it follows each appended token."""
    session_id: str | None = None
    """The conversation the request belongs to (the router's session, or the client's
    ``prompt_cache_key``); its blocks are kept by session value (`engine.eviction`)."""

    output_token_ids: list[int] = field(default_factory=list, init=False)
    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    num_computed_tokens: int = field(default=0, init=False)
    """Tokens of `all_token_ids` whose KV is in this request's blocks."""
    block_ids: list[int] = field(default_factory=list, init=False)
    """Block table: block ``i`` holds positions ``[i*block_size, (i+1)*block_size)``."""
    num_cached_tokens: int = field(default=0, init=False)
    """Prompt tokens served from the local prefix cache at first admission."""
    num_remote_cached_tokens: int | None = field(default=None, init=False)
    """When the prompt's KV came from another instance: the prompt tokens that instance
    served from its own prefix cache (it computed the rest). None: computed here."""
    num_prompt_computed_here: int = field(default=0, init=False)
    """Prompt tokens this instance computed (prefill chunks, recomputations included)."""
    num_remote_kv_bytes: int = field(default=0, init=False)
    """Bytes of prompt KV that arrived from another instance."""
    forced_first_token: int | None = field(default=None, init=False)
    """The first output token when another instance sampled it (and the client may have
    it already): a request that computes its prompt here after all continues from it
    instead of sampling its own."""
    first_token_logprobs: TokenLogprobs | None = field(default=None, init=False)
    """With ``SamplingParams.logprobs``: the first output token's logprobs, computed here
    when it was sampled here, or by the instance that sampled it (sent with its KV)."""
    stop_reason: int | None = field(default=None, init=False)
    """The stop token id that ended the request (None for EOS, length and abort)."""
    finish_reason: FinishReason | None = field(default=None, init=False)
    num_preemptions: int = field(default=0, init=False)
    block_hashes: list[BlockHash] = field(default_factory=list, init=False, repr=False)
    """Prefix-cache keys of the full blocks of `all_token_ids`, extended incrementally."""
    _all_token_ids: list[int] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must be a non-empty string")
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: the prompt must have at least one token")
        self.prompt_token_ids = list(self.prompt_token_ids)
        self._all_token_ids = list(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt then output tokens (a live view: do not mutate)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        """Append one generated token (its KV is computed by the next step); the
        request's grammar, if any, advances past it."""
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)


__all__ = ["FinishReason", "RemoteKVSpec", "Request", "RequestStatus"]
