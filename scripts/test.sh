#!/usr/bin/env bash
# Sets up .venv if needed (with the test and lint tools), then runs lint, type checks,
# the import layers (import-linter, pyproject.toml) and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh nixl,bench,dev,store
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
.venv/bin/ruff check kvduplex tests benchmarks
.venv/bin/mypy
.venv/bin/lint-imports
.venv/bin/python -m pytest -q "$@"
