"""Small NIXL notifications keep no memory: UCX's mmap hooks (its default "bistro"
mode, in the UCX that NIXL's wheel bundles) made each one keep about 330 bytes of
its sender's memory for good, so an instance that sends a few per request grew
without bound. kvduplex turns the hooks off before NIXL is first imported
(`nixl_agent._import_nixl`), unless the environment names a mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.skips import skip_module_without_nixl

skip_module_without_nixl()
pytestmark = pytest.mark.timeout(180)

SCRIPT = Path(__file__).with_name("nixl_notif_memory.py")
ROOT = Path(__file__).resolve().parents[2]


def _measure(env_extra: dict[str, str], num: int = 10_000) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "UCX_MEM_MMAP_HOOK_MODE"}
    env.update(env_extra, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--num", str(num)],
        env=env, capture_output=True, text=True, timeout=150, check=True,
    )  # fmt: skip
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_ten_thousand_notifications_keep_no_memory() -> None:
    """10,000 notifications of 64 bytes: the process keeps under 100 bytes for each
    (about 330 with UCX's hooks on), and every one arrived."""
    result = _measure({})
    assert result["received"] == 10_000
    assert float(result["bytes_per_notification"]) < 100, result  # type: ignore[arg-type]
    assert result["hook_mode"] == "none"


def test_a_hook_mode_the_environment_names_is_kept() -> None:
    result = _measure({"UCX_MEM_MMAP_HOOK_MODE": "reloc"}, num=100)
    assert result["hook_mode"] == "reloc"
