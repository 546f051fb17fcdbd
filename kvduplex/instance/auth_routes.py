"""The instance's side of the proof of the cluster secret (`kvduplex.common.challenge`).

``POST /internal/auth/challenge`` and ``POST /internal/auth/proof``, the two
internal routes open to callers without the secret (`InternalGuard` lets them
through): a router proves the secret there before it trusts this instance, as
does a peer before it sends this instance its secret (a KV handshake, a lease's
release). Answers: 200 with the step's JSON; 400 for a body that is not one;
401 (``invalid_cluster_secret``) for a wrong, used or expired proof; 409
(``no_cluster_secret``) on an instance without a secret, which has nothing to
prove.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter
from fastapi import Request
from fastapi import Response
from fastapi.responses import JSONResponse

from kvduplex.common.challenge import CHALLENGE_PATH
from kvduplex.common.challenge import NO_SECRET_CODE
from kvduplex.common.challenge import PROOF_PATH
from kvduplex.common.challenge import Refused
from kvduplex.common.challenge import Responder
from kvduplex.common.challenge import seen_address
from kvduplex.common.openai.protocol import error_body

logger = logging.getLogger(__name__)


def make_auth_router(responder: Responder | None) -> APIRouter:
    """The two routes, answered by `responder` (None: this instance has no secret)."""
    router = APIRouter()

    @router.post(CHALLENGE_PATH)
    async def challenge(raw: Request) -> Response:
        if responder is None:
            return _no_secret()
        try:
            answer = responder.challenge(await raw.body(), seen_address(raw.scope.get("server")))
        except ValueError as exc:
            return JSONResponse(error_body(str(exc)), status_code=400)
        return Response(answer, media_type="application/json")

    @router.post(PROOF_PATH)
    async def proof(raw: Request) -> Response:
        if responder is None:
            return _no_secret()
        try:
            answer = responder.prove(await raw.body())
        except ValueError as exc:
            return JSONResponse(error_body(str(exc)), status_code=400)
        except Refused as exc:
            client = raw.client.host if raw.client else "?"
            logger.warning("proof of the cluster secret from %s refused: %s", client, exc)
            body = error_body(f"proof refused: {exc}", code="invalid_cluster_secret")
            return JSONResponse(body, status_code=401)
        return Response(answer, media_type="application/json")

    return router


def _no_secret() -> JSONResponse:
    body = error_body(
        "this instance has no cluster secret to prove (set KVDUPLEX_CLUSTER_SECRET or "
        "--cluster-secret-file on every instance and router)", code=NO_SECRET_CODE,
    )  # fmt: skip
    return JSONResponse(body, status_code=409)


__all__ = ["make_auth_router"]
