#!/usr/bin/env bash
# Session 36 in one call after `source .device/setup.sh`: NVFP4_ROW_SCALED_FREE=1 (the library's default now) through
# the NVFP4 kernel tests against the twin, compute-sanitizer memcheck and racecheck over tests/sanitize_nvfp4_v7.py,
# the quantize benchmark at 16384 x 6144; then where an NVFP4 Linear step's host time goes (profile_host.py,
# host_costs.py). STAGES picks stages (default "test san bench host"); logs and JSON in $OUT.
set -o pipefail
OUT=${OUT:-/tmp/gpu_session36_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
{
  git log --oneline -1 2>/dev/null || true
  for stage in ${STAGES:-test san bench host}; do
    echo "== $stage ($(date +%T))"
    case $stage in
      test) timeout -s ABRT -k 15 "${LIM_TEST:-170}" python3 -X faulthandler -m pytest -q -m cuda -p no:cacheprovider \
                --tb=short tests/test_cuda_nvfp4_kernels.py ${EXTRA_TESTS:-} > "$OUT/pytest.txt" 2>&1
            echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -n 20; tail -n 1 "$OUT/pytest.txt" ;;
      san) SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
           for tool in memcheck racecheck; do
             echo "-- compute-sanitizer --tool $tool tests/sanitize_nvfp4_v7.py ($(date +%T))"
             ref=1; [ "$tool" = racecheck ] && ref=0
             SANITIZE_REF=$ref timeout "${LIM_SAN:-45}" "$SAN" --tool "$tool" python3 tests/sanitize_nvfp4_v7.py 2>&1 \
                 | grep -vE "^========= (Program hit|    Saved host backtrace|        Host Frame)" | tail -n 4
             echo "$tool rc=$?"
           done ;;
      bench) timeout "${LIM_BENCH:-50}" python3 benchmarks/bench_quantize_nvfp4.py --quick --shapes 16384x6144 \
                 --json "$OUT/bench_quantize_nvfp4.json" > "$OUT/bench_quantize.log" 2>&1
             echo "bench rc=$?"; grep -E "^16384x6144" "$OUT/bench_quantize.log" | head -n 30 ;;
      host) timeout "${LIM_HOST:-120}" python3 benchmarks/profile_host.py --recipes off,nvfp4,current --steps 200 \
                --top 30 > "$OUT/profile_host.txt" 2>&1; echo "profile_host rc=$?"; grep "^=====" "$OUT/profile_host.txt"
            timeout "${LIM_COSTS:-60}" python3 benchmarks/host_costs.py --recipes off,nvfp4,current \
                --json "$OUT/host_costs.json" 2>&1 | grep -v Warning | tail -n 40 ;;
      linear) timeout "${LIM_LIN:-60}" python3 benchmarks/bench_model.py --linear --no-compiled --json "$OUT/linear.json" \
                  2>&1 | grep -v Warning | tail -n 7 ;;
      profile) for size in ${PROFILE_SIZES:-h2048_t8192 h4096_t4096}; do
                 timeout "${LIM_PROFILE:-150}" python3 benchmarks/profile_model.py --size "$size" --top 40 \
                     --rows "${PROFILE_ROWS:-BF16 eager,FP8 delayed,FP8 current,NVFP4 default,NVFP4 row-scaled+4over6 fast}" \
                     > "$OUT/profile_$size.txt" 2>&1
                 echo "profile $size rc=$?"; grep -E "^== |^   (GEMM|attention|quantize|other|norm|memset)" "$OUT/profile_$size.txt"
               done ;;
      units) timeout -s ABRT -k 15 "${LIM_UNITS:-200}" python3 -X faulthandler -m pytest -q -m cuda -p no:cacheprovider \
                 --tb=short tests/test_cuda_nvfp4_units.py tests/test_nvfp4_host_path2.py tests/test_nvfp4_host_path.py \
                 tests/test_cuda_fast_ops.py tests/test_bias_grad.py tests/test_cuda_graphs.py tests/test_host_sync.py \
                 tests/test_layernorm_mlp.py tests/test_modules_linear.py tests/test_weight_columnwise.py \
                 tests/test_nvfp4_fast_gemm.py > "$OUT/pytest_units.txt" 2>&1
             echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_units.txt" | head -n 20; tail -n 1 "$OUT/pytest_units.txt" ;;
      memcheck) SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
                timeout "${LIM_SAN:-60}" "$SAN" --tool memcheck python3 tests/sanitize_nvfp4_fast.py 2>&1 \
                    | grep -vE "^========= (Program hit|    Saved host backtrace|        Host Frame)" | tail -n 4
                echo "memcheck rc=$?" ;;
      units_ab) timeout "${LIM_LIN:-90}" python3 benchmarks/bench_model.py --linear --no-compiled --nvfp4-units-ab none \
                    --json "$OUT/linear_units.json" 2>&1 | grep -v Warning | tail -n 9
                timeout "${LIM_MODEL:-240}" python3 benchmarks/bench_model.py --sizes ${SIZES:-h4096_t4096,h2048_t8192} \
                    --no-compiled --rows NVFP4 --nvfp4-units-ab none --json "$OUT/model_units.json" 2>&1 \
                    | grep -v Warning | tail -n 12 ;;
      model) timeout "${LIM_MODEL:-150}" python3 benchmarks/bench_model.py --sizes ${SIZES:-h4096_t4096,h2048_t8192} \
                 --no-compiled --rows "${ROWS:-NVFP4}" --json "$OUT/model.json" 2>&1 | grep -v Warning | tail -n 10 ;;
    esac
  done
  echo "== done ($(date +%T))"
} 2>&1 | tee "$OUT/log.txt"
