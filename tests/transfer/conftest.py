"""Fixtures of the transfer tests: peer processes on 127.0.0.1, always stopped."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.transfer.peer_procs import PeerLauncher


@pytest.fixture(scope="module")
def peers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerLauncher]:
    """A launcher whose peers are all stopped when the module's tests are done."""
    launcher = PeerLauncher(tmp_path_factory.mktemp("peers"))
    yield launcher
    launcher.stop_all()
