"""A link's throughput: one TCP stream from a `NetnsHost`'s outer end to its inner end.

A measurement for benchmarks and manual checks, not for tests::

    with NetnsHost(rate_mbit=10_000) as host:
        print(measure_link_gbit(host))
"""

from __future__ import annotations

import socket
import subprocess
import sys

from kvduplex.bench.netns import NetnsHost

# Throughput sink run inside the namespace by `measure_link_gbit`: prints its
# port once listening, accepts one connection, then prints "<bytes> <seconds>"
# (from the first byte to EOF).
_SINK = """
import socket, sys, time
s = socket.create_server((sys.argv[1], 0))
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
buf = bytearray(1 << 20)
n = c.recv_into(buf)
t0 = time.perf_counter()
while k := c.recv_into(buf):
    n += k
print(n, time.perf_counter() - t0, flush=True)
"""


def measure_link_gbit(host: NetnsHost, num_mib: int = 1000, timeout_s: float = 60.0) -> float:
    """Payload throughput of one TCP stream from the outer to the inner end, in Gbit/s.

    Runs a sink in the namespace and sends `num_mib` MiB to it from this
    process. A measurement for benchmarks and manual checks, not for tests.
    """
    cmd = [*host.inner.exec_prefix(), sys.executable, "-c", _SINK, host.inner.ip]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as sink:
        try:
            assert sink.stdout is not None
            port = int(sink.stdout.readline())
            chunk = b"\0" * (1 << 20)
            with socket.create_connection((host.inner.ip, port), timeout=timeout_s) as conn:
                for _ in range(num_mib):
                    conn.sendall(chunk)
            num_bytes, seconds = sink.stdout.readline().split()
            sink.wait(timeout_s)
        finally:
            if sink.poll() is None:
                sink.kill()
    return int(num_bytes) * 8 / float(seconds) / 1e9
