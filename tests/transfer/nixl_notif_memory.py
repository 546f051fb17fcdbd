"""Run as a script: how much of the process's memory each small NIXL notification keeps.

Two NIXL transports in this process; one sends ``--num`` notifications of 64 bytes
to the other, which takes them as they come. Prints one JSON line:
``{"bytes_per_notification": ..., "received": ..., "hook_mode": ...}``. A fresh
interpreter, so that the UCX memory-hook mode is chosen as kvduplex chooses it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.engine.kv_cache import allocate_kv_pool
from kvduplex.transport.metrics import TransferMetrics
from kvduplex.transport.nixl import NixlTransport

LAYOUT = KVCacheLayout(num_layers=2, num_blocks=16, block_size=4, num_kv_heads=1, head_dim=8)
WARMUP = 2000


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num", type=int, default=10_000)
    args = ap.parse_args()
    sender = NixlTransport(allocate_kv_pool(LAYOUT), LAYOUT, metrics=TransferMetrics(None))
    receiver = NixlTransport(allocate_kv_pool(LAYOUT), LAYOUT, metrics=TransferMetrics(None))
    peer = sender.connect(receiver.local_metadata())
    receiver.connect(sender.local_metadata())  # it hears only peers it connected to
    received = 0

    def send(num: int, expected: int) -> None:
        nonlocal received
        for i in range(num):
            sender.send_notif(peer, b"n" * 64, f"x{i}")
            if i % 100 == 99:
                received += len(receiver.poll_notifs(0.0))
        deadline = time.monotonic() + 30
        while received < expected and time.monotonic() < deadline:
            received += len(receiver.poll_notifs(0.05))

    send(WARMUP, WARMUP)
    gc.collect()
    before = rss_bytes()
    send(args.num, WARMUP + args.num)
    gc.collect()
    out = {
        "bytes_per_notification": (rss_bytes() - before) / args.num,
        "received": received - WARMUP,
        "hook_mode": os.environ.get("UCX_MEM_MMAP_HOOK_MODE"),
    }
    sender.close()
    receiver.close()
    print(json.dumps(out), flush=True)
    # Two NIXL agents in one interpreter crash its teardown (SIGSEGV after both closed,
    # whatever the hook mode): leave without it; the answer is out.
    os._exit(0)


if __name__ == "__main__":
    main()
