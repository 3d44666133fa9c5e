#!/usr/bin/env bash
# The whole evaluation pipeline on the built-in pair (SmolLM2-135M-Instruct + its caddtree
# drafter, bfloat16), sized for a 2-core CPU: a quick profile, a small bench at temperatures 0
# and 1 with the cost-model ablations, and the report. Run from the repository root.
set -euo pipefail
out=docs/results/pipeline
caddtree profile --quick --out "$out/cost.json" --plot "$out/fig4_cost_profile.png"
caddtree bench --cost-model "$out/cost.json" --datasets gsm8k mt-bench --max-samples 2 \
    --max-new-tokens 64 --methods ar dflash ddtree caddtree --budgets 4 16 64 --ablations \
    --max-budget 256 --temperatures 0 1 --out "$out/results.jsonl"
caddtree report "$out/results.jsonl" --out "$out" --cost-model "$out/cost.json"
