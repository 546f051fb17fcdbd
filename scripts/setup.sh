#!/usr/bin/env bash
# Creates .venv and installs kvduplex with an extra set of dependencies:
#   bash scripts/setup.sh [EXTRAS]      (or KVDUPLEX_EXTRAS=...; default: nixl,bench)
# nixl: the KV transport (prefill and decode roles); bench: plots of `kvduplex bench`;
# dev: the test and lint tools (scripts/test.sh asks for nixl,bench,dev,store); store: the
# shared KV store tier (Mooncake; it also needs the system's libibverbs1).
# Idempotent per extra set: a second run with nothing changed only checks, and a run
# that asks for another set (run.sh, then test.sh) installs what that set adds.
# GPU users: install your own torch into .venv first (or set KVDUPLEX_TORCH_SPEC), and
# this script keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
EXTRAS="${1:-${KVDUPLEX_EXTRAS:-nixl,bench}}"
if [[ ! "$EXTRAS" =~ ^[a-z,]+$ ]]; then
    echo "setup.sh: extras are names separated by commas (e.g. nixl,bench,dev), got '$EXTRAS'" >&2
    exit 2
fi
STAMP=".venv/.kvduplex-setup-${EXTRAS//,/-}"
if [[ -f "$STAMP" && "$STAMP" -nt pyproject.toml && "$STAMP" -nt scripts/setup.sh ]]; then
    exit 0
fi
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    # The CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
    "${PIP[@]}" "${KVDUPLEX_TORCH_SPEC:-torch==2.13.0}"
fi
"${PIP[@]}" -e ".[$EXTRAS]"
touch "$STAMP"
