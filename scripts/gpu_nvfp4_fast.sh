#!/usr/bin/env bash
# The fast emulated NVFP4 GEMM's whole GPU check in one device call (after `source .device/setup.sh`):
# CUDA tests of the new kernels and the paths that use them, compute-sanitizer memcheck/racecheck over
# tests/sanitize_nvfp4_fast.py, the one-Linear 4096^3 profile and the model benchmark. Logs in $OUT.
set -o pipefail
OUT=${OUT:-/tmp/gpu_nvfp4_fast_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
LIM_TEST=${LIM_TEST:-120}
LIM_SAN=${LIM_SAN:-45}
LIM_LIN=${LIM_LIN:-50}
LIM_MODEL=${LIM_MODEL:-150}
MODEL_SIZES=${MODEL_SIZES:-h2048_t8192,h4096_t4096}
{
  echo "== nvidia-smi -L"; nvidia-smi -L
  git log --oneline -1 2>/dev/null || true
  python3 -c "import fp_recipes; i = fp_recipes.backend_info(); print(i['summary']); print(i['grouped_gemm'])"
  echo "== pytest -m cuda"
  timeout "$LIM_TEST" python3 -m pytest -q -m cuda -p no:cacheprovider --durations=5 \
      ${TEST_FILES:-tests/test_cuda_nvfp4_units.py tests/test_nvfp4_fast_gemm.py tests/test_modules_gemm.py \
      tests/test_gemm_lt.py tests/test_modules_linear.py tests/test_cuda_nvfp4_kernels.py} 2>&1 | tail -n 30
  echo "pytest rc=$?"
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  # racecheck (SAN_TOOLS="memcheck racecheck"): the quantize tile kernel uses shared memory
  for tool in ${SAN_TOOLS:-memcheck}; do
    echo "== compute-sanitizer --tool $tool"
    timeout "$LIM_SAN" "$SAN" --tool "$tool" python3 tests/sanitize_nvfp4_fast.py 2>&1 \
        | grep -vE "^========= (Program hit|    Saved host backtrace|        Host Frame)" | tail -n 12
    echo "$tool rc=$?"
  done
  echo "== bench_model --linear"
  timeout "$LIM_LIN" python3 benchmarks/bench_model.py --linear --json "$OUT/linear.json" 2>&1 | grep -v Warning
  echo "linear rc=$?"
  if [ -n "${QUANT_SHAPES:-}" ]; then
    echo "== bench_quantize_nvfp4 $QUANT_SHAPES"
    timeout "${LIM_QUANT:-90}" python3 benchmarks/bench_quantize_nvfp4.py --quick --shapes "$QUANT_SHAPES" \
        --json "$OUT/quantize.json" 2>&1 | grep -v Warning | tail -n 40
    echo "quantize rc=$?"
  fi
  echo "== bench_model $MODEL_SIZES"
  timeout "$LIM_MODEL" python3 benchmarks/bench_model.py --sizes "$MODEL_SIZES" ${MODEL_FLAGS:-} \
      --json "$OUT/model.json" 2>&1 | grep -v Warning
  echo "model rc=$?"
  if [ -n "${MODEL2_SIZES:-}" ]; then
    echo "== bench_model $MODEL2_SIZES (second set)"
    timeout "${LIM_MODEL2:-150}" python3 benchmarks/bench_model.py --sizes "$MODEL2_SIZES" ${MODEL2_FLAGS:-} \
        --json "$OUT/model2.json" 2>&1 | grep -v Warning
    echo "model2 rc=$?"
  fi
} 2>&1 | tee "$OUT/log.txt"
