"""CLI flags generated from the config dataclasses."""

from __future__ import annotations

import argparse

import pytest

from kvduplex.cli.flags import add_dataclass_flags
from kvduplex.cli.flags import dataclass_from_args
from kvduplex.cli.main import build_parser
from kvduplex.common.config import CacheConfig
from kvduplex.common.config import Role
from kvduplex.common.config import SchedulerConfig
from kvduplex.common.config import ServerConfig
from kvduplex.common.config import TransferConfig


def test_boolean_fields_are_on_off_switches() -> None:
    parser = build_parser()
    default = parser.parse_args(["serve"])
    assert dataclass_from_args(CacheConfig, default).enable_prefix_caching is True
    assert dataclass_from_args(SchedulerConfig, default).enable_chunked_prefill is True
    off = parser.parse_args(["serve", "--no-enable-prefix-caching", "--no-enable-chunked-prefill"])
    assert dataclass_from_args(CacheConfig, off).enable_prefix_caching is False
    assert dataclass_from_args(SchedulerConfig, off).enable_chunked_prefill is False
    on = parser.parse_args(["serve", "--no-enable-prefix-caching", "--enable-prefix-caching"])
    assert dataclass_from_args(CacheConfig, on).enable_prefix_caching is True


def test_boolean_switches_take_no_value() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--enable-prefix-caching", "false"])


def test_fields_become_flags_with_their_defaults_and_docs() -> None:
    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, TransferConfig)
    add_dataclass_flags(parser, ServerConfig)
    text = parser.format_help()
    assert "--transfer-timeout-s" in text and "(default: 10.0)" in text
    assert "--no-enable" not in text
    args = parser.parse_args(["--kv-wait-timeout-s", "2.5", "--role", "decode"])
    assert dataclass_from_args(TransferConfig, args).kv_wait_timeout_s == 2.5
    assert dataclass_from_args(ServerConfig, args).role is Role.DECODE
    with pytest.raises(SystemExit):
        parser.parse_args(["--role", "router"])
