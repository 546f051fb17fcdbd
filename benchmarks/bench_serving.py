"""Disaggregated serving benchmark (not a test): colocated / pull / push in one run.

    .venv/bin/python benchmarks/bench_serving.py --model small
    .venv/bin/python benchmarks/bench_serving.py --model kv-heavy --netns --link-gbit 10
    .venv/bin/python benchmarks/bench_serving.py --quick

Also reachable as ``kvduplex bench``. Writes results/serving-<model>[-netns].json
and .md (see `kvduplex.bench.serving` for what runs where).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import write_results
from kvduplex.bench.serving import ServingBenchSettings
from kvduplex.bench.serving import main
from kvduplex.common.settings import load_settings


def cli() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the cluster
    try:
        args = load_settings(ServingBenchSettings, sys.argv[1:])
    except ValueError as exc:  # a flag to change: say which, no traceback
        print(f"bench_serving: error: {exc}", file=sys.stderr)
        sys.exit(2)
    result = main(args)
    name = f"serving-{result['options']['model']}" + ("-netns" if args.netns else "")
    path = write_results(name, result, result["table"])
    print(f"wrote {path}")


if __name__ == "__main__":
    cli()
