"""The data one scheduler step hands to the engine, and the stop-condition check.

`StepBuilder` collects a step's requests under the token budget while the
scheduler decides; `build` turns it into the `SchedulerOutput` the engine runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvduplex.engine.request import FinishReason, Request


@dataclass
class ScheduledSeq:
    """One request's share of a step."""

    request: Request
    start_pos: int
    """Position of the first token to compute (num_computed_tokens before the step)."""
    num_new_tokens: int
    token_ids: list[int]
    """The tokens to compute: ``all_token_ids[start_pos : start_pos + num_new_tokens]``."""
    block_table: list[int]
    """The request's blocks, covering positions up to ``start_pos + num_new_tokens``."""
    needs_sample: bool
    """This chunk reaches the end of the known tokens: sample the next one."""


@dataclass
class SchedulerOutput:
    """What one step computes, plus the state changes the engine must act on."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    """Requests whose KV was dropped this step (the runner forgets their state)."""
    remote_kv_allocated: list[Request] = field(default_factory=list)
    """Requests whose blocks were just allocated for remote KV: tell the sender
    ``block_ids`` and ``num_cached_tokens`` (what is already here)."""
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.seqs


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

    def build(self) -> SchedulerOutput:
        out = SchedulerOutput(
            preempted=self.preempted, remote_kv_allocated=self.remote_kv_allocated
        )
        for req, n in self.seqs.values():
            start = req.num_computed_tokens
            out.seqs.append(
                ScheduledSeq(
                    request=req,
                    start_pos=start,
                    num_new_tokens=n,
                    token_ids=list(req.all_token_ids[start : start + n]),
                    block_table=list(req.block_ids),
                    needs_sample=start + n == req.num_tokens,
                )
            )
            out.num_batched_tokens += n
        return out


def check_stop(req: Request, max_num_tokens: int) -> FinishReason | None:
    """Why the request must finish after its latest output token, or None.

    Order: stop_token_ids (sets ``req.stop_reason``) and EOS (unless
    ignore_eos), both only once ``min_tokens`` are out; then max_tokens; then
    the pool's capacity (the next step could not hold the KV even alone).
    """
    sp = req.sampling_params
    n = req.num_output_tokens
    if n == 0:
        return None
    last = req.output_token_ids[-1]
    if n >= sp.min_tokens:
        if last in sp.stop_token_ids:
            req.stop_reason = last
            return FinishReason.STOP
        if not sp.ignore_eos and last in sp.extra_eos_token_ids:
            return FinishReason.STOP
    if n >= sp.max_tokens or req.num_tokens > max_num_tokens:
        return FinishReason.LENGTH
    return None


__all__ = ["ScheduledSeq", "SchedulerOutput", "StepBuilder", "check_stop"]
