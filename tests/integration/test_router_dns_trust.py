"""DNS discovery with a cluster secret, on real processes: an impostor that DNS names is
refused and never gets the secret or the API key.

A prefill and a decode instance with the cluster's secret and API key listen on
127.0.0.2, one port per role; on 127.0.0.3, at the same ports, impostors that
record every request: each answers /health with its role and relays the proof's
two POSTs to the member of its role (the strongest impostor short of holding the
secret). A DNS server for tests (`StaticDns`) names both addresses for each role,
as a rogue A record, or a pod that matches a Service's selector, would. Checked:

* the router admits the members only, counts each impostor, and serves requests
  through the members;
* prefill, asked to push to the decode impostor, and decode, asked to read from the
  prefill impostor (as a router would ask, with the secret), refuse to send it
  their secret: prefill answers 502, decode computes the prompt itself;
* no impostor ever received the secret or the API key, in a header or a body.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from http.server import ThreadingHTTPServer

import httpx
import pytest

from kvduplex.cluster import LocalCluster
from kvduplex.cluster import free_port
from kvduplex.common.challenge import AUTH_PATHS
from kvduplex.common.trust import secret_headers
from tests.integration.conftest import assert_pool_clean
from tests.integration.conftest import metric
from tests.integration.conftest import wait_until
from tests.integration.test_router_replicas import _port_free_on
from tests.skips import skip_module_without_nixl
from tests.support.static_dns import StaticDns

pytestmark = pytest.mark.integration

skip_module_without_nixl()

SECRET = "dns-trust-" + uuid.uuid4().hex
API_KEY = "dns-trust-key-" + uuid.uuid4().hex
ENV = {"KVDUPLEX_CLUSTER_SECRET": SECRET, "KVDUPLEX_API_KEY": API_KEY}
MEMBER, IMPOSTOR = "127.0.0.2", "127.0.0.3"
BS = 8
_SERVE = ["serve", "--model", "tiny", "--num-blocks", "128", "--block-size", str(BS),
          "--log-level", "warning", "--kv-wait-timeout-s", "3"]  # fmt: skip


class Impostor(ThreadingHTTPServer):
    """Answers /health as a `role` instance and relays the proof's POSTs to `member`;
    records (method, path, headers, body) of every request; anything else gets 500."""

    def __init__(self, port: int, role: str, member: str) -> None:
        super().__init__((IMPOSTOR, port), _ImpostorHandler)
        self.role, self.member = role, member
        self.received: list[tuple[str, str, str, bytes]] = []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{IMPOSTOR}:{self.server_address[1]}"

    def credentials_received(self) -> list[str]:
        with self.lock:
            return [
                f"{method} {path}" for method, path, headers, body in self.received
                if any(s in headers or s.encode() in body for s in (SECRET, API_KEY))
            ]  # fmt: skip

    def paths(self) -> set[str]:
        with self.lock:
            return {path for _, path, _, _ in self.received}


class _ImpostorHandler(BaseHTTPRequestHandler):
    server: Impostor

    def _answer(self, method: str) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        with self.server.lock:
            self.server.received.append((method, self.path, str(self.headers), body))
        status, content = 500, b'{"error": "not served here"}'
        if self.path in ("/health", "/ready"):
            status, content = 200, json.dumps({"status": "ok", "role": self.server.role}).encode()
        elif method == "POST" and self.path in AUTH_PATHS:
            relayed = httpx.post(self.server.member + self.path, content=body, timeout=5,
                                 headers={"content-type": "application/json"})  # fmt: skip
            status, content = relayed.status_code, relayed.content
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(content)))
        self.end_headers()
        self.wfile.write(content)

    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self._answer("POST")

    def log_message(self, format: str, *args: object) -> None:
        pass


@dataclass
class Rig:
    prefill: str
    decode: str
    impostors: dict[str, Impostor]
    """By role."""
    router: str


@pytest.fixture(scope="module")
def rig(cluster: LocalCluster) -> Iterator[Rig]:
    hosts = (MEMBER, IMPOSTOR)
    p_port, d_port = _port_free_on(hosts), _port_free_on(hosts)
    p = cluster.start("prefill", [*_SERVE, "--role", "prefill"], p_port, host=MEMBER, env=ENV)
    d = cluster.start("decode", [*_SERVE, "--role", "decode"], d_port, host=MEMBER, env=ENV)
    impostors = {"prefill": Impostor(p_port, "prefill", p.url),
                 "decode": Impostor(d_port, "decode", d.url)}  # fmt: skip
    for impostor in impostors.values():
        impostor.thread.start()
    try:
        with StaticDns() as dns:
            dns.set("prefill.trust.test", list(hosts))
            dns.set("decode.trust.test", list(hosts))
            cluster.wait_healthy(timeout_s=180)
            router = cluster.start("router", [
                "router", "--model", "tiny", "--mode", "push", "--return-mode", "push",
                "--prefill-dns", f"prefill.trust.test:{p_port}",
                "--decode-dns", f"decode.trust.test:{d_port}",
                "--dns-server", dns.address, "--dns-interval-s", "0.2",
                "--health-interval-s", "0.5",
            ], free_port(), env=ENV)  # fmt: skip
            cluster.wait_healthy(timeout_s=60)
            yield Rig(p.url, d.url, impostors, router.url)
    finally:
        for impostor in impostors.values():
            impostor.shutdown()
            impostor.server_close()


def _refusals(rig: Rig, role: str) -> float:
    return metric(rig.router, "kvduplex_router_instance_refusals_total", role=role)


def test_the_router_admits_the_members_only_and_serves_through_them(rig: Rig) -> None:
    wait_until(lambda: httpx.get(rig.router + "/ready").status_code == 200, 30, "router ready")
    wait_until(
        lambda: _refusals(rig, "prefill") >= 1 and _refusals(rig, "decode") >= 1, 30,
        "both impostors refused",
    )  # fmt: skip
    for role in ("prefill", "decode"):
        labels = {"role": role, "reason": "address"}  # a relay: the member's own address
        assert metric(rig.router, "kvduplex_router_instance_refusals_total", **labels) >= 1
    instances = httpx.get(rig.router + "/health").json()["instances"]
    assert {(i["role"], i["url"]) for i in instances} == {
        ("prefill", rig.prefill), ("decode", rig.decode)
    }
    auth = {"authorization": f"Bearer {API_KEY}"}
    for n, session in enumerate(("ann", "bob", "cy")):
        body = {"model": "tiny", "prompt": [7 + n, 8, 9, 10] * 6, "max_tokens": 4,
                "temperature": 0.0, "ignore_eos": True}  # fmt: skip
        resp = httpx.post(rig.router + "/v1/completions", json=body, timeout=60,
                          headers={**auth, "x-session-id": session})  # fmt: skip
        assert resp.status_code == 200, resp.text
    assert metric(rig.router, "kvduplex_router_requests_total", mode="push") == 3
    for impostor in rig.impostors.values():
        assert impostor.credentials_received() == []
        assert impostor.paths() <= {"/health", "/ready", *AUTH_PATHS}
    for url in (rig.prefill, rig.decode):
        assert_pool_clean(url, SECRET)


def test_instances_do_not_send_their_secret_to_a_peer_that_does_not_prove_it(rig: Rig) -> None:
    """What a router would ask, with the secret: prefill to push to the decode impostor,
    decode to read from the prefill impostor."""
    members = secret_headers(SECRET)
    prompt = [11, 12, 13, 14] * 5
    resp = httpx.post(rig.prefill + "/internal/push/prefill", headers=members, timeout=60, json={
        "xid": "to-impostor-1", "prompt_token_ids": prompt, "decode_url": rig.impostors["decode"].url,
    })  # fmt: skip
    assert resp.status_code == 502 and "cluster secret" in resp.json()["error"]["message"]
    params = {"mode": "push", "xid": "from-impostor-1", "prefill_url": rig.impostors["prefill"].url}
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0.0,
            "ignore_eos": True, "kv_transfer_params": params}  # fmt: skip
    headers = {**members, "authorization": f"Bearer {API_KEY}"}
    resp = httpx.post(rig.decode + "/v1/completions", json=body, headers=headers, timeout=60)
    assert resp.status_code == 200, resp.text  # computed by decode itself
    for impostor in rig.impostors.values():
        assert impostor.credentials_received() == []
        assert "/internal/kv/handshake" not in impostor.paths()
    for url in (rig.prefill, rig.decode):
        assert_pool_clean(url, SECRET)
