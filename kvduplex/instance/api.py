"""The OpenAI-compatible HTTP API of one instance: the app (`create_app`).

Routes: /v1/completions, /v1/chat/completions (streaming SSE or not),
/v1/models, /health (liveness), /ready (readiness: not while draining, see
`kvduplex.common.drain`), /metrics. Extra routes (internal KV endpoints of a
disaggregated instance) are added by the caller through `extra_routers`.

The app is built here from its parts: `state.py` (`InstanceState`, what the routes
share, and `Generation`, what a request hands the engine), `openai_routes.py` (the
/v1 routes and the checks that turn a body into a `Generation`), `answers.py` (a
generation served: admitted, gathered whole or streamed, rendered), `health.py`
(/health, /ready and the dead-engine and drain guards) and `errors.py` (the OpenAI
error JSON). /metrics and /internal/kv/stats are added here.

Request ids: every request gets an engine request id of this instance's own
making (``cmpl-``/``chatcmpl-`` and a random hex), which is the answer's `id`
and its ``X-Request-ID`` response header, unless the client sent an
``X-Request-ID``: that one is echoed back in the header, and never becomes an
engine id (an id names what an abort or a held request's release acts on).

A dead engine (its loop crashed or stopped) answers 503 in OpenAI error JSON
(``code: engine_dead``) on every route but /health and /ready (503 with the reason) and
/metrics: at once for new requests (`health.DeadEngineGuard`), and for a request in
flight as soon as the engine call it awaits fails with EngineDeadError.

Chat answers are recorded in the instance's `AnswerBook` (their generated ids and
the message as returned), so a later request that sends one back unchanged gets
those ids in its prompt (`kvduplex.common.openai.transcript`). A router passes the ids it
built in ``kv_transfer_params.prompt_token_ids`` (used as they are) and asks with
``report_answer`` for the answer's ids at the end of the answer
(`transcript.ANSWER_IDS_FIELD`).

Trust: on an instance with a cluster secret, a request that carries
``kv_transfer_params`` (any role) needs the secret in its header, else 401
(``code: invalid_cluster_secret``): the params name the prompt's ids as they are
and, on decode, peers and where KV goes. /health and /ready name the KV engine id
only to callers that send the secret; what the instance serves (its model
fingerprint) they show to all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from fastapi import APIRouter
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client import generate_latest

from kvduplex.engine.report import pool_report
from kvduplex.instance.errors import install_error_handlers
from kvduplex.instance.health import add_health
from kvduplex.instance.openai_routes import add_openai_routes
from kvduplex.instance.state import InstanceState


def create_app(state: InstanceState, extra_routers: Sequence[APIRouter] = ()) -> FastAPI:
    """Build the FastAPI app of one instance."""
    app = FastAPI(title="kvduplex", version="0.1.0")
    app.state.instance = state
    install_error_handlers(app)
    add_health(app, state)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/internal/kv/stats")
    async def kv_stats() -> JSONResponse:
        """Block-pool accounting, checked in the engine thread (tests, operators)."""
        return JSONResponse(asdict(await state.engine.run_in_engine(pool_report)))

    add_openai_routes(app, state)
    for router in extra_routers:
        app.include_router(router)
    return app
