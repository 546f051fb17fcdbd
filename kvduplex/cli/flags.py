"""CLI flags generated from the config dataclasses.

Each field becomes ``--field-name`` with the field's default and the docstring
line under it as help text, so the dataclasses stay the one source of truth.
A boolean field becomes the pair ``--field-name`` / ``--no-field-name``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import functools
import inspect
import itertools
import textwrap
import typing
from typing import Any
from typing import TypeVar

T = TypeVar("T")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass: the string literal right after each field."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for prev, node in itertools.pairwise(body):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = node.value.value.strip()
    return docs


def add_dataclass_flags(
    parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = (), prefix: str = ""
) -> None:
    """Add one flag per field of dataclass `cls` (nested dataclass fields are skipped)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    group = parser.add_argument_group(cls.__name__, (cls.__doc__ or "").strip().splitlines()[0])
    for f in dataclasses.fields(cls):
        if f.name in skip or dataclasses.is_dataclass(hints[f.name]):
            continue
        tp = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else None
        flag = "--" + (prefix + f.name).replace("_", "-")
        kwargs: dict[str, Any] = {"dest": prefix + f.name, "default": default, "help": docs.get(f.name, "")}
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            kwargs["choices"] = list(tp)
            kwargs["metavar"] = "{" + ",".join(str(m.value) for m in tp) + "}"
            kwargs["type"] = lambda s, tp=tp: tp(s)
        elif tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif tp in (int, float, str):
            kwargs["type"] = tp
        else:
            continue
        if kwargs["help"] and default is not None:
            default_text = default.value if isinstance(default, enum.Enum) else default
            kwargs["help"] += f" (default: {default_text})"
        group.add_argument(flag, **kwargs)


def dataclass_from_args(cls: type[T], args: argparse.Namespace, *, prefix: str = "", **extra: Any) -> T:
    """Build `cls` from parsed flags (fields without a flag keep their default)."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        key = prefix + f.name
        if key in vars(args):
            values[f.name] = getattr(args, key)
    values.update(extra)
    return cls(**values)


def flags_of(cls: type, args: argparse.Namespace, *, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags of `cls`'s fields as parsed in `args`, as a child process's arguments.

    Fields in `skip` and fields without a flag (not in `args`) are left out.
    """
    out: list[str] = []
    for f in dataclasses.fields(cls):
        if f.name in skip or f.name not in vars(args):
            continue
        value = getattr(args, f.name)
        if isinstance(value, enum.Enum):
            value = value.value
        out += ["--" + f.name.replace("_", "-"), str(value)]
    return out
