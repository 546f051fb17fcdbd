"""The KV pool's memory: zeroed, aligned, and resident before the first request."""

from __future__ import annotations

import sys

import pytest

from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.common.kv_layout import num_blocks_for_tokens
from kvduplex.engine.kv_cache import allocate_kv_pool
from kvduplex.engine.kv_cache import pool_base_address


def _resident_kib(addr: int) -> int:
    """Rss of the mapping that contains ``addr``, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/smaps")
def test_pool_pages_are_resident_and_zero_before_first_use() -> None:
    layout = KVCacheLayout(4, 64, 16, 2, 64, "float32")  # 4 MiB
    pool = allocate_kv_pool(layout)
    assert tuple(pool.shape) == layout.shape
    assert pool_base_address(pool) % 4096 == 0
    assert _resident_kib(pool_base_address(pool)) * 1024 >= layout.total_bytes
    assert int(pool.count_nonzero()) == 0


def test_num_blocks_for_tokens_rounds_up() -> None:
    assert [num_blocks_for_tokens(n, 4) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]
