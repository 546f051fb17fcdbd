"""What an instance's routes share: `InstanceState` (its engine, its role's hooks, the
cluster secret, the answer book, readiness) and `Generation`, what one OpenAI request
hands the engine (a role's `prepare` hook adjusts it; `AdmitRefused` from its
`on_admit` refuses it). `kv_clock` is the cache's size and clock that /health and the
KV routes report.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from fastapi import Request
from prometheus_client import CollectorRegistry

from kvduplex.common.drain import DrainState
from kvduplex.common.fingerprint import ModelFingerprint
from kvduplex.common.openai import structured
from kvduplex.common.openai.chat_output import ChatOutputParser
from kvduplex.common.openai.errors import APIError
from kvduplex.common.openai.parsing_config import ParsingConfig
from kvduplex.common.openai.protocol import OpenAIRequest
from kvduplex.common.openai.transcript import AnswerBook
from kvduplex.common.sampling import GrammarSpec
from kvduplex.common.sampling import TokenLogprobs
from kvduplex.common.trust import SECRET_HEADER
from kvduplex.common.trust import secret_matches
from kvduplex.engine.async_engine import AsyncEngine
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.request import Request as EngineRequest
from kvduplex.engine.structured import GrammarCompiler
from kvduplex.engine.structured import RequestGrammar
from kvduplex.engine.structured import StructuredOutputError


@dataclass
class Generation:
    """What the API layer hands the engine for one request (hooks let roles adjust it)."""

    request: EngineRequest
    """The engine's request; a role's `prepare` hook sets its KV options (``remote_kv``,
    ``hold_blocks_on_finish``, ``connector_meta``: e.g. where the finished turn's KV is
    returned)."""
    body: OpenAIRequest
    extra: dict[str, Any] = field(default_factory=dict)
    mark_first_token: bool = False
    """A streamed answer's first chunk with tokens names their ids in
    `render.FIRST_TOKEN_IDS_FIELD` (the router asks, to splice in prefill's token)."""
    report_answer: bool = False
    """The answer ends with its generated ids (`ANSWER_IDS_FIELD`; the router asks, to
    record them and remove the field)."""
    parser: ChatOutputParser | None = None
    """A chat answer's tool-call and reasoning parser (`kvduplex.common.openai.chat_output`);
    None: the text is the content."""
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    """A whole answer's logprobs as they are gathered (when the request asks for them)."""
    tool_calls: structured.ForcedToolCalls | None = None
    """tool_choice required or named: the answer is rendered as tool calls."""
    on_admit: Callable[[], None] | None = None
    """Runs on the engine thread just before the request is added, in the same turn
    (`AsyncEngine.generate`): a role's `prepare` registers what the request waits for
    (a push or pull spec) there. AdmitRefused from it refuses the request with its status
    before any answer begins."""


class AdmitRefused(ValueError):
    """A `Generation.on_admit` refused the request (e.g. a duplicate xid: 409)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass
class InstanceState:
    """What the routes need."""

    engine: AsyncEngine
    served_model_names: list[str]
    registry: CollectorRegistry
    role: str = "both"
    prepare: Callable[[Request, Generation], Awaitable[None]] | None = None
    """Role hook run before a generation is submitted (e.g. set `remote_kv`)."""
    engine_id: str | None = None
    """The KV transport's engine id (prefill and decode instances): new at every start,
    reported by /health to callers that send the cluster secret (a router names it to
    the instance's peers)."""
    cluster_secret: str | None = None
    """The cluster secret (None: none, and every caller counts as a cluster member)."""
    fingerprint: ModelFingerprint | None = None
    """What this instance serves (`kvduplex.common.fingerprint`), shown by /health."""
    answers: AnswerBook = field(default_factory=AnswerBook)
    """The chat answers this instance generated, for prompts that send them back."""
    created: int = field(default_factory=lambda: int(time.time()))
    parsing: ParsingConfig = field(default_factory=ParsingConfig)
    """Tool-call and reasoning parsing of chat answers (``--tool-call-parser`` ...)."""
    _grammars: GrammarCompiler | None = field(default=None, init=False, repr=False)
    _grammar_pool: ThreadPoolExecutor | None = field(default=None, init=False, repr=False)
    """Grammar compiles run here: a slow schema never holds the loop, nor the threads of
    `asyncio.to_thread` (peer lookups of the KV routes use those)."""
    drain: DrainState = field(default_factory=DrainState)
    """Readiness and the graceful drain on SIGTERM (`kvduplex.common.drain`)."""
    health_checks: list[Callable[[], str | None]] = field(default_factory=list)
    """Parts besides the engine that the instance cannot serve without (its KV
    notification pump): each returns why it is broken, or None; /health and /ready
    answer 503 with the first reason."""

    def problem(self) -> str | None:
        """Why the instance cannot serve (its engine's problem first), or None."""
        problem = self.engine.problem()
        for check in self.health_checks:
            if problem is not None:
                break
            problem = check()
        return problem

    @property
    def tokenizer(self) -> Any:
        return self.engine.core.loaded.tokenizer

    async def grammar(
        self, spec: GrammarSpec, request_id: str, param: str = "response_format"
    ) -> RequestGrammar:
        """A request's grammar matcher, compiled off the event loop (cached by schema);
        APIError 400 naming `param` if the schema cannot be compiled."""
        if self._grammars is None or self._grammar_pool is None:
            loaded = self.engine.core.loaded
            self._grammars = GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size)
            self._grammar_pool = ThreadPoolExecutor(2, thread_name_prefix="grammar")
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(
                self._grammar_pool, self._grammars.grammar, spec, request_id
            )
        except StructuredOutputError as exc:
            raise APIError(400, str(exc), param=param) from None

    @property
    def max_model_len(self) -> int:
        return self.engine.core.max_model_len

    def is_member(self, raw: Request) -> bool:
        """Whether the caller proved the cluster secret (its header; exactly one copy),
        or this instance has none."""
        if self.cluster_secret is None:
            return True
        given = raw.headers.getlist(SECRET_HEADER)
        return len(given) == 1 and secret_matches(given[0], self.cluster_secret)

    def health(self, is_member: bool) -> dict[str, Any]:
        """/health's body while the engine is healthy; the KV engine id only for a caller
        that `is_member` (it names the instance to its peers' transports)."""
        body: dict[str, Any] = {
            "status": "ok", "role": self.role, "max_model_len": self.max_model_len,
            "block_size": self.engine.core.config.cache.block_size,
            **kv_clock(self.engine.core),
        }  # fmt: skip
        if self.fingerprint is not None:
            body["fingerprint"] = self.fingerprint.to_json()
        if self.engine_id is not None and is_member:
            body["engine_id"] = self.engine_id
        return body


def kv_clock(core: LLMEngine) -> dict[str, int | str]:
    """The cache's size and clock (`BlockPool.num_allocated`), by which the router tells
    whether a session's blocks are likely still cached here. The size counts the KV tier's
    blocks too: every block the pool evicts goes down to the tier, so a block stays here,
    in the pool or the tier, for about pool + tier blocks allocated since it was last
    used. Read off the engine thread: ints at most one step old, a hint and never a
    decision that needs them exact."""
    pool = core.block_pool
    num_blocks = pool.num_blocks + (core.kv_tier.tier.num_slots if core.kv_tier else 0)
    return {
        "kv_num_blocks": num_blocks, "kv_blocks_allocated": pool.num_allocated,
        "kv_epoch": pool.epoch,
    }  # fmt: skip
