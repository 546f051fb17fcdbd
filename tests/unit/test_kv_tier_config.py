"""The KV tier's settings: flags of ``kvduplex serve``, off by default, and validation
messages that say what to change."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvduplex.cli.main import parse_args
from kvduplex.cli.settings import ServeSettings
from kvduplex.cli.settings import UpSettings
from kvduplex.common.engine_config import CacheConfig
from kvduplex.common.engine_config import KVTierKind
from kvduplex.common.settings import ConfigError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No KVDUPLEX_* setting from the shell that runs the tests."""
    import os

    for name in list(os.environ):
        if name.startswith("KVDUPLEX_"):
            monkeypatch.delenv(name)


def cache_of(argv: list[str]) -> CacheConfig:
    settings = parse_args(argv)
    assert isinstance(settings, ServeSettings)
    return settings.engine_config().cache


def test_the_tier_is_off_by_default() -> None:
    assert cache_of(["serve"]).kv_tier is KVTierKind.NONE


def test_tier_flags_reach_the_engine_config(tmp_path: Path) -> None:
    argv = ["serve", "--kv-tier", "file", "--kv-tier-path", str(tmp_path), "--kv-tier-gib", "0.5"]
    cache = cache_of(argv)
    assert (cache.kv_tier, cache.kv_tier_path, cache.kv_tier_gib) == (
        KVTierKind.FILE, str(tmp_path), 0.5,
    )  # fmt: skip
    assert cache_of(["serve", "--kv-tier", "host", "--kv-tier-blocks", "100"]).kv_tier_blocks == 100
    assert cache_of(["serve"]).kv_tier_overlap_blocks is None  # by the pool's device
    overlap = ["serve", "--kv-tier", "file", "--kv-tier-overlap-blocks", "0"]
    assert cache_of(overlap).kv_tier_overlap_blocks == 0


def test_tier_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDUPLEX_KV_TIER", "host")
    assert cache_of(["serve"]).kv_tier is KVTierKind.HOST


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--kv-tier-path", "/tmp"], "set kv_tier to file or leave kv_tier_path empty"),
        (["--kv-tier", "host", "--kv-tier-path", "/tmp"], "set kv_tier to file"),
        (
            ["--kv-tier", "file", "--kv-tier-path", "/no/such/dir"],
            "not an existing directory; create it",
        ),
        (
            ["--kv-tier", "host", "--no-enable-prefix-caching"],
            "turn enable_prefix_caching on or set kv_tier to none",
        ),
        (
            ["--kv-tier", "host", "--kv-tier-gib", "0"],
            r"kv_tier_gib must be > 0 \(or set kv_tier_blocks\)",
        ),
        (["--kv-tier", "host", "--kv-tier-blocks", "-1"], "kv_tier_blocks must be >= 0"),
        (
            ["--kv-tier", "host", "--kv-tier-overlap-blocks", "-1"],
            "kv_tier_overlap_blocks must be >= 0",
        ),
    ],
)
def test_bad_tier_settings_say_what_to_change(argv: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_args(["serve", *argv])


def test_an_unknown_tier_is_refused_with_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["serve", "--kv-tier", "disk"])
    assert "choose from 'none', 'host', 'file'" in capsys.readouterr().err


def test_zero_gib_is_fine_when_blocks_size_the_tier() -> None:
    cache = CacheConfig(kv_tier=KVTierKind.HOST, kv_tier_gib=0, kv_tier_blocks=8)
    assert cache.kv_tier_blocks == 8


def test_store_flags_reach_the_engine_config() -> None:
    argv = ["serve", "--kv-tier", "store", "--kv-store-master", "store.example:50051"]
    argv += ["--kv-store-timeout-s", "0.25", "--kv-store-retry-s", "2"]
    cache = cache_of(argv)
    assert (cache.kv_tier, cache.kv_store_master) == (KVTierKind.STORE, "store.example:50051")
    assert (cache.kv_store_timeout_s, cache.kv_store_retry_s) == (0.25, 2.0)
    # Without a metadata URL: the metadata server the master serves itself, on its host.
    assert cache.store_metadata_url() == "http://store.example:8080/metadata"
    url = "http://meta.example:9000/metadata"
    assert cache_of([*argv, "--kv-store-metadata-url", url]).store_metadata_url() == url


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--kv-tier", "store"], "kv_tier store needs kv_store_master: HOST:PORT"),
        (["--kv-store-master", "h:1"], "set kv_tier to store or leave kv_store_master empty"),
        (
            ["--kv-tier", "host", "--kv-store-local-host", "10.0.0.1"],
            "leave kv_store_local_host empty",
        ),
        (
            ["--kv-tier", "store", "--kv-store-master", "nohost"],
            "kv_store_master must be HOST:PORT",
        ),
        (
            ["--kv-tier", "store", "--kv-store-master", "h:1", "--kv-store-metadata-url", "h:2"],
            "kv_store_metadata_url must be http://HOST:PORT/metadata",
        ),
        (
            ["--kv-tier", "store", "--kv-store-master", "h:1", "--kv-store-timeout-s", "0"],
            "kv_store_timeout_s must be > 0",
        ),
    ],
)
def test_bad_store_settings_say_what_to_change(argv: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_args(["serve", *argv])


def test_up_takes_a_store_flag() -> None:
    settings = parse_args(["up", "--kv-store", "--kv-store-gib", "0.5"])
    assert isinstance(settings, UpSettings)
    assert settings.kv_store and settings.kv_store_gib == 0.5
    assert not parse_args(["up"]).kv_store  # type: ignore[attr-defined]
