"""Structured output: grammars that constrain which tokens a request may sample.

A request with a `GrammarSpec` (a JSON Schema, or "any JSON object") gets a
`RequestGrammar` before it reaches the engine. Each step the engine asks the
grammars of its sampling rows for a token bitmask (`fill_bitmask`, before the
forward), the sampler masks the disallowed logits to -inf
(`sampler.apply_token_bitmask`), and every output token the request keeps is
fed back through `Request.append_output_token` → `RequestGrammar.accept`, so
the matcher follows the request wherever its tokens come from::

    P (prefill instance)                      D (decode instance)
    grammar → mask → first token ──KVDone──►  grammar.accept(first token)
                                              grammar → mask → token 2, 3, ...

End of output: EOS is allowed only once the grammar can end, and a grammar
that has accepted its stop token has terminated: `scheduler_output.check_stop`
then finishes the request ("stop") even under ``ignore_eos`` or ``min_tokens``.
``max_tokens`` reached first: "length", with the partial text.

Library: xgrammar, chosen against llguidance and outlines-core by compile time and
mask fill per token on a typical tool schema (figures in docs/structured_output.md):
it fills masks several times faster than llguidance (the cost that grows with the
batch), compiles a tool schema in milliseconds, and is the default of vLLM and
SGLang. Compiled grammars are cached here (`GrammarCompiler`, LRU by schema). Its
bitmask layout (int32 words, bit ``i`` of word ``j`` allows token ``32*j+i``)
is what `sampler.apply_token_bitmask` reads. Its wheel pulls triton (unused on
CPU; checked harmless to torch 2.13 CPU, flex attention included), not torch.

JSON is generated compact (separators ``,`` and ``:``, no free whitespace) and
in schema property order: a random-weight model cannot wander in whitespace,
and tool-call text is predictable for `openai.structured.ToolCallStream`.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from typing import Any

import torch

from kvduplex.common.sampling import GrammarKind
from kvduplex.common.sampling import GrammarSpec
from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.common.tokenizer import HFTokenizer
from kvduplex.common.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

COMPILE_CACHE_ENTRIES = 256
"""Compiled grammars kept per instance (least recently used dropped), keyed by schema."""


class StructuredOutputError(ValueError):
    """A grammar that cannot be compiled (a bad or unsupported schema); the message says why."""


_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location."""
    return _CPP_PREFIX.sub("", str(exc)).strip() or type(exc).__name__


class GrammarCompiler:
    """Compiles `GrammarSpec`s for one tokenizer and vocabulary; thread-safe.

    Built once per instance. `compile` blocks (milliseconds for a typical
    schema, longer for a large one): call it off the event loop, e.g. with
    ``asyncio.to_thread``. Results are cached by schema text.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        """`vocab_size` is the model's (its logits' width); ids the tokenizer does not
        know are never allowed."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: Any = None
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()  # LRU, by schema text
        self._lock = threading.Lock()

    def _get_compiler(self) -> Any:
        with self._lock:  # the tokenizer's info is built once (0.1-0.3 s for a BPE)
            if self._compiler is None:
                import xgrammar as xgr

                info = tokenizer_info(self._tokenizer, self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of `spec`; StructuredOutputError if it cannot be compiled."""
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                return compiled
        compiler = self._get_compiler()
        if spec.kind is GrammarKind.JSON_OBJECT:
            schema, strict = '{"type": "object"}', False
        else:
            assert spec.schema is not None
            schema, strict = spec.schema, True
        try:
            compiled = compiler.compile_grammar(_json_grammar(schema, strict))
        except Exception as exc:  # xgrammar raises RuntimeError (and others) with a reason
            raise StructuredOutputError(f"the schema cannot be used: {_reason(exc)}") from None
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > COMPILE_CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def grammar(self, spec: GrammarSpec, request_id: str) -> RequestGrammar:
        """A fresh matcher for one request (compiles `spec`, or takes it from the cache);
        StructuredOutputError if the grammar cannot be compiled or accepts no text at all
        (e.g. ``{"anyOf": []}``)."""
        grammar = RequestGrammar(self.compile(spec), request_id)
        bitmask = torch.zeros((1, bitmask_words(self.vocab_size)), dtype=torch.int32)
        grammar.fill(bitmask, 0)
        for stop in self._tokenizer.eos_token_ids:  # an empty answer is no value either
            keep = ~(1 << (stop % 32)) & 0xFFFFFFFF
            bitmask[0, stop // 32] &= keep - (1 << 32) if keep >= 1 << 31 else keep
        if not bool(bitmask.any()):
            raise StructuredOutputError("the schema cannot be used: no value satisfies it")
        return grammar


_LOOSE_CHAR = r"[^\"\\\r\n]"
"""How xgrammar 0.2.9 prints the character of a ``minLength``/``maxLength`` string."""
_JSON_CHAR = r"[^\0-\x1f\"\\\r\n]"
"""The character of its other strings: no control characters."""


def _json_grammar(schema: str, strict: bool) -> Any:
    """xgrammar's grammar of a JSON Schema: compact, in property order.

    xgrammar 0.2.9 lets raw control characters (invalid JSON; a random-weight
    model emits them at once) into length-bounded strings, whose character class
    lacks the ``\\0-\\x1f`` its other strings exclude: the grammar is printed,
    that class fixed, and parsed again (its native repetition kept, so a
    ``minLength`` of thousands compiles as fast as before).
    """
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(
        schema, any_whitespace=False, separators=(",", ":"), strict_mode=strict
    )
    text = str(grammar)
    if _LOOSE_CHAR in text:
        grammar = xgr.Grammar.from_ebnf(text.replace(_LOOSE_CHAR, _JSON_CHAR))
    return grammar


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> Any:
    """xgrammar's view of the vocabulary: each token's bytes, its stop tokens.

    Byte tokenizer: ids 0..255 are their byte; its special tokens (and the ids
    past it) are never allowed, EOS and <|im_end|> only where the grammar may
    end. HF tokenizer: read from its tokenizer.json (byte-level BPE, byte
    fallback or raw pieces). ValueError for any other tokenizer.
    """
    import xgrammar as xgr

    stop = list(tokenizer.eos_token_ids)
    if isinstance(tokenizer, ByteTokenizer):
        # An empty piece makes a token special: it never matches grammar text.
        vocab = [bytes([i]) for i in range(256)] + [b""] * (tokenizer.vocab_size - 256)
        return xgr.TokenizerInfo(
            vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop
        )
    if isinstance(tokenizer, HFTokenizer):
        from transformers import AutoTokenizer

        hf_tokenizer = AutoTokenizer.from_pretrained(str(tokenizer.folder), local_files_only=True)
        return xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop
        )
    raise ValueError(f"structured output does not support {type(tokenizer).__name__}")


class RequestGrammar:
    """One request's grammar matcher: where its output stands in the grammar.

    Owned by the engine thread once the request is added. Every output token
    goes through `accept` (see `Request.append_output_token`). A token the
    grammar rejects (it was sampled elsewhere without this grammar) stops the
    constraint for the rest of the request, logged once: the request goes on
    unconstrained rather than failing.
    """

    def __init__(self, compiled: Any, request_id: str) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self.request_id = request_id
        self.is_active = True
        """False once a token was rejected: no more masks."""

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and has accepted its stop token (EOS)."""
        return self.is_active and bool(self._matcher.is_terminated())

    def accept(self, token_id: int) -> None:
        if not self.is_active:
            return
        if not self._matcher.accept_token(token_id):
            self.is_active = False
            logger.warning(
                "request %s: token %d does not fit its grammar; the rest is unconstrained",
                self.request_id, token_id,
            )  # fmt: skip

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask` row `row` (all allowed if inactive)."""
        if self.is_active:
            self._matcher.fill_next_token_bitmask(bitmask, row)
        else:
            bitmask[row].fill_(-1)


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def fill_bitmask(grammars: list[RequestGrammar | None], vocab_size: int) -> torch.Tensor | None:
    """One bitmask row per sampling row (a row without a grammar allows everything),
    or None when no row has an active grammar."""
    if not any(g is not None and g.is_active for g in grammars):
        return None
    bitmask = torch.full((len(grammars), bitmask_words(vocab_size)), -1, dtype=torch.int32)
    for row, grammar in enumerate(grammars):
        if grammar is not None:
            grammar.fill(bitmask, row)
    return bitmask


__all__ = [
    "GrammarCompiler",
    "GrammarKind",
    "GrammarSpec",
    "RequestGrammar",
    "StructuredOutputError",
    "fill_bitmask",
    "tokenizer_info",
]
