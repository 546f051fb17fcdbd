"""An instance's liveness and readiness: /health, /ready, and the 503s of a dead engine
(`DeadEngineGuard` before a route runs, EngineDeadError while one awaits it) and of a
draining instance (`kvduplex.common.drain.DrainGuard`).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp
from starlette.types import Receive
from starlette.types import Scope
from starlette.types import Send

from kvduplex.common.drain import DrainGuard
from kvduplex.common.openai.errors import APIError
from kvduplex.engine.async_engine import AsyncEngine
from kvduplex.engine.commands import EngineDeadError
from kvduplex.instance.state import InstanceState


def add_health(app: FastAPI, state: InstanceState) -> None:
    """/health, /ready, 503s for a dead engine (`DeadEngineGuard`, EngineDeadError) and
    for new work while draining (`DrainGuard`)."""
    app.add_middleware(DrainGuard, drain=state.drain)
    app.add_middleware(DeadEngineGuard, engine=state.engine)

    @app.exception_handler(EngineDeadError)
    async def _on_engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return engine_dead_response(str(exc))

    @app.get("/health")
    async def health(raw: Request) -> JSONResponse:
        """200 while the engine loop runs and makes progress; 503 with the reason when it
        ended or is stalled past its limit (``--engine-stall-timeout-s``), or a part the
        instance needs stopped (`InstanceState.health_checks`: its KV notification pump)."""
        problem = state.problem()
        if problem is None:
            return JSONResponse(state.health(state.is_member(raw)))
        body = {"status": "unavailable", "role": state.role, "reason": problem}
        return JSONResponse(body, status_code=503)

    @app.get("/ready")
    async def ready(raw: Request) -> JSONResponse:
        """Readiness: 200 (/health's body, ``status: ready``) while the engine is healthy
        and the instance takes new work; 503 ``draining`` after SIGTERM, or
        ``unavailable`` with the reason when the engine (or a part in
        `InstanceState.health_checks`) is not healthy."""
        problem = state.problem()
        if problem is not None:
            body = {"status": "unavailable", "role": state.role, "reason": problem}
            return JSONResponse(body, status_code=503)
        if state.drain.is_draining:
            reason = "shutting down: finishing the work in flight"
            body = {"status": "draining", "role": state.role, "reason": reason}
            return JSONResponse(body, status_code=503)
        return JSONResponse({**state.health(state.is_member(raw)), "status": "ready"})


def engine_dead_response(reason: str) -> JSONResponse:
    return APIError(503, reason, code="engine_dead").response()


class DeadEngineGuard:
    """ASGI middleware: once the engine loop has ended, every route but /health, /ready
    and /metrics answers 503 at once, before the route runs."""

    OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})

    def __init__(self, app: ASGIApp, engine: AsyncEngine) -> None:
        self.app = app
        self.engine = engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.OPEN_PATHS:
            reason = self.engine.dead_reason()
            if reason is not None:
                await engine_dead_response(reason)(scope, receive, send)
                return
        await self.app(scope, receive, send)
