from __future__ import annotations

import os

import pytest

# Keep torch from oversubscribing the two cores CI has when several processes run.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fault-trials", type=int, default=2,
        help="trials per fault and moment in tests/integration/test_faults.py (default 2)",
    )  # fmt: skip
