"""The engine of one instance: schedule → run the model → update.

`LLMEngine` is synchronous and single-threaded: the caller owns the loop.
`AsyncEngine` (in `async_engine.py`) runs it in its own thread for the server.

A `KVConnector` (see `connector.py`) plugs disaggregation into the step
without the step knowing about prefill or decode roles::

    scheduler.apply_kv_results(connector.get_finished())   # transfers that ended
    out = scheduler.schedule()
    meta = out.kv_connector_metadata = connector.build_connector_meta(out)
    connector.start_load_kv(meta)             # e.g. register remote-KV blocks with P
    job = tier_loads.start(tier_loads.take_planned())   # long KV tier hits, layer by layer
    logits = runner.execute(inputs, on_layer_done=tier wait, then connector.layer_hook(meta))
    void = tier_loads.finish(job)             # the loader joined: its failed loads
    connector.wait_for_save(meta)
    void |= connector.get_failed_loads()      # loads that did not land: recompute those
    finished = scheduler.update(out, sampled, void)  # each finish: connector.request_finished

One output path: every `RequestOutput` (read off its request by `outputs.py`)
comes from `step` (tokens sampled here, first tokens that came with remote KV,
finishes, aborts since the last step); `has_unfinished` stays true while any is
pending, so a loop that steps while it is true delivers them all.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence

import torch

from kvduplex.common.engine_config import EngineConfig
from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.common.limits import RequestRejected
from kvduplex.common.limits import check_request_size
from kvduplex.common.sampling import SamplingParams
from kvduplex.common.sampling import TokenLogprobs
from kvduplex.engine.block_pool import BlockPool
from kvduplex.engine.connector import KVConnector
from kvduplex.engine.connector import chain_layer_hooks
from kvduplex.engine.eviction import Clock
from kvduplex.engine.kv_cache import allocate_kv_pool
from kvduplex.engine.kv_manager import KVCacheManager
from kvduplex.engine.kv_tier import SlotTier
from kvduplex.engine.outputs import OutputTracker
from kvduplex.engine.outputs import RequestOutput
from kvduplex.engine.request import FinishReason
from kvduplex.engine.request import Request
from kvduplex.engine.runner import ModelRunner
from kvduplex.engine.runner import SeqInput
from kvduplex.engine.runner import kv_layout_for
from kvduplex.engine.runner import num_blocks_for_memory
from kvduplex.engine.sampler import PenaltyCounts
from kvduplex.engine.sampler import RequestGenerators
from kvduplex.engine.sampler import apply_token_bitmask
from kvduplex.engine.sampler import compute_logprobs
from kvduplex.engine.sampler import sample
from kvduplex.engine.sampler import stop_bans
from kvduplex.engine.scheduler import Scheduler
from kvduplex.engine.scheduler import SchedulerOutput
from kvduplex.engine.scheduler_output import KVConnectorMetadata
from kvduplex.engine.structured import fill_bitmask
from kvduplex.engine.tier_link import attach_tier
from kvduplex.engine.tier_load import TierJob
from kvduplex.engine.tier_load import TierLoads
from kvduplex.model.loader import LoadedModel
from kvduplex.model.loader import load_model

logger = logging.getLogger(__name__)


SampleHook = Callable[[list[Request], list[int]], list[int]]
"""``hook(requests, sampled)``: the tokens `requests` take at this step, given those the
sampler drew for them (same order, same length). Called on the engine thread after each
sampling; what it returns goes on as the drawn tokens would (logprobs, stop checks,
detokenizing), and a first token that came with remote KV replaces it as it would a drawn
one. It must be quick and must not touch engine state."""


class LLMEngine:
    """One model, one paged KV pool, one scheduler."""

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        *,
        sample_hook: SampleHook | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        """`loaded`: the model (default: loaded from ``config.model``). `sample_hook`: see
        `SampleHook` (default: none, the sampled tokens stand). `clock`: monotonic seconds,
        by which the pool tells idle sessions (``--session-idle-s``)."""
        self.config = config
        self.sample_hook = sample_hook
        self.loaded = loaded if loaded is not None else load_model(config.model)
        model_cfg = self.loaded.config
        dtype_name = str(self.loaded.dtype).removeprefix("torch.")
        num_blocks = config.cache.num_blocks or num_blocks_for_memory(
            model_cfg, config.cache.block_size, self.loaded.dtype, config.cache.kv_cache_mb
        )
        self.layout: KVCacheLayout = kv_layout_for(
            model_cfg, config.cache.block_size, num_blocks, dtype_name
        )
        t0 = time.perf_counter()
        self.kv_pool = allocate_kv_pool(self.layout, self.loaded.device)
        logger.info(
            "KV pool: %d blocks of %d tokens, %.0f MiB, resident after %.2f s",
            num_blocks, config.cache.block_size, self.layout.total_bytes / 2**20,
            time.perf_counter() - t0,
        )  # fmt: skip
        self.block_pool = BlockPool(
            num_blocks, enable_caching=config.cache.enable_prefix_caching,
            eviction=config.cache.eviction, session_idle_s=config.cache.session_idle_s,
            clock=clock,
        )  # fmt: skip
        self.kv_tier = attach_tier(
            config.cache, self.layout, self.loaded.identity, self.kv_pool, self.block_pool
        )
        self.kv_manager = KVCacheManager(
            self.block_pool, config.cache.block_size, self.loaded.identity, self.kv_tier
        )
        self.tier_loads: TierLoads | None = None
        """Long tier hits read layer by layer during the first forward (host and file tiers;
        the store's, one call per block and its own deadline, are promoted whole)."""
        overlap_blocks = config.cache.kv_tier_overlap_blocks
        if overlap_blocks is None:  # GPU pools only: on a CPU the loader takes the forward's cores
            overlap_blocks = 4 if self.loaded.device.type == "cuda" else 0
        if self.kv_tier is not None and isinstance(self.kv_tier.tier, SlotTier) and overlap_blocks:
            self.tier_loads = TierLoads(
                self.kv_tier.tier, self.kv_pool, self.kv_manager, overlap_blocks
            )
            self.kv_tier.loads = self.tier_loads
            self.kv_manager.tier_overlap_blocks = overlap_blocks
        self.scheduler = Scheduler(
            config.scheduler, self.kv_manager, self._request_finished, _ConnectorPrefix(self)
        )
        self.runner = ModelRunner(
            self.loaded.model, model_cfg, self.kv_pool, self.layout, self.loaded.device,
            decode_attention=config.model.decode_attention,
            prefill_attention=config.model.prefill_attention,
        )  # fmt: skip
        self.max_model_len = min(
            model_cfg.max_position_embeddings, num_blocks * config.cache.block_size
        )
        self.eos_token_ids = tuple(self.loaded.tokenizer.eos_token_ids)
        self.connector: KVConnector = KVConnector()
        self._generators = RequestGenerators()
        self._penalties = PenaltyCounts(model_cfg.vocab_size)
        self._penalised: set[str] = set()
        """Live requests with penalties (none: a step skips them at no cost)."""
        self._with_min_tokens: set[str] = set()
        """Live requests with ``min_tokens`` (none: a step skips the stop bans at no cost)."""
        self._logprobs: dict[str, dict[int, TokenLogprobs]] = {}
        """Per live request asking for logprobs: by output position, those computed here."""
        self._outputs = OutputTracker(self.loaded.tokenizer, self.scheduler.finish_request)
        """Each live request's detokenizer and how much of its output was handed out."""
        self._pending: list[RequestOutput] = []  # made between steps (aborts), not yet returned
        self.last_step_did_work = False
        """The last `step` computed tokens, allocated blocks for remote KV or preempted: when
        it did none of these, nothing can run until a request, an abort or a call changes
        the state (the engine thread then waits for one instead of stepping again)."""
        logger.info(
            "engine ready: model=%s layout=%s max_model_len=%d",
            self.loaded.name,
            self.layout,
            self.max_model_len,
        )

    # ---------------------------------------------------------------- requests

    def check_request(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise RequestRejected when a request of this size can never be served."""
        check_request_size(self.max_model_len, num_prompt_tokens, max_tokens)

    def add_request(self, req: Request) -> Request:
        """Queue a request built by the caller (its id, prompt, sampling and KV options);
        the engine takes it over. Raises RequestRejected if it can never be served."""
        params = req.sampling_params
        self.check_request(req.num_prompt_tokens, params.max_tokens)
        vocab_size = self.loaded.config.vocab_size
        bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestRejected(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        request_id = req.request_id
        if self.scheduler.get_request(request_id) is not None:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        if not params.extra_eos_token_ids:
            req.sampling_params = params = _with_eos(params, self.eos_token_ids)
        self.scheduler.add_request(req)
        self.kv_manager.note_session(req.session_id)
        if params.has_penalties:
            self._penalised.add(request_id)
        if params.min_tokens > 0:
            self._with_min_tokens.add(request_id)
        if params.logprobs is not None:
            self._logprobs[request_id] = {}
        self._outputs.add(request_id, params)
        return req

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its blocks (the connector hears `request_finished`);
        False if it is unknown or already gone (a held one just releases its blocks).

        Its final output (finish_reason "abort") comes with the next `step`, so that
        whoever still reads the request's outputs sees it end: the abort may come from
        a connector (a cancelled push), not the client.
        """
        req = self.scheduler.get_request(request_id)
        found = self.scheduler.abort_request(request_id)
        if found and req is not None and (out := self._make_output(req)) is not None:
            self._pending.append(out)
        self._forget(request_id)
        self._drop_stale_tables()
        return found

    def drop_unadded(self, request: Request) -> None:
        """A request that will never be added (its client left while it was queued for
        the engine): it finishes as aborted, and its connector hears so."""
        request.status = FinishReason.ABORT.status
        request.finish_reason = FinishReason.ABORT
        self.connector.request_finished(request, FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        """Requests to run, outputs to return, or transfers that need the loop stepping."""
        return (
            self.scheduler.has_unfinished()
            or bool(self._pending)
            or self.connector.has_pending_work()
        )

    # -------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return what changed for each request since the last one.

        A step that applies transfer results which gave requests their first token (or
        stopped prefills) returns their outputs at once, without a forward: the first
        token of a pushed prompt reaches its client one forward sooner."""
        outputs, self._pending = self._pending, []
        changed = self._apply_kv_results()
        if changed:
            self.last_step_did_work = True
            return outputs + [o for req in changed if (o := self._make_output(req)) is not None]
        out = self.scheduler.schedule()
        self.last_step_did_work = bool(out.seqs or out.remote_kv_allocated or out.preempted_ids)
        connector = self.connector
        meta = out.kv_connector_metadata = connector.build_connector_meta(out)
        self.runner.drop_tables(out.dropped_table_ids)
        connector.start_load_kv(meta)
        loads = self.tier_loads
        job = loads.start(loads.take_planned()) if loads is not None else None
        is_forward_done = False
        try:
            sampled = self._execute(out, meta, job) if out.seqs else {}
            is_forward_done = True
        finally:  # the loader lets go of the pool and the tier before anything else
            void = loads.finish(job, is_forward_done=is_forward_done) if loads else set()
        connector.wait_for_save(meta)
        void |= connector.get_failed_loads()
        for rid in void:  # nothing of the step stays: a seeded draw is drawn again
            self._generators.drop(rid)
        finished = self.scheduler.update(out, sampled, void)
        touched = {req.request_id: req for req in finished}
        for seq in out.seqs:
            if seq.needs_sample and seq.request_id not in touched:
                req = self.scheduler.get_request(seq.request_id)
                if req is not None:
                    touched[seq.request_id] = req
        outputs += [o for req in touched.values() if (o := self._make_output(req)) is not None]
        self._drop_stale_tables()
        outputs += self._pending  # aborts during the step (a connector's)
        self._pending = []
        return outputs

    def _apply_kv_results(self) -> list[Request]:
        """Apply the transfers the connector saw end (the one place they change
        requests); return the requests whose outputs changed: those that got their
        first token with remote KV, and prefills stopped because their push failed."""
        results = self.connector.get_finished()
        if not results:
            return []
        applied = self.scheduler.apply_kv_results(results)
        vocab_size = self.loaded.config.vocab_size
        for req in applied.resumed:  # sampled elsewhere: a seeded generator skips that draw
            self._generators.skip(req.request_id, req.sampling_params, vocab_size)
        if applied.stopped:
            self._drop_stale_tables()
        return applied.resumed + applied.stopped

    def _request_finished(self, req: Request, reason: FinishReason) -> bool:
        """The scheduler's finish hook: the connector hears of every finish."""
        return self.connector.request_finished(req, reason)

    def _drop_stale_tables(self) -> None:
        """The runner forgets at once the tables of requests that stopped running."""
        self.runner.drop_tables(self.scheduler.tables.take_dropped())

    def _layer_hook(
        self, meta: KVConnectorMetadata | None, job: TierJob | None
    ) -> Callable[[int], None] | None:
        """Before each layer's attention: wait for that layer of the step's tier loads, then
        the connector's hook (its push of the layer must see the loaded KV)."""
        connector = self.connector
        push = connector.layer_hook(meta)
        wait = None
        if self.tier_loads is not None:
            wait = self.tier_loads.layer_wait(job, connector.load_failed)
        return chain_layer_hooks(wait, push)

    def _execute(
        self, out: SchedulerOutput, meta: KVConnectorMetadata | None, job: TierJob | None = None
    ) -> dict[str, int]:
        runner = self.runner
        requests = self.scheduler.get_request
        inputs: list[SeqInput] = []
        sampling: list[Request] = []
        for seq in out.seqs:
            rid = seq.request_id
            if seq.new_block_ids or seq.replaces_table:
                runner.update_table(rid, seq.new_block_ids, seq.replaces_table)
            inputs.append(SeqInput(seq.token_ids, seq.start_pos, None, seq.needs_sample, rid))
            if seq.needs_sample:
                req = requests(rid)
                assert req is not None, f"request {rid} scheduled but unknown"
                sampling.append(req)
        # Structured output: masks filled before the forward (they depend only on the
        # tokens accepted so far), applied to its logits.
        constrained = [i for i, req in enumerate(sampling) if req.grammar is not None]
        vocab_size = self.loaded.config.vocab_size
        bitmask = fill_bitmask([sampling[i].grammar for i in constrained], vocab_size)
        logits = runner.execute(inputs, on_layer_done=self._layer_hook(meta, job))
        if not sampling:
            return {}
        if bitmask is not None:
            apply_token_bitmask(logits, bitmask, constrained)
        params = [req.sampling_params for req in sampling]
        gens = [
            None if p.is_greedy else self._generators.get(req.request_id, p)
            for req, p in zip(sampling, params, strict=True)
        ]
        penalties = self._penalties.penalties(sampling) if self._penalised else None
        bans = stop_bans(sampling) if self._with_min_tokens else None
        tokens = sample(logits, params, gens, penalties, bans)
        if self.sample_hook is not None:
            tokens = self.sample_hook(sampling, tokens)
            assert len(tokens) == len(sampling), "a sample hook returns one token per request"
        if self._logprobs:
            self._note_logprobs(logits, sampling, tokens)
        return {req.request_id: tok for req, tok in zip(sampling, tokens, strict=True)}

    def _note_logprobs(
        self,
        logits: torch.Tensor,  # (len(sampling), vocab): the step's raw logits
        sampling: list[Request],
        tokens: list[int],
    ) -> None:
        """Logprobs of the tokens the requests asking for them take at this step (a first
        token sampled elsewhere, `Request.forced_first_token`, replaces the one drawn
        here), kept by the output position the token will have."""
        rows = [j for j, req in enumerate(sampling) if req.request_id in self._logprobs]
        if not rows:
            return
        chosen, positions = [], []
        for j in rows:
            req, position = sampling[j], sampling[j].num_output_tokens
            forced = req.forced_first_token if position == 0 else None
            chosen.append(tokens[j] if forced is None else forced)
            positions.append(position)
        num_top = [sampling[j].sampling_params.logprobs or 0 for j in rows]
        computed = compute_logprobs(logits[rows], chosen, num_top)
        for j, position, lp in zip(rows, positions, computed, strict=True):
            self._logprobs[sampling[j].request_id][position] = lp
            if position == 0:  # for a push's KVDone, which carries it with the token
                sampling[j].first_token_logprobs = lp

    def _make_output(self, req: Request) -> RequestOutput | None:
        """What changed for `req` since its last output (None: nothing); a finished
        request is forgotten."""
        output = self._outputs.next_output(req, self._logprobs.get(req.request_id, {}))
        if output is not None and output.finished:
            self._forget(req.request_id)
        return output

    def _forget(self, request_id: str) -> None:
        self._outputs.forget(request_id)
        self._generators.drop(request_id)
        self._penalties.drop(request_id)
        self._penalised.discard(request_id)
        self._with_min_tokens.discard(request_id)
        self._logprobs.pop(request_id, None)

    # ------------------------------------------------------------------- stats

    def check_integrity(self) -> None:
        """Raise AssertionError if the block pool's accounting is inconsistent."""
        self.block_pool.check_integrity()

    def warmup(self) -> None:
        """Run tiny requests so the first real ones do not pay for lazy init.

        With in-place (flex) decode attention, a lone decode and a batch of two
        too: each compiles its kernel once (seconds), here rather than mid-serving.
        """
        batches = [1, 2] if self.runner.decode_attention == "flex" else [1]
        with torch.inference_mode():
            for n in batches:
                rids = [f"__warmup__{i}" for i in range(n)]
                for rid in rids:
                    greedy = SamplingParams(max_tokens=2, temperature=0.0)
                    self.add_request(Request(rid, [1, 2, 3], greedy))
                while self.scheduler.has_unfinished() and any(
                    self.scheduler.get_request(rid) is not None for rid in rids
                ):
                    self.step()
                for rid in rids:
                    self.abort_request(rid)


class _ConnectorPrefix:
    """What the scheduler's admission asks of the tokens loaded during a new request's first
    forward: a long KV tier run first (`TierLoads`), then what the engine's connector,
    whichever is installed, loads after it (`KVConnector.get_num_new_matched_tokens`,
    `update_state_after_alloc`)::

        prompt   [ pool hit | tier run | connector's | new tokens ... ]
    """

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        loads = self._engine.tier_loads
        num_tier = loads.get_num_new_matched_tokens(request, num_computed_tokens) if loads else 0
        connector = self._engine.connector
        return num_tier + connector.get_num_new_matched_tokens(
            request, num_computed_tokens + num_tier
        )

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        loads = self._engine.tier_loads
        num_tier = min(loads.offered(request), num_external_tokens) if loads else 0
        num_tier_blocks = num_tier // self._engine.kv_manager.block_size
        if loads is not None:
            loads.update_state_after_alloc(request, block_ids[:num_tier_blocks], num_tier)
        self._engine.connector.update_state_after_alloc(
            request, block_ids[num_tier_blocks:], num_external_tokens - num_tier
        )


def _with_eos(params: SamplingParams, eos: tuple[int, ...]) -> SamplingParams:
    from dataclasses import replace

    return replace(params, extra_eos_token_ids=eos)


# RequestOutput is imported from here too (the instance's API, tests).
__all__ = ["LLMEngine", "RequestOutput", "SampleHook"]
