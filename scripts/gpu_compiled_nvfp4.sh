#!/usr/bin/env bash
# After `source .device/setup.sh`: the NVFP4 model under torch.compile, never measured on a GPU before (session 36
# prepared it). 1. tests/test_compile_cuda.py (the GEMM as one op: compiled training bit for bit as eager);
# 2. bench_model.py's NVFP4 rows eager and compiled, each compiled row again with the GEMM op
# (--nvfp4-traced-ops-ab: the torch-ops forms against the default ops); 3. the CUDA suite's files that session 36's last call did not reach (REST=1).
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
      --rows NVFP4 --compiled-nvfp4 --nvfp4-traced-ops-ab --json "$OUT/model_compiled_nvfp4.json" 2>&1 \
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
