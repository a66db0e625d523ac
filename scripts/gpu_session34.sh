#!/usr/bin/env bash
# Session 34 in device calls (after `source .device/setup.sh`); STAGES picks them (default "tests linear"):
#   tests   every CUDA test of the suite (the dense GEMMs now planned with no cuBLASLt workspace, the post-RHT amax
#           with 4 columns a thread), then compute-sanitizer memcheck over the NVFP4 family (quick)
#   linear  one Linear 4096^3 profile with the default (no) GEMM workspace and with torch's 32 MiB (LINEAR_WS)
#   model   the model rows (FP8 delayed, FP8 current, NVFP4 default; h2048 and h4096), each again with a 32 MiB GEMM
#           workspace in the same process (--gemm-workspace-ab)
# Logs and JSON in $OUT.
set -o pipefail
OUT=${OUT:-/tmp/gpu_session34_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
STAGES=${STAGES:-tests linear}
# TESTS=rest: the CUDA tests that run 280 s and later into the suite (test_cuda_nvfp4_kernels.py from test_rht on, then
# every later file), which the first call's time limit cut off
if [ "${TESTS:-}" = rest ]; then
  K=tests/test_cuda_nvfp4_kernels.py
  TESTS="$K::test_rht $K::test_stochastic_rounding $K::test_stochastic_rounding_unbiased $K::test_given_amax $K::test_four_over_six_stress $K::test_big $K::test_v7_tile_modes $K::test_v7_tile_many_tiles $K::test_v7_tile_unaligned_columns $K::test_v7_tile_nan_inf_amax $K::test_v7_row_scaled $K::test_v7_row_scaled_big $K::test_amax_ops $K::test_amax_noncontiguous_and_offset $K::test_dequantize $K::test_dispatch_uses_kernel $K::test_other_stream_and_device_index $K::test_torch_compile_fullgraph $K::test_errors_options $K::test_errors_shapes_and_types tests/test_cuda_nvfp4_units.py tests/test_delayed_update_cuda.py tests/test_faults_dist_amax.py tests/test_gemm_lt.py tests/test_grouped_padded_rows.py tests/test_host_fp8_path.py tests/test_host_grouped_path.py tests/test_host_sync.py tests/test_modules_gemm.py tests/test_modules_linear.py tests/test_nvfp4_fast_gemm.py tests/test_nvfp4_host_path2.py tests/test_nvfp4_native_gemm.py tests/test_nvfp4_reference_cuda.py tests/test_weight_columnwise.py"
fi
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
{
  echo "device: $(nvidia-smi -L | head -n 1)"
  for stage in $STAGES; do
    case $stage in
      tests)
        echo "== pytest -m cuda tests ($(date +%T))"
        # TESTS: files or node ids (default: every test file; the whole CUDA suite takes more than 280 s on an H200)
        timeout -s ABRT -k 15 "${LIM_TEST:-280}" python3 -X faulthandler -m pytest -v -m cuda -p no:cacheprovider \
            --tb=short --durations=12 ${TESTS:-tests} > "$OUT/pytest.txt" 2>&1
        echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|(FAILED|ERROR) *\[" "$OUT/pytest.txt" | head -n 30; tail -n 2 "$OUT/pytest.txt"
        [ -n "${SKIP_SAN:-}" ] && continue
        echo "== memcheck: NVFP4 family, quick ($(date +%T))"
        SANITIZE_QUICK=1 timeout "${LIM_SAN:-90}" "$SAN" --tool memcheck --error-exitcode 9 \
            python3 "${SAN_SCRIPT:-tests/sanitize_nvfp4.py}" 2>&1 | tail -n 3
        echo "memcheck rc=$?" ;;
      linear)
        for ws in ${LINEAR_WS:-default 33554432}; do
          echo "== bench_model --linear, GEMM workspace $ws ($(date +%T))"
          flag=(); [ "$ws" != default ] && flag=(--gemm-workspace "$ws")
          timeout "${LIM_LIN:-70}" python3 benchmarks/bench_model.py --linear --no-compiled "${flag[@]}" \
              --json "$OUT/linear_ws_$ws.json" 2>&1 | grep -v Warning | tail -n 7
        done ;;
      model)
        echo "== bench_model model rows, GEMM workspace A/B ($(date +%T))"
        timeout "${LIM_MODEL:-400}" python3 benchmarks/bench_model.py --sizes "${SIZES:-h2048_t8192,h4096_t4096}" \
            --no-compiled --rows "${ROWS:-FP8 delayed,FP8 current,NVFP4 default}" --gemm-workspace-ab 33554432 \
            --json "$OUT/model_ws_ab.json" 2>&1 | grep -v Warning | tail -n 20 ;;
    esac
  done
  echo "== done ($(date +%T))"
} 2>&1 | tee "$OUT/log.txt"
