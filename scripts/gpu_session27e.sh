#!/usr/bin/env bash
# Session 27, run 6: the final tree on the GPU: the full CUDA suite (the torch-linked host path is the default
# there), compute-sanitizer memcheck over tests/sanitize_fp8.py (its planned casts now go through _torch_ops),
# and one more in-process host-path A/B at 4096^3.
#   source .device/setup.sh > $OUT/setup.log 2>&1 && bash scripts/gpu_session27e.sh
set -o pipefail
OUT=${OUT:-/tmp/gpu_session27e_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
{
  nvidia-smi -L
  git log --oneline -1 2>/dev/null || true
  python3 -m fp_recipes doctor 2>&1 | grep -E "FP8 host path|backend:"
  echo "== pytest -m cuda tests $(date +%T)"
  timeout "${LIM_TEST:-370}" python3 -m pytest -q -m cuda -p no:cacheprovider -rfE --tb=short tests \
    > "$OUT/pytest.txt" 2>&1
  echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -n 30; tail -n 2 "$OUT/pytest.txt"
  echo "== compute-sanitizer memcheck tests/sanitize_fp8.py $(date +%T)"
  timeout 100 compute-sanitizer --tool memcheck --kernel-name kns=fp_recipes python3 tests/sanitize_fp8.py \
    > "$OUT/san_memcheck.txt" 2>&1
  echo "rc=$?"; tail -n 3 "$OUT/san_memcheck.txt"
  echo "== host_phases --host-paths both --size 4096 $(date +%T)"
  timeout 60 python3 benchmarks/host_phases.py --recipes off,delayed,current --host-paths both --rounds 3 \
    --steps 200 --size 4096 --json "$OUT/phases_both_4096.json" 2>&1 | grep -v -E "Warning|run_backward"
} 2>&1 | tee "$OUT/log.txt"
