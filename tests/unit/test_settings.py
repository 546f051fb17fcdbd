"""Layered settings (`kvduplex.cli.settings`): flag > KVDUPLEX_* > --config file >
default, for serve, router and up; errors name the key and its source; the logged
effective config has its secrets redacted."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvduplex.cli.main import main
from kvduplex.cli.main import parse_args
from kvduplex.cli.main import router_config
from kvduplex.cli.main import server_config
from kvduplex.cli.settings import REDACTED
from kvduplex.cli.settings import ConfigError
from kvduplex.common.config import ReturnMode
from kvduplex.common.config import Role
from kvduplex.common.config import TransferMode


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No KVDUPLEX_* setting from the shell that runs the tests."""
    import os

    for name in list(os.environ):
        if name.startswith("KVDUPLEX_") and not name.startswith("KVDUPLEX_TEST_"):
            monkeypatch.delenv(name)


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_defaults_without_any_layer() -> None:
    args = parse_args(["serve"])
    assert (args.kv_cache_mb, args.role, args.drain_timeout_s) == (512, Role.BOTH, 60.0)


def test_each_layer_alone_gives_the_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    yaml_file = write(tmp_path, "c.yaml", "kv_cache_mb: 64\nrole: decode\n")
    args = parse_args(["serve", "--config", yaml_file])
    assert (args.kv_cache_mb, args.role) == (64, Role.DECODE)
    toml_file = write(tmp_path, "c.toml", 'kv_cache_mb = 65\nrole = "prefill"\n')
    args = parse_args(["serve", "--config", toml_file])
    assert (args.kv_cache_mb, args.role) == (65, Role.PREFILL)
    monkeypatch.setenv("KVDUPLEX_KV_CACHE_MB", "66")
    assert parse_args(["serve"]).kv_cache_mb == 66
    assert parse_args(["serve", "--kv-cache-mb", "67"]).kv_cache_mb == 67


def test_precedence_flag_then_env_then_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = write(tmp_path, "c.yaml", "kv_cache_mb: 64\nmax_num_seqs: 3\nport: 9100\n")
    monkeypatch.setenv("KVDUPLEX_KV_CACHE_MB", "128")
    monkeypatch.setenv("KVDUPLEX_MAX_NUM_SEQS", "5")
    args = parse_args(["serve", "--config", cfg, "--kv-cache-mb", "256"])
    assert args.kv_cache_mb == 256  # flag over env and file
    assert args.max_num_seqs == 5  # env over file
    assert args.port == 9100  # file over default
    assert args.block_size == 16  # default
    # A flag given with the default's value still wins.
    assert parse_args(["serve", "--config", cfg, "--max-num-seqs", "64"]).max_num_seqs == 64


def test_env_values_of_each_type(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDUPLEX_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv("KVDUPLEX_RETURN_MODE", "push")
    monkeypatch.setenv("KVDUPLEX_HEALTH_INTERVAL_S", "0.5")
    monkeypatch.setenv("KVDUPLEX_DECODE", "http://d1:1, http://d2:2")
    monkeypatch.setenv("KVDUPLEX_PREFILL", '["http://p:1"]')
    monkeypatch.setenv("KVDUPLEX_API_KEY", "")  # empty: unset
    assert parse_args(["serve"]).enable_prefix_caching is False
    config = router_config(parse_args(["router"]))
    assert config.decode == ("http://d1:1", "http://d2:2")
    assert config.prefill == ("http://p:1",)
    assert config.return_mode is ReturnMode.PUSH and config.mode is TransferMode.PUSH
    assert config.health_interval_s == 0.5 and config.api_key == ""


def test_router_takes_its_instances_and_secret_file_from_a_file(tmp_path: Path) -> None:
    cfg = write(
        tmp_path, "router.yaml",
        "decode: [http://d:1]\nprefill:\n  - http://p:1\nmode: pull\n"
        "cluster_secret_file: /etc/kvduplex/secret/cluster-secret\n",
    )  # fmt: skip
    config = router_config(parse_args(["router", "--config", cfg]))
    assert config.decode == ("http://d:1",) and config.prefill == ("http://p:1",)
    assert config.mode is TransferMode.PULL
    assert config.cluster_secret_file == "/etc/kvduplex/secret/cluster-secret"
    # The command line's list replaces the file's.
    config = router_config(parse_args(["router", "--config", cfg, "--decode", "http://x:2"]))
    assert config.decode == ("http://x:2",)


def test_router_finds_its_instances_by_dns_from_each_layer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = write(
        tmp_path, "router.yaml",
        "prefill_dns: kvduplex-prefill-headless:8000\ndns_interval_s: 2.5\n",
    )  # fmt: skip
    monkeypatch.setenv("KVDUPLEX_DECODE_DNS", "kvduplex-decode-headless:8000")
    config = router_config(parse_args(["router", "--config", cfg, "--dns-server", "10.0.0.10"]))
    assert config.prefill_dns == "kvduplex-prefill-headless:8000"
    assert config.decode_dns == "kvduplex-decode-headless:8000" and config.decode == ()
    assert (config.dns_interval_s, config.dns_server) == (2.5, "10.0.0.10")
    monkeypatch.setenv("KVDUPLEX_DECODE_DNS", "kvduplex-decode-headless")
    with pytest.raises(ValueError, match="decode_dns must be HOST:PORT"):
        router_config(parse_args(["router"]))


def test_router_without_decode_anywhere_says_so() -> None:
    with pytest.raises(ValueError, match="--decode"):
        router_config(parse_args(["router"]))


def test_up_is_layered_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDUPLEX_DEMO_TURNS", "0")
    monkeypatch.setenv("KVDUPLEX_MODE", "colocated")
    args = parse_args(["up"])
    assert (args.demo_turns, args.mode) == (0, "colocated")
    monkeypatch.setenv("KVDUPLEX_MODE", "sideways")
    with pytest.raises(ConfigError, match="KVDUPLEX_MODE"):
        parse_args(["up"])


def test_unknown_key_in_the_file_is_named(tmp_path: Path) -> None:
    cfg = write(tmp_path, "c.yaml", "kv_cache_mb: 64\nkv_cache_gb: 1\n")
    with pytest.raises(ConfigError, match=r"unknown key 'kv_cache_gb' in --config .*c\.yaml"):
        parse_args(["serve", "--config", cfg])


def test_a_router_key_in_an_instance_file_is_unknown(tmp_path: Path) -> None:
    cfg = write(tmp_path, "c.toml", "session_ttl_s = 5\n")
    with pytest.raises(ConfigError, match="unknown key 'session_ttl_s'"):
        parse_args(["serve", "--config", cfg])


def test_wrong_types_name_the_key_and_the_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = write(tmp_path, "c.yaml", "kv_cache_mb: lots\n")
    with pytest.raises(ConfigError, match=r"kv_cache_mb: .*integer.*'lots' from --config"):
        parse_args(["serve", "--config", cfg])
    monkeypatch.setenv("KVDUPLEX_MAX_NUM_SEQS", "many")
    with pytest.raises(ConfigError, match=r"max_num_seqs: .*'many' from KVDUPLEX_MAX_NUM_SEQS"):
        parse_args(["serve"])
    monkeypatch.delenv("KVDUPLEX_MAX_NUM_SEQS")
    monkeypatch.setenv("KVDUPLEX_ROLE", "router")
    with pytest.raises(ConfigError, match="role: "):
        parse_args(["serve"])


def test_a_secret_of_the_wrong_type_is_not_echoed(tmp_path: Path) -> None:
    cfg = write(tmp_path, "c.yaml", "api_key: [sk-do-not-print]\n")
    with pytest.raises(ConfigError) as info:
        parse_args(["serve", "--config", cfg])
    assert "api_key" in str(info.value) and "sk-do-not-print" not in str(info.value)


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("missing.yaml", None, "no such file"),
        ("c.json", "{}", "use a .yaml, .yml or .toml file"),
        ("broken.yaml", "a: [\n", "broken.yaml"),
        ("broken.toml", "a = \n", "broken.toml"),
        ("list.yaml", "- 1\n- 2\n", "one mapping"),
    ],
)
def test_unusable_files_are_refused(
    tmp_path: Path, name: str, text: str | None, match: str
) -> None:
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        parse_args(["serve", "--config", str(path)])


def test_values_are_still_checked_by_the_dataclasses(tmp_path: Path) -> None:
    cfg = write(tmp_path, "c.yaml", "port: 70000\n")
    with pytest.raises(ValueError, match="port must be in"):
        server_config(parse_args(["serve", "--config", cfg]))


def test_bad_settings_exit_2_with_the_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = write(tmp_path, "c.yaml", "no_such_flag: 1\n")
    with pytest.raises(SystemExit) as info:
        main(["serve", "--config", cfg])
    assert info.value.code == 2
    assert "unknown key 'no_such_flag'" in capsys.readouterr().err


def test_effective_config_redacts_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVDUPLEX_API_KEY", "sk-secret-key")
    args = parse_args(["serve", "--kv-cache-mb", "32"])
    assert args.api_key == "sk-secret-key"  # the value is used...
    assert args.effective_config["api_key"] == REDACTED  # ...never logged
    assert args.effective_config["kv_cache_mb"] == 32
    assert args.effective_config["role"] == "both"
    assert parse_args(["serve"]).effective_config["api_key"] == REDACTED
    monkeypatch.delenv("KVDUPLEX_API_KEY")
    assert parse_args(["serve"]).effective_config["api_key"] == ""  # none set: shown empty
    cfg = write(tmp_path, "r.yaml", "decode: [http://d:1]\napi_key: sk-file-key\n")
    monkeypatch.setattr("kvduplex.router.app.serve_router", lambda config: None)
    with caplog.at_level(logging.INFO, logger="kvduplex"):
        main(["router", "--config", cfg])
    lines = [r.getMessage() for r in caplog.records if "effective config" in r.getMessage()]
    assert len(lines) == 1 and "http://d:1" in lines[0] and REDACTED in lines[0]
    assert "sk-file-key" not in caplog.text


def test_the_router_sends_the_secret_of_its_secret_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvduplex.common.tokenizer import ByteTokenizer
    from kvduplex.common.trust import SECRET_HEADER
    from kvduplex.router.state import RouterState
    from tests.support.fake_instances import mock_instances

    secret = tmp_path / "cluster-secret"
    secret.write_text("s" * 32 + "\n")
    monkeypatch.setenv("KVDUPLEX_CLUSTER_SECRET", "e" * 32)  # the file wins
    args = ["router", "--decode", "http://d:1", "--cluster-secret-file", str(secret)]
    fake = mock_instances(lambda _: None)  # type: ignore[arg-type,return-value]
    state = RouterState.create(router_config(parse_args(args)), ByteTokenizer(), make_client=fake)
    assert state.client.credentials[SECRET_HEADER] == "s" * 32  # type: ignore[attr-defined]
    monkeypatch.delenv("KVDUPLEX_CLUSTER_SECRET")
    secret.write_text("short")
    with pytest.raises(ValueError, match="at least"):
        RouterState.create(router_config(parse_args(args)), ByteTokenizer())


def test_router_prompt_threads_from_each_layer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    decode = ["router", "--decode", "http://d"]
    assert router_config(parse_args(decode)).prompt_threads == 4
    cfg = write(tmp_path, "r.yaml", "prompt_threads: 2\n")
    assert router_config(parse_args([*decode, "--config", cfg])).prompt_threads == 2
    monkeypatch.setenv("KVDUPLEX_PROMPT_THREADS", "3")
    assert router_config(parse_args([*decode, "--config", cfg])).prompt_threads == 3
    assert router_config(parse_args([*decode, "--prompt-threads", "8"])).prompt_threads == 8
    with pytest.raises(ValueError, match="prompt_threads must be >= 1"):
        router_config(parse_args([*decode, "--prompt-threads", "0"]))
