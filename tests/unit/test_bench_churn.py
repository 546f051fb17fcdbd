"""The churn soak reads each long-lived instance's peer tables, forgotten peers and
distinct peers met from its /metrics, and reports them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client import generate_latest

from benchmarks.bench_churn import Tally
from benchmarks.bench_churn import parse_peers
from benchmarks.bench_churn import report
from benchmarks.bench_churn import summarize
from benchmarks.soak import MAPPING_CLASSES
from benchmarks.soak import MappingClassUsage
from benchmarks.soak import parse_smaps
from kvduplex.transport.metrics import TransferMetrics
from kvduplex.transport.peer_usage import ForgetReason


def _exposition(num_met: int, num_idle: int, peers: tuple[int, int]) -> str:
    registry = CollectorRegistry()
    metrics = TransferMetrics(registry)
    for _ in range(num_met):
        metrics.on_peer_met()
    for _ in range(num_idle):
        metrics.on_peer_forgotten(ForgetReason.IDLE)
    metrics.on_peers(*peers)
    return generate_latest(registry).decode()


def test_an_instances_metrics_give_its_tables_forgotten_and_met_peers() -> None:
    got = parse_peers(_exposition(num_met=7, num_idle=4, peers=(3, 2)))
    assert got == {"transport": 3, "directory": 2, "forgotten_idle": 4, "met": 7}


def test_the_report_gives_the_peers_each_long_lived_instance_met() -> None:
    """Samples over time: the summary keeps the last peers met, the RSS slope after the
    warm-up, and the table has a peers-met column."""
    samples = [
        {"t_s": float(t), "prefill-long-lived": {
            "rss_mib": 400.0 + t / 60, **parse_peers(_exposition(t // 10, t // 20, (2, 2))),
        }}
        for t in range(0, 400, 10)
    ]  # fmt: skip
    summary = summarize(samples, ["prefill-long-lived"], warmup_s=60.0)
    s = summary["prefill-long-lived"]
    assert s["peers_met"] == 39
    assert s["forgotten_end"] == {"idle": 19}
    assert abs(s["rss_slope_mib_per_min"] - 1.0) < 1e-9
    table = report(summary, Tally(), num_started=44, minutes=20)
    assert "| peers met |" in table.splitlines()[4]
    assert table.splitlines()[6].endswith("| 39 |")


SMAPS = """\
55d0c8a3e000-55d0c8a5f000 rw-p 00000000 00:00 0                          [heap]
Size:                132 kB
Rss:                 100 kB
Private_Dirty:        96 kB
VmFlags: rd wr mr mw me ac sd
7f0000000000-7f0000021000 rw-p 00000000 00:00 0
Rss:                  40 kB
Private_Dirty:        40 kB
7f0000100000-7f0000200000 r-xp 00001000 08:01 1234                       /usr/lib/x86_64-linux-gnu/libc.so.6
Rss:                 800 kB
Private_Dirty:         0 kB
7f0000300000-7f0000301000 r--p 00000000 08:01 99                         /venv/lib/torch/_C.cpython-312-x86_64-linux-gnu.so
Rss:                   4 kB
Private_Dirty:         4 kB
7f0000400000-7f0000401000 r--p 00000000 08:01 77                         /models/tiny/model weights.safetensors
Rss:                  12 kB
Private_Dirty:         0 kB
7f0000500000-7f0000501000 rw-s 00000000 00:01 5                          /dev/shm/ucx_seg (deleted)
Rss:                   8 kB
Private_Dirty:         0 kB
7f0000600000-7f0000601000 rw-p 00000000 00:00 0                          [anon:glibc: malloc arena]
Rss:                   4 kB
Private_Dirty:         4 kB
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]
Rss:                  16 kB
Private_Dirty:        16 kB
7ffd00100000-7ffd00102000 r-xp 00000000 00:00 0                          [vdso]
Rss:                   4 kB
Private_Dirty:         0 kB
"""


def test_smaps_is_summed_by_mapping_class() -> None:
    got = parse_smaps(SMAPS)
    assert set(got) == set(MAPPING_CLASSES)
    assert got["heap"] == MappingClassUsage(num_mappings=1, rss_kib=100, private_dirty_kib=96)
    assert got["anon"] == MappingClassUsage(num_mappings=2, rss_kib=44, private_dirty_kib=44)
    assert got["lib"] == MappingClassUsage(num_mappings=2, rss_kib=804, private_dirty_kib=4)
    assert got["file"] == MappingClassUsage(num_mappings=1, rss_kib=12, private_dirty_kib=0)
    assert got["shm"] == MappingClassUsage(num_mappings=1, rss_kib=8, private_dirty_kib=0)
    assert got["stack"] == MappingClassUsage(num_mappings=1, rss_kib=16, private_dirty_kib=16)
    assert got["other"] == MappingClassUsage(num_mappings=1, rss_kib=4, private_dirty_kib=0)


def test_the_report_gives_each_classs_slope_after_the_warm_up() -> None:
    """The anonymous mappings grow by 2 MiB a minute after the warm-up (and jump during
    it), the heap stays flat: the summary and the table say so per class."""

    def smaps(t: int) -> dict[str, dict[str, float]]:
        anon = (50.0 if t < 60 else 100.0) + 2 * t / 60
        return {c: {"n": 3, "rss_mib": 10.0, "private_dirty_mib": 1.0} for c in MAPPING_CLASSES} | {
            "anon": {"n": 9, "rss_mib": anon, "private_dirty_mib": anon}
        }

    samples = [
        {"t_s": float(t), "prefill-long-lived": {"rss_mib": 400.0, "threads": 30,
                                                 "smaps": smaps(t)}}
        for t in range(0, 400, 10)
    ]  # fmt: skip
    s = summarize(samples, ["prefill-long-lived"], warmup_s=60.0)["prefill-long-lived"]
    assert abs(s["by_class"]["anon"]["rss_slope_mib_per_min"] - 2.0) < 1e-9
    assert abs(s["by_class"]["anon"]["private_dirty_slope_mib_per_min"] - 2.0) < 1e-9
    assert abs(s["by_class"]["heap"]["rss_slope_mib_per_min"]) < 1e-9
    assert abs(s["by_class"]["all"]["private_dirty_slope_mib_per_min"] - 2.0) < 1e-9
    assert s["by_class"]["all"]["mappings_end"] == 3 * (len(MAPPING_CLASSES) - 1) + 9
    assert s["by_class"]["anon"]["mappings_end"] == 9
    assert s["threads_end"] == 30
    table = report({"prefill-long-lived": s}, Tally(), num_started=2, minutes=6)
    assert "| prefill-long-lived | anon | 113.0 | +2.00 | +2.00 | 9 |" in table
