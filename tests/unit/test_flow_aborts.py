"""Aborts at every moment of a push or a pull: the engine tells the connector
(`request_finished`, also for a request that never reached the scheduler), the peer stops
its part, and afterwards every flow table is empty and both pools are clean.

P and D are stepped in one thread (`tests.unit.flow_sim`); a client leaving is the
abort its engine front queues (`AsyncEngine.abort`), or a request dropped before the
engine took it (`drop_unadded`)."""

from __future__ import annotations

import asyncio

import pytest

from kvduplex.engine.request import RemoteKVSpec
from kvduplex.engine.request import Request
from kvduplex.model.loader import LoadedModel
from tests.unit.flow_common import GREEDY
from tests.unit.flow_common import PROMPT
from tests.unit.flow_common import _reference
from tests.unit.flow_common import tiny as tiny  # the module-scoped model fixture
from tests.unit.flow_sim import Sim

LONG = PROMPT * 4  # 72 tokens: 18 steps of 4 tokens on P with p_budget=4


def _tables_empty(s: Sim) -> None:
    s.run(lambda: not s.busy_tables())  # every flow table empties


def test_decode_aborted_while_waiting_for_pushed_kv_stops_the_prefill(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch, p_budget=4)
    s.push("xa", LONG)
    s.run(lambda: s.pf.sender.stats.num_writes >= 1)  # the first WRITEs
    s.ad.abort("d-xa")
    s.run(lambda: s.finished("xa"))
    assert s.outputs["xa"] == [], "P's prefill was stopped before its first token"
    assert s.pf.sender.stats.num_failed == 1
    assert s.df.push.stats.num_fallbacks == 0, "an abort is no fallback"
    _tables_empty(s)
    s.assert_clean()


def test_decode_aborted_before_admission_tells_prefill(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D's request is queued behind a long one when its client leaves: its spec goes,
    and P, told at once, never computes the prompt."""
    s = Sim(tiny, monkeypatch)
    registered = s.df.push.submit(s.push_spec("xb"))
    s.step()
    assert registered.result(0) is None
    s.df.push.on_aborted("xb")
    assert s.df.push.num_specs() == 0
    s.run(lambda: s.pf.sender.tables()["send_cancelled_tombstones"] == 1)  # P hears it
    try:
        s.push_prefill("xb")
    except ValueError:
        out: list[int] = []
    else:
        s.run(lambda: s.finished("xb"))
        out = s.outputs["xb"]
    assert out == [], "P refuses a prefill its decode already gave up"
    _tables_empty(s)
    s.assert_clean()


def test_prefill_aborted_mid_prefill_lets_decode_compute_at_once(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch, p_budget=4, wait_s=30)
    s.push("xc", LONG)
    s.run(lambda: s.pf.sender.stats.num_writes >= 1)  # the first WRITEs
    s.ap.abort("xc")
    s.run(lambda: s.finished("d-xc"))
    assert s.outputs["d-xc"] == _reference(tiny, LONG)
    assert s.clock.now - 1000.0 < 30.0 and s.df.push.stats.num_fallbacks == 1, (
        "well before D's 30 s wait"
    )
    _tables_empty(s)
    s.assert_clean()


def test_a_request_that_never_reached_the_engine_drops_its_push_spec(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch)
    registered = s.df.push.submit(s.push_spec("xd"))
    s.step()
    assert registered.result(0) is None
    s.d.drop_unadded(Request("d-xd", PROMPT, GREEDY, remote_kv=RemoteKVSpec("xd")))
    assert s.df.push.num_specs() == 0
    _tables_empty(s)


def test_pull_spec_of_an_aborted_request_releases_prefills_lease(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch)
    s.pull("xe")
    s.run(lambda: s.finished("xe"))
    registered = s.df.pull.submit(s.pull_spec("xe"))
    s.step()
    assert registered.result(0) is None
    s.d.drop_unadded(Request("d-xe", PROMPT, GREEDY, remote_kv=RemoteKVSpec("xe")))
    assert s.df.pull.num_specs() == 0
    assert s.released == [("http://p", "xe")], "the lease's release"


def test_pull_spec_whose_request_never_arrives_is_swept(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch, wait_s=0.2, transfer_timeout_s=0.2, quarantine_s=1.0)
    s.pull("xf")
    s.run(lambda: s.finished("xf"))
    s.df.pull.register(s.pull_spec("xf"))
    s.run(lambda: s.df.pull.num_specs() == 0)  # the orphan spec goes
    assert s.released == [("http://p", "xf")], "the lease's release"


def test_prefill_aborted_before_its_job_refuses_the_acknowledged_registration(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D registered first (P acknowledged it and kept it for the job to come); P's request
    is then dropped before its job began: D hears KVFailed at once, not after its wait."""
    s = Sim(tiny, monkeypatch, wait_s=30)
    s.push_decode("xg")
    s.run(lambda: s.pf.sender.tables()["send_early_registrations"] == 1)  # reached P
    s.p.drop_unadded(Request("xg", PROMPT, GREEDY))
    s.run(lambda: s.finished("d-xg"), max_s=10)  # well before D's 30 s wait
    assert s.outputs["d-xg"] == _reference(tiny)
    assert s.df.push.stats.num_fallbacks == 1
    _tables_empty(s)
    s.assert_clean()


def test_a_spec_registered_on_admit_goes_with_a_request_that_never_reached_the_engine(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode registers a request's spec as its ``on_admit``; a client that leaves while
    the request is queued for the engine still has it registered and then dropped with
    the request (a pull's lease is released at once, as before the spec moved there)."""
    s = Sim(tiny, monkeypatch)
    ran: list[str] = []
    spec = s.push_spec("xq")

    def admit() -> None:
        s.df.push.register(spec)
        ran.append(spec.xid)

    async def leave() -> None:
        req = Request("d-xq", PROMPT, GREEDY, remote_kv=RemoteKVSpec("xq"))
        outputs = s.ad.generate(req, on_admit=admit)
        first = asyncio.ensure_future(outputs.__anext__())
        await asyncio.sleep(0)  # one turn of the loop: the request is queued for the engine
        assert not s.ad._inbox.empty() and not ran, "queued, not taken yet"
        first.cancel()  # the client leaves before the engine takes the request
        await asyncio.gather(first, return_exceptions=True)
        await outputs.aclose()  # type: ignore[attr-defined]

    asyncio.run(leave())
    s.step()  # the engine thread takes its commands now
    assert ran == ["xq"], "the spec registered as the request is dropped"
    assert s.df.push.num_specs() == 0
    _tables_empty(s)
