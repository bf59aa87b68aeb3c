#!/usr/bin/env bash
# The distributed-training issue's GPU checks on one GPU, in under 7 minutes, with the machine's own torch:
#   bash bench/gpu_suite.sh [OUT_DIR]
# writes OUT_DIR/gpu_suite.json (default: $OUT where set, else ./bench-out). No install step, no network.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-bench-out}}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
export PYTHONPATH=src PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR="$out/inductor-cache"
timeout 420 python3 bench/gpu_suite.py --out "$out/gpu_suite.json" 2>&1 | tee "$out/gpu_suite.log"
status=${PIPESTATUS[0]}
[ -s "$out/gpu_suite.json" ] && cat "$out/gpu_suite.json"
exit "$status"
