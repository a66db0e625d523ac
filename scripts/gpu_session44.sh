#!/usr/bin/env bash
# After `source .device/setup.sh`: session 44's measurements. 1. (TRACE=1) host_trace.py: an eager Linear step's
# host time by thread (torch.profiler with its Python tracer; Chrome traces under $OUT/trace); 2. (LAYERS=1)
# host_costs.py --layers: host us per layer, and the backward through the engine against its node called directly;
# 3. (TEST_FILES=...) pytest -m cuda over those files; 4. (LINEAR=1) bench_model.py --linear LINEAR_ARGS;
# 5. (MODEL=1) bench_model.py --sizes SIZES MODEL_ARGS.
set -o pipefail
OUT=${OUT:-/tmp/gpu_session44_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if [ -n "${TEST_FILES:-}" ]; then
  echo "== pytest -m cuda $TEST_FILES ($(date +%T))"
  timeout -k 10 "${LIM_TESTS:-240}" python3 -m pytest -q -m cuda -x -p no:cacheprovider $TEST_FILES > "$OUT/pytest.txt" 2>&1
  echo "pytest rc=$?"; tail -n 15 "$OUT/pytest.txt"
fi
if [ -n "${TRACE:-}" ]; then
  for size in ${TRACE_SIZES:-256}; do
    echo "== host_trace --size $size ($(date +%T))"
    timeout -k 10 "${LIM_TRACE:-120}" python3 benchmarks/host_trace.py --size "$size" --steps "${TRACE_STEPS:-20}" \
        --recipes "${TRACE_RECIPES:-off,current,delayed}" --out "$OUT/trace_$size" 2>&1 | grep -v -E "USDT|Warning" \
        | tee "$OUT/host_trace_$size.txt" | head -n 120
    echo "trace rc=$?"
  done
fi
if [ -n "${LAYERS:-}" ]; then
  echo "== host_costs --layers ($(date +%T))"
  timeout -k 10 "${LIM_LAYERS:-90}" python3 benchmarks/host_costs.py --layers --json "$OUT/layers.json" 2>&1 \
      | grep -v Warning | tail -n 24
  echo "layers rc=$?"
fi
if [ -n "${LINEAR:-}" ]; then
  echo "== bench_model --linear ${LINEAR_ARGS:-} ($(date +%T))"
  timeout -k 10 "${LIM_LINEAR:-150}" python3 benchmarks/bench_model.py --linear ${LINEAR_ARGS:-} \
      --json "$OUT/linear.json" > "$OUT/linear.txt" 2>&1
  echo "linear rc=$?"; grep -v Warning "$OUT/linear.txt" | tail -n 24
fi
if [ -n "${MODEL:-}" ]; then
  for size in ${SIZES:-h2048_t8192}; do
    echo "== bench_model --size $size ${MODEL_ARGS:-} ($(date +%T))"
    timeout -k 10 "${LIM_MODEL:-240}" python3 benchmarks/bench_model.py --sizes "$size" ${MODEL_ARGS:-} \
        --json "$OUT/model_$size.json" > "$OUT/model_$size.txt" 2>&1
    echo "model rc=$?"; grep -v Warning "$OUT/model_$size.txt" | tail -n 24
  done
fi
echo "== done ($(date +%T))"
