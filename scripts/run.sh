#!/usr/bin/env bash
# Sets up .venv if needed (kvduplex with NIXL and the benchmark's plots; no test tools),
# then runs the main job: a local cluster on a built-in model serving a multi-turn
# session, printing what it measured.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh nixl,bench
exec .venv/bin/kvduplex up "$@"
