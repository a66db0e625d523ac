#!/usr/bin/env bash
# Issue 13: the step kernels of the emulated NVFP4 path measured in one call after `source .device/setup.sh`:
#   1. benchmarks/nvfp4_variants/decode_bench.cu: the library's unit decode (`lib`) byte-checked against the kernel it
#      replaced in session 34 (`prev`) on tails, one row, > 64 rows, empty operands, NaN/zero/negative scale codes,
#      then both timed against their traffic floors and memset (store_bench.cu: store patterns alone);
#      rht_amax_bench.cu: the post-RHT amax with 8, 4 (the library's), 2 and 1 columns a thread, bit-checked and timed;
#   2. the GPU tests that read the decode's bytes (units, fast emulated GEMM, the C++ host path) and
#      compute-sanitizer memcheck over tests/sanitize_nvfp4_fast.py;
#   3. one Linear 4096^3 (also with torch's 32 MiB cuBLASLt workspace: the per-GEMM memsets) and the NVFP4 model rows
#      (bench_model.py), as in RESULTS.md sessions 33-34.
# Logs and JSON in $OUT. Stage limits: LIM_BENCH, LIM_TEST, LIM_SAN, LIM_LIN, LIM_MODEL; SKIP_MODEL=1 skips stage 3's model rows.
set -o pipefail
OUT=${OUT:-/tmp/gpu_nvfp4_step_kernels_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
B=${STEP_KERNELS_BUILD:-/tmp/nvfp4_step_kernels_build}
mkdir -p "$B"
{
  echo "== build decode_bench ($(date +%T))"
  "$NVCC" -O3 -std=c++17 --expt-relaxed-constexpr -fmad=false -Ifp_recipes/csrc \
      -gencode=arch=compute_90a,code=sm_90a -Xptxas -v benchmarks/nvfp4_variants/decode_bench.cu -o "$B/decode_bench" \
      2>&1 | grep -E "error|registers" | head -n 12
  "$NVCC" -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a benchmarks/nvfp4_variants/store_bench.cu \
      -o "$B/store_bench" 2>&1 | grep -E "error" | head -n 12
  "$NVCC" -O3 -std=c++17 --expt-relaxed-constexpr -fmad=false -Ifp_recipes/csrc \
      -gencode=arch=compute_90a,code=sm_90a -Xptxas -v benchmarks/nvfp4_variants/rht_amax_bench.cu \
      -o "$B/rht_amax_bench" 2>&1 | grep -E "error|registers" | head -n 12
  echo "== decode_bench ($(date +%T))"
  timeout "${LIM_BENCH:-90}" "$B/decode_bench" "$OUT/decode_bench.json"
  echo "decode_bench rc=$?"
  timeout "${LIM_BENCH:-90}" "$B/store_bench" "$OUT/store_bench.json"
  echo "store_bench rc=$?"
  echo "== rht_amax_bench ($(date +%T))"
  timeout "${LIM_BENCH:-90}" "$B/rht_amax_bench" "$OUT/rht_amax_bench.json"
  echo "rht_amax_bench rc=$?"
  echo "== pytest ($(date +%T))"
  timeout -s ABRT -k 15 "${LIM_TEST:-200}" python3 -X faulthandler -m pytest -q -m cuda -p no:cacheprovider --tb=short \
      tests/test_cuda_nvfp4_units.py tests/test_nvfp4_fast_gemm.py tests/test_cuda_fast_ops.py > "$OUT/pytest.txt" 2>&1
  echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -n 20; tail -n 2 "$OUT/pytest.txt"
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  echo "== compute-sanitizer memcheck over tests/sanitize_nvfp4_fast.py ($(date +%T))"
  timeout "${LIM_SAN:-120}" "$SAN" --tool memcheck python3 tests/sanitize_nvfp4_fast.py 2>&1 \
      | grep -vE "^========= (Program hit|    Saved host backtrace|        Host Frame)" | tail -n 6
  echo "memcheck rc=$?"
  echo "== bench_model --linear ($(date +%T))"
  timeout "${LIM_LIN:-70}" python3 benchmarks/bench_model.py --linear --no-compiled --json "$OUT/linear.json" 2>&1 \
      | grep -v Warning | tail -n 7
  # the same with torch's 32 MiB cuBLASLt workspace for fp_recipes' GEMMs (the default is none since session 34):
  # one cuBLAS memset per GEMM comes back (kernel names and counts in the profile above the table)
  echo "== bench_model --linear --gemm-workspace 33554432 ($(date +%T))"
  timeout "${LIM_LIN:-70}" python3 benchmarks/bench_model.py --linear --no-compiled --gemm-workspace 33554432 \
      --json "$OUT/linear_ws32m.json" 2>&1 | grep -v Warning | grep -E "Memset|nvjet|row|^[A-Z]" | tail -n 40
  if [ -z "${SKIP_MODEL:-}" ]; then
    echo "== bench_model NVFP4 rows ($(date +%T))"
    timeout "${LIM_MODEL:-150}" python3 benchmarks/bench_model.py --sizes h4096_t4096,h2048_t8192 --no-compiled \
        --rows NVFP4 --json "$OUT/model.json" 2>&1 | grep -v Warning | tail -n 8
  fi
  echo "== done ($(date +%T))"
} 2>&1 | tee "$OUT/log.txt"
