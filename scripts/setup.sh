#!/usr/bin/env bash
# Create .venv (if missing) with the CPU build of torch and caddtree installed in editable mode.
# torch is installed first, pinned, so that pip never resolves it on its own (that would pull a
# multi-GB CUDA build). Extra groups to install can be passed as arguments, e.g. `test`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
extras=$(IFS=,; echo "$*")
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}"
