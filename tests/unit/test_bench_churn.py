"""The churn soak reads each long-lived instance's peer tables, forgotten peers and
distinct peers met from its /metrics, and reports them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client import generate_latest

from benchmarks.bench_churn import Tally
from benchmarks.bench_churn import parse_peers
from benchmarks.bench_churn import report
from benchmarks.bench_churn import summarize
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
