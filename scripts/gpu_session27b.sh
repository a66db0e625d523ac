#!/usr/bin/env bash
# Session 27, the torch-linked host path (fp_recipes._torch_ops, FP_RECIPES_TORCH_OPS): built by setup.sh's
# `pip install --no-build-isolation -e .`; its tests and the FP8 kernel / graph / host / GEMM files that now run
# through it; then host time A/B in one call (host_phases.py and bench_model.py --linear, on / off alternating).
#   source .device/setup.sh > $OUT/setup.log 2>&1 && bash scripts/gpu_session27b.sh
# Writes log.txt, pytest.txt, phases_{on,off}{1,2}.json, linear_{on,off}.json under $OUT (at most 8 files return).
set -o pipefail
OUT=${OUT:-/tmp/gpu_session27b_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
{
  nvidia-smi -L
  python3 -m fp_recipes doctor 2>&1 | grep -E "FP8 host path|backend:"
  if [ -z "${SKIP_TESTS:-}" ]; then
    echo "== pytest -m cuda (fast path and the FP8 files) $(date +%T)"
    timeout "${LIM_TEST:-260}" python3 -m pytest -q -m cuda -p no:cacheprovider -rfE --tb=short \
      tests/test_cuda_fast_ops.py tests/test_cuda_fp8_kernels.py tests/test_cuda_graphs.py tests/test_host_fp8_path.py \
      tests/test_host_sync.py tests/test_gemm_lt.py tests/test_compile_cuda.py tests/test_modules_linear.py \
      > "$OUT/pytest.txt" 2>&1
    echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -n 30; tail -n 2 "$OUT/pytest.txt"
  fi
  for round in 1 2; do
    for mode in on off; do
      v=auto; [ "$mode" = off ] && v=off
      echo "== host_phases ($mode, round $round) $(date +%T)"
      FP_RECIPES_TORCH_OPS=$v timeout 90 python3 benchmarks/host_phases.py --recipes off,delayed,current \
        --json "$OUT/phases_${mode}${round}.json" 2>&1 | grep -v Warning | tail -n 5
    done
  done
  for mode in on off; do
    v=auto; [ "$mode" = off ] && v=off
    echo "== bench_model --linear --no-compiled ($mode) $(date +%T)"
    FP_RECIPES_TORCH_OPS=$v timeout "${LIM_LIN:-75}" python3 benchmarks/bench_model.py --linear --no-compiled \
      --json "$OUT/linear_$mode.json" 2>&1 | grep -v Warning | tail -n 7
  done
} 2>&1 | tee "$OUT/log.txt"
