#!/usr/bin/env bash
# Creates .venv and installs kvduplex with its test tools. Idempotent: a second
# run with nothing changed only checks. GPU users: install your own torch into
# .venv first (or set KVDUPLEX_TORCH_SPEC), and this script keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
STAMP=.venv/.kvduplex-setup
if [[ -f "$STAMP" && "$STAMP" -nt pyproject.toml && "$STAMP" -nt scripts/setup.sh ]]; then
    exit 0
fi
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    # The CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
    "${PIP[@]}" "${KVDUPLEX_TORCH_SPEC:-torch==2.13.0}"
fi
"${PIP[@]}" -e ".[nixl,dev]"
touch "$STAMP"
