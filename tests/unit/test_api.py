"""The OpenAI API of one instance, in process (TestClient): inputs that once
reached the engine loop and failed there, and /health when the engine is gone."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvduplex.instance.server import Instance
from tests.unit.conftest import tiny_instance


@pytest.fixture()
def client(instance: Instance) -> Iterator[TestClient]:
    with TestClient(instance.app) as c:
        yield c
    assert instance.async_engine.is_healthy, "a request took the engine down"
    stats = instance.async_engine.call(lambda e: (e.check_integrity(), e.block_pool.stats())).result(10)[1]
    assert stats.num_in_use == 0, "a request left blocks in use"


def _complete(client: TestClient, **fields: object) -> dict:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_temperature_near_zero_samples_greedily(client: TestClient) -> None:
    greedy = _complete(client, temperature=0)["choices"][0]["text"]
    # 1e-45 would overflow logits / t to inf (NaN probabilities) if sampled literally.
    for t in (1e-45, 1e-6):
        assert _complete(client, temperature=t, seed=1)["choices"][0]["text"] == greedy


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 2**70])
def test_seed_outside_the_generator_range_is_400(client: TestClient, seed: int) -> None:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "seed": seed})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "seed" in err["message"]


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63), 0])
def test_seed_range_edges_are_served(client: TestClient, seed: int) -> None:
    assert _complete(client, seed=seed, temperature=1.0)["usage"]["completion_tokens"] == 4


def test_chat_template_refusal_is_400(
    client: TestClient, instance: Instance, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = instance.engine.loaded.tokenizer

    def refuse(messages: object, add_generation_prompt: bool = True, tools: object = None) -> str:
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt")

    monkeypatch.setattr(tok, "apply_chat_template", refuse)
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and "chat template" in err["message"]


def test_health_is_503_once_the_engine_stopped() -> None:
    inst = tiny_instance()
    try:
        with TestClient(inst.app) as c:
            assert c.get("/health").status_code == 200
            inst.async_engine.shutdown()
            r = c.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "unavailable"
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["message"]
    finally:
        inst.async_engine.shutdown()


def test_null_fields_take_their_defaults(client: TestClient) -> None:
    nulls = {k: None for k in ("temperature", "top_p", "n", "presence_penalty", "frequency_penalty",
                               "stream", "stop", "seed", "logprobs", "user", "response_format")}
    greedy = _complete(client, temperature=0)["choices"][0]["text"]
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, **nulls, "top_k": 1}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy  # top_k=1 at the default temperature
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **nulls}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    missing = client.post("/v1/chat/completions", json={"model": "tiny", "messages": None})
    assert missing.status_code == 400 and "messages" in missing.json()["error"]["message"]
