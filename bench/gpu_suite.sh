#!/usr/bin/env bash
# The GPU checks (training, kernels, precision) on one GPU, with the machine's own torch:
#   bash bench/gpu_suite.sh [OUT_DIR]                  # both parts: under 11 minutes
#   PARTS=ledger bash bench/gpu_suite.sh [OUT_DIR]     # one part: 'ledger' (under 3 minutes) or 'suite' (under 8)
# writes OUT_DIR/build_ledger.json (every entry point's build at FLUX width against the planner's figure, then a LoRA
# DPO step and a sample on an nf4 base against the planner's per-GPU figure: bench/build_ledger.py) and OUT_DIR/gpu_suite.json (default: $OUT where set, else ./bench-out). No network: wheels put in bench/wheels/
# beforehand (pip download torchao==0.18.0 --no-deps -d bench/wheels) are installed from there when the machine's
# Python lacks them; without torchao the precision figures say "not run".
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-bench-out}}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
export PYTHONPATH=src PYTHONUNBUFFERED=1
if ls bench/wheels/*.whl >/dev/null 2>&1 && ! python3 -c "import torchao" >/dev/null 2>&1; then
  pylib="$(mktemp -d)"
  python3 -m pip install -q --no-deps --no-index --target "$pylib" bench/wheels/*.whl \
    && export PYTHONPATH="src:$pylib"
fi
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d)}"   # not under OUT: its files would travel back
parts="${PARTS:-ledger suite}"
status=0
if [[ " $parts " == *" ledger "* ]]; then
  timeout 180 python3 bench/build_ledger.py --device cuda --width 3072 --steps --out "$out/build_ledger.json" \
    > "$out/build_ledger.log" 2>&1 || status=$?
  [ -s "$out/build_ledger.json" ] && cat "$out/build_ledger.json" || tail -20 "$out/build_ledger.log"
fi
if [[ " $parts " == *" suite "* ]]; then
  timeout 480 python3 bench/gpu_suite.py --out "$out/gpu_suite.json" 2>&1 | tee "$out/gpu_suite.log"
  suite=${PIPESTATUS[0]}
  [ "$suite" -ne 0 ] && status=$suite
  [ -s "$out/gpu_suite.json" ] && cat "$out/gpu_suite.json"
fi
exit "$status"
