#!/usr/bin/env bash
# Session 35's verification in one call after `source .device/setup.sh`: tile2's strips of 4 tiles (the library's
# default since 8f5e6d7) through the NVFP4 kernel tests against the twin, compute-sanitizer memcheck and racecheck,
# the quantize benchmark, one Linear and the NVFP4 model rows; then host_costs.py (what one host call costs on this
# machine). Logs and JSON in $OUT. Stage limits: LIM_TEST, LIM_SAN (per tool), LIM_BENCH, LIM_LIN, LIM_MODEL, LIM_HOST.
set -o pipefail
OUT=${OUT:-/tmp/gpu_session35_verify_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
{
  git log --oneline -1 2>/dev/null || true
  echo "== pytest -m cuda ($(date +%T))"
  timeout -s ABRT -k 15 "${LIM_TEST:-170}" python3 -X faulthandler -m pytest -q -m cuda -p no:cacheprovider --tb=short \
      tests/test_cuda_nvfp4_kernels.py tests/test_nvfp4_reference_cuda.py tests/test_cuda_nvfp4_units.py \
      tests/test_nvfp4_fast_gemm.py > "$OUT/pytest.txt" 2>&1
  echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -n 20; tail -n 1 "$OUT/pytest.txt"
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool tests/sanitize_nvfp4_v7.py ($(date +%T))"
    ref=1; [ "$tool" = racecheck ] && ref=0
    SANITIZE_REF=$ref timeout "${LIM_SAN:-45}" "$SAN" --tool "$tool" python3 tests/sanitize_nvfp4_v7.py 2>&1 \
        | grep -vE "^========= (Program hit|    Saved host backtrace|        Host Frame)" | tail -n 4
    echo "$tool rc=$?"
  done
  echo "== bench_quantize_nvfp4 --quick --shapes 16384x6144 ($(date +%T))"
  timeout "${LIM_BENCH:-50}" python3 benchmarks/bench_quantize_nvfp4.py --quick --shapes 16384x6144 \
      --json "$OUT/bench_quantize_nvfp4.json" > "$OUT/bench_quantize.log" 2>&1
  echo "bench rc=$?"; grep -E "^16384x6144" "$OUT/bench_quantize.log" | head -n 30
  echo "== bench_model --linear ($(date +%T))"
  timeout "${LIM_LIN:-60}" python3 benchmarks/bench_model.py --linear --no-compiled --json "$OUT/linear.json" 2>&1 \
      | grep -v Warning | tail -n 7
  echo "== bench_model NVFP4 rows ($(date +%T))"
  timeout "${LIM_MODEL:-150}" python3 benchmarks/bench_model.py --sizes h4096_t4096,h2048_t8192 --no-compiled \
      --rows NVFP4 --json "$OUT/model.json" 2>&1 | grep -v Warning | tail -n 8
  echo "== host_costs ($(date +%T))"
  timeout "${LIM_HOST:-60}" python3 benchmarks/host_costs.py --json "$OUT/host_costs.json" 2>&1 | grep -v Warning | tail -n 30
  echo "== done ($(date +%T))"
} 2>&1 | tee "$OUT/log.txt"
