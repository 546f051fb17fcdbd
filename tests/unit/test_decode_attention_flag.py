"""``serve --decode-attention {auto,paged,copy,flex,kernel}``: the flag reaches the runner, the
forward takes the path it names, and ``paged`` and ``copy`` pick the same tokens (``kernel``:
`test_cpu_decode_kernel.py`)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvduplex.cli.main import parse_args
from kvduplex.common.engine_config import DecodeAttention
from kvduplex.common.engine_config import EngineConfig
from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.common.presets import preset_config
from kvduplex.common.sampling import SamplingParams
from kvduplex.engine import runner_inputs
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.kv_cache import allocate_kv_pool
from kvduplex.engine.request import Request
from kvduplex.engine.runner import ModelRunner
from kvduplex.engine.runner import kv_layout_for
from kvduplex.model import attention
from kvduplex.model.decoder import DecoderForCausalLM
from kvduplex.model.loader import LoadedModel
from kvduplex.model.loader import load_model

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model(ModelLoadConfig(model="tiny", seed=5))


def _serve_config(*flags: str) -> EngineConfig:
    """The engine config ``kvduplex serve`` builds from `flags` (16-token blocks, small pool)."""
    argv = ["serve", "--model", "tiny", "--seed", "5", "--num-blocks", "96", *flags]
    argv += ["--max-num-batched-tokens", "512"]
    return parse_args(argv).engine_config()


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count the forward's calls into each decode attention path (they still run)."""
    calls = {"paged": 0, "copy": 0}

    def counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(
        attention, "paged_decode_attention", counting("paged", attention.paged_decode_attention)
    )
    monkeypatch.setattr(
        attention, "_decode_attention", counting("copy", attention._decode_attention)
    )
    return calls


def _generate(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    """All prompts at once, stepped to completion: the token ids of each."""
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"r{i}", prompt, GREEDY))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert not engine.has_unfinished()
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def test_the_flag_parses_to_the_config_and_defaults_to_auto(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["serve", "--help"])
    assert "--decode-attention {auto,paged,copy,flex,kernel}" in capsys.readouterr().out
    assert _serve_config().model.decode_attention is DecodeAttention.AUTO
    for name in ("auto", "paged", "copy", "flex", "kernel"):
        assert _serve_config("--decode-attention", name).model.decode_attention is DecodeAttention(
            name
        )
    with pytest.raises(SystemExit):
        parse_args(["serve", "--decode-attention", "in-place"])
    # the engine config's old name of the default still reads as it
    assert ModelLoadConfig(decode_attention="sdpa").decode_attention is DecodeAttention.AUTO  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="auto, paged, copy, flex, kernel"):
        ModelLoadConfig(decode_attention="in-place")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("flag", "path"), [("auto", "paged"), ("paged", "paged"), ("copy", "copy")]
)
def test_the_flag_picks_the_path_every_decode_step_takes(
    tiny: LoadedModel, flag: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # auto: the CPU kernel only with one thread
    engine = LLMEngine(_serve_config("--decode-attention", flag), loaded=tiny)
    assert engine.runner.decode_attention == path
    calls = _count_calls(monkeypatch)
    rng = random.Random(0)
    _generate(engine, [[rng.randrange(3, 250) for _ in range(n)] for n in (40, 70)])
    other = "copy" if path == "paged" else "paged"
    assert calls[path] > 0 and calls[other] == 0, calls


@pytest.mark.parametrize("min_range_tokens", [32, 256])
def test_paged_and_copy_are_token_exact(
    tiny: LoadedModel, min_range_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Concurrent greedy requests of different lengths through two engines that differ only in
    ``--decode-attention``: the same tokens, and every step's logits close (tiny's random
    weights let attention move the logits far more than the argmax). Prompts past 256 tokens
    form ranges read in place at the default threshold; 32 tokens also reads the short runs
    that concurrent decodes' interleaved blocks leave."""
    monkeypatch.setattr(runner_inputs, "IN_PLACE_MIN_RANGE_TOKENS", min_range_tokens)
    rng = random.Random(min_range_tokens)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (300, 45, 270, 130)]
    tokens, logits = {}, {}
    for flag in ("paged", "copy"):
        engine = LLMEngine(_serve_config("--decode-attention", flag), loaded=tiny)
        steps: list[torch.Tensor] = []
        execute = engine.runner.execute

        def recording(*args: Any, execute: Any = execute, steps: Any = steps, **kwargs: Any) -> Any:
            out = execute(*args, **kwargs)
            steps.append(out.clone())
            return out

        engine.runner.execute = recording  # type: ignore[method-assign]
        tokens[flag], logits[flag] = _generate(engine, prompts), steps
    assert all(len(t) == GREEDY.max_tokens for t in tokens["paged"])
    assert len({tuple(t) for t in tokens["paged"]}) == len(prompts)  # not one constant answer
    assert tokens["paged"] == tokens["copy"]
    assert len(logits["paged"]) == len(logits["copy"]) > GREEDY.max_tokens
    for got, want in zip(logits["paged"], logits["copy"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_windowed_models_copy_under_auto_and_refuse_paged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # auto: the CPU kernel only with one thread
    cfg = dataclasses.replace(
        preset_config("tiny"), architecture="mistral", sliding_window=8, sliding_layers=(0, 1, 2, 3)
    )
    layout = kv_layout_for(cfg, 4, 8, "float32")

    def runner(name: str) -> ModelRunner:
        return ModelRunner(
            DecoderForCausalLM(cfg), cfg, allocate_kv_pool(layout), layout, "cpu", name
        )

    assert runner("auto").decode_attention == "copy"
    assert runner("copy").decode_attention == "copy"
    with pytest.raises(ValueError, match=r"sliding-window.*auto or copy"):
        runner("paged")
