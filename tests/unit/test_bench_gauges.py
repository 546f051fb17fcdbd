"""`GaugeSampler`: each server's gauges read over a run, summed over label sets, and
summarised as mean, share of samples above zero and largest value."""

from __future__ import annotations

from kvduplex.bench.gauges import GaugeSampler
from kvduplex.bench.report import Samples

WAITING = "kvduplex_num_requests_waiting"
REMOTE = "kvduplex_num_requests_waiting_for_remote_kv"


def test_a_sample_is_taken_on_entry_and_each_server_keeps_only_its_own_gauges() -> None:
    pages: dict[str, Samples] = {
        "http://p": {(WAITING, ()): 2.0, ("kvduplex_other_total", ()): 9.0},
        "http://d": {(WAITING, ()): 0.0, (REMOTE, (("engine", "0"),)): 1.0,
                     (REMOTE, (("engine", "1"),)): 2.0},
        "http://gone": {},
    }  # fmt: skip
    with GaugeSampler({"P": "http://p", "D": "http://d", "X": "http://gone"},
                      every_s=3600, read=pages.__getitem__) as sampler:  # fmt: skip
        pass
    assert sampler.series == {"P": {WAITING: [2.0]}, "D": {WAITING: [0.0], REMOTE: [3.0]}, "X": {}}


def test_the_summary_gives_mean_busy_share_and_max() -> None:
    sampler = GaugeSampler({}, series={"D": {WAITING: [0.0, 2.0, 4.0, 0.0]}})
    assert sampler.summary() == {"D": {WAITING: {"mean": 1.5, "busy": 0.5, "max": 4.0, "n": 4}}}
