#!/usr/bin/env bash
# Sets up .venv if needed, then runs the main job: a local cluster on a built-in
# model serving a multi-turn session, printing what it measured.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvduplex up "$@"
