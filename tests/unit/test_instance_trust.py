"""What an instance with a cluster secret gives only to callers that send it, on its public
routes: ``kv_transfer_params`` (the prompt's ids as they are, the answer's ids) on every
role, and its KV engine id in /health and /ready. What it serves (its model fingerprint)
/health shows to all."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvduplex.common.config import Environment
from kvduplex.common.config import Role
from kvduplex.common.engine_config import CacheConfig
from kvduplex.common.engine_config import EngineConfig
from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.common.openai.transcript import ANSWER_IDS_FIELD
from kvduplex.common.trust import secret_headers
from kvduplex.instance.config import ServerConfig
from kvduplex.instance.server import Instance
from kvduplex.instance.server import build_instance
from tests.skips import nixl_installed

pytestmark = pytest.mark.timeout(120)

SECRET = "instance-trust-" + "y" * 20
AUTH = secret_headers(SECRET)
ROLES = [Role.BOTH, Role.PREFILL] if nixl_installed() else [Role.BOTH]


def _build(role: Role, secret: str | None) -> Instance:
    cfg = EngineConfig(model=ModelLoadConfig(model="tiny"), cache=CacheConfig(kv_cache_mb=16))
    return build_instance(cfg, ServerConfig(port=0, role=role), Environment(cluster_secret=secret))


@pytest.fixture(scope="module", params=ROLES, ids=lambda r: r.value)
def client(request: pytest.FixtureRequest) -> Iterator[TestClient]:
    inst = _build(request.param, SECRET)
    try:
        with TestClient(inst.app) as c:
            yield c
    finally:
        inst.shutdown()


def _chat(**kv: object) -> dict:
    return {
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "temperature": 0.0, "ignore_eos": True, "kv_transfer_params": kv,
    }  # fmt: skip


def _assert_401(resp: object) -> None:
    assert resp.status_code == 401, resp.text  # type: ignore[attr-defined]
    error = resp.json()["error"]  # type: ignore[attr-defined]
    assert error["code"] == "invalid_cluster_secret" and error["param"] == "kv_transfer_params"


def test_routed_prompt_ids_need_the_secret(client: TestClient) -> None:
    ids = [256, 10, 20, 30, 40, 50, 60]
    _assert_401(client.post("/v1/chat/completions", json=_chat(prompt_token_ids=ids)))
    wrong = secret_headers(SECRET + "-not")
    _assert_401(client.post("/v1/chat/completions", json=_chat(prompt_token_ids=ids), headers=wrong))
    resp = client.post("/v1/chat/completions", json=_chat(prompt_token_ids=ids), headers=AUTH)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] == len(ids)  # the ids as they were sent


def test_report_answer_needs_the_secret(client: TestClient) -> None:
    for path, body in (
        ("/v1/chat/completions", _chat(report_answer=True)),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 3, "ignore_eos": True,
                             "kv_transfer_params": {"report_answer": True}}),
    ):  # fmt: skip
        _assert_401(client.post(path, json=body))
        _assert_401(client.post(path, json={**body, "stream": True}))
        resp = client.post(path, json=body, headers=AUTH)
        assert resp.status_code == 200, resp.text
        assert len(resp.json()[ANSWER_IDS_FIELD]) == 3


def test_requests_without_kv_params_need_no_secret(client: TestClient) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert client.post("/v1/chat/completions", json=body).status_code == 200


def test_health_names_the_engine_id_only_to_members(client: TestClient) -> None:
    for path in ("/health", "/ready"):
        public = client.get(path).json()
        member = client.get(path, headers=AUTH).json()
        assert "engine_id" not in public
        assert public["fingerprint"] == member["fingerprint"]
        assert public["fingerprint"]["weights"] == "preset:tiny:seed=0"
        if member["role"] == "prefill":
            assert isinstance(member["engine_id"], str) and member["engine_id"]
        wrong = client.get(path, headers=secret_headers(SECRET + "-not")).json()
        assert "engine_id" not in wrong


@pytest.mark.skipif(not nixl_installed(), reason="NIXL is not installed")
def test_without_a_secret_the_engine_id_stays_public() -> None:
    inst = _build(Role.PREFILL, None)
    try:
        with TestClient(inst.app) as c:
            assert isinstance(c.get("/health").json()["engine_id"], str)
            resp = c.post("/v1/chat/completions", json=_chat(report_answer=True))
            assert resp.status_code == 200 and ANSWER_IDS_FIELD in resp.json()
    finally:
        inst.shutdown()
