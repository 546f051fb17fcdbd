"""The router's background loops outlive any error: a probe that fails in a way the
transport does not turn into an httpx error (an answer that is not HTTP) is a failed
probe of its instance, a probe round that raises is logged and the next one runs, and
the same holds for DNS discovery's rounds and its admission checks. Fakes over httpx
MockTransport, and one instance over a real socket that does not speak HTTP.

The rounds are driven by the tests (`probe_all`, `Discovery.run_round`), or run by the
loops with no interval and waited on through their `on_round`."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest

from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.router.config import RouterConfig
from kvduplex.router.discovery import run_discovery
from kvduplex.router.health import probe_all
from kvduplex.router.health import run_prober
from kvduplex.router.state import RouterState
from tests.support.fake_instances import mock_instances
from tests.unit.test_router_discovery import DECODE_NAME
from tests.unit.test_router_discovery import FakeDns

P, D1, D2 = "http://10.0.0.1:8000", "http://10.0.1.1:8001", "http://10.0.1.2:8001"
BOUND_S = 10.0
"""A bound for a failing run only: a loop that died would be waited on here."""


class NotHttp(Exception):
    """What a client may raise that is not one of its call errors (a bug, a library's
    own error that escaped its mapping)."""


class Fleet:
    """Instances whose /ready and /health answer 200, but those in `broken`, which raise
    `NotHttp`; `paths` records every probe."""

    def __init__(self) -> None:
        self.broken: set[str] = set()
        self.paths: list[str] = []

    async def handle(self, request: httpx.Request) -> httpx.Response:
        url = str(request.url)
        self.paths.append(url)
        if url.rsplit("/", 1)[0] in self.broken:
            raise NotHttp("Bad status line: expected HTTP/")
        return httpx.Response(200, json={"status": "ok", "role": "decode", "engine_id": "e"})


def _state(fleet: Fleet, **config: Any) -> RouterState:
    cfg = RouterConfig(prefill=(P,), decode=(D1, D2), health_interval_s=60.0, **config)
    return RouterState.create(cfg, ByteTokenizer(), make_client=mock_instances(fleet.handle))


def _probe(state: RouterState) -> None:
    asyncio.run(probe_all(state.client, state.policy, timeout_s=1.0))


def test_a_probe_that_raises_something_else_is_a_failed_probe(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """1. D1's probe raises an error that is not httpx's: one failed probe, logged with
    D1's URL; the round probes the others as ever; 2. the second marks D1 down and tells
    its watchers; 3. once D1 answers again, a probe takes it back."""
    fleet = Fleet()
    state = _state(fleet)
    d1 = state.policy.decode.by_url(D1)
    assert d1 is not None
    told: list[str] = []
    d1.watch(lambda: told.append("d1"))
    fleet.broken.add(D1)
    with caplog.at_level(logging.INFO, logger="kvduplex.router.health"):
        _probe(state)  # 1.
    assert d1.is_healthy and d1.num_failed_probes == 1 and told == []
    (logged,) = [r for r in caplog.records if D1 in r.getMessage()]
    assert logged.levelno == logging.WARNING and "NotHttp" in logged.getMessage()
    assert {P + "/ready", D1 + "/ready", D2 + "/ready"} == set(fleet.paths)
    _probe(state)  # 2.
    assert not d1.is_healthy and d1.is_down and told == ["d1"]
    assert [b.url for b in state.policy.decode.healthy()] == [D2]
    fleet.broken.clear()  # 3.
    _probe(state)
    assert d1.is_healthy and not d1.is_down and d1.num_failed_probes == 0


def test_a_probe_whose_watcher_raises_is_logged_and_the_round_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A watcher that breaks its contract (it raises) fails its instance's probe: logged
    with the instance; the round's other probes end as they would, the round returns."""
    fleet = Fleet()
    state = _state(fleet, health_failures=1)
    d1 = state.policy.decode.by_url(D1)
    assert d1 is not None

    def raises() -> None:
        raise RuntimeError("a watcher that raises")

    d1.watch(raises)
    fleet.broken.add(D1)
    with caplog.at_level(logging.ERROR, logger="kvduplex.router.health"):
        _probe(state)
    assert d1.is_down and [b.url for b in state.policy.decode.healthy()] == [D2]
    assert any(
        D1 in r.getMessage() and r.exc_info and "a watcher that raises" in str(r.exc_info[1])
        for r in caplog.records
    )


def test_the_prober_goes_on_after_a_round_that_fails(caplog: pytest.LogCaptureFixture) -> None:
    """The first round's `on_round` raises: logged, and the rounds after it run (and are
    reported); D1's probes, which raise, fail each round without ending the prober."""
    fleet = Fleet()
    fleet.broken.add(D1)
    state = _state(fleet)
    rounds: list[int] = []
    third = asyncio.Event()

    def on_round() -> None:
        rounds.append(len(fleet.paths))
        if len(rounds) == 1:
            raise RuntimeError("the first round's report fails")
        if len(rounds) == 3:
            third.set()

    async def run() -> bool:
        prober = asyncio.create_task(
            run_prober(state.client, state.policy, 0.0, 1.0, on_round=on_round)
        )
        await asyncio.wait_for(third.wait(), BOUND_S)
        is_running = not prober.done()
        prober.cancel()
        return is_running

    with caplog.at_level(logging.ERROR, logger="kvduplex.router.health"):
        assert asyncio.run(run()), "the prober ended"
    assert rounds[:3] == [3, 6, 9]
    assert "health probe round failed" in caplog.text
    d1 = state.policy.decode.by_url(D1)
    assert d1 is not None and d1.is_down


async def _not_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers any request with a line that is not HTTP, then closes."""
    await reader.read(1024)
    writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
    await writer.drain()
    writer.close()


async def _ready(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers any request with 200 ``{"status": "ready"}``, then closes."""
    await reader.read(1024)
    body = b'{"status": "ready"}'
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    writer.close()


def test_an_instance_that_does_not_speak_http_is_marked_down_over_a_socket() -> None:
    """The router's own client (`wire.WirePool`) against a port that answers something that is
    not HTTP: its probes fail round after round, it is marked down, and the prober goes
    on probing the others (a decode instance marked down by a call is taken back)."""

    async def run() -> None:
        bad = await asyncio.start_server(_not_http, "127.0.0.1", 0)
        good = await asyncio.start_server(_ready, "127.0.0.1", 0)
        p_url = f"http://127.0.0.1:{bad.sockets[0].getsockname()[1]}"
        d_url = f"http://127.0.0.1:{good.sockets[0].getsockname()[1]}"
        cfg = RouterConfig(prefill=(p_url,), decode=(d_url,), health_timeout_s=BOUND_S)
        state = RouterState.create(cfg, ByteTokenizer())
        (p,), (d,) = state.policy.prefill.backends, state.policy.decode.backends
        p_down: list[bool] = []
        taken_back = asyncio.Event()

        def on_round() -> None:
            p_down.append(p.is_down)
            if len(p_down) == 2:
                state.policy.decode.mark_failed(d, state.policy.clock())  # a failed call
            elif len(p_down) > 2 and d.is_healthy:
                taken_back.set()

        prober = asyncio.create_task(
            run_prober(state.client, state.policy, 0.0, BOUND_S, on_round=on_round)
        )
        try:
            await asyncio.wait_for(taken_back.wait(), BOUND_S)
            assert not prober.done()
            assert p_down[:3] == [False, True, True], "P is down after two failed probes"
            assert p.is_down and not p.is_healthy and d.is_healthy
        finally:
            prober.cancel()
            await state.aclose()
            bad.close()
            good.close()

    asyncio.run(run())


def test_an_admission_check_that_raises_is_asked_again_next_round(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Discovery: an address whose /health raises an error that is not httpx's is not
    added (logged with its URL), the round counts; 2. once it answers, it joins."""
    fleet, dns = Fleet(), FakeDns()
    dns.answers = {DECODE_NAME: {"10.0.1.1"}}
    fleet.broken.add(D1)
    cfg = RouterConfig(decode_dns=f"{DECODE_NAME}:8001", dns_interval_s=60.0)
    state = RouterState.create(
        cfg, ByteTokenizer(), make_client=mock_instances(fleet.handle), resolve=dns
    )
    discovery = state.discovery
    assert discovery is not None
    with caplog.at_level(logging.WARNING, logger="kvduplex.router.discovery"):
        asyncio.run(discovery.run_round())  # 1.
    assert discovery.num_rounds == 1 and state.policy.decode.backends == []
    assert any(D1 in r.getMessage() and "not added yet" in r.getMessage() for r in caplog.records)
    fleet.broken.clear()  # 2.
    asyncio.run(discovery.run_round())
    assert discovery.num_rounds == 2
    assert [b.url for b in state.policy.decode.backends] == [D1]


def test_discovery_goes_on_after_rounds_that_fail(caplog: pytest.LogCaptureFixture) -> None:
    """The resolver raises something unexpected: the round is logged, counts, and keeps
    the instances; the loop goes on, and the next good answer adds the instance."""
    fleet = Fleet()
    answers: list[set[str] | Exception] = [RuntimeError("resolver broke"), {"10.0.1.1"}]
    third_round = asyncio.Event()
    rounds_done: list[int] = []
    """`num_rounds` as each round began."""

    async def resolve(name: str) -> set[str]:
        rounds_done.append(discovery.num_rounds)
        if not answers:  # the second round is over
            third_round.set()
            return {"10.0.1.1"}
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    cfg = RouterConfig(decode_dns=f"{DECODE_NAME}:8001", dns_interval_s=60.0)
    state = RouterState.create(
        cfg, ByteTokenizer(), make_client=mock_instances(fleet.handle), resolve=resolve
    )
    discovery = state.discovery
    assert discovery is not None

    async def run() -> None:
        rounds = asyncio.create_task(run_discovery(discovery, interval_s=0.0))
        try:
            await asyncio.wait_for(third_round.wait(), BOUND_S)
        finally:
            rounds.cancel()

    with caplog.at_level(logging.ERROR, logger="kvduplex.router.discovery"):
        asyncio.run(run())
    assert "resolver broke" in caplog.text and DECODE_NAME in caplog.text
    assert rounds_done[:3] == [0, 1, 2], "the round that failed counts"
    assert [b.url for b in state.policy.decode.backends] == [D1]
