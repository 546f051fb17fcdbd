"""Servers' queue and pool gauges sampled while a workload runs.

A counter says how much happened; where a request waited needs the gauges over time:
on a push pair, a request queued on decode for blocks (``num_requests_waiting``) waits
before prefill starts, one whose blocks decode holds while prefill computes
(``num_requests_waiting_for_remote_kv``) waits on prefill. `GaugeSampler` reads every
server's ``/metrics`` every `every_s` seconds in its own thread; `summary` gives each
gauge's mean, its share of samples above zero and its largest value.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field

from kvduplex.bench.prompt_sources import try_scrape
from kvduplex.bench.report import Samples
from kvduplex.bench.report import metric_sum

GAUGES = (
    "kvduplex_num_requests_running",
    "kvduplex_num_requests_waiting",
    "kvduplex_num_requests_waiting_for_remote_kv",
    "kvduplex_kv_blocks_in_use",
    "kvduplex_kv_blocks_total",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
)


@dataclass
class GaugeSampler:
    """Samples `gauges` of the servers in `urls` (name -> base URL) every `every_s` s.

    `series[server][gauge]` holds the values read, in order; a gauge a server does not
    export is left out. `start` takes the first sample at once; `stop` takes none and
    joins the thread.
    """

    urls: dict[str, str]
    every_s: float = 0.5
    gauges: tuple[str, ...] = GAUGES
    read: Callable[[str], Samples] = try_scrape
    series: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def __enter__(self) -> GaugeSampler:
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="gauge-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def _sample(self) -> None:
        for server, url in self.urls.items():
            got = self.read(url)
            names = {name for name, _ in got}
            row = self.series.setdefault(server, {})
            for gauge in self.gauges:
                if gauge in names:
                    row.setdefault(gauge, []).append(metric_sum(got, gauge))

    def summary(self) -> dict[str, dict[str, dict[str, float]]]:
        """Per server and gauge: ``mean``, ``busy`` (the share of samples above 0), ``max``
        and the number of samples ``n``."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        for server, row in self.series.items():
            for gauge, values in row.items():
                out.setdefault(server, {})[gauge] = {
                    "mean": sum(values) / len(values),
                    "busy": sum(v > 0 for v in values) / len(values),
                    "max": max(values),
                    "n": len(values),
                }
        return out
