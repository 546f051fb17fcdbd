"""The router's OpenAPI document (``GET /openapi.json``): its public routes, the request
bodies as the instances' pydantic models describe them (`kvduplex.common.openai.protocol`).

Made once, at the first request for it. It describes what the router serves, so that a
client, or a schema-driven fuzzer, can drive it; the answers' bodies are not described
beyond their media types.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode
from pydantic.json_schema import models_json_schema

from kvduplex.common.openai.protocol import ChatCompletionRequest
from kvduplex.common.openai.protocol import CompletionRequest

_REF = "#/components/schemas/{model}"
_ERROR = {"description": "OpenAI error JSON", "content": {"application/json": {"schema": {}}}}


def _json_answer(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {}}}}


def _get(summary: str, answer: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": answer}, **extra}}


def _post(summary: str, schema: dict[str, Any]) -> dict[str, Any]:
    body = {"required": True, "content": {"application/json": {"schema": schema}}}
    answers = {
        "200": {
            "description": "The answer: whole (JSON), or streamed (server-sent events)",
            "content": {"application/json": {"schema": {}}, "text/event-stream": {"schema": {}}},
        },
        "400": _ERROR,
    }
    return {"post": {"summary": summary, "requestBody": body, "responses": answers}}


def openapi_doc() -> dict[str, Any]:
    """The document, as a dict."""
    models: list[tuple[type[BaseModel], JsonSchemaMode]] = [
        (CompletionRequest, "validation"), (ChatCompletionRequest, "validation"),
    ]  # fmt: skip
    refs, schemas = models_json_schema(models, ref_template=_REF)
    limit = {
        "name": "limit", "in": "query", "required": False,
        "schema": {"type": "integer", "default": 100},
    }  # fmt: skip
    paths = {
        "/v1/completions": _post("Create a completion", refs[models[0]]),
        "/v1/chat/completions": _post("Create a chat completion", refs[models[1]]),
        "/v1/models": _get("A decode instance's models", _json_answer("The model list")),
        "/health": _get("Liveness, and each instance's health", _json_answer("Up")),
        "/ready": _get("Readiness", _json_answer("Ready (503: not)")),
        "/metrics": _get(
            "Prometheus metrics",
            {"description": "Metrics", "content": {"text/plain": {"schema": {}}}},
        ),
        "/sessions": _get("The most recent sessions", _json_answer("Sessions"), parameters=[limit]),
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvduplex-router", "version": "0.1.0"},
        "paths": paths,
        "components": {"schemas": schemas.get("$defs", {})},
    }


@functools.cache
def openapi_json() -> bytes:
    """The document as JSON bytes (made once)."""
    return json.dumps(openapi_doc()).encode()
