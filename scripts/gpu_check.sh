#!/usr/bin/env bash
# One device call that checks a tree and measures it (after `source .device/setup.sh`). Every stage is
# optional and has its own time limit, so one call can run what the budget allows; logs in $OUT.
#   TESTS="tests"            pytest -m cuda over these paths ("" skips)       LIM_TEST (s)
#   LINEAR=1                 bench_model.py --linear (one Linear 4096^3; LINEAR_FLAGS) LIM_LIN
#   MODEL_SIZES=h2048_t8192  bench_model.py --sizes ... (MODEL_FLAGS)          LIM_MODEL
#   QUANT_SHAPES=16384x6144  bench_quantize_nvfp4.py --quick --shapes ...      LIM_QUANT
#   HOST_AB="256 4096"       host_phases.py --host-paths both per size: the torch-linked and the Python host
#                            path alternating in one process (HOST_RECIPES, default off,delayed,current,nvfp4) LIM_HOST
#   DEMO="--steps 300"       python -m fp_recipes demo with these arguments    LIM_DEMO
#   BENCH="--size small"     python -m fp_recipes bench with these arguments   LIM_BENCH
#   EXTRA="cmd"              any further command                               LIM_EXTRA
# The device tool returns at most 8 files from $OUT (two folders down; the rest are left out): the stages here
# write log.txt, pytest.txt, linear.json, quantize.json, model.json and extra.txt; DEMO and BENCH write folders of
# several files each, so run them in a call of their own (or with few other stages).
set -o pipefail
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
stage() { echo; echo "== $* ($(date +%T))"; }
{
  stage "device"; nvidia-smi -L
  git log --oneline -1 2>/dev/null || true
  python3 -c "import fp_recipes, torch; i = fp_recipes.backend_info(); print(i['summary']); print('torch', torch.__version__)"
  python3 -m fp_recipes doctor 2>&1 | grep -E "host path"
  if [ -n "${TESTS-tests}" ]; then
    stage "pytest -m cuda ${TESTS-tests}"
    # SIGABRT at the limit: faulthandler writes every thread's stack to pytest.txt (a hang shows where it is)
    timeout -s ABRT -k 15 "${LIM_TEST:-240}" python3 -X faulthandler -m pytest -q -m cuda -p no:cacheprovider \
        --tb=short --durations=8 ${TESTS-tests} > "$OUT/pytest.txt" 2>&1
    echo "pytest rc=$? ($(date +%T))"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -n 30; tail -n 3 "$OUT/pytest.txt"
  fi
  if [ -n "${LINEAR:-}" ]; then
    stage "bench_model --linear ${LINEAR_FLAGS:-}"
    timeout "${LIM_LIN:-60}" python3 benchmarks/bench_model.py --linear ${LINEAR_FLAGS:-} --json "$OUT/linear.json" 2>&1 \
        | grep -v Warning
    echo "linear rc=$?"
  fi
  if [ -n "${QUANT_SHAPES:-}" ]; then
    stage "bench_quantize_nvfp4 $QUANT_SHAPES"
    timeout "${LIM_QUANT:-90}" python3 benchmarks/bench_quantize_nvfp4.py --quick --shapes "$QUANT_SHAPES" \
        --json "$OUT/quantize.json" 2>&1 | grep -v Warning | tail -n 50
    echo "quantize rc=$?"
  fi
  for size in ${HOST_AB:-}; do
    stage "host_phases --host-paths both --size $size"
    timeout "${LIM_HOST:-90}" python3 benchmarks/host_phases.py --recipes "${HOST_RECIPES:-off,delayed,current,nvfp4}" \
        --host-paths both --rounds 3 --steps 200 --size "$size" --json "$OUT/host_$size.json" 2>&1 \
        | grep -v -E "Warning|run_backward"
    echo "host_phases rc=$?"
  done
  if [ -n "${MODEL_SIZES:-}" ]; then
    stage "bench_model --sizes $MODEL_SIZES ${MODEL_FLAGS:-}"
    timeout "${LIM_MODEL:-200}" python3 benchmarks/bench_model.py --sizes "$MODEL_SIZES" ${MODEL_FLAGS:-} \
        --json "$OUT/model.json" 2>&1 | grep -v Warning
    echo "model rc=$?"
  fi
  if [ -n "${DEMO:-}" ]; then
    stage "python -m fp_recipes demo $DEMO"
    timeout "${LIM_DEMO:-150}" python3 -m fp_recipes demo $DEMO --no-progress --out "$OUT/demo" 2>&1 | tail -n 40
    echo "demo rc=$?"
  fi
  if [ -n "${BENCH:-}" ]; then
    stage "python -m fp_recipes bench $BENCH"
    timeout "${LIM_BENCH:-150}" python3 -m fp_recipes bench $BENCH --out "$OUT/bench" 2>&1 | grep -v Warning | tail -n 80
    echo "bench rc=$?"
  fi
  if [ -n "${EXTRA:-}" ]; then
    stage "$EXTRA"
    # its own $OUT: a script it runs may write log.txt too
    mkdir -p "$OUT/extra"
    OUT="$OUT/extra" timeout "${LIM_EXTRA:-120}" bash -c "$EXTRA" > "$OUT/extra.txt" 2>&1
    echo "extra rc=$?"; tail -n 60 "$OUT/extra.txt"
  fi
  stage "done"
} 2>&1 | tee "$OUT/log.txt"
