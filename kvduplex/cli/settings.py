"""Layered settings of ``serve``, ``router`` and ``up``: flag > environment > file > default.

argparse keeps the command line and its ``--help`` (the flags come from the config
dataclasses, `kvduplex.cli.flags`); pydantic-settings merges the other layers over
them. Every flag ``--field-name`` of a command is also

* the environment variable ``KVDUPLEX_FIELD_NAME`` (``KVDUPLEX_KV_CACHE_MB=1024``;
  an empty one counts as unset; lists such as the router's ``decode`` take commas or a
  JSON list), and
* the key ``field_name`` of the file named by ``--config`` (YAML for ``.yaml``/``.yml``,
  TOML for ``.toml``; flat, one key per flag).

A flag given on the command line wins over the variable, which wins over the file,
which wins over the default::

    explicit flags ─► KVDUPLEX_* ─► --config FILE ─► dataclass default
         (first layer that names a field gives its value)

A key the command does not know, a value of the wrong type, or a file that cannot be
read is a `ConfigError` naming the key and where it came from (the CLI exits 2). The
values are then built into the config dataclasses as before, whose ``__post_init__``
checks ranges. `effective_config` is what each process logs at start, secrets redacted.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
from pathlib import Path
from typing import Annotated
from typing import Any
from typing import Literal

import pydantic
import yaml
from pydantic import BeforeValidator
from pydantic_settings import BaseSettings
from pydantic_settings import NoDecode
from pydantic_settings import PydanticBaseSettingsSource
from pydantic_settings import SettingsConfigDict
from pydantic_settings import TomlConfigSettingsSource
from pydantic_settings import YamlConfigSettingsSource

ENV_PREFIX = "KVDUPLEX_"
CONFIG_DEST = "config"
"""The dest of ``--config``: not a setting itself."""
SECRET_FIELDS = frozenset({"api_key", "cluster_secret"})
"""Fields whose values are never logged."""
REDACTED = "<redacted>"


class ConfigError(ValueError):
    """A setting that cannot be used; the message names the key and its source."""


def _split_list(value: Any) -> Any:
    """A list from the environment: a JSON list, or items separated by commas or spaces."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("["):
        try:
            return json.loads(text)
        except ValueError as exc:
            raise ValueError(f"not a JSON list: {exc}") from None
    return [item for item in text.replace(",", " ").split() if item]


ListOfStr = Annotated[tuple[str, ...], NoDecode, BeforeValidator(_split_list)]


def _field_type(action: argparse.Action) -> Any:
    """The pydantic type of one flag, from how argparse parses it."""
    if action.nargs in ("*", "+"):
        return ListOfStr
    if isinstance(action, argparse.BooleanOptionalAction) or action.const is True:
        return bool
    if action.choices:
        first = next(iter(action.choices))
        if isinstance(first, enum.Enum):
            return type(first)
        return Literal[tuple(action.choices)]
    if isinstance(action.type, type):
        return action.type
    return str


def setting_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The actions of `parser` that are settings (all but ``--help`` and ``--config``)."""
    return [
        a
        for a in parser._actions
        if a.dest not in (argparse.SUPPRESS, CONFIG_DEST)
        and not isinstance(a, argparse._HelpAction)
    ]


def explicit_values(parser: argparse.ArgumentParser, argv: list[str]) -> dict[str, Any]:
    """The settings `argv` gives on the command line (`parser` parsed it once already, so
    it is valid): parsed again with every default suppressed."""
    actions = setting_actions(parser)
    saved = [(a, a.default, a.required) for a in actions]
    try:
        for a in actions:
            a.default, a.required = argparse.SUPPRESS, False
        known, _ = parser.parse_known_args(argv)
    finally:
        for a, default, required in saved:
            a.default, a.required = default, required
    return {k: v for k, v in vars(known).items() if k != CONFIG_DEST and k in _dests(actions)}


def _dests(actions: list[argparse.Action]) -> set[str]:
    return {a.dest for a in actions}


def _file_source(settings_cls: type[BaseSettings], path: Path) -> PydanticBaseSettingsSource:
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):
        return YamlConfigSettingsSource(settings_cls, yaml_file=path)
    if suffix == ".toml":
        return TomlConfigSettingsSource(settings_cls, toml_file=path)
    raise ConfigError(f"--config {path}: use a .yaml, .yml or .toml file")


def _settings_class(actions: list[argparse.Action], config_file: Path | None) -> type[BaseSettings]:
    class Layers(BaseSettings):
        model_config = SettingsConfigDict(
            env_prefix=ENV_PREFIX, extra="forbid", env_ignore_empty=True, case_sensitive=False
        )

        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            sources = [init_settings, env_settings]
            if config_file is not None:
                sources.append(_file_source(settings_cls, config_file))
            return tuple(sources)

    fields: dict[str, Any] = {a.dest: (_field_type(a), a.default) for a in actions}
    model: type[BaseSettings] = pydantic.create_model("Settings", __base__=Layers, **fields)
    return model


def _check_file(path: Path) -> None:
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it: {exc}") from None


def _source_of(key: str, explicit: dict[str, Any], config_file: Path | None) -> str:
    if key in explicit:
        return "--" + key.replace("_", "-")
    var = ENV_PREFIX + key.upper()
    if os.environ.get(var):
        return var
    return f"--config {config_file}" if config_file is not None else "the default"


def _error(
    exc: pydantic.ValidationError, explicit: dict[str, Any], config_file: Path | None
) -> str:
    problems = []
    for err in exc.errors():
        key = ".".join(str(part) for part in err["loc"])
        if err["type"] == "extra_forbidden":
            problems.append(f"unknown key {key!r} in --config {config_file}")
            continue
        where = _source_of(str(err["loc"][0]), explicit, config_file)
        shown = REDACTED if err["loc"][0] in SECRET_FIELDS else repr(err["input"])
        problems.append(f"{key}: {err['msg']} (got {shown} from {where})")
    return "; ".join(problems)


def layered(
    parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]
) -> argparse.Namespace:
    """`args` (what `parser` parsed from `argv`) with every setting's value taken from the
    first layer that gives it: the command line, ``KVDUPLEX_*``, the ``--config`` file,
    the default. Raises `ConfigError` for an unknown key or a value of the wrong type."""
    actions = setting_actions(parser)
    explicit = explicit_values(parser, argv)
    raw_path = getattr(args, CONFIG_DEST, None)
    config_file = Path(raw_path) if raw_path else None
    if config_file is not None:
        _check_file(config_file)
    cls = _settings_class(actions, config_file)
    try:
        settings = cls(**explicit)
    except pydantic.ValidationError as exc:
        raise ConfigError(_error(exc, explicit, config_file)) from None
    except (ValueError, yaml.YAMLError) as exc:  # a file that does not parse
        raise ConfigError(f"--config {config_file}: {exc}") from None
    except TypeError:  # a file that parses, but not into one mapping
        raise ConfigError(
            f"--config {config_file}: the file must hold one mapping of keys to values"
        ) from None
    out = argparse.Namespace(**vars(args))
    for a in actions:
        value = getattr(settings, a.dest)
        setattr(out, a.dest, list(value) if isinstance(value, tuple) else value)
    return out


def effective_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The settings of `args` as JSON-able values, secrets redacted (for the start log)."""
    out: dict[str, Any] = {}
    for a in setting_actions(parser):
        value = getattr(args, a.dest, None)
        if isinstance(value, enum.Enum):
            value = value.value
        elif isinstance(value, tuple):
            value = list(value)
        if a.dest in SECRET_FIELDS and value:
            value = REDACTED
        out[a.dest] = value
    return out
