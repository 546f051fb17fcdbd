"""The router's client (`wire.WirePool`) on a connection that the instance closed, or spoke
on unasked, after it was made and before the call was written on it: the call fails at
once with `rc.ClosedBeforeWrite` (a `rc.ConnectError`: the instance never saw the
request, and the flows route a request to D again), whichever call it is, over plain
TCP and TLS, on asyncio's loop and on uvloop's: never a `RuntimeError` (uvloop's write on
a closed transport), nor a call left waiting for an answer that cannot come (asyncio's
write drops the request).

The loop's delay between connecting and writing is made certain: the call's connect
returns only once the loop has seen its connection lost. Each server listens on
127.0.0.1 on a port the kernel picks, and is stopped by its test."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from collections.abc import Awaitable
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import uvloop

from kvduplex.router import client as rc
from kvduplex.router import wire_protocol
from kvduplex.router.wire import Key
from kvduplex.router.wire import WirePool

BOUND_S = 10.0
"""A bound for a failing run only: a call that hangs would be waited for here."""


@pytest.fixture(params=["asyncio", "uvloop"])
def loop_factory(request: pytest.FixtureRequest) -> Callable[[], asyncio.AbstractEventLoop] | None:
    return uvloop.new_event_loop if request.param == "uvloop" else None


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, and its key."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a test certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


CALLS: dict[str, Callable[[WirePool, str], Awaitable[Any]]] = {
    "post_stream": lambda pool, url: pool.post_stream(url + "/v1/completions", b"{}"),
    "post_whole": lambda pool, url: pool.post_whole(url + "/internal/push/prefill", b"{}"),
    "get": lambda pool, url: pool.get(url + "/ready", BOUND_S),
}


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("instance", ["closes", "speaks_first"])
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_a_call_on_a_connection_closed_before_it_was_written_fails_at_once(
    call: str,
    instance: str,
    tls: bool,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`closes`: the instance accepts the connection and closes it at once; `speaks_first`:
    it sends bytes no call asked for (the router closes that connection) and keeps it
    open. Either way the call fails at once with `rc.ClosedBeforeWrite`, and the
    instance gets not one byte of it."""
    server_tls = client_tls = None
    if tls:
        cert, key = request.getfixturevalue("certificate")
        server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_tls.load_cert_chain(cert, key)
        client_tls = ssl.create_default_context(cafile=str(cert))
    received: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if instance == "speaks_first":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
            received.append(await reader.read())  # until the router closes
        writer.close()

    async def run() -> None:
        lost = asyncio.Event()
        connection_lost = wire_protocol.Connection.connection_lost

        def noting_lost(self: wire_protocol.Connection, exc: Exception | None) -> None:
            connection_lost(self, exc)
            lost.set()

        # On the class: uvloop binds a protocol's callbacks when the connection is made.
        monkeypatch.setattr(wire_protocol.Connection, "connection_lost", noting_lost)
        connect = WirePool._connect

        async def connect_then_wait(self: WirePool, key: Key) -> wire_protocol.Connection:
            conn = await connect(self, key)
            await lost.wait()  # the instance's close (or the router's) is seen first
            return conn

        monkeypatch.setattr(WirePool, "_connect", connect_then_wait)
        server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_tls)
        port = server.sockets[0].getsockname()[1]
        url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
        pool = WirePool({}, BOUND_S, BOUND_S)
        pool._tls = client_tls
        async with server:
            try:
                with pytest.raises(rc.ClosedBeforeWrite) as caught:
                    await asyncio.wait_for(CALLS[call](pool, url), BOUND_S)
            finally:
                pool.close()
        assert isinstance(caught.value, rc.ConnectError), "the instance never saw it"
        assert not pool._idle, "a connection that failed is never pooled"

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(run())
    assert received in ([], [b""]), "not one byte of the call was sent"
