"""Request ids of one instance served over a real socket (uvicorn in a thread): a client's
X-Request-ID is echoed, never the engine's id, so clients that send the same one (or
abort theirs) cannot touch each other's requests."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from kvduplex.engine.commands import AbortRequest
from kvduplex.engine.commands import AddRequest
from kvduplex.engine.commands import EngineCommand
from kvduplex.engine.engine import LLMEngine
from kvduplex.instance.server import Instance
from tests.support.engine_inbox import watch_inbox

TIMEOUT_S = 60.0
BODY = {"model": "tiny", "prompt": "hello there", "temperature": 0.0, "return_token_ids": True}


@pytest.fixture(scope="module")
def base_url(instance: Instance) -> Iterator[str]:
    """The instance served on a socket that listens before the server starts: connections
    wait in its backlog until the server takes them, so nobody waits for it to start."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(instance.app, host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, args=([listener],), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(TIMEOUT_S)
        listener.close()


def _finished(instance: Instance, reason: str) -> float:
    """Requests the engine finished for `reason` (an abort is not counted)."""
    value = instance.state.registry.get_sample_value(
        "kvduplex_requests_finished_total", {"reason": reason}
    )
    return value or 0.0


def test_same_client_request_id_twice_one_aborted_the_other_untouched(
    instance: Instance, base_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two requests carry one X-Request-ID; the first one's client leaves mid-answer. The
    second is served whole, with the tokens it gets alone; both responses echo the id."""
    want = httpx.post(
        f"{base_url}/v1/completions", json={**BODY, "max_tokens": 8}, timeout=TIMEOUT_S
    )
    assert want.status_code == 200, want.text
    engine = instance.async_engine
    num_finished = _finished(instance, "length")
    added: list[str] = []
    aborted: list[str] = []
    changed = threading.Condition()

    def seen(command: EngineCommand) -> None:  # on the server's thread
        with changed:
            if isinstance(command, AddRequest):
                added.append(command.request.request_id)
            elif isinstance(command, AbortRequest):
                aborted.append(command.request_id)
            changed.notify_all()

    watch_inbox(monkeypatch, engine, seen)
    release = threading.Event()
    engine.call(lambda e: release.wait(TIMEOUT_S))  # hold the engine: both are in flight at once
    leaver = socket.create_connection(("127.0.0.1", int(base_url.rsplit(":", 1)[1])), TIMEOUT_S)
    try:
        body = json.dumps({**BODY, "max_tokens": 200, "stream": True}).encode()
        leaver.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
            b"x-request-id: same\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        head = b""
        while b"\r\n\r\n" not in head:  # a stream's head comes before its first token
            head += leaver.recv(4096)
        assert b"200 OK" in head and b"x-request-id: same" in head.lower(), head
        result: list[httpx.Response] = []

        def stay() -> None:
            url, body = f"{base_url}/v1/completions", {**BODY, "max_tokens": 8}
            headers = {"X-Request-ID": "same"}
            result.append(httpx.post(url, json=body, headers=headers, timeout=TIMEOUT_S))

        stayer = threading.Thread(target=stay)
        stayer.start()
        with changed:
            both = changed.wait_for(lambda: len(added) == 2, TIMEOUT_S)
        assert both, "both requests should reach the engine"
        assert len(engine._streams) == 2
        assert "same" not in engine._streams, "the engine's ids are the instance's own"
    finally:
        leaver.close()  # the first client leaves
        release.set()
    stayer.join(TIMEOUT_S)
    (got,) = result
    assert got.status_code == 200, got.text
    assert got.headers["x-request-id"] == "same"
    assert got.json()["choices"][0]["token_ids"] == want.json()["choices"][0]["token_ids"]
    assert got.json()["id"] != "same" and got.json()["id"].startswith("cmpl-")
    (leaver_id,) = set(added) - {got.json()["id"]}
    with changed:
        assert changed.wait_for(lambda: leaver_id in aborted, TIMEOUT_S), "the leaver stayed"
    # Applied in order: this call runs after the leaver's abort.
    assert engine.call(_is_idle).result(TIMEOUT_S), "the leaver's request should end"
    assert _finished(instance, "length") == num_finished + 1, "the leaver's was aborted"
    assert engine.call(_num_blocks_in_use).result(TIMEOUT_S) == 0


def _num_blocks_in_use(engine: LLMEngine) -> int:
    engine.check_integrity()
    return engine.block_pool.stats().num_in_use


def _is_idle(engine: LLMEngine) -> bool:
    return engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0


def test_without_a_client_id_the_header_names_the_answer(base_url: str) -> None:
    r = httpx.post(f"{base_url}/v1/completions", json={**BODY, "max_tokens": 2}, timeout=TIMEOUT_S)
    assert r.status_code == 200 and r.headers["x-request-id"] == r.json()["id"]
    r = httpx.post(
        f"{base_url}/v1/completions", json={**BODY, "max_tokens": 0},
        headers={"x-request-id": "mine"}, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert r.status_code == 400 and r.headers["x-request-id"] == "mine", "errors echo it too"
