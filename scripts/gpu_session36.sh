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
      model) timeout "${LIM_MODEL:-150}" python3 benchmarks/bench_model.py --sizes ${SIZES:-h4096_t4096,h2048_t8192} \
                 --no-compiled --rows ${ROWS:-NVFP4} --json "$OUT/model.json" 2>&1 | grep -v Warning | tail -n 10 ;;
    esac
  done
  echo "== done ($(date +%T))"
} 2>&1 | tee "$OUT/log.txt"
