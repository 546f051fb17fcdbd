"""One real instance process: the OpenAI API, streaming, errors, disconnects, metrics."""

from __future__ import annotations

import json
import socket

import httpx
import openai
import pytest
from httpx_sse import connect_sse
from openai.types import Completion

from kvduplex.bench.report import metric_sum
from kvduplex.bench.report import scrape
from kvduplex.cluster import LocalCluster
from kvduplex.cluster import Process
from kvduplex.cluster import free_port
from tests.integration.conftest import assert_pool_clean
from tests.integration.conftest import kv_stats
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(cluster: LocalCluster) -> Process:
    proc = cluster.start(
        "instance",
        ["serve", "--model", "tiny", "--num-blocks", "128", "--block-size", "8", "--log-level", "warning"],
        free_port(),
    )
    cluster.wait_healthy(timeout_s=120)
    return proc


@pytest.fixture()
def client(server: Process) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_health_and_models(server: Process, client: openai.OpenAI) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completion_stream_matches_non_stream(server: Process, client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", prompt="Hello, disaggregated world", max_tokens=12, temperature=0.0)
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert full.usage is not None and full.usage.completion_tokens == 12
    assert full.choices[0].finish_reason == "length"
    stream = client.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage:
            usage = chunk.usage
    assert text == full.choices[0].text
    assert usage is not None and usage.completion_tokens == 12
    assert_pool_clean(server.url)


def test_chat_completion_and_cached_tokens(server: Process, client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "be brief " * 8}, {"role": "user", "content": "hi there"}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert first.choices[0].message.content == again.choices[0].message.content
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == first.choices[0].message.content
    assert_pool_clean(server.url)


def test_token_id_prompt_and_return_token_ids(server: Process) -> None:
    body = {"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["prompt_token_ids"] == [5, 6, 7, 8, 9]
    assert len(data["choices"][0]["token_ids"]) == 4


BAD_BODIES = [
    ("max_tokens", {"model": "tiny", "prompt": "x", "max_tokens": 0}, 400),
    ("max_tokens", {"model": "tiny", "prompt": "x", "max_tokens": "many"}, 400),
    ("prompt", {"model": "tiny", "prompt": ""}, 400),
    ("prompt", {"model": "tiny", "prompt": []}, 400),
    ("prompt", {"model": "tiny"}, 400),
    ("prompt", {"model": "tiny", "prompt": 42}, 400),
    ("temperature", {"model": "tiny", "prompt": "x", "temperature": -1}, 400),
    ("temperature", {"model": "tiny", "prompt": "x", "temperature": 5}, 400),
    ("top_p", {"model": "tiny", "prompt": "x", "top_p": 0}, 400),
    ("top_p", {"model": "tiny", "prompt": "x", "top_p": 1.5}, 400),
    ("top_k", {"model": "tiny", "prompt": "x", "top_k": -5}, 400),
    ("n", {"model": "tiny", "prompt": "x", "n": 3}, 400),
    ("context", {"model": "tiny", "prompt": "x", "max_tokens": 10**6}, 400),
    ("model", {"model": "no-such-model", "prompt": "x"}, 404),
    ("token ids", {"model": "tiny", "prompt": [10**9]}, 400),
    ("stop", {"model": "tiny", "prompt": "x", "stop": [""]}, 400),
    ("seed", {"model": "tiny", "prompt": "x", "seed": 2**70}, 400),
    ("seed", {"model": "tiny", "prompt": "x", "seed": "lucky"}, 400),
    ("temperature", {"model": "tiny", "prompt": "x", "temperature": "hot"}, 400),
]


@pytest.mark.parametrize(("what", "body", "status"), BAD_BODIES, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_BODIES)])
def test_bad_completion_input(server: Process, what: str, body: dict, status: int) -> None:
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    assert_pool_clean(server.url)


@pytest.mark.parametrize(
    "body",
    [
        {"model": "tiny", "messages": []},
        {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]},
        {"model": "tiny", "messages": "hello"},
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
        {"model": "tiny", "messages": [{"role": "user", "content": "x" * 5000}]},
    ],
)
def test_bad_chat_input(server: Process, body: dict) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    assert_pool_clean(server.url)


def test_malformed_json(server: Process) -> None:
    r = httpx.post(
        server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]["message"]
    assert_pool_clean(server.url)


def test_client_disconnect_aborts_and_frees_blocks(server: Process) -> None:
    body = {"model": "tiny", "prompt": "a long one", "max_tokens": 900, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with (
        httpx.Client(timeout=60) as http,
        connect_sse(http, "POST", server.url + "/v1/completions", json=body) as source,
    ):
        events = source.iter_sse()  # kept: a dropped iterator would close the stream here
        for event in events:
            if json.loads(event.data)["choices"][0]["text"] is not None:
                break
        assert kv_stats(server.url)["num_in_use"] > 0
    # Closing the stream is the disconnect: the request must be aborted and its blocks freed.
    assert_pool_clean(server.url)
    wait_until(lambda: kv_stats(server.url)["num_running"] == 0, what="request aborted")


def test_non_streaming_disconnect_aborts(server: Process) -> None:
    body = json.dumps({"model": "tiny", "prompt": "another long one", "max_tokens": 900,
                       "temperature": 0, "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    )
    wait_until(lambda: kv_stats(server.url)["num_running"] == 1, what="request running")
    sock.close()
    wait_until(lambda: kv_stats(server.url)["num_running"] == 0, what="request aborted")
    assert_pool_clean(server.url)


def test_metrics_count_served_requests(server: Process, client: openai.OpenAI) -> None:
    assert_pool_clean(server.url)
    before = scrape(server.url)
    prompt = "metrics please, with a prompt longer than one block of eight tokens"
    first = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    again = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    after = scrape(server.url)

    def cached_tokens(c: Completion) -> int:
        assert c.usage is not None
        details = c.usage.prompt_tokens_details
        return (details.cached_tokens or 0) if details is not None else 0

    assert first.usage is not None and cached_tokens(again) > 0

    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    assert delta("kvduplex_requests_finished_total", reason="length") == 2
    assert delta("kvduplex_generation_tokens_total") == 8
    assert delta("kvduplex_prompt_tokens_total") == first.usage.prompt_tokens * 2
    hits = cached_tokens(first) + cached_tokens(again)
    assert delta("kvduplex_prefix_cache_hit_tokens_total") == hits
    for histogram in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        assert delta(f"kvduplex_{histogram}_seconds_count") == 2, histogram
        assert delta(f"kvduplex_{histogram}_seconds_sum") > 0, histogram
    assert metric_sum(after, "kvduplex_kv_blocks_total") == 128
    assert metric_sum(after, "kvduplex_kv_blocks_in_use") == 0
    assert metric_sum(after, "kvduplex_kv_blocks_cached") > 0  # the prompt's blocks


def test_gauges_follow_a_running_request(server: Process) -> None:
    def gauges() -> tuple[float, float, float]:
        m = scrape(server.url)
        return (
            metric_sum(m, "kvduplex_num_requests_running"),
            metric_sum(m, "kvduplex_num_requests_waiting"),
            metric_sum(m, "kvduplex_kv_blocks_in_use"),
        )

    body = {"model": "tiny", "prompt": "gauges", "max_tokens": 900, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # held: closing the iterator would close the stream
        for line in lines:
            if line.startswith("data: "):
                break  # the request runs
        running, waiting, in_use = gauges()
        assert (running, waiting) == (1, 0) and in_use > 0
    wait_until(lambda: gauges() == (0, 0, 0), what="the gauges to drop after the disconnect")
