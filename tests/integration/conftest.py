from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvduplex.server.cluster import LocalCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(log_dir=Path(tmp_path_factory.mktemp("logs")), env={"OMP_NUM_THREADS": "1"})
    try:
        yield c
    finally:
        c.stop()


def wait_until(cond: Callable[[], bool], timeout_s: float = 20.0, what: str = "condition") -> None:
    """Poll `cond` until it holds; fail with `what` after the deadline."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def kv_stats(url: str) -> dict:
    return httpx.get(url + "/internal/kv/stats", timeout=10).json()


def assert_pool_clean(url: str) -> None:
    """The instance's pool is consistent and holds no blocks for requests."""
    wait_until(lambda: kv_stats(url)["num_in_use"] == 0, what=f"no blocks in use on {url}")
    st = kv_stats(url)
    assert st["integrity_ok"], st["integrity_error"]
    assert st["num_free"] + st["num_cached"] == st["total"]
