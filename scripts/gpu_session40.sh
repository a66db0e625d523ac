#!/usr/bin/env bash
# After `source .device/setup.sh`: session 40's checks of NVFP4 stochastic rounding with its Philox state in device
# memory. 1. the GPU tests (TEST_FILES, TEST_K); 2. compute-sanitizer (SAN_TOOLS) over tests/sanitize_nvfp4_device_rng.py;
# 3. bench_quantize_nvfp4 at QUANT_SHAPES (the SR rows with and without the device state; QUANT_FULL=1: 50 iterations,
# not --quick's 20); 4. with LINEAR=1,
# bench_model --linear --graphed --no-compiled; 5. with PROF_GRAPHED=1, profile_host.py --graphed (where a replayed
# step's host time goes); 6. with MODEL=1, bench_model's rows at SIZES (MODEL_ARGS). Logs in $OUT.
set -o pipefail
OUT=${OUT:-/tmp/gpu_session40_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
{
  nvidia-smi -L; git log --oneline -1 2>/dev/null || true
  if [ -z "${NO_TESTS:-}" ]; then
    echo "== pytest ${TEST_FILES} ($(date +%T))"
    kfilter=()
    [ -n "${TEST_K:-}" ] && kfilter=(-k "$TEST_K")
    timeout -k 10 "${LIM_TEST:-240}" python3 -m pytest -q -m cuda -p no:cacheprovider --tb=short --durations=5 \
        ${TEST_FILES:-tests/test_cuda_nvfp4_device_rng.py tests/test_cuda_graphs.py} "${kfilter[@]}" > "$OUT/pytest.txt" 2>&1
    echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -n 30; tail -n 8 "$OUT/pytest.txt"
  fi
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  for tool in ${SAN_TOOLS:-}; do
    echo "== compute-sanitizer --tool $tool ($(date +%T))"
    timeout -k 10 "${LIM_SAN:-120}" "$SAN" --tool "$tool" python3 tests/sanitize_nvfp4_device_rng.py 2>&1 \
        | grep -vE "^========= (Program hit|    Saved host backtrace|        Host Frame)" | tail -n 8
    echo "$tool rc=$?"
  done
  if [ -n "${QUANT_SHAPES:-}" ]; then
    echo "== bench_quantize_nvfp4 $QUANT_SHAPES ($(date +%T))"
    qflag=--quick; [ -n "${QUANT_FULL:-}" ] && qflag=
    timeout -k 10 "${LIM_QUANT:-120}" python3 benchmarks/bench_quantize_nvfp4.py $qflag --shapes "$QUANT_SHAPES" \
        --json "$OUT/quantize.json" 2>&1 | grep -v Warning | tail -n 40
    echo "quantize rc=$?"
  fi
  if [ -n "${LINEAR:-}" ]; then
    echo "== bench_model --linear --graphed ($(date +%T))"
    timeout -k 10 "${LIM_LIN:-200}" python3 benchmarks/bench_model.py --linear --graphed --no-compiled \
        --json "$OUT/linear.json" 2>&1 | grep -v Warning | tail -n 12
    echo "linear rc=$?"
  fi
  if [ -n "${PROF_GRAPHED:-}" ]; then
    echo "== profile_host --graphed ($(date +%T))"
    timeout -k 10 "${LIM_PROF:-150}" python3 benchmarks/profile_host.py --graphed --recipes "${PROFILE_RECIPES:-off,delayed,current,nvfp4}" \
        --steps 200 --top 25 > "$OUT/profile_host_graphed.txt" 2>&1
    echo "rc=$?"; grep "=====" "$OUT/profile_host_graphed.txt"
  fi
  if [ -n "${MODEL:-}" ]; then
    echo "== bench_model ${SIZES} ${MODEL_ARGS} ($(date +%T))"
    timeout -k 10 "${LIM_MODEL:-300}" python3 benchmarks/bench_model.py --sizes "${SIZES:-h2048_t8192}" ${MODEL_ARGS:-} \
        --json "$OUT/model.json" 2>&1 | grep -v Warning | tail -n 24
    echo "model rc=$?"
  fi
  echo "== done ($(date +%T))"
} 2>&1 | tee "$OUT/log.txt"
