"""A front door for vLLM's prefill/decode disaggregation with its NIXL pull connector (benchmarks only).

vLLM's disaggregated serving needs a proxy in front of its instances; this is a minimal
one for ``/v1/completions`` and ``/v1/chat/completions``, following the protocol of
vLLM's ``NixlConnector`` (pull, ``kv_buffer_device: cpu`` on CPU):

1. the request goes to the prefill instance with ``max_tokens`` 1, not streamed, and
   ``kv_transfer_params`` asking it to keep the prompt's KV for a remote decode
   (``do_remote_decode``);
2. its answer carries the ``kv_transfer_params`` that name those blocks;
3. the original request goes to the decode instance with them (it READs the blocks over
   NIXL, then decodes), and the decode instance's answer, streamed or not, is relayed.

Health: ``/health`` answers 200 when both instances do, with ``role: router`` (the
agentic benchmark reads a router as disaggregated); ``/v1/models`` is the decode's.

    python benchmarks/vllm_pd_proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.responses import Response
from starlette.responses import StreamingResponse
from starlette.routing import Route

KEEP_FOR_REMOTE_DECODE = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}  # fmt: skip
"""The ``kv_transfer_params`` that ask vLLM's prefill instance to hold the prompt's KV."""


class PDProxy:
    """The proxy's handlers over one prefill and one decode instance."""

    def __init__(self, prefill: str, decode: str) -> None:
        self.prefill, self.decode = prefill, decode
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(1800.0, connect=10.0),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=256),
        )

    async def prefill_params(self, path: str, body: dict[str, Any]) -> dict[str, Any] | Response:
        """Steps 1-2: the prompt computed on the prefill instance; its transfer parameters."""
        p_body = {
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": KEEP_FOR_REMOTE_DECODE,
        }
        p_body.pop("stream_options", None)
        if "max_completion_tokens" in p_body:
            p_body["max_completion_tokens"] = 1
        resp = await self.client.post(self.prefill + path, json=p_body)
        if resp.status_code != 200:
            return Response(resp.content, resp.status_code, media_type="application/json")
        params = resp.json().get("kv_transfer_params")
        if not isinstance(params, dict):
            return JSONResponse(
                {"error": {"message": "prefill returned no kv_transfer_params"}}, 502
            )
        return params

    async def forward(self, request: Request) -> Response:
        """Step 3: the request with the prefill's parameters to the decode instance, relayed."""
        path = request.url.path
        body = await request.json()
        params = await self.prefill_params(path, body)
        if isinstance(params, Response):
            return params
        d_body = {**body, "kv_transfer_params": params}
        if not body.get("stream"):
            resp = await self.client.post(self.decode + path, json=d_body)
            return Response(resp.content, resp.status_code, media_type="application/json")
        req = self.client.build_request("POST", self.decode + path, json=d_body)
        upstream = await self.client.send(req, stream=True)
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            return Response(content, upstream.status_code, media_type="application/json")
        return StreamingResponse(self._relay(upstream), media_type="text/event-stream")

    @staticmethod
    async def _relay(upstream: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()

    async def health(self, request: Request) -> Response:
        codes = []
        for url in (self.prefill, self.decode):
            try:
                codes.append((await self.client.get(url + "/health", timeout=5)).status_code)
            except httpx.HTTPError:
                codes.append(0)
        ok = all(c == 200 for c in codes)
        return JSONResponse(
            {"status": "ok" if ok else "unhealthy", "role": "router"}, 200 if ok else 503
        )

    async def models(self, request: Request) -> Response:
        resp = await self.client.get(self.decode + "/v1/models")
        return Response(resp.content, resp.status_code, media_type="application/json")


def build_app(prefill: str, decode: str) -> Starlette:
    proxy = PDProxy(prefill, decode)
    return Starlette(routes=[
        Route("/v1/completions", proxy.forward, methods=["POST"]),
        Route("/v1/chat/completions", proxy.forward, methods=["POST"]),
        Route("/health", proxy.health), Route("/v1/models", proxy.models),
    ])  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prefill", required=True, help="vLLM prefill instance URL")
    ap.add_argument("--decode", required=True, help="vLLM decode instance URL")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    app = build_app(args.prefill.rstrip("/"), args.decode.rstrip("/"))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
