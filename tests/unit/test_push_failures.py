"""Push jobs that fail while their prefill still runs, over the in-process transport:
prefill must not keep the request's blocks once nobody will take its KV."""

from __future__ import annotations

import asyncio

from kvduplex.model.loader import LoadedModel
from tests.unit.flow_pair import PROMPT
from tests.unit.flow_pair import Pair
from tests.unit.flow_pair import _reference
from tests.unit.flow_pair import tiny as tiny  # the module-scoped model fixture

LONG = PROMPT * 4  # 72 tokens: 18 steps of 4 tokens on P


def test_write_failing_mid_prefill_frees_prefills_blocks(tiny: LoadedModel) -> None:
    """The first chunk's WRITE fails: the job ends at once, long before P's prefill does.
    P stops the prefill (its KV goes nowhere) and holds nothing; D computes the prompt."""
    with Pair(tiny, p_budget=4) as s:
        s.tp.fail_next("link down")

        async def both() -> tuple[list[int], list[int]]:
            return await asyncio.gather(s.prefill("xm", LONG), s.decode("xm", LONG))

        p_out, d_out = asyncio.run(both())
        assert d_out == _reference(tiny, LONG)
        assert s.sender.stats.num_failed == 1 and s.push.stats.num_fallbacks == 1
        assert p_out == [], "P's prefill was stopped before its first token"
        s.assert_clean()
