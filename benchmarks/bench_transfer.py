"""KV transfer benchmark (not a test): NIXL WRITE/READ between two processes.

For the `small` preset's KV layout (30 layers, 3 KV heads, head_dim 64,
float32; one region = block_size * 3 * 64 * 4 bytes), in one run:

1. Baselines over the same bytes: one-thread memcpy between two pools in one
   process, and a plain TCP socket on 127.0.0.1 between two processes. Per
   block size, also a one-thread in-process copy of the same random regions
   (gathered from random places into one contiguous buffer: one copy, one
   side scattered, a bound on what random region access costs in memory).
2. 256 MiB moved by WRITE and by READ, blocks of 16, 64 and 128 tokens, as
   per-layer transfers (30 posted back to back, as layer-wise push does) and
   as one transfer: GB/s, post time per transfer, descriptors per transfer.
   Block ids are random permutations (no two regions of a transfer adjacent),
   one contiguous run, or the ids a `BlockPool` hands out after churn
   (requests of 128-1024 tokens allocated and released tail first, in random
   order; then the transfer's blocks allocated 512 tokens at a time).
3. Post time against descriptors per transfer (blocks of 16 tokens).
4. Latency of one small WRITE (1 layer x 4 blocks x K,V = 8 descriptors) with
   its notification: post -> DONE at the initiator, post -> notification seen by
   the target's thread, median/p90, with the target busy and idle.

    .venv/bin/python benchmarks/bench_transfer.py           # full run
    .venv/bin/python benchmarks/bench_transfer.py --quick   # 32 MiB, a smoke run

Writes results/bench_transfer.json and .md and prints the table. UCX settings
pass through the environment (UCX_TLS, UCX_NET_DEVICES; see docs/transfer.md).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import socket
import statistics
import struct
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import md_table
from benchmarks.common import write_results
from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.common.presets import preset_config
from kvduplex.engine.block_pool import BlockPool
from kvduplex.engine.kv_cache import allocate_kv_pool
from kvduplex.transport.messages import decode_handshake
from kvduplex.transport.messages import encode_handshake
from kvduplex.transport.metrics import TransferMetrics
from kvduplex.transport.nixl import NixlTransport
from kvduplex.transport.protocol import PeerHandle
from kvduplex.transport.protocol import TransferHandle
from kvduplex.transport.protocol import TransferOp
from kvduplex.transport.protocol import TransferState

MiB = 1 << 20


def small_layout(block_size: int, total_bytes: int) -> KVCacheLayout:
    cfg = preset_config("small")
    probe = KVCacheLayout(cfg.num_layers, 1, block_size, cfg.num_kv_heads, cfg.head_dim, "float32")
    num_blocks = math.ceil(total_bytes / (probe.num_layers * 2 * probe.block_bytes))
    return KVCacheLayout(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)


def fill(pool: torch.Tensor, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    flat = pool.view(torch.int32).view(-1)
    flat.copy_(torch.randint(-(2**31), 2**31 - 1, flat.shape, generator=gen, dtype=torch.int32))


# -- the target process -------------------------------------------------------


def peer_main(conn: Connection, seed: int) -> None:
    """Serve commands from the benchmark over ``conn`` until "stop"."""
    torch.set_num_threads(1)
    state: dict[str, Any] = {}
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            if "t" in state:
                state["t"].close()
            conn.send(None)
            return
        if cmd == "setup":  # arg: layout dict -> our handshake
            if "t" in state:
                state["t"].close()
            layout = KVCacheLayout(**arg)
            state["pool"] = pool = allocate_kv_pool(layout)
            fill(pool, seed + 1)
            state["t"] = NixlTransport(pool, layout, metrics=TransferMetrics(None))
            conn.send(encode_handshake(state["t"].local_metadata()))
        elif cmd == "connect":
            state["back"] = state["t"].connect(decode_handshake(arg))
            conn.send(None)
        elif cmd == "regions":  # arg: region indices -> their bytes
            layout = state["t"].layout
            flat = state["pool"].view(layout.num_layers * 2 * layout.num_blocks, -1)
            conn.send(flat[torch.tensor(arg)].contiguous().numpy().tobytes())
        elif cmd == "echo":  # reply to each notification with our receive time
            state["echo_stop"] = stop = threading.Event()
            th = threading.Thread(target=_echo, args=(state["t"], state["back"], stop), daemon=True)
            th.start()
            conn.send(None)
        elif cmd == "echo_stop":
            state["echo_stop"].set()
            conn.send(None)
        elif cmd == "tcp":  # arg: (nbytes, reps) -> port of a sink that acks each message
            srv = socket.create_server(("127.0.0.1", 0))
            threading.Thread(target=_tcp_sink, args=(srv, *arg), daemon=True).start()
            conn.send(srv.getsockname()[1])


def _echo(t: NixlTransport, back: PeerHandle, stop: threading.Event) -> None:
    while not stop.is_set():
        for n in t.poll_notifs(timeout=0.2):
            t.send_notif(back, struct.pack("d", time.monotonic()), xid=n.xid)


def _tcp_sink(srv: socket.socket, nbytes: int, reps: int) -> None:
    sock, _ = srv.accept()
    buf = memoryview(bytearray(1 << 22))
    for _ in range(reps):
        left = nbytes
        while left:
            left -= sock.recv_into(buf, min(left, len(buf)))
        sock.sendall(b"k")
    sock.close()
    srv.close()


# -- the initiator ---------------------------------------------------------------


class Bench:
    def __init__(self, conn: Connection, reps: int, seed: int) -> None:
        self.conn = conn
        self.reps = reps
        self.rng = np.random.default_rng(seed)
        self.seed = seed
        self.t: NixlTransport | None = None
        self.peer: PeerHandle | None = None

    def call(self, cmd: str, arg: Any = None) -> Any:
        self.conn.send((cmd, arg))
        return self.conn.recv()

    def setup(self, layout: KVCacheLayout) -> None:
        if self.t is not None:
            self.t.close()
        info = decode_handshake(self.call("setup", layout.to_dict()))
        self.pool = allocate_kv_pool(layout)
        fill(self.pool, self.seed)
        self.t = NixlTransport(self.pool, layout, metrics=TransferMetrics(None))
        self.peer = self.t.connect(info)
        self.call("connect", encode_handshake(self.t.local_metadata()))

    def run(
        self, op: str, layers_per_xfer: int, num_blocks: int, pattern: str = "random"
    ) -> dict[str, Any]:
        """Move ``num_blocks`` blocks of every layer, chosen by ``pattern`` (random,
        contiguous, pool); medians over reps."""
        assert self.t is not None and self.peer is not None
        layout = self.t.layout
        transfer_op = TransferOp(op)
        gbps, posts, backend, ndesc = [], [], [], 0
        for rep in range(self.reps + 1):  # the first is the warm-up
            if pattern == "pool":
                local = churned_blocks(layout.num_blocks, num_blocks, self.rng)
                remote = churned_blocks(self.peer.layout.num_blocks, num_blocks, self.rng)
            elif pattern == "contiguous":
                local = list(range(num_blocks))
                remote = list(
                    range(self.peer.layout.num_blocks - num_blocks, self.peer.layout.num_blocks)
                )
            else:
                local = self.rng.permutation(layout.num_blocks)[:num_blocks].tolist()
                remote = self.rng.permutation(self.peer.layout.num_blocks)[:num_blocks].tolist()
            t0 = time.perf_counter()
            handles: list[TransferHandle] = []
            for first in range(0, layout.num_layers, layers_per_xfer):
                layers = list(range(first, min(first + layers_per_xfer, layout.num_layers)))
                handles.append(self.t.transfer(
                    transfer_op, self.peer, f"{op}-{rep}-{first}", local, remote, layers=layers
                ))
            states = [h.wait(60) for h in handles]
            elapsed = time.perf_counter() - t0
            if any(s is not TransferState.DONE for s in states):
                raise RuntimeError(f"{op} failed: {[h.reason for h in handles]}")
            if rep:
                gbps.append(sum(h.num_bytes for h in handles) / elapsed / 1e9)
                posts.extend(h.post_time_s for h in handles)
                backend.extend(h.backend_post_s or 0.0 for h in handles)
            ndesc = handles[0].num_descriptors
        self._verify(op, local, remote)
        return {
            "gbps": statistics.median(gbps),
            "post_us": statistics.median(posts) * 1e6,
            "nixl_post_us": statistics.median(backend) * 1e6,
            "descriptors": ndesc,
            "transfers": len(handles),
            "bytes": sum(h.num_bytes for h in handles),
        }

    def _verify(self, op: str, local: list[int], remote: list[int]) -> None:
        """The last run's bytes match at 16 sampled regions."""
        assert self.t is not None and self.peer is not None
        lay, rlay = self.t.layout, self.peer.layout
        picks = self.rng.integers(0, len(local), 16)
        layer = self.rng.integers(0, lay.num_layers, 16)
        li = [
            lay.region_index(int(ly), 1, local[int(i)]) for i, ly in zip(picks, layer, strict=True)
        ]
        ri = [
            rlay.region_index(int(ly), 1, remote[int(i)])
            for i, ly in zip(picks, layer, strict=True)
        ]
        flat = self.pool.view(lay.num_layers * 2 * lay.num_blocks, -1)
        if flat[torch.tensor(li)].contiguous().numpy().tobytes() != self.call("regions", ri):
            raise RuntimeError(f"{op}: bytes differ after the transfer")

    def latency(self, iters: int, gap_s: float) -> dict[str, float]:
        """Post -> DONE and post -> target saw the notification, for a small WRITE."""
        assert self.t is not None and self.peer is not None
        self.call("echo")
        done, seen = [], []
        for i in range(iters + 10):
            if gap_s:
                time.sleep(gap_s)  # let both sides go idle
            blocks = self.rng.permutation(self.t.layout.num_blocks)[:4].tolist()
            t0 = time.monotonic()
            h = self.t.transfer(TransferOp.WRITE, self.peer, f"lat{i}", blocks, blocks, layers=[0], notif=b"n")
            h.wait(10)
            t_done = time.monotonic()
            reply = self.t.poll_notifs(timeout=10)
            assert h.state is TransferState.DONE and reply and reply[0].xid == f"lat{i}"
            if i >= 10:
                done.append(t_done - t0)
                seen.append(struct.unpack("d", reply[0].payload)[0] - t0)
        self.call("echo_stop")
        done_p50, done_p90 = np.percentile(done, [50, 90]) * 1e6
        seen_p50, seen_p90 = np.percentile(seen, [50, 90]) * 1e6
        return {
            "done_p50_us": float(done_p50),
            "done_p90_us": float(done_p90),
            "notif_p50_us": float(seen_p50),
            "notif_p90_us": float(seen_p90),
            "bytes": h.num_bytes,
            "descriptors": h.num_descriptors,
        }


def memcpy_gbps(nbytes: int, reps: int) -> float:
    torch.set_num_threads(1)
    layout = small_layout(16, nbytes)
    src, dst = allocate_kv_pool(layout), allocate_kv_pool(layout)
    fill(src, 0)
    a, b = src.view(-1)[: nbytes // 4], dst.view(-1)[: nbytes // 4]
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[1:]) / 1e9


def churned_blocks(pool_blocks: int, num_blocks: int, rng: np.random.Generator) -> list[int]:
    """Block ids a `BlockPool` of ``pool_blocks`` hands out for ``num_blocks`` blocks
    after churn: 40 requests come and go (released tail first, as the engine does),
    then the blocks are allocated a request at a time. Sizes are those of 16-token
    blocks (8-64 blocks, 32 at a time, in a 365-block pool), scaled to the pool."""
    pool = BlockPool(pool_blocks)
    live: list[list[int]] = []
    for _ in range(40):
        n = int(rng.integers(8, 65)) * pool_blocks // 365  # request sizes scale with the pool
        while (got := pool.try_allocate(n)) is None:
            pool.release(reversed(live.pop(int(rng.integers(len(live))))))
        live.append(got)
    for i in rng.permutation(len(live)):
        pool.release(reversed(live[i]))
    out: list[int] = []
    while len(out) < num_blocks:
        got = pool.try_allocate(min(max(1, 32 * pool_blocks // 365), num_blocks - len(out)))
        assert got is not None
        out.extend(got)
    return out


def scattered_copy_gbps(layout: KVCacheLayout, reps: int, seed: int) -> float:
    """One-thread gather of every region of `layout`'s pool, in random order, into a
    contiguous buffer (torch.index_select): the in-process cost of random region access."""
    torch.set_num_threads(1)
    src = allocate_kv_pool(layout)
    fill(src, 0)
    regions = src.view(layout.num_layers * 2 * layout.num_blocks, -1)
    order = torch.randperm(regions.shape[0], generator=torch.Generator().manual_seed(seed))
    out = torch.empty_like(regions)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        torch.index_select(regions, 0, order, out=out)
        times.append(time.perf_counter() - t0)
    return regions.numel() * regions.element_size() / statistics.median(times[1:]) / 1e9


def tcp_gbps(bench: Bench, nbytes: int, reps: int) -> float:
    port = bench.call("tcp", (nbytes, reps + 1))
    data = memoryview(bytearray(nbytes))
    times = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            sock.sendall(data)
            sock.recv(1)
            times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[1:]) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--total-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5, help="measured repetitions (after one warm-up)")
    ap.add_argument("--latency-iters", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="32 MiB, 2 reps, 50 latency iterations")
    args = ap.parse_args()
    if args.quick:
        args.total_mib, args.reps, args.latency_iters = 32, 2, 50
    total = args.total_mib * MiB
    torch.set_num_threads(1)

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=peer_main, args=(child_conn, args.seed), daemon=True)
    proc.start()
    bench = Bench(conn, args.reps, args.seed)
    rows: list[dict[str, Any]] = []
    try:
        base = {"memcpy": memcpy_gbps(total, args.reps), "tcp": tcp_gbps(bench, total, args.reps)}
        base["scattered"] = {}
        for block_size in (16, 64, 128):
            layout = small_layout(block_size, total)
            base["scattered"][block_size] = scattered_copy_gbps(layout, args.reps, args.seed)
            bench.setup(layout)
            nb = layout.num_blocks
            for op in ("write", "read"):
                for shape, per, pattern in (
                    ("per layer, random", 1, "random"),
                    ("one, random", layout.num_layers, "random"),
                    ("one, contiguous", layout.num_layers, "contiguous"),
                    ("per layer, as the pool allocates", 1, "pool"),
                    ("one, as the pool allocates", layout.num_layers, "pool"),
                ):
                    r = bench.run(op, per, nb, pattern)
                    rows.append({"op": op, "block_size": block_size, "shape": shape, **r})
        layout = small_layout(16, total)
        bench.setup(layout)
        sweep = []
        for nblocks in sorted({min(n, layout.num_blocks) for n in (1, 8, 16, 128, 512)}):
            r = bench.run("write", layout.num_layers, nblocks)
            sweep.append({"blocks": nblocks, **r})
        lat_busy = bench.latency(args.latency_iters, 0.0)
        lat_idle = bench.latency(max(20, args.latency_iters // 6), 0.1)
    finally:
        if bench.t is not None:
            bench.t.close()
        bench.call("stop")
        proc.join(10)

    table = render(base, rows, sweep, lat_busy, lat_idle, total)
    path = write_results(
        "bench_transfer",
        {"baselines_gbps": base, "transfers": rows, "post_sweep": sweep,
         "latency_busy": lat_busy, "latency_idle": lat_idle, "total_bytes": total},
    table)  # fmt: skip
    print(table)
    print(f"\nwrote {path}")
    return 0


def render(
    base: dict[str, float],
    rows: list[dict[str, Any]],
    sweep: list[dict[str, Any]],
    busy: dict[str, float],
    idle: dict[str, float],
    total: int,
) -> str:
    out = [f"Baselines, {total // MiB} MiB: memcpy in one process (1 thread) "
           f"{base['memcpy']:.2f} GB/s; TCP socket on 127.0.0.1 {base['tcp']:.2f} GB/s; "
           "in-process copy of the same regions gathered in random order (1 thread): "
           + ", ".join(f"{bs}-token blocks {g:.2f} GB/s" for bs, g in base["scattered"].items()) + ".",
           ""]  # fmt: skip
    out.append(md_table(
        ["op", "block tokens", "region KiB", "transfers (blocks)", "descriptors/transfer", "GB/s",
         "vs memcpy", "vs scattered copy", "vs TCP", "caller post us", "NIXL post us"],
        [[r["op"], r["block_size"], r["block_size"] * 3 * 64 * 4 // 1024, f"{r['transfers']} ({r['shape']})",
          r["descriptors"], f"{r['gbps']:.2f}", f"{r['gbps'] / base['memcpy']:.2f}",
          f"{r['gbps'] / base['scattered'][r['block_size']]:.2f}" if "random" in r["shape"] else "",
          f"{r['gbps'] / base['tcp']:.2f}", f"{r['post_us']:.0f}", f"{r['nixl_post_us']:.0f}"]
         for r in rows],
    ))  # fmt: skip
    out += [
        "",
        "Post time vs descriptors per WRITE (16-token blocks, 12 KiB regions, all layers):",
        "",
    ]
    out.append(md_table(
        ["descriptors", "MiB", "caller post us", "NIXL post us", "GB/s"],
        [[s["descriptors"], f"{s['bytes'] / MiB:.1f}", f"{s['post_us']:.0f}", f"{s['nixl_post_us']:.0f}",
          f"{s['gbps']:.2f}"] for s in sweep],
    ))  # fmt: skip
    out += ["", f"Small WRITE + notification ({busy['descriptors']:.0f} descriptors, "
            f"{busy['bytes'] / 1024:.0f} KiB), microseconds:", ""]  # fmt: skip
    out.append(md_table(
        ["target", "post->DONE p50", "p90", "post->notification seen p50", "p90"],
        [[name, f"{d['done_p50_us']:.0f}", f"{d['done_p90_us']:.0f}", f"{d['notif_p50_us']:.0f}",
          f"{d['notif_p90_us']:.0f}"] for name, d in (("busy", busy), ("idle (100 ms gaps)", idle))],
    ))  # fmt: skip
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
