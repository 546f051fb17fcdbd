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
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field

from kvduplex.engine.request import FinishReason
from kvduplex.engine.request import Request


@dataclass
class ScheduledSeq:
    """One request's share of a step."""

    request: Request
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

    @property
    def block_table(self) -> list[int]:
        """The request's whole table, live (not a copy; for tests and connectors)."""
        return self.request.block_ids


@dataclass
class SchedulerOutput:
    """What one step computes, plus the state changes the engine must act on."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    """Requests whose KV was dropped this step (the runner forgets their state)."""
    remote_kv_allocated: list[Request] = field(default_factory=list)
    """Requests whose blocks were just allocated for remote KV: tell the sender
    ``block_ids`` and ``num_cached_tokens`` (what is already here)."""
    dropped_table_ids: list[str] = field(default_factory=list)
    """Requests whose block tables the runner drops before this step (finished,
    aborted or preempted since it last saw them)."""
    num_batched_tokens: int = 0

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
        self.preempted: list[Request] = []
        self.remote_kv_allocated: list[Request] = []
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
            preempted=self.preempted,
            remote_kv_allocated=self.remote_kv_allocated,
            dropped_table_ids=tables.take_dropped(),
        )
        for req, n in self.seqs.values():
            start = req.num_computed_tokens
            new_block_ids, replaces = tables.take_delta(req)
            out.seqs.append(
                ScheduledSeq(
                    request=req,
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
    out; then max_tokens; then
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


__all__ = ["BlockTableTracker", "ScheduledSeq", "SchedulerOutput", "StepBuilder", "check_stop"]
