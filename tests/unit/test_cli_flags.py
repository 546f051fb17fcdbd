"""CLI flags generated from the settings models (pydantic-settings' CLI source)."""

from __future__ import annotations

from typing import ClassVar

import pytest

from kvduplex.cli.main import parse_args
from kvduplex.common.config import Role
from kvduplex.common.engine_config import TransferConfig
from kvduplex.common.settings import ProcessSettings
from kvduplex.common.settings import load_settings
from kvduplex.common.settings import settings_parser
from kvduplex.instance.config import ServerConfig


class TransferAndRole(TransferConfig, ProcessSettings):
    """A section's flags and an enum's (``ServerConfig.role``), alone: no boolean."""

    command: ClassVar[str] = "serve"

    role: Role = ServerConfig.model_fields["role"].default


def test_boolean_fields_are_on_off_switches() -> None:
    default = parse_args(["serve"]).engine_config()
    assert default.cache.enable_prefix_caching is True
    assert default.scheduler.enable_chunked_prefill is True
    off = parse_args(["serve", "--no-enable-prefix-caching", "--no-enable-chunked-prefill"])
    assert off.engine_config().cache.enable_prefix_caching is False
    assert off.engine_config().scheduler.enable_chunked_prefill is False
    on = parse_args(["serve", "--no-enable-prefix-caching", "--enable-prefix-caching"])
    assert on.engine_config().cache.enable_prefix_caching is True


def test_boolean_switches_take_no_value() -> None:
    with pytest.raises(SystemExit):
        parse_args(["serve", "--enable-prefix-caching", "false"])


def test_fields_become_flags_with_their_defaults_and_docs() -> None:
    text = settings_parser(TransferAndRole).root_parser.format_help()
    assert "--transfer-timeout-s" in text and "(default: 10.0)" in text
    assert "--no-enable" not in text
    args = load_settings(TransferAndRole, ["--kv-wait-timeout-s", "2.5", "--role", "decode"])
    assert args.section(TransferConfig).kv_wait_timeout_s == 2.5
    assert args.role is Role.DECODE
    with pytest.raises(SystemExit):
        load_settings(TransferAndRole, ["--role", "router"])
