"""A pull's lease on prefill's blocks ends when decode's READ settles, not at its
outcome: a READ that failed at its deadline may still be reading them (a deadline ends
the wait, not the transfer). Stepped in one thread (`tests.unit.flow_sim`)."""

from __future__ import annotations

import pytest

from kvduplex.model.loader import LoadedModel
from kvduplex.transport.base import Post
from tests.unit.flow_common import _reference
from tests.unit.flow_common import tiny as tiny  # the module-scoped model fixture
from tests.unit.flow_sim import Sim


def _read_fails_at_its_deadline(sim: Sim, tiny: LoadedModel, xid: str) -> None:
    """P prefills ``xid`` and holds it; D's READ of it fails at its deadline but stays
    unsettled; D computes its prompt itself and answers."""
    sim.pull(xid)
    sim.run(lambda: sim.finished(xid))
    sim.td.land_late_next(None)  # D's READ: FAILED at its deadline, lands when told
    sim.pull_decode(xid)
    sim.run(lambda: sim.finished(f"d-{xid}"))
    assert sim.outputs[f"d-{xid}"] == _reference(tiny)
    assert sim.df.pull.stats.num_failed == 1
    assert sim.td.num_late() == 1, "the READ may still land"
    sim.step()
    assert xid in sim.p.scheduler._held, "P let its blocks go under a READ that may land"
    assert sim.df.pull.num_in_flight() == 1


def test_the_lease_is_held_until_a_late_read_lands(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = Sim(tiny, monkeypatch, wait_s=1.0, transfer_timeout_s=30.0)
    _read_fails_at_its_deadline(sim, tiny, "pl")
    source = list(sim.p.scheduler._held["pl"].block_ids)
    problems: list[str] = []

    def check(post: Post) -> None:  # just before the late READ reads P's blocks
        if "pl" not in sim.p.scheduler._held:
            problems.append("P released the lease")
        problems.extend(f"block {b} free" for b in source if sim.p.block_pool.ref_count(b) < 1)

    assert sim.td.land_late(check) == 1
    assert problems == []
    sim.settle()
    assert "pl" not in sim.p.scheduler._held, "the settled READ released the lease"
    assert sim.df.pull.num_in_flight() == 0
    sim.assert_clean()


def test_the_lease_is_held_until_a_late_reads_endpoint_is_torn_down(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The READ never lands: D tears its endpoint down (which settles it) and only then
    releases P's lease."""
    sim = Sim(tiny, monkeypatch, wait_s=1.0, transfer_timeout_s=30.0)
    _read_fails_at_its_deadline(sim, tiny, "pt")
    sim.run(lambda: sim.td.num_late() == 0)  # D's check tears the endpoint down
    sim.settle()
    assert "pt" not in sim.p.scheduler._held
    assert sim.df.pull.num_in_flight() == 0
    sim.assert_clean()
