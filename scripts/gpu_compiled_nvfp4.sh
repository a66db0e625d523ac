#!/usr/bin/env bash
# After `source .device/setup.sh`: the NVFP4 model under torch.compile (session 37: each GEMM and SR cast one op).
# 1. tests/test_compile_cuda.py (TEST_K: a -k filter, e.g. "nvfp4" or "reduce_overhead"); 2. bench_model.py's NVFP4
# rows eager and compiled at SIZES, each compiled row again with the torch-ops forms (--nvfp4-traced-ops-ab; NO_AB=1
# skips them); 3. with REST=1, the CUDA suite from REST_FROM on (alphabetical).
# Logs and JSON in $OUT. Limits: LIM_TEST, LIM_MODEL, LIM_REST.
set -o pipefail
OUT=${OUT:-/tmp/gpu_compiled_nvfp4_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
{
  git log --oneline -1 2>/dev/null || true
  echo "== test_compile_cuda.py ($(date +%T))"
  timeout -k 10 "${LIM_TEST:-240}" python3 -m pytest -q -m cuda -p no:cacheprovider --tb=short tests/test_compile_cuda.py ${TEST_K:+-k "$TEST_K"} \
      > "$OUT/pytest_compile.txt" 2>&1
  echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_compile.txt" | head -n 20; tail -n 1 "$OUT/pytest_compile.txt"
  echo "== bench_model NVFP4 eager + compiled ($(date +%T))"
  timeout -k 10 "${LIM_MODEL:-420}" python3 benchmarks/bench_model.py --sizes "${SIZES:-h2048_t8192,h4096_t4096}" \
      --rows NVFP4 --compiled-nvfp4 $([ -n "${NO_AB:-}" ] || echo --nvfp4-traced-ops-ab) --json "$OUT/model_compiled_nvfp4.json" 2>&1 \
      | grep -v Warning | tail -n 14
  if [ -n "${REST:-}" ]; then
    echo "== the rest of the CUDA suite ($(date +%T))"
    # session 36 run 6 stopped in test_grouped_padded_rows.py (821 of 1419 tests, alphabetical): that file on
    files=$(ls tests/test_*.py | sort | awk -v from="${REST_FROM:-tests/test_grouped_padded_rows.py}" '$0 >= from')
    timeout -k 10 "${LIM_REST:-300}" python3 -m pytest -q -m cuda -p no:cacheprovider --tb=short $files \
        > "$OUT/pytest_rest.txt" 2>&1
    echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_rest.txt" | head -n 20; tail -n 1 "$OUT/pytest_rest.txt"
  fi
  echo "== done ($(date +%T))"
} 2>&1 | tee "$OUT/log.txt"
