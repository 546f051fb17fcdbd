"""Sampling parameters through push and pull routers, token for token against a
colocated instance: prefill samples the first token with the request's penalties
and seed, decode continues with that token counted in its penalties. A request
asking for logprobs gets the colocated instance's logprobs (in push mode prefill
computes the first token's and sends them with the token)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import httpx
import pytest

from kvduplex.cluster import LocalCluster
from tests.integration.conftest import Deployment
from tests.integration.conftest import assert_pool_clean
from tests.integration.conftest import start_deployment
from tests.integration.conftest import stream
from tests.skips import skip_module_without_nixl

pytestmark = pytest.mark.integration

skip_module_without_nixl()

_SERVE = [
    "serve",
    "--model",
    "tiny",
    "--num-blocks",
    "160",
    "--block-size",
    "8",
    "--log-level",
    "warning",
]
MODES = ["push", "pull"]


@pytest.fixture(scope="module")
def dep(cluster: LocalCluster) -> Deployment:
    return start_deployment(cluster, _SERVE, modes=tuple(MODES))


@pytest.fixture(autouse=True)
def clean_pools(dep: Deployment) -> Iterator[None]:
    yield
    for url in dep.instances:
        assert_pool_clean(url)


def _post(url: str, body: dict) -> dict:
    resp = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def _ids(url: str, body: dict) -> list[int]:
    ids = list(_post(url, body)["choices"][0]["token_ids"])
    assert len(ids) == body["max_tokens"], ids
    return ids


def _push_stats(url: str) -> dict:
    return dict(httpx.get(url + "/internal/kv/push/stats", timeout=10).json())


def _body(prompt: str | list[int], **extra: object) -> dict:
    return {
        "model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True, **extra,
    }  # fmt: skip


def _prompt_whose_first_token_it_holds(ref: str) -> list[int]:
    """A token-id prompt that holds its own greedy first token (so a repetition penalty
    on the prompt changes the first token, which prefill samples)."""
    for salt in range(50):
        ids = [(salt * 37 + i * 11) % 250 + 1 for i in range(60)]
        if _ids(ref, _body(ids, max_tokens=1))[0] in ids:
            return ids
    raise AssertionError("no prompt holds its greedy first token")


@pytest.mark.parametrize("mode", MODES)
def test_repetition_penalty_reaches_the_first_token(dep: Deployment, mode: str) -> None:
    ids = _prompt_whose_first_token_it_holds(dep.reference)
    body = _body(ids, repetition_penalty=3.0)
    want = _ids(dep.reference, body)
    assert want[0] != _ids(dep.reference, _body(ids))[0], "the penalty changes the first token"
    before = _push_stats(dep.decode)
    assert _ids(dep.routers[mode], body) == want
    routed, _, _ = stream(dep.routers[mode], "/v1/completions", body)
    assert routed == want
    _check_pushed(dep, mode, before, 2)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("penalty", ["presence_penalty", "frequency_penalty"])
def test_decode_counts_prefills_first_token(dep: Deployment, mode: str, penalty: str) -> None:
    """The plain answer repeats its first token; penalised, the second token is another.
    Decode, which did not sample the first token, must count it."""
    plain = _ids(dep.reference, _body("hello hello"))
    assert plain[1] == plain[0], plain
    body = _body("hello hello", **{penalty: 2.0})
    want = _ids(dep.reference, body)
    assert want[0] == plain[0] and want[1] != plain[0], want
    before = _push_stats(dep.decode)
    assert _ids(dep.routers[mode], body) == want
    routed, _, _ = stream(dep.routers[mode], "/v1/completions", body)
    assert routed == want
    _check_pushed(dep, mode, before, 2)


def _check_pushed(dep: Deployment, mode: str, before: dict, num: int) -> None:
    """In push mode, `num` more prompts reached decode by push, none fell back."""
    if mode != "push":
        return
    after = _push_stats(dep.decode)
    assert after["num_received"] == before["num_received"] + num
    assert after["num_fallbacks"] == before["num_fallbacks"]


SEEDED = [
    {"temperature": 0.9, "seed": 11, "frequency_penalty": 0.8, "min_p": 0.02},
    {
        "temperature": 1.2,
        "seed": 12,
        "presence_penalty": 1.0,
        "repetition_penalty": 1.3,
        "top_k": 40,
    },
    {"temperature": 0.7, "seed": 13, "min_p": 0.2, "top_p": 0.95},
]


@pytest.mark.parametrize("mode", MODES)
def test_seeded_penalised_requests_match_colocated(dep: Deployment, mode: str) -> None:
    before = _push_stats(dep.decode)
    for i, extra in enumerate(SEEDED):
        body = _body([(i * 53 + k * 5) % 250 + 1 for k in range(30)], max_tokens=12, **extra)
        want = _ids(dep.reference, body)
        assert _ids(dep.routers[mode], body) == want, extra
        routed, _, _ = stream(dep.routers[mode], "/v1/completions", body)
        assert routed == want, extra
    _check_pushed(dep, mode, before, 2 * len(SEEDED))


def _logprobs(url: str, path: str, body: dict, is_stream: bool) -> tuple[list[int], dict]:
    """The answer's ids and its ``choice.logprobs``; streamed, the chunks' lists joined."""
    if not is_stream:
        resp = httpx.post(url + path, json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        return list(choice["token_ids"]), dict(choice["logprobs"])
    ids, _, chunks = stream(url, path, body)
    joined: dict[str, list] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            for key, entries in (choice.get("logprobs") or {}).items():
                joined.setdefault(key, []).extend(entries)
    return ids, joined


def _assert_close(got: object, want: object, where: str = "logprobs") -> None:
    """Equal, but floats within 1e-5."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (where, got, want)
        for key in want:
            _assert_close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (where, got, want)
        for k, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_close(g, w, f"{where}[{k}]")
    elif isinstance(want, float):
        assert isinstance(got, float) and math.isclose(got, want, abs_tol=1e-5), (where, got, want)
    else:
        assert got == want, (where, got, want)


@pytest.mark.parametrize("mode", MODES)
def test_logprobs_through_the_router_match_colocated(dep: Deployment, mode: str) -> None:
    """Every token has its logprobs entry, the first one included (prefill computed it and
    sent it with the token), streamed or not, chat or completions, as colocated's."""
    completion = _body([(k * 13) % 250 + 1 for k in range(40)], max_tokens=6, logprobs=3,
                       temperature=0.8, seed=21)  # fmt: skip
    chat = {"model": "tiny", "messages": [{"role": "user", "content": f"logprobs via {mode}"}],
            "max_tokens": 5, "temperature": 0.0, "logprobs": True, "top_logprobs": 2,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    before = _push_stats(dep.decode)
    for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        for is_stream in (False, True):
            want_ids, want = _logprobs(dep.reference, path, body, is_stream)
            got_ids, got = _logprobs(dep.routers[mode], path, body, is_stream)
            assert got_ids == want_ids, (path, is_stream)
            _assert_close(got, want, f"{path} stream={is_stream}")
            entries = want["content"] if "content" in want else want["token_logprobs"]
            assert len(entries) == body["max_tokens"]
    _check_pushed(dep, mode, before, 4)  # pushed: none went to decode alone


@pytest.mark.parametrize("mode", MODES)
def test_unknown_fields_and_n_are_refused_before_dispatch(dep: Deployment, mode: str) -> None:
    before = _push_stats(dep.decode)
    for extra, name in (({"best_of": 1, "frobnicate": True}, "frobnicate"), ({"n": 2}, "n")):
        resp = httpx.post(
            dep.routers[mode] + "/v1/completions", json=_body("x", **extra), timeout=30
        )
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == name and name in err["message"]
        direct = httpx.post(dep.reference + "/v1/completions", json=_body("x", **extra), timeout=30)
        assert direct.json() == resp.json()
    assert _push_stats(dep.decode)["num_received"] == before["num_received"]
