#!/usr/bin/env bash
# Set up .venv (see setup.sh) and run the whole test suite: lint, then pytest, one worker per
# core (pytest-xdist), with the slowest tests listed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test plot serve
.venv/bin/ruff check src tests benchmarks scripts
.venv/bin/python -m pytest -q -n auto --durations=15
