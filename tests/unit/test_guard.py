"""The trust boundary of internal routes (`InternalGuard`), the cluster secret's
sources, and an instance built with a secret (its /internal/kv/stats, which
lives in api.py, guarded from instance.py)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi import Request
from fastapi.testclient import TestClient

import kvduplex
from kvduplex.common.config import Environment
from kvduplex.common.engine_config import CacheConfig
from kvduplex.common.engine_config import EngineConfig
from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.common.guard import InternalGuard
from kvduplex.common.guard import load_cluster_secret
from kvduplex.common.guard import new_cluster_secret
from kvduplex.common.trust import SECRET_HEADER
from kvduplex.common.trust import secret_headers
from kvduplex.common.trust import secret_matches
from kvduplex.instance.config import ServerConfig
from kvduplex.instance.server import Instance
from kvduplex.instance.server import build_instance

SECRET = "s3cret-" + "x" * 20
CAP = 1024


def _app(secret: str | None) -> FastAPI:
    app = FastAPI()

    @app.post("/internal/echo")
    async def echo(raw: Request) -> dict:
        return {"size": len(await raw.body())}

    @app.get("/internal/kv/stats")
    async def stats() -> dict:
        return {"ok": True}

    @app.post("/v1/echo")
    async def public(raw: Request) -> dict:
        return {"size": len(await raw.body())}

    app.add_middleware(InternalGuard, secret=secret, max_body_bytes=CAP)
    return app


@pytest.fixture()
def guarded() -> Iterator[TestClient]:
    with TestClient(_app(SECRET)) as c:
        yield c


def _assert_error(resp: object, status: int, code: str) -> None:
    assert resp.status_code == status, resp.text  # type: ignore[attr-defined]
    err = resp.json()["error"]  # type: ignore[attr-defined]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == code


@pytest.mark.parametrize(
    "headers",
    [{}, {SECRET_HEADER: "wrong"}, {SECRET_HEADER: SECRET[:-1]}, {SECRET_HEADER: SECRET + "x"},
     {SECRET_HEADER.lower(): ""}],
)  # fmt: skip
def test_internal_routes_without_the_secret_are_401(
    guarded: TestClient, headers: dict[str, str]
) -> None:
    _assert_error(guarded.get("/internal/kv/stats", headers=headers), 401, "invalid_cluster_secret")
    resp = guarded.post("/internal/echo", content=b"{}", headers=headers)
    _assert_error(resp, 401, "invalid_cluster_secret")
    assert SECRET_HEADER in resp.json()["error"]["message"]
    # An unknown internal path says nothing about what exists there.
    _assert_error(guarded.get("/internal/nope", headers=headers), 401, "invalid_cluster_secret")


def test_the_secret_opens_internal_routes_and_public_ones_need_none(guarded: TestClient) -> None:
    ok = secret_headers(SECRET)
    assert guarded.get("/internal/kv/stats", headers=ok).json() == {"ok": True}
    assert (
        guarded.get("/internal/kv/stats", headers={SECRET_HEADER.upper(): SECRET}).status_code
        == 200
    )
    assert guarded.post("/internal/echo", content=b"x" * CAP, headers=ok).json() == {"size": CAP}
    assert guarded.post("/v1/echo", content=b"abc").json() == {"size": 3}


def test_two_secret_headers_are_refused(guarded: TestClient) -> None:
    headers = [(SECRET_HEADER, SECRET), (SECRET_HEADER, "other")]
    resp = guarded.get("/internal/kv/stats", headers=headers)  # type: ignore[arg-type]
    _assert_error(resp, 401, "invalid_cluster_secret")


def test_oversize_internal_bodies_are_413_announced_or_chunked(guarded: TestClient) -> None:
    ok = secret_headers(SECRET)
    resp = guarded.post("/internal/echo", content=b"x" * (CAP + 1), headers=ok)
    _assert_error(resp, 413, "request_too_large")

    def chunks() -> Iterator[bytes]:  # no content-length: counted as it arrives
        for _ in range(3):
            yield b"y" * (CAP // 2)

    _assert_error(
        guarded.post("/internal/echo", content=chunks(), headers=ok), 413, "request_too_large"
    )
    # The cap is on internal routes only.
    assert guarded.post("/v1/echo", content=b"z" * (4 * CAP)).json() == {"size": 4 * CAP}


@pytest.mark.parametrize("public_cap", [CAP // 4, 4 * CAP])
def test_public_routes_have_a_cap_of_their_own(public_cap: int) -> None:
    app = _app(None)
    app.user_middleware.clear()
    app.add_middleware(
        InternalGuard, secret=SECRET, max_body_bytes=CAP, public_max_body_bytes=public_cap
    )
    ok = secret_headers(SECRET)

    def chunks(total: int) -> Iterator[bytes]:  # no content-length: counted as it arrives
        yield b"y" * (total // 2)
        yield b"y" * (total - total // 2)

    with TestClient(app) as c:
        assert c.post("/v1/echo", content=b"z" * public_cap).json() == {"size": public_cap}
        assert c.post("/v1/echo", content=chunks(public_cap)).json() == {"size": public_cap}
        for content in (b"z" * (public_cap + 1), chunks(public_cap + 1)):
            resp = c.post("/v1/echo", content=content)
            _assert_error(resp, 413, "request_too_large")
            assert f"({public_cap} bytes)" in resp.json()["error"]["message"]
        # Internal routes keep theirs, whichever is larger; the secret is still checked first.
        assert c.post("/internal/echo", content=b"x" * CAP, headers=ok).json() == {"size": CAP}
        _assert_error(
            c.post("/internal/echo", content=b"x" * (CAP + 1), headers=ok), 413, "request_too_large"
        )
        _assert_error(
            c.post("/internal/echo", content=b"x" * (CAP + 1)), 401, "invalid_cluster_secret"
        )


def test_without_a_secret_internal_routes_are_open_but_capped() -> None:
    with TestClient(_app(None)) as c:
        assert c.get("/internal/kv/stats").status_code == 200
        assert (
            c.post("/internal/echo", content=b"{}", headers=secret_headers("any")).status_code
            == 200
        )
        _assert_error(c.post("/internal/echo", content=b"x" * (CAP + 1)), 413, "request_too_large")


def test_secret_compare_and_headers() -> None:
    assert secret_matches(SECRET, SECRET) and secret_matches(SECRET.encode(), SECRET)
    assert not secret_matches(None, SECRET) and not secret_matches("", SECRET)
    assert not secret_matches("\udcff", SECRET)  # undecodable header bytes, not a crash
    assert secret_headers(None) == {}
    assert new_cluster_secret() != new_cluster_secret() and len(new_cluster_secret()) >= 32


def test_secret_sources(tmp_path: Path) -> None:
    assert load_cluster_secret("", None) is None
    assert load_cluster_secret("", SECRET) == SECRET
    f = tmp_path / "secret"
    f.write_text(f"  {SECRET}-file\n")
    assert load_cluster_secret(str(f), SECRET) == f"{SECRET}-file"  # the file wins
    f.write_text("short\n")
    with pytest.raises(ValueError, match="at least 16"):
        load_cluster_secret(str(f), None)
    with pytest.raises(ValueError, match="at least 16"):
        load_cluster_secret("", "tiny")
    with pytest.raises(ValueError, match="cannot read the cluster secret"):
        load_cluster_secret(str(tmp_path / "missing"), None)


def test_a_non_ascii_secret_is_refused_at_start(tmp_path: Path) -> None:
    """An HTTP header carries printable ASCII only: a secret with anything else would fail
    every internal call later, so it is refused where it is read."""
    for bad in ("geheimnis-für-den-cluster", "no-break\u00a0space-in-the-secret", "tab\tinside-the-secret"):
        with pytest.raises(ValueError, match="printable ASCII"):
            load_cluster_secret("", bad)
    f = tmp_path / "secret"
    f.write_text("ключ-кластера-достаточно-длинный\n", encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(f"--cluster-secret-file {f}") + r".*printable ASCII"):
        load_cluster_secret(str(f), None)
    with pytest.raises(ValueError, match=r"KVDUPLEX_CLUSTER_SECRET.*printable ASCII"):
        build_instance(
            EngineConfig(), ServerConfig(port=0), Environment(cluster_secret="ü" * 20)
        )


def test_environment_reads_the_secret_and_no_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDUPLEX_CLUSTER_SECRET", SECRET)
    monkeypatch.setenv("KVDUPLEX_TEST_DROP_MESSAGES", "kv_register, kv_offer,")  # no longer read
    env = Environment.read()
    assert env.cluster_secret == SECRET and SECRET not in repr(env)
    assert env == Environment(cluster_secret=SECRET)
    monkeypatch.setenv("KVDUPLEX_CLUSTER_SECRET", "")
    assert Environment.read() == Environment()


def test_the_package_reads_no_test_variable() -> None:
    """Faults and test behaviour reach an instance as objects passed at construction
    (`InstanceParts`), never through the environment."""
    package = Path(kvduplex.__file__).parent
    assert [p for p in package.rglob("*.py") if "KVDUPLEX_TEST" in p.read_text()] == []


@pytest.fixture(scope="module")
def instance() -> Iterator[Instance]:
    cfg = EngineConfig(model=ModelLoadConfig(model="tiny"), cache=CacheConfig(kv_cache_mb=16))
    inst = build_instance(cfg, ServerConfig(port=0), Environment(cluster_secret=SECRET))
    try:
        yield inst
    finally:
        inst.async_engine.shutdown()


def test_instance_guards_its_kv_stats_route(instance: Instance) -> None:
    with TestClient(instance.app) as c:
        _assert_error(c.get("/internal/kv/stats"), 401, "invalid_cluster_secret")
        stats = c.get("/internal/kv/stats", headers=secret_headers(SECRET)).json()
        assert stats["integrity_ok"] and stats["num_in_use"] == 0
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        assert c.post("/v1/completions", json=body).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200


def test_instance_with_a_short_secret_does_not_start() -> None:
    with pytest.raises(ValueError, match="at least 16"):
        build_instance(EngineConfig(), ServerConfig(port=0), Environment(cluster_secret="short"))
