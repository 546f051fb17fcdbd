"""Layered settings of every kvduplex command: flag > environment > config file > default.

Each process has one settings model, a `ProcessSettings` made of the config sections it
needs (`kvduplex.cli.settings`, and the benchmarks' in `kvduplex.bench`).
pydantic-settings reads it from three places:

* the command line (its CLI source): field ``name`` is the flag ``--name`` with ``-``
  for ``_``; a bool is the pair ``--name`` / ``--no-name``; an enum takes one of its
  values; a list takes commas, a JSON list, or (instance URLs) the values after its
  flag. ``--help`` shows each field's docstring and default;
* the environment: ``KVDUPLEX_NAME`` (``KVDUPLEX_KV_CACHE_MB=1024``; an empty one counts
  as unset; a list takes commas or a JSON list) for every field except `env_excluded`:
  ``config``, and ``port``, whose ``KVDUPLEX_PORT`` is what a Kubernetes Service named
  ``kvduplex`` injects into every pod of its namespace (``tcp://10.96.0.12:8000``). No
  name read may be one a service link can produce (`SERVICE_LINK`); a unit test holds
  every model to it. Variables of undeclared names are never read;
* the file named by ``--config`` (YAML for ``.yaml``/``.yml``, TOML for ``.toml``; flat,
  one key per field).

The first that gives a field wins::

    --flag ─► KVDUPLEX_* ─► --config FILE ─► default

A key the model does not know, a value of the wrong type or out of range, or a file
that cannot be read is a `ConfigError` that names the key and where its value came
from (the CLI exits 2). `ProcessSettings.effective_config` is what each process logs at
start, secrets redacted.
"""

from __future__ import annotations

import difflib
import enum
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated
from typing import Any
from typing import ClassVar
from typing import Literal
from typing import TypeVar
from typing import cast
from typing import get_args
from typing import get_origin

import pydantic
import yaml
from pydantic import BeforeValidator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings
from pydantic_settings import CliApp
from pydantic_settings import CliSettingsSource
from pydantic_settings import CliVariadicArg
from pydantic_settings import EnvSettingsSource
from pydantic_settings import NoDecode
from pydantic_settings import PydanticBaseSettingsSource
from pydantic_settings import SettingsConfigDict
from pydantic_settings import SettingsError
from pydantic_settings import TomlConfigSettingsSource
from pydantic_settings import YamlConfigSettingsSource

from kvduplex.common.config import ENV_PREFIX

REDACTED = "<redacted>"

_SVC = r"[A-Z]([A-Z0-9_]*[A-Z0-9])?"
SERVICE_LINK = re.compile(
    rf"{_SVC}_SERVICE_HOST|{_SVC}_SERVICE_PORT(_[A-Z0-9_]+)?|{_SVC}_PORT"
    rf"|{_SVC}_PORT_[0-9]+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?"
)
"""The names of the variables Kubernetes service links inject (match with
``fullmatch``): for a Service SVC (a DNS-1035 label, upper-cased, ``-`` as ``_``),
``SVC_SERVICE_HOST``, ``SVC_SERVICE_PORT``, ``SVC_SERVICE_PORT_<PORT NAME>``,
``SVC_PORT``, ``SVC_PORT_<N>_<PROTO>`` and ``SVC_PORT_<N>_<PROTO>_{PROTO,PORT,ADDR}``."""


class ConfigError(ValueError):
    """A setting that cannot be used; the message names the key and its source."""


def split_list(value: Any) -> Any:
    """A list from text: a JSON list, or items separated by commas or spaces."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("["):
        try:
            return json.loads(text)
        except ValueError as exc:
            raise ValueError(f"not a JSON list: {exc}") from None
    return [item for item in text.replace(",", " ").split() if item]


StrList = Annotated[tuple[str, ...], NoDecode, BeforeValidator(split_list)]
"""A list setting: ``--flag a,b`` (or the flag repeated), ``KVDUPLEX_FLAG=a,b`` or a
JSON list, a YAML or TOML list."""
IntList = Annotated[tuple[int, ...], NoDecode, BeforeValidator(split_list)]
"""`StrList` of integers."""
StrArgs = CliVariadicArg[StrList]
"""`StrList` whose flag also takes the values after it: ``--decode URL URL``."""


_Section = TypeVar("_Section", bound=pydantic.BaseModel)


class _DeclaredEnvSource(EnvSettingsSource):
    """The environment of a `ProcessSettings`, read under the names it declares
    (`ProcessSettings.env_names`) and no other."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        name = cast("type[ProcessSettings]", self.settings_cls).env_names().get(field_name)
        if name is None:
            return None, field_name, False
        value = self.env_vars.get(name if self.case_sensitive else name.lower())
        return value, field_name, self.field_is_complex(field)


def _file_source(settings_cls: type[BaseSettings], path: Path) -> PydanticBaseSettingsSource:
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):
        return YamlConfigSettingsSource(settings_cls, yaml_file=path)
    if suffix == ".toml":
        return TomlConfigSettingsSource(settings_cls, toml_file=path)
    raise ConfigError(f"--config {path}: use a .yaml, .yml or .toml file")


class ProcessSettings(BaseSettings):
    """Base of each process's settings model: its sources and their order (the module's
    docstring), the ``--config`` flag, and the effective config it logs."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_ignore_empty=True,
        case_sensitive=True,
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
    )

    command: ClassVar[str]
    """The ``kvduplex`` command these are the settings of."""
    env_excluded: ClassVar[frozenset[str]] = frozenset({"config", "port"})
    """Fields the environment never sets: the flag and the config file still do."""
    reads_environment: ClassVar[bool] = True
    """False for a command that reads no variable (the benchmarks: what they measure is
    what their command line says, whatever a shell exported for `serve`)."""
    secret_fields: ClassVar[frozenset[str]] = frozenset({"api_key"})
    """Fields whose values are never logged or echoed in an error."""

    config: str = ""
    """A YAML (.yaml, .yml) or TOML (.toml) file of settings, one key per flag
    (kv_cache_mb: 1024). Every flag but --config, --port and bench's is also the environment
    variable KVDUPLEX_<FLAG_NAME> (KVDUPLEX_KV_CACHE_MB=1024). A flag given here wins
    over the variable, which wins over the file."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Keyword arguments, then the declared environment, then the ``config`` file
        (given as a keyword argument; `load_settings` passes the flag's). The command line
        goes before them all (`load_settings`)."""
        sources: list[PydanticBaseSettingsSource] = [init_settings, _DeclaredEnvSource(settings_cls)]
        path = getattr(init_settings, "init_kwargs", {}).get("config")
        if path:
            sources.append(_file_source(settings_cls, Path(path)))
        return tuple(sources)

    @classmethod
    def env_names(cls) -> dict[str, str]:
        """Field name → the environment variable that sets it, for every field the
        environment may set: the only names these settings read."""
        if not cls.reads_environment:
            return {}
        return {
            name: ENV_PREFIX + name.upper()
            for name in cls.model_fields
            if name not in cls.env_excluded
        }

    @property
    def effective_config(self) -> dict[str, Any]:
        """Every setting as JSON-able values, secrets redacted (for the start log)."""
        out = self.model_dump(mode="json", exclude={"config"})
        for name in self.secret_fields & out.keys():
            if out[name]:
                out[name] = REDACTED
        return out

    def section(self, cls: type[_Section]) -> _Section:
        """The fields of section `cls` among these settings, as a `cls` (checked again)."""
        return cls.model_validate({name: getattr(self, name) for name in cls.model_fields})


_Settings = TypeVar("_Settings", bound=ProcessSettings)


def _choices(annotation: Any) -> list[str] | None:
    """The values a flag of type `annotation` takes, if it takes one of a few."""
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return [str(m.value) for m in annotation]
    if get_origin(annotation) is Literal:
        return [str(v) for v in get_args(annotation)]
    return None


def _readable(dest: str, field: FieldInfo, kwargs: dict[str, Any]) -> None:
    """`kwargs` of a field's flag as argparse shows it: an enum's or a literal's values as
    its choices, a list's items named after it, an empty default as ``empty``."""
    choices = _choices(field.annotation)
    if choices is not None:
        kwargs["choices"] = choices
        kwargs["metavar"] = "{" + ",".join(choices) + "}"
        if isinstance(field.default, enum.Enum):
            name, value = field.default.name, field.default.value
            kwargs["help"] = kwargs["help"].replace(f"(default: {name})", f"(default: {value})")
    elif str(kwargs.get("metavar", "")).startswith("tuple["):
        kwargs["metavar"] = dest.upper()
    if isinstance(kwargs.get("help"), str):
        kwargs["help"] = kwargs["help"].replace("(default: )", "(default: empty)")


def settings_parser(cls: type[ProcessSettings]) -> CliSettingsSource[Any]:
    """The command line of `cls` (pydantic-settings' CLI source; ``root_parser`` is its
    argparse parser): one flag per field, kebab-case, booleans as ``--x``/``--no-x``,
    enums and literals as choices of their values."""

    def add_argument(parser: Any, *names: str, **kwargs: Any) -> Any:
        dest = kwargs.get("dest", "")
        field = cls.model_fields.get(dest)
        if field is not None:
            _readable(dest, field, kwargs)
        if kwargs.get("nargs") in ("*", "+") and "action" not in kwargs:
            kwargs["action"] = "extend"  # the flag repeated adds its values
        return parser.add_argument(*names, **kwargs)

    return CliSettingsSource(
        cls,
        cli_prog_name=f"kvduplex {cls.command}",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        add_argument_method=add_argument,
    )


def load_settings(cls: type[_Settings], argv: Sequence[str]) -> _Settings:
    """`cls` from the command line `argv` (the command's own arguments), the environment
    and the ``--config`` file, each field from the first that gives it. ``--help`` and a
    malformed command line exit (argparse: 0 and 2); any other unusable setting raises
    `ConfigError`."""
    cli = settings_parser(cls)
    try:
        cli(args=list(argv))
    except SettingsError as exc:
        raise ConfigError(str(exc)) from None
    given: dict[str, Any] = {k: v for k, v in cli.env_vars.items() if v is not None}
    path = str(given.get("config") or "")
    init: dict[str, Any] = {"config": path} if path else {}
    if path:
        _check_file(Path(path))
    try:
        return CliApp.run(cls, cli_args=list(argv), cli_settings_source=cli, **init)
    except pydantic.ValidationError as exc:
        raise ConfigError(_describe(exc, cls, given, path)) from None
    except ConfigError:
        raise
    except SettingsError as exc:
        raise ConfigError(str(exc)) from None
    except (ValueError, yaml.YAMLError) as exc:  # a file that does not parse
        raise ConfigError(f"--config {path}: {exc}") from None
    except (TypeError, AttributeError):  # a file that parses, but not into one mapping
        raise ConfigError(
            f"--config {path}: the file must hold one mapping of keys to values"
        ) from None


def _check_file(path: Path) -> None:
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it: {exc}") from None


def _source_of(cls: type[ProcessSettings], key: str, given: dict[str, Any], path: str) -> str:
    if key in given:
        return "--" + key.replace("_", "-")
    var = cls.env_names().get(key)
    if var is not None and os.environ.get(var):
        return var
    return f"--config {path}" if path else "the default"


def _describe(
    exc: pydantic.ValidationError, cls: type[ProcessSettings], given: dict[str, Any], path: str
) -> str:
    problems = []
    for err in exc.errors():
        key = ".".join(str(part) for part in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(key, cls.model_fields, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(
                f"unknown key {key!r} in --config {path} ({hint}kvduplex {cls.command} --help "
                "lists the settings; a key is a flag's name with _ for -)"
            )
        elif not err["loc"]:  # a check across fields: its message names them
            problems.append(message)
        else:
            name = str(err["loc"][0])
            shown = REDACTED if name in cls.secret_fields else repr(err["input"])
            problems.append(f"{key}: {message} (got {shown} from {_source_of(cls, name, given, path)})")
    return "; ".join(problems)
