"""Layered settings (`kvduplex.common.settings`): flag > KVDUPLEX_* > --config file >
default, for serve, router and up; errors name the key and its source; the logged
effective config has its secrets redacted."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from kvduplex.bench.agentic_cli import AgenticBenchSettings
from kvduplex.bench.serving import ServingBenchSettings
from kvduplex.cli.main import main
from kvduplex.cli.main import parse_args
from kvduplex.cli.settings import RouterSettings
from kvduplex.cli.settings import ServeSettings
from kvduplex.cli.settings import UpSettings
from kvduplex.common.config import ENV_PREFIX
from kvduplex.common.config import ENVIRONMENT_VARIABLES
from kvduplex.common.config import ReturnMode
from kvduplex.common.config import Role
from kvduplex.common.config import TransferMode
from kvduplex.common.settings import REDACTED
from kvduplex.common.settings import SERVICE_LINK
from kvduplex.common.settings import ConfigError
from kvduplex.common.settings import ProcessSettings
from kvduplex.instance.config import ServerConfig
from kvduplex.router.config import RouterConfig
from tests.support.service_links import SERVICE_LINK_ENV


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No KVDUPLEX_* setting from the shell that runs the tests."""
    import os

    for name in list(os.environ):
        if name.startswith("KVDUPLEX_"):
            monkeypatch.delenv(name)


def router_config(settings: object) -> RouterConfig:
    assert isinstance(settings, RouterSettings)
    return settings.router_config()


def server_config(settings: object) -> ServerConfig:
    assert isinstance(settings, ServeSettings)
    return settings.server_config()


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
    # With a secret, the calls go through the admission's client; the secret is its inner's.
    sent = getattr(state.client, "inner", state.client)
    assert sent.credentials[SECRET_HEADER] == "s" * 32
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


# --- the environment: declared names only, none a Kubernetes service link can produce ---

SETTINGS_MODELS = (ServeSettings, RouterSettings, UpSettings, ServingBenchSettings,
                   AgenticBenchSettings)  # fmt: skip


def _all_settings_models() -> set[type[ProcessSettings]]:
    found: set[type[ProcessSettings]] = set()
    todo = list(ProcessSettings.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("kvduplex."):
            found.add(cls)
        todo.extend(cls.__subclasses__())
    return found



def test_the_service_link_pattern_matches_what_kubernetes_injects() -> None:
    for name in SERVICE_LINK_ENV:
        assert SERVICE_LINK.fullmatch(name), name
    for service in ("kvduplex-decode-headless", "a", "kvduplex-router-0"):
        svc = service.upper().replace("-", "_")
        for suffix in ("_SERVICE_HOST", "_SERVICE_PORT", "_SERVICE_PORT_METRICS", "_PORT",
                       "_PORT_53_UDP", "_PORT_8000_SCTP_ADDR"):  # fmt: skip
            assert SERVICE_LINK.fullmatch(svc + suffix), svc + suffix
    assert not SERVICE_LINK.fullmatch("KVDUPLEX_KV_CACHE_MB")
    assert not SERVICE_LINK.fullmatch("KVDUPLEX_PORT_NUMBER")


def test_no_environment_name_read_is_one_a_service_link_can_produce() -> None:
    assert set(SETTINGS_MODELS) <= _all_settings_models()
    names = {name for model in _all_settings_models() for name in model.env_names().values()}
    names |= set(ENVIRONMENT_VARIABLES)
    assert {"KVDUPLEX_CLUSTER_SECRET", "KVDUPLEX_API_KEY", "KVDUPLEX_LOG_LEVEL"} <= names
    assert "KVDUPLEX_KV_CACHE_MB" in names and "KVDUPLEX_DECODE" in names
    assert all(name.startswith(ENV_PREFIX) for name in names)
    produced = sorted(name for name in names if SERVICE_LINK.fullmatch(name))
    assert not produced, f"a Kubernetes service link can set {produced}"


def test_service_link_variables_are_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in SERVICE_LINK_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("KVDUPLEX_API_KEY", "sk-from-env")
    monkeypatch.setenv("KVDUPLEX_LOG_LEVEL", "debug")
    serve = parse_args(["serve"])
    assert serve.port == 8000 and serve.api_key == "sk-from-env"
    router = parse_args(["router", "--decode", "http://d:1"])
    assert router.port == 8000 and router.log_level == "debug"
    assert parse_args(["up"]).port == 0
    # --port still comes from the flag and the file
    assert parse_args(["serve", "--port", "9000"]).port == 9000
    cfg = write(tmp_path, "c.yaml", "port: 9001\n")
    assert parse_args(["serve", "--config", cfg]).port == 9001


def test_an_undeclared_variable_is_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDUPLEX_KV_CACHE_GB", "1")  # no such setting: ignored
    monkeypatch.setenv("KVDUPLEX_SESSION_TTL_S", "5")  # the router's, not an instance's
    assert parse_args(["serve"]).kv_cache_mb == 512


def test_the_engine_config_imports_no_openai_parser() -> None:
    code = (
        "import sys; import kvduplex.common.engine_config, kvduplex.engine.scheduler;"
        "loaded = [m for m in sys.modules if m.startswith('kvduplex.common.openai')];"
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_list_flag_repeated_adds_its_values() -> None:
    args = parse_args(["router", "--model", "tiny", "--decode", "http://a:1", "http://c:1",
                       "--decode", "http://b:1"])  # fmt: skip
    assert isinstance(args, RouterSettings)
    assert args.decode == ("http://a:1", "http://c:1", "http://b:1")


def test_the_benchmarks_read_no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDUPLEX_KV_CACHE_MB", "1024")
    monkeypatch.setenv("KVDUPLEX_MODEL", "/models/elsewhere")
    args = parse_args(["bench", "--workload", "agentic"])
    assert isinstance(args, AgenticBenchSettings)
    assert (args.kv_cache_mb, args.model) == (0, "")
    assert ServingBenchSettings.env_names() == {} == AgenticBenchSettings.env_names()


def test_a_workload_from_anywhere_but_its_flag_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bench.yaml"
    path.write_text("workload: agentic\n")
    with pytest.raises(ConfigError, match="workload"):
        parse_args(["bench", "--config", str(path)])


def test_a_port_in_the_environment_is_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDUPLEX_PORT", "9000")
    args = parse_args(["serve", "--model", "tiny"])
    assert isinstance(args, ServeSettings)
    assert args.port != 9000


def test_peer_idle_s_must_outlast_the_flows_waits() -> None:
    assert parse_args(["serve", "--peer-idle-s", "0"]).peer_idle_s == 0  # never for idleness
    assert parse_args(["serve", "--peer-idle-s", "45"]).engine_config().transfer.peer_idle_s == 45
    with pytest.raises(ConfigError, match=r"peer_idle_s must be 0 \(never\) or > 21 s"):
        parse_args(["serve", "--peer-idle-s", "20"])
    args = ["serve", "--peer-idle-s", "20", "--transfer-timeout-s", "5", "--kv-wait-timeout-s", "5"]
    assert parse_args(args).peer_idle_s == 20
