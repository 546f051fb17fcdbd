"""What structured output costs per decode step (not a test).

One engine (default: the `small` preset, pinned to one core, one torch thread)
decodes a batch of 1 and of 8 requests, each step timed once every request of
the batch is decoding: free (no grammar) against constrained by a JSON Schema
(an array of tool-call-like objects with enums, bounded integers, strings and
nested arrays; ``minItems`` keeps the grammar open for every timed step).
Modes interleave A B A B over rounds after a warm-up round; same prompts, same
seeds. The constrained step pays for the mask fill (xgrammar, before the
forward) and the mask's application to the logits (`sampler.apply_token_bitmask`).

Vocabularies for the grammar: ``byte`` (the preset's own byte tokenizer; the
logits are still 49,152 wide) and ``bpe`` (a byte-level BPE of the model's
vocabulary size, trained here on Python's standard library sources in a few
seconds: what a real model's mask fill costs).

    .venv/bin/python benchmarks/bench_structured.py                 # full run
    .venv/bin/python benchmarks/bench_structured.py --quick         # smoke run

Target: constrained / free <= 1.10 per step on `small`. Writes
results/bench_structured.json and .md and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import md_table
from benchmarks.common import pin
from benchmarks.common import write_results
from kvduplex.common.engine_config import CacheConfig
from kvduplex.common.engine_config import EngineConfig
from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.common.engine_config import SchedulerConfig
from kvduplex.common.sampling import GrammarKind
from kvduplex.common.sampling import GrammarSpec
from kvduplex.common.sampling import SamplingParams
from kvduplex.common.tokenizer import HFTokenizer
from kvduplex.common.tokenizer import Tokenizer
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.request import Request
from kvduplex.engine.structured import GrammarCompiler
from kvduplex.model.loader import LoadedModel
from kvduplex.model.loader import load_model

CALL = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["get_weather", "search", "read_file", "run"]},
        "arguments": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "pattern": "^[a-z/._]{1,24}$"},
                "limit": {"type": "integer", "minimum": 1, "maximum": 1000},
                "mode": {"type": "string", "enum": ["fast", "exact", "fuzzy"]},
                "fields": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
                "recursive": {"type": "boolean"},
            },
            "required": ["path", "limit", "mode", "fields", "recursive"],
        },
    },
    "required": ["name", "arguments"],
}  # fmt: skip
SCHEMA = {"type": "array", "items": CALL, "minItems": 10_000}
"""Never complete within the timed steps: every step is constrained."""


def train_bpe(vocab_size: int, folder: Path) -> HFTokenizer:
    """A byte-level BPE of `vocab_size` tokens over the standard library's sources."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders
    from tokenizers import models
    from tokenizers import pre_tokenizers
    from tokenizers import trainers

    root = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(errors="ignore") for p in sorted(root.rglob("*.py"))[:1500]]
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return HFTokenizer(folder)


def decode_step_times(
    engine: LLMEngine, prompts: list[list[int]], grammars: GrammarCompiler | None, num_steps: int
) -> list[float]:
    """Seconds of each of `num_steps` engine steps once every request decodes."""
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
    rids = [f"b{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    reqs = []
    for i, (rid, prompt) in enumerate(zip(rids, prompts, strict=True)):
        params = SamplingParams(max_tokens=num_steps + 8, temperature=1.0, seed=i, ignore_eos=True)
        grammar = grammars.grammar(spec, rid) if grammars is not None else None
        reqs.append(engine.add_request(Request(rid, prompt, params, grammar=grammar)))
    while any(r.num_output_tokens == 0 for r in reqs):  # prefills
        engine.step()
    times = []
    for _ in range(num_steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    for rid in rids:
        engine.abort_request(rid)
    engine.step()  # collect the aborts
    assert all(r.grammar is None or r.grammar.is_active for r in reqs), "a grammar was lifted"
    return times


def measure(
    loaded: LoadedModel, tokenizer: Tokenizer, batch: int, args: argparse.Namespace
) -> dict[str, Any]:
    loaded = dataclasses.replace(loaded, tokenizer=tokenizer)
    cfg = EngineConfig(
        model=ModelLoadConfig(model=args.preset), cache=CacheConfig(kv_cache_mb=args.kv_cache_mb),
        scheduler=SchedulerConfig(max_num_batched_tokens=2048),
    )  # fmt: skip
    engine = LLMEngine(cfg, loaded=loaded)
    grammars = GrammarCompiler(tokenizer, loaded.config.vocab_size)
    grammars.compile(GrammarSpec(GrammarKind.JSON_OBJECT))  # the vocabulary's info, once
    t0 = time.perf_counter()
    grammars.compile(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)))
    compile_s = time.perf_counter() - t0
    words = "write the tool calls for the plan, one per step: " * 8
    prompts = [tokenizer.encode(f"{i}: {words}")[: args.prompt_len] for i in range(batch)]
    times: dict[str, list[float]] = {"free": [], "schema": []}
    for rnd in range(args.rounds + 1):  # round 0 warms up
        for mode in ("free", "schema"):
            got = decode_step_times(
                engine, prompts, grammars if mode == "schema" else None, args.steps
            )
            if rnd > 0:
                times[mode] += got
    engine.check_integrity()
    free, schema = times["free"], times["schema"]
    return {
        "batch": batch, "compile_ms": compile_s * 1e3, "num_steps": len(free),
        "free_ms": [t * 1e3 for t in free], "schema_ms": [t * 1e3 for t in schema],
        "free_p50_ms": statistics.median(free) * 1e3, "schema_p50_ms": statistics.median(schema) * 1e3,
        "free_mean_ms": statistics.mean(free) * 1e3, "schema_mean_ms": statistics.mean(schema) * 1e3,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--vocabs", nargs="+", choices=["byte", "bpe"], default=["byte", "bpe"])
    parser.add_argument(
        "--steps", type=int, default=32, help="timed decode steps per round and mode"
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="interleaved rounds after the warm-up"
    )
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--kv-cache-mb", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 steps, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 4, 1
    pinned = pin({0}, 1)
    loaded = load_model(ModelLoadConfig(model=args.preset, seed=args.seed))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for vocab in args.vocabs:
            tok = (
                loaded.tokenizer
                if vocab == "byte"
                else train_bpe(loaded.config.vocab_size, Path(tmp))
            )
            for batch in args.batches:
                res = {"vocab": vocab, **measure(loaded, tok, batch, args)}
                results.append(res)
                print(f"{vocab} batch {batch}: {res['free_p50_ms']:.2f} ms free, "
                      f"{res['schema_p50_ms']:.2f} ms constrained", flush=True)  # fmt: skip
    header = ["vocab", "batch", "steps", "compile ms", "free p50 ms", "schema p50 ms", "ratio p50",
              "free mean ms", "schema mean ms", "ratio mean"]  # fmt: skip
    rows = [
        [r["vocab"], r["batch"], r["num_steps"], f"{r['compile_ms']:.1f}",
         f"{r['free_p50_ms']:.2f}", f"{r['schema_p50_ms']:.2f}",
         f"{r['schema_p50_ms'] / r['free_p50_ms']:.3f}", f"{r['free_mean_ms']:.2f}",
         f"{r['schema_mean_ms']:.2f}", f"{r['schema_mean_ms'] / r['free_mean_ms']:.3f}"]
        for r in results
    ]  # fmt: skip
    table = md_table(header, rows)
    note = (f"\n\n{args.preset} preset, {pinned}; decode steps of a batch, free vs constrained by "
            "a JSON Schema, interleaved rounds after a warm-up. Target: ratio <= 1.10.")  # fmt: skip
    print(table + note)
    write_results(
        "bench_structured", {"args": vars(args), "pinned": pinned, "results": results}, table + note
    )


if __name__ == "__main__":
    main()
