"""PullConnector over the in-process transport: READ, failure fallback, abort mid-READ.

P and D are stepped in one thread (`tests.unit.flow_sim`); decode's release of a lease
ends P's held prefill and is recorded (`Sim.released`)."""

from __future__ import annotations

import pytest

from kvduplex.engine.request import Request
from kvduplex.model.loader import LoadedModel
from tests.unit.flow_common import FIRST
from tests.unit.flow_common import PROMPT
from tests.unit.flow_common import _reference
from tests.unit.flow_common import tiny as tiny  # the module-scoped model fixture
from tests.unit.flow_sim import Sim


def _setup(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, deadline_s: float = 5.0) -> Sim:
    return Sim(
        tiny, monkeypatch, wait_s=deadline_s, transfer_timeout_s=deadline_s, quarantine_s=1.0
    )


def _prefill(s: Sim, xid: str) -> None:
    """P prefills ``xid`` to its first token and holds its blocks for the READ."""
    s.pull(xid)
    s.run(lambda: s.finished(xid))
    assert len(s.outputs[xid]) == 1, "P's first token"


def test_pull_reads_prefill_blocks_and_matches_local(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = _setup(tiny, monkeypatch)
    _prefill(s, "x1")
    s.pull_decode("x1")
    s.run(lambda: s.finished("d-x1"))
    assert s.outputs["d-x1"] == _reference(tiny)
    assert s.df.pull.stats.num_pulled_blocks == 5 and s.df.pull.stats.num_failed == 0
    assert s.released == [("http://p", "x1")]
    s.d.check_integrity()
    assert s.in_use(s.d) == 0


def test_failed_read_falls_back_to_local_prefill(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = _setup(tiny, monkeypatch)
    _prefill(s, "x2")
    s.td.fail_next("boom")
    s.pull_decode("x2")
    s.run(lambda: s.finished("d-x2"))
    assert s.outputs["d-x2"] == _reference(tiny)
    assert s.df.pull.stats.num_failed == 1 and s.df.pull.stats.num_pulled_blocks == 0
    assert s.released == [("http://p", "x2")]


def test_abort_during_read_keeps_targets_until_it_ends(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The READ ends when the test disconnects, not at a deadline.
    s = _setup(tiny, monkeypatch, deadline_s=60)
    _prefill(s, "x3")
    s.td.hang_next()

    def read_in_flight() -> bool:
        return s.d.connector.has_pending_work()

    s.pull_decode("x3")
    s.run(read_in_flight)  # the READ is posted
    s.ad.abort("d-x3")  # the client leaves (an engine command)
    s.step()
    # The READ may still land, so its targets stay allocated.
    assert s.d.scheduler.get_request("d-x3") is None and s.finish["d-x3"] == "abort"
    assert s.in_use(s.d) == 5 and read_in_flight()
    s.td.disconnect(s.p_peer)  # the hung READ fails now
    s.run(lambda: not read_in_flight())
    assert s.in_use(s.d) == 0
    assert s.df.pull.stats.num_failed == 1
    s.d.check_integrity()


def test_cached_tokens_are_prefills_prefix_hits(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D computed nothing: the usage it reports counts what P served from its cache."""
    s = _setup(tiny, monkeypatch)
    s.p.add_request(Request("warm", PROMPT, FIRST))  # P caches PROMPT's blocks
    s.run(lambda: s.finished("warm"))
    _prefill(s, "x3")
    spec = s.pull_spec("x3")
    assert spec.num_cached_tokens == 16  # 4 full blocks of 4; the partial one is computed
    s.pull_decode("x3")
    s.run(lambda: s.finished("d-x3"))
    last = s.last["d-x3"]
    assert last.num_cached_tokens == 16 and last.num_local_cached_tokens == 0
