"""A Hugging Face folder's chat templates, found and rendered as transformers does,
without transformers (whose import brings torch with it; the router must stay torch-free).

Where the templates are (as transformers reads them): ``tokenizer_config.json``'s
``chat_template`` (one template, or a list of ``{name, template}``), overridden by
``chat_template.jinja`` (the default one) and ``additional_chat_templates/NAME.jinja``.
With several, a request with tools gets ``tool_use`` where there is one, else
``default``.

How one renders (transformers' ``apply_chat_template`` with ``tokenize=False``): a
sandboxed, immutable jinja2 environment with ``trim_blocks``, ``lstrip_blocks`` and loop
controls; ``tojson`` as ``json.dumps`` (no HTML escaping, ``ensure_ascii=False``),
``raise_exception(message)``, ``strftime_now(format)``; the template sees ``messages``
(keys whose value is None dropped), ``tools``, ``add_generation_prompt`` and the special
tokens by name (``bos_token``, ``eos_token``, ...). A template that raises, or fails to
render, is a ValueError. Compiled templates are kept per tokenizer; rendering is
thread-safe (the router renders in worker threads).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATES_DIR = "additional_chat_templates"
DEFAULT_NAME = "default"
TOOL_USE_NAME = "tool_use"


def read_chat_templates(folder: Path, tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """The folder's templates by name (the single or default one is `DEFAULT_NAME`)."""
    templates: dict[str, str] = {}
    configured = tokenizer_config.get("chat_template")
    if isinstance(configured, str):
        templates[DEFAULT_NAME] = configured
    elif isinstance(configured, list):
        for entry in configured:
            if isinstance(entry, Mapping) and isinstance(entry.get("template"), str):
                templates[str(entry.get("name", DEFAULT_NAME))] = entry["template"]
    if (folder / TEMPLATE_FILE).is_file():
        templates[DEFAULT_NAME] = (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
    if (folder / TEMPLATES_DIR).is_dir():
        for path in sorted((folder / TEMPLATES_DIR).glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    return templates


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None,
    separators: tuple[str, str] | None = None, sort_keys: bool = False,
) -> str:  # fmt: skip
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplates:
    """One tokenizer's chat templates, compiled once each (on first use)."""

    def __init__(self, templates: Mapping[str, str], special_tokens: Mapping[str, Any]) -> None:
        """`special_tokens`: what the templates see by name (``bos_token``: its text, ...)."""
        self._sources = dict(templates)
        self._special_tokens = dict(special_tokens)
        self._env = _environment()
        self._compiled: dict[str, jinja2.Template] = {}

    def __bool__(self) -> bool:
        return bool(self._sources)

    def _template(self, has_tools: bool) -> jinja2.Template:
        if has_tools and TOOL_USE_NAME in self._sources:
            name = TOOL_USE_NAME
        elif DEFAULT_NAME in self._sources:
            name = DEFAULT_NAME
        else:
            raise ValueError(
                "this model has several chat templates and none is the default: "
                f"{sorted(self._sources)}"
            )
        compiled = self._compiled.get(name)
        if compiled is None:  # two threads may compile it at once: either result serves
            try:
                compiled = self._env.from_string(self._sources[name])
            except jinja2.TemplateError as exc:
                raise ValueError(f"this model's chat template does not compile: {exc}") from exc
            self._compiled[name] = compiled
        return compiled

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None,
    ) -> str:  # fmt: skip
        """The prompt text; ValueError if the template refuses the messages."""
        template = self._template(bool(tools))
        cleaned = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return template.render(
                messages=cleaned, tools=tools or None, add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
            )  # fmt: skip
        except Exception as exc:  # raise_exception, or any error of the template's own
            raise ValueError(f"the chat template refused these messages: {exc}") from exc
