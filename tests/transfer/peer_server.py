"""A KV transfer peer for the two-process tests and the benchmark.

Allocates its own pool with the given layout, runs a NixlTransport and serves
the handshake endpoint plus a few test endpoints under uvicorn on 127.0.0.1.
Writes one line ``{"port": ..., "engine_id": ...}`` to ``--ready-fd`` (a pipe
from the parent; default stdout, where NIXL also logs, prefixed READY_PREFIX)
once the socket listens; stops on SIGTERM.

Test endpoints (bodies are JSON):

* ``POST /test/fill {"blocks": [...], "seed": n}``: fill every layer's K and V
  of ``blocks`` with seeded random values.
* ``POST /test/dump {"blocks": [...], "layers": [...]|null}``: the raw bytes of
  those regions, in transfer order (layer, K|V, block).
* ``POST /test/connect`` (a HandshakeInfo): connect to that engine.
* ``POST /test/notify {"engine_id", "xid", "payload", "claim"?}``: send a
  notification; with ``claim``, its envelope names that engine id as the sender
  (a forged sender).
* ``GET /test/notifs?timeout=s&min=n``: notifications received so far.
* ``POST /test/transfer {"engine_id", "op": "write"|"read", "local": [...], "remote": [...]}``:
  move those blocks (all layers, K and V) to or from a peer connected with
  ``/test/connect``; answers ``{"state": ...}`` once the transfer ended.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import socket
import sys
import time
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI
from fastapi import Request
from fastapi import Response

from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.engine.kv_cache import allocate_kv_pool
from kvduplex.transport.handshake import make_handshake_router
from kvduplex.transport.messages import Envelope
from kvduplex.transport.messages import EnvelopeKind
from kvduplex.transport.messages import decode_handshake
from kvduplex.transport.messages import encode_envelope
from kvduplex.transport.metrics import TransferMetrics
from kvduplex.transport.nixl import NixlTransport
from kvduplex.transport.protocol import Notification
from kvduplex.transport.protocol import PeerHandle
from kvduplex.transport.protocol import TransferOp
from kvduplex.transport.regions import block_region_indices

READY_PREFIX = "KVDUPLEX_PEER_READY"


def regions_bytes(
    pool: torch.Tensor, layout: KVCacheLayout, blocks: list[int], layers: list[int] | None
) -> bytes:
    """Raw bytes of the regions ``layers × (K, V) × blocks``, in transfer order."""
    idx = torch.from_numpy(block_region_indices(layout, blocks, layers).astype("int64"))
    flat = pool.view(layout.num_layers * 2 * layout.num_blocks, -1)
    return flat.index_select(0, idx).contiguous().view(torch.uint8).numpy().tobytes()


def fill_blocks(pool: torch.Tensor, blocks: list[int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    idx = torch.tensor(blocks, dtype=torch.long)
    shape = (pool.shape[0], 2, len(blocks), *pool.shape[3:])
    pool.index_copy_(2, idx, torch.randn(shape, generator=gen, dtype=torch.float32).to(pool.dtype))


def build_app(transport: NixlTransport, pool: torch.Tensor) -> FastAPI:
    app = FastAPI()
    app.include_router(make_handshake_router(transport))
    layout = transport.layout
    peers: dict[str, PeerHandle] = {}
    received: list[Notification] = []

    @app.post("/test/fill")
    async def fill(req: Request) -> dict[str, Any]:
        body = await req.json()
        fill_blocks(pool, body["blocks"], body["seed"])
        return {}

    @app.post("/test/dump")
    async def dump(req: Request) -> Response:
        body = await req.json()
        data = regions_bytes(pool, layout, body["blocks"], body.get("layers"))
        return Response(content=data, media_type="application/octet-stream")

    @app.post("/test/connect")
    async def connect(req: Request) -> dict[str, Any]:
        info = decode_handshake(await req.body())
        # This peer serves no model: it claims whatever the instance it connects to
        # serves (as anyone holding that instance's handshake could), so that only the
        # checks after the handshake's stand between it and the instance.
        transport._fingerprint = info.fingerprint
        peers[info.engine_id] = transport.connect(info)
        return {"engine_id": info.engine_id}

    @app.post("/test/notify")
    async def notify(req: Request) -> dict[str, Any]:
        body = await req.json()
        payload = base64.b64decode(body["payload"])
        peer = peers[body["engine_id"]]
        claim = body.get("claim")
        if claim is None:
            transport.send_notif(peer, payload, xid=body["xid"])
        else:  # what a forger would put on the wire: our agent, another engine's id
            env = Envelope(EnvelopeKind.USER, claim, body["xid"], payload)
            transport._agent.send_notif(peer.agent_name, encode_envelope(env))
        return {}

    @app.post("/test/transfer")
    def transfer(body: dict[str, Any]) -> dict[str, Any]:
        op = TransferOp(body["op"])
        peer = peers[body["engine_id"]]
        handle = transport.transfer(op, peer, f"peer-{op.name}", body["local"], body["remote"])
        return {"state": handle.wait(10).name}

    @app.get("/test/notifs")
    def notifs(timeout: float = 0.0, min: int = 0) -> list[dict[str, Any]]:
        end = time.monotonic() + timeout
        while True:
            received.extend(transport.poll_notifs(timeout=max(0.0, end - time.monotonic())))
            if len(received) >= min or time.monotonic() >= end:
                break
        out = [
            {
                "peer_engine_id": n.peer_engine_id,
                "xid": n.xid,
                "payload": base64.b64encode(n.payload).decode(),
            }
            for n in received
        ]
        received.clear()
        return out

    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--num-blocks", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--ready-fd", type=int, default=-1, help="write the ready line here")
    ap.add_argument(
        "--seed", type=int, default=0, help="fill the whole pool with this seed (-1: zeros)"
    )
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="peer %(levelname)s %(name)s: %(message)s"
    )

    layout = KVCacheLayout(
        num_layers=args.num_layers, num_blocks=args.num_blocks, block_size=args.block_size,
        num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, dtype=args.dtype,
    )  # fmt: skip
    pool = allocate_kv_pool(layout)
    if args.seed >= 0:
        fill_blocks(pool, list(range(layout.num_blocks)), args.seed)
    transport = NixlTransport(pool, layout, metrics=TransferMetrics(None))
    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", args.port))
        sock.listen(128)
        app = build_app(transport, pool)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        ready = json.dumps({"port": sock.getsockname()[1], "engine_id": transport.engine_id})
        if args.ready_fd >= 0:
            with os.fdopen(args.ready_fd, "w") as f:
                f.write(ready + "\n")
        else:
            print(READY_PREFIX, ready, flush=True)
        server.run(sockets=[sock])
    finally:
        transport.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
