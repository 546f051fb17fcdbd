"""The data one scheduler step hands to the engine, and the stop-condition check.

`StepBuilder` collects a step's requests under the token budget while the
scheduler decides; `build` turns it into the `SchedulerOutput` the engine runs.

Block tables travel as deltas: the runner keeps each running request's table
across steps, and a step carries only the block ids appended since the runner
last saw the request (`BlockTableTracker` remembers how many it was sent)::

    step 1   new request a   new_block_ids [7, 2, 9]  replaces_table  (runner: a -> 7 2 9)
    step 2   a decodes       new_block_ids []                         (a -> 7 2 9)
    step 9   a crosses into  new_block_ids [4]                        (a -> 7 2 9 4)
             a new block
    a finishes / is preempted / aborts: its id in `dropped_table_ids` of the next step

A `SchedulerOutput` is plain data (ids, positions, token ids, block ids, the
connector's metadata): no live `Request` reaches the runner or the worker side
of a connector, which read only what the step hands them.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field

from kvduplex.common.sampling import TokenLogprobs
from kvduplex.engine.request import FinishReason
from kvduplex.engine.request import Request


@dataclass
class ScheduledSeq:
    """One request's share of a step."""

    request_id: str
    start_pos: int
    """Position of the first token to compute (num_computed_tokens before the step)."""
    num_new_tokens: int
    token_ids: list[int]
    """The tokens to compute: ``all_token_ids[start_pos : start_pos + num_new_tokens]``."""
    new_block_ids: list[int]
    """Block ids appended to the request's table since the runner last saw it; the
    whole table when `replaces_table`. With them the runner's table covers positions
    up to ``start_pos + num_new_tokens``."""
    replaces_table: bool
    """The runner holds no table for this request (first step, or after preemption)."""
    needs_sample: bool
    """This chunk reaches the end of the known tokens: sample the next one."""


@dataclass(frozen=True)
class RemoteKVAllocation:
    """A request whose blocks were just allocated for its prompt's remote KV: the
    connector registers them with (or reads into them from) the sender."""

    request_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    """The request's whole table: blocks for every prompt token."""
    num_cached_tokens: int
    """Prompt tokens already here (local prefix-cache hit): their blocks need no KV."""
    num_prompt_tokens: int


@dataclass(frozen=True)
class KVReceived:
    """A request's prompt KV is in its blocks: it decodes on from `first_token` (sampled
    by the sender), or, without one, recomputes its last prompt token here."""

    request_id: str
    first_token: int | None
    num_remote_cached_tokens: int
    """Prompt tokens the sender served from its own prefix cache."""
    num_remote_kv_bytes: int
    first_token_logprobs: TokenLogprobs | None = None
    """The sender's logprobs of `first_token`, when the request asked for logprobs."""


@dataclass(frozen=True)
class KVReceiveFailed:
    """A request's prompt KV will not come: it prefills here, into fresh blocks with
    `discard_blocks` (a late WRITE may still land in the ones it has)."""

    request_id: str
    discard_blocks: bool


@dataclass(frozen=True)
class KVFirstToken:
    """The sender sampled the request's first token (a client may have it already): a
    request that prefills here continues from it if it has not sampled yet."""

    request_id: str
    token: int


@dataclass(frozen=True)
class KVSendCancelled:
    """The push of a prefill request's KV was cancelled (the receiver gave up, the
    router cancelled it): a prefill still computing stops. Its blocks stay held while
    WRITEs from them may still land (`KVSendEnded` frees them)."""

    request_id: str


@dataclass(frozen=True)
class KVSendEnded:
    """Nothing more of the push of a prefill request's KV can land: its held blocks are
    freed; a prefill still computing (its push failed first) stops, since its KV would
    go nowhere."""

    request_id: str


KVTransferResult = KVReceived | KVReceiveFailed | KVFirstToken | KVSendCancelled | KVSendEnded
"""What a connector's worker side reports about its transfers; the engine applies them
at the start of its next step (`Scheduler.apply_kv_results`)."""


class KVConnectorMetadata:
    """Base of what a connector's scheduler side hands its worker side for one step
    (`KVConnector.build_connector_meta`); subclasses are plain dataclasses."""


@dataclass
class SchedulerOutput:
    """What one step computes, plus the state changes the engine must act on."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    """Requests whose KV was dropped this step (the runner forgets their state)."""
    remote_kv_allocated: list[RemoteKVAllocation] = field(default_factory=list)
    """Requests whose blocks were just allocated for remote KV."""
    dropped_table_ids: list[str] = field(default_factory=list)
    """Requests whose block tables the runner drops before this step (finished,
    aborted or preempted since it last saw them)."""
    num_batched_tokens: int = 0
    blocks_short: bool = False
    """A request could not get blocks this step (one waits for admission, or a running
    one was preempted): blocks that finished requests hold for a transfer are wanted."""
    kv_connector_metadata: KVConnectorMetadata | None = None
    """What the connector's scheduler side planned for this step (set by the engine
    after `schedule`), for its worker side."""

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class BlockTableTracker:
    """How many of each request's block ids the runner was sent; owned by the scheduler.

    `forget` must be called whenever a request's table shrinks or the request
    stops running (finish, abort, preemption, dropped tail): the runner then
    drops its copy, and the request's next step sends the whole table again.
    """

    def __init__(self) -> None:
        self._num_sent: dict[str, int] = {}
        self._dropped: list[str] = []

    def take_delta(self, req: Request) -> tuple[list[int], bool]:
        """The ids to send for `req` this step and whether they replace the runner's table."""
        ids = req.block_ids
        sent = self._num_sent.get(req.request_id)
        self._num_sent[req.request_id] = len(ids)
        if sent is None or sent > len(ids):
            return list(ids), True
        return ids[sent:], False

    def forget(self, request_id: str) -> None:
        if self._num_sent.pop(request_id, None) is not None:
            self._dropped.append(request_id)

    def take_dropped(self) -> list[str]:
        dropped, self._dropped = self._dropped, []
        return dropped

    @property
    def num_tracked(self) -> int:
        return len(self._num_sent)


class StepBuilder:
    """Collects one step's seqs under the token budget."""

    def __init__(self, token_budget: int) -> None:
        self.token_budget = token_budget
        self.seqs: dict[str, tuple[Request, int]] = {}
        self.preempted_ids: list[str] = []
        self.remote_kv_allocated: list[RemoteKVAllocation] = []
        self.blocks_short = False
        """Admission stopped at a request the pool had no blocks for."""
        self._num_tokens = 0

    @property
    def budget_left(self) -> int:
        return max(0, self.token_budget - self._num_tokens)

    def add(self, req: Request, num_new_tokens: int) -> None:
        assert req.request_id not in self.seqs, f"request {req.request_id} scheduled twice"
        self.seqs[req.request_id] = (req, num_new_tokens)
        self._num_tokens += num_new_tokens

    def drop(self, req: Request) -> None:
        """Take a request out of this step again (it was preempted)."""
        entry = self.seqs.pop(req.request_id, None)
        if entry is not None:
            self._num_tokens -= entry[1]

    def build(self, tables: BlockTableTracker) -> SchedulerOutput:
        out = SchedulerOutput(
            preempted_ids=self.preempted_ids,
            remote_kv_allocated=self.remote_kv_allocated,
            dropped_table_ids=tables.take_dropped(),
            blocks_short=self.blocks_short or bool(self.preempted_ids),
        )
        for req, n in self.seqs.values():
            start = req.num_computed_tokens
            if start < req.num_prompt_tokens:
                req.num_prompt_computed_here += min(start + n, req.num_prompt_tokens) - start
            new_block_ids, replaces = tables.take_delta(req)
            out.seqs.append(
                ScheduledSeq(
                    request_id=req.request_id,
                    start_pos=start,
                    num_new_tokens=n,
                    token_ids=list(req.all_token_ids[start : start + n]),
                    new_block_ids=new_block_ids,
                    replaces_table=replaces,
                    needs_sample=start + n == req.num_tokens,
                )
            )
            out.num_batched_tokens += n
        return out


def check_stop(req: Request, max_num_tokens: int) -> FinishReason | None:
    """Why the request must finish after its latest output token, or None.

    Order: a structured output's grammar that has terminated; stop_token_ids (sets
    ``req.stop_reason``) and EOS (unless ignore_eos), both only once ``min_tokens`` are
    out (before, the sampler masks them; a grammar that allows nothing else brings
    them); then max_tokens; then
    the pool's capacity (the next step could not hold the KV even alone).
    """
    sp = req.sampling_params
    n = req.num_output_tokens
    if n == 0:
        return None
    last = req.output_token_ids[-1]
    if req.grammar is not None and req.grammar.is_terminated:
        return FinishReason.STOP  # the structured output is complete
    if n >= sp.min_tokens:
        if last in sp.stop_token_ids:
            req.stop_reason = last
            return FinishReason.STOP
        if not sp.ignore_eos and last in sp.extra_eos_token_ids:
            return FinishReason.STOP
    if n >= sp.max_tokens or req.num_tokens > max_num_tokens:
        return FinishReason.LENGTH
    return None


__all__ = [
    "BlockTableTracker",
    "KVConnectorMetadata",
    "KVFirstToken",
    "KVReceiveFailed",
    "KVReceived",
    "KVSendCancelled",
    "KVSendEnded",
    "KVTransferResult",
    "RemoteKVAllocation",
    "ScheduledSeq",
    "SchedulerOutput",
    "StepBuilder",
    "check_stop",
]
