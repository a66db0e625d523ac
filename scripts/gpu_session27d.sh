#!/usr/bin/env bash
# Session 27, run 5: the torch-linked host path with the FP8 GEMM branch in C++ (fp8_linear_gemm): tests, host
# time of both paths in one process (host_phases.py --host-paths both), the model at hidden 2048 with the Python
# host path's rows beside the default ones (bench_model.py --python-host-rows), one Linear 4096^3.
#   source .device/setup.sh > $OUT/setup.log 2>&1 && bash scripts/gpu_session27d.sh
set -o pipefail
OUT=${OUT:-/tmp/gpu_session27d_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
{
  nvidia-smi -L
  python3 -m fp_recipes doctor 2>&1 | grep -E "FP8 host path|backend:"
  echo "== pytest -m cuda $(date +%T)"
  timeout "${LIM_TEST:-200}" python3 -m pytest -q -m cuda -p no:cacheprovider -rfE --tb=short \
    tests/test_cuda_fast_ops.py tests/test_host_fp8_path.py tests/test_gemm_lt.py tests/test_cuda_graphs.py \
    tests/test_host_sync.py tests/test_modules_linear.py tests/test_compile_cuda.py ${EXTRA_TESTS:-} \
    > "$OUT/pytest.txt" 2>&1
  echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -n 30; tail -n 2 "$OUT/pytest.txt"
  for size in 256 4096; do
    echo "== host_phases --host-paths both --size $size $(date +%T)"
    timeout 150 python3 benchmarks/host_phases.py --recipes off,delayed,current --host-paths both --rounds 3 \
      --steps 200 --size $size --json "$OUT/phases_both_$size.json" 2>&1 | grep -v -E "Warning|run_backward"
  done
  echo "== bench_model --sizes h2048_t8192 --no-compiled --python-host-rows $(date +%T)"
  timeout 150 python3 benchmarks/bench_model.py --sizes h2048_t8192 --no-compiled --python-host-rows \
    --json "$OUT/model.json" 2>&1 | grep -v Warning | grep -E "^h2048" 
  echo "== bench_model --linear --no-compiled $(date +%T)"
  timeout 75 python3 benchmarks/bench_model.py --linear --no-compiled --json "$OUT/linear.json" 2>&1 \
    | grep -v Warning | tail -n 7
} 2>&1 | tee "$OUT/log.txt"
