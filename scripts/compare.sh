#!/usr/bin/env bash
# The main job: compare decoders on the shipped cover-tiny model (accuracy, NFE, tokens/s,
# remasks, flip-flops) on every task's held-out split. Installs what it needs first.
# Extra arguments go to `cover-vllm eval` (e.g. --num 50 for a quick look).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
mkdir -p bench_out
.venv/bin/cover-vllm eval --model cover-tiny --task all \
    --decoding low_confidence,threshold,factor,wino,saber,asrd,cover --tokens-per-step 1,2,4 \
    --num 200 --json bench_out/compare.json "$@"
