"""Multi-turn agentic benchmark (not a test): every KV mode side by side on local instances.

    .venv/bin/python benchmarks/bench_agentic.py                  # small preset, ~45 min
    .venv/bin/python benchmarks/bench_agentic.py --quick          # smoke run on tiny
    .venv/bin/python benchmarks/bench_agentic.py --modes colocated,push,push+duplex --shapes reasoning
    .venv/bin/python benchmarks/bench_agentic.py --url http://127.0.0.1:8000 --label other-system
    .venv/bin/python benchmarks/bench_agentic.py --model long --shapes coding_agent --length-scale 0.1 \
        --kv-cache-mb 128 --oversubscription 2          # sessions whose KV is 2x P's pool

Also reachable as ``kvduplex bench --workload agentic``. Writes
results/agentic-<model>.json, .md and .png (see `kvduplex.bench.agentic_cli`).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvduplex.bench.agentic_cli import AgenticBenchSettings
from kvduplex.bench.agentic_cli import main
from kvduplex.common.settings import load_settings

REPO = Path(__file__).resolve().parent.parent


def cli() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the cluster
    try:
        # results/ of the repository unless --results-dir names another (the later flag wins)
        main(load_settings(AgenticBenchSettings, ["--results-dir", str(REPO / "results"), *sys.argv[1:]]))
    except ValueError as exc:  # a flag to change: say which, no traceback
        print(f"bench_agentic: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli()
