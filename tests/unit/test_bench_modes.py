"""Mode names of the multi-turn benchmark, with a prefill pool of their own (``@``)."""

import pytest

from kvduplex.bench.agentic_modes import PrefillPool
from kvduplex.bench.agentic_modes import modes_named


def test_a_pool_suffix_gives_the_mode_its_own_prefill_pool_and_tier() -> None:
    plain, small, tiered = modes_named(["push+duplex", "push+duplex@256", "push@512+file"])
    assert plain.prefill_pool is None
    assert (small.name, small.prefill_pool) == ("push+duplex@256", PrefillPool(256))
    assert small.router_flags == plain.router_flags  # the mode's routing is unchanged
    assert tiered.kv_mode == "push"
    assert tiered.prefill_pool == PrefillPool(512, "file")
    assert tiered.prefill_pool.serve_flags() == [
        "--eviction", "session", "--kv-tier", "file", "--kv-tier-gib", "2"
    ]  # fmt: skip
    assert PrefillPool(256).serve_flags() == ["--eviction", "session"]
    (lru,) = modes_named(["push+duplex@256+file+lru"])
    assert lru.prefill_pool == PrefillPool(256, "file", "lru")
    assert lru.prefill_pool.label == "256+file+lru"


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("colocated@256", "only a mode with prefill instances"),
        ("push@0", "a prefill pool is"),
        ("push@big", "a prefill pool is"),
        ("push@256+disk", "a prefill pool is"),
        ("push@256+file+host", "a prefill pool is"),
        ("pushy@256", "unknown modes"),
    ],
)
def test_a_bad_pool_or_mode_is_refused_by_name(name: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        modes_named([name])
