"""Run as a script: how much of this process's memory each peer it met and forgot keeps.

One long-lived NixlTransport in this process meets ``--peers`` peer processes
(``peer_server.py``) one after another: it connects to each, and each to it, blocks
move both ways (our WRITE and READ, the peer's WRITE into us), then the peer stops
and we disconnect it (or the other way round, ``--disconnect-first``). After each
peer: this process's RSS (and its parts) and its mappings of shared memory.
Prints one JSON line per peer, then a summary line ``{"summary": ...}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
from pathlib import Path

import httpx

from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.engine.kv_cache import allocate_kv_pool
from kvduplex.transport.handshake import fetch_handshake
from kvduplex.transport.messages import encode_handshake
from kvduplex.transport.metrics import TransferMetrics
from kvduplex.transport.nixl import NixlTransport
from kvduplex.transport.protocol import TransferOp
from kvduplex.transport.protocol import TransferState
from tests.transfer.peer_procs import PeerLauncher

NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 4, 16, 2, 32  # the tiny preset's KV shape


def _is_shm(maps_line: str) -> bool:
    """Shared memory: POSIX (UCX names its segments ucx_shm_posix_*) or SysV."""
    return "/dev/shm/" in maps_line or "SYSV" in maps_line


def memory() -> dict[str, int]:
    """VmRSS and its parts (KiB), and counts of this process's shared-memory mappings."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmSize"):
                out[key] = int(line.split()[1])
    num_maps = num_shm = shm_kib = 0
    with open("/proc/self/maps") as f:
        for line in f:
            num_maps += 1
            if _is_shm(line):
                num_shm += 1
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                shm_kib += (hi - lo) // 1024
    out.update(maps=num_maps, shm_maps=num_shm, shm_map_kib=shm_kib)
    out["fds"] = len(os.listdir("/proc/self/fd"))
    return out


def shm_rss_by_name() -> dict[str, int]:
    """Rss (KiB) of each shared-memory mapping, by its name in /proc/self/smaps."""
    out: dict[str, int] = {}
    name = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                path = " ".join(head[5:]) if len(head) > 5 else ""
                name = path if _is_shm(path) else None
            elif name is not None and head[0] == "Rss:":
                out[name] = out.get(name, 0) + int(head[1])
    return out


def meet(
    t: NixlTransport, launcher: PeerLauncher, i: int, num_blocks: int, disconnect_first: bool
) -> None:
    peer = launcher.spawn(
        seed=i, num_blocks=num_blocks, num_layers=NUM_LAYERS, block_size=BLOCK_SIZE,
        num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
    )  # fmt: skip
    handle = t.connect(fetch_handshake(peer.url))
    httpx.post(f"{peer.url}/test/connect", content=encode_handshake(t.local_metadata()),
               timeout=10).raise_for_status()  # fmt: skip
    blocks = list(range(4))
    for op in TransferOp:
        state = t.transfer(op, handle, f"{op.value}-{i}", blocks, blocks).wait(10)
        assert state is TransferState.DONE, (op, state)
    body = {"engine_id": t.engine_id, "op": "write", "local": blocks, "remote": blocks}
    resp = httpx.post(f"{peer.url}/test/transfer", json=body, timeout=20)
    resp.raise_for_status()
    assert resp.json()["state"] == "DONE", resp.json()
    if disconnect_first:
        t.disconnect(handle)
        peer.stop()
    else:
        peer.stop()
        t.disconnect(handle)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peers", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--num-blocks", type=int, default=16, help="blocks of every pool")
    ap.add_argument("--disconnect-first", action="store_true")
    ap.add_argument("--smaps", action="store_true", help="print shm Rss by mapping at the end")
    args = ap.parse_args()
    layout = KVCacheLayout(
        num_layers=NUM_LAYERS, num_blocks=args.num_blocks, block_size=BLOCK_SIZE,
        num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
    )  # fmt: skip
    t = NixlTransport(allocate_kv_pool(layout), layout, metrics=TransferMetrics(None))
    launcher = PeerLauncher(Path(tempfile.mkdtemp(prefix="peer-memory-")))
    rows = [{"peer": -1, **memory()}]  # before any peer
    try:
        for i in range(args.warmup + args.peers):
            meet(t, launcher, i, args.num_blocks, args.disconnect_first)
            gc.collect()
            row = {"peer": i, **memory(), "num_peers": t.num_peers()}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        launcher.stop_all()
    if args.smaps:
        print(json.dumps({"smaps": shm_rss_by_name()}), flush=True)
    first, last = rows[args.warmup], rows[-1]
    keys = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "maps", "shm_maps", "shm_map_kib", "fds")
    summary: dict[str, object] = {k: (last[k] - first[k]) / args.peers for k in keys}
    summary["ucx_env"] = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    print(json.dumps({"summary": summary}), flush=True)
    t.close()
    os._exit(0)


if __name__ == "__main__":
    main()
