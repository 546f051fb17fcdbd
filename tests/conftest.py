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


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave with the session's status once pytest is done, skipping the interpreter's
    teardown: native transport objects the tests made in this process have crashed in
    it (SIGSEGV after every test passed), as `kvduplex serve` skips it too."""
    if _EXIT_STATUS and not hasattr(config, "workerinput"):
        import logging
        import sys

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])
