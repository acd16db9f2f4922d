#!/usr/bin/env bash
# The one prepared script for a lent GPU machine, and CI's CPU rehearsal of it (.ci/run):
#   bash benchmarks/gpu_check.sh [--smoke] [--gpus N] [--out DIR] [--budget-s S] [--only STEP ...]
# Runs benchmarks/gpu_check.py from the repository root with this machine's python3 (or $PYTHON):
# wheel, rotary, dump, train, ttt, eval, plan. Writes $OUT/gpu_check.json (or --out DIR, else a
# temporary folder) and the launched commands' logs beside it; prints one line per step and
# `BENCH gpu_check_steps_passed|failed <n> count`. Exit status 1 if a step failed (skipped is fine).
# Without CUDA every step runs at CPU sizes and the GPU-only parts are reported as skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"  # python3: the one a lent GPU machine holds torch in
exec "$PYTHON" benchmarks/gpu_check.py "$@"
