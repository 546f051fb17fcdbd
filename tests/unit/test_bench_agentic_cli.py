"""`kvduplex bench --workload agentic`: the flags it takes and the workloads they make."""

from __future__ import annotations

import pytest

from kvduplex.bench.agentic_cli import _check_context
from kvduplex.bench.agentic_cli import max_session_tokens
from kvduplex.bench.agentic_cli import workload_configs
from kvduplex.bench.conversation import PromptForm
from kvduplex.bench.workload import REASONING
from kvduplex.bench.workload import WorkloadConfig
from kvduplex.cli.main import bench_workload_of
from kvduplex.cli.main import parse_args


def test_the_workload_flag_picks_the_bench_flags() -> None:
    argv = ["bench", "--workload", "agentic", "--url", "http://h:1", "--sessions", "3"]
    assert bench_workload_of(argv) == "agentic"
    assert bench_workload_of(["bench", "--rounds", "2"]) == "serving"
    assert bench_workload_of(["serve", "--workload", "agentic"]) is None  # no bench flags
    args = parse_args(argv)
    assert (args.workload, args.url, args.sessions) == ("agentic", "http://h:1", 3)
    serving = parse_args(["bench", "--rounds", "2"])
    assert (serving.workload, serving.rounds) == ("serving", 2)


def test_configs_from_flags_and_quick() -> None:
    args = parse_args(["bench", "--workload", "agentic", "--shapes", "reasoning",
                              "--turns", "5", "--length-scale", "0.5", "--seed", "4"])  # fmt: skip
    (config,) = workload_configs(args)
    assert (config.shape.name, config.num_turns, config.num_sessions, config.seed) == ("reasoning", 5, 6, 4)
    assert config.shape.answer_tokens == (200, 400) and config.system_tokens == 1000
    quick = workload_configs(parse_args(["bench", "--workload", "agentic", "--quick"]))
    assert [c.shape.name for c in quick] == ["agentic", "reasoning"]
    assert all((c.num_sessions, c.num_turns, c.think_time_s) == (2, 3, (0.0, 0.0)) for c in quick)
    assert all(c.shape.answer_tokens[1] <= 80 and c.system_tokens <= 128 for c in quick)


def test_a_session_longer_than_the_context_is_refused() -> None:
    config = WorkloadConfig(shape=REASONING, num_turns=8, system_tokens=1000)
    need = max_session_tokens(config)
    assert 1000 + 8 * (60 + 400) <= need <= 1000 + 8 * (160 + 800)
    models = [{"id": "small", "max_model_len": need}]
    _check_context([config], models, "small", PromptForm.TOKENS)  # fits exactly
    with pytest.raises(ValueError, match="max_model_len"):
        _check_context([config], models, "small", PromptForm.CHAT)  # template overhead
    _check_context([config], [{"id": "other"}], "other", PromptForm.CHAT)  # limit unknown
