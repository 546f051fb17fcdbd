"""Push jobs that fail while their prefill still runs, over the in-process transport:
prefill must not keep the request's blocks once nobody will take its KV.

P and D are stepped in one thread (`tests.unit.flow_sim`)."""

from __future__ import annotations

import pytest

from kvduplex.model.loader import LoadedModel
from tests.unit.flow_common import PROMPT
from tests.unit.flow_common import _reference
from tests.unit.flow_common import tiny as tiny  # the module-scoped model fixture
from tests.unit.flow_sim import Sim

LONG = PROMPT * 4  # 72 tokens: 18 steps of 4 tokens on P


def test_write_failing_mid_prefill_frees_prefills_blocks(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first chunk's WRITE fails: the job ends at once, long before P's prefill does.
    P stops the prefill (its KV goes nowhere) and holds nothing; D computes the prompt."""
    s = Sim(tiny, monkeypatch, p_budget=4)
    s.tp.fail_next("link down")
    s.push_decode("xm", LONG)
    s.run(lambda: "xm" in s.pf.sender._early)  # D registered: P streams from its first chunk
    s.push_prefill("xm", LONG)
    s.run(lambda: s.finished("xm") and s.finished("d-xm"))
    assert s.outputs["d-xm"] == _reference(tiny, LONG)
    assert s.pf.sender.stats.num_failed == 1 and s.df.push.stats.num_fallbacks == 1
    assert s.outputs["xm"] == [], "P's prefill was stopped before its first token"
    assert s.finish["xm"] == "abort"
    s.assert_clean()
