"""Skips the test packages share."""

from __future__ import annotations

import importlib.util

import pytest


def nixl_installed() -> bool:
    """Whether a NIXL package (nixl_cu12 or nixl) is installed, without importing it."""
    return any(importlib.util.find_spec(name) is not None for name in ("nixl_cu12", "nixl"))


def skip_module_without_nixl() -> None:
    """Skip the calling test module when NIXL is not installed; call at module level."""
    if not nixl_installed():
        pytest.skip("NIXL is not installed (pip install nixl-cu12)", allow_module_level=True)
