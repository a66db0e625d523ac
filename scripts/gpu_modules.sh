#!/usr/bin/env bash
# H6 (modules) GPU check in one device call, after `source .device/setup.sh`:
# the module/GEMM tests on CUDA, the Linear/GroupedLinear benchmark, the profile (syncs, host time,
# kernels) and the demo on the GPU. Options by environment: LIM_* (seconds per stage), BENCH_ARGS,
# PROF_ARGS, SKIP_DEMO=1.
# Everything goes to $OUT; each stage has its own time limit so a slow one cannot swallow the rest.
set -o pipefail
OUT=${OUT:-/tmp/gpu_modules_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
LIM_TEST=${LIM_TEST:-80}
LIM_BENCH=${LIM_BENCH:-220}
LIM_DEMO=${LIM_DEMO:-30}
LIM_PROF=${LIM_PROF:-90}
BENCH_ARGS=${BENCH_ARGS:-"--iters 20 --warmup 5"}
PROF_ARGS=${PROF_ARGS:-""}
{
  echo "== nvidia-smi -L"; nvidia-smi -L
  python3 -c "import fp_recipes; i=fp_recipes.backend_info(); print(i['summary'], i['cuda_ops'])"
  echo "== pytest -m cuda (modules + gemm on CUDA)"
  timeout "$LIM_TEST" python3 -m pytest -q -m cuda -p no:cacheprovider --durations=5 --tb=short \
      tests/test_modules_gemm.py tests/test_modules_linear.py 2>&1 | tail -n 100
  echo "pytest rc=$?"
  echo "== benchmark"
  timeout "$LIM_BENCH" python3 benchmarks/bench_linear.py $BENCH_ARGS --json "$OUT/linear.json"
  echo "bench rc=$?"
  echo "== profile (host syncs, enqueue time, kernels)"
  timeout "$LIM_PROF" python3 benchmarks/profile_linear.py $PROF_ARGS 2>&1 | tail -n 150
  echo "profile rc=$?"
  if [ -z "${SKIP_DEMO:-}" ]; then
    echo "== demo"
    timeout "$LIM_DEMO" python3 -m fp_recipes demo --steps 40 --json "$OUT/demo.json"
    echo "demo rc=$?"
  fi
} 2>&1 | tee "$OUT/log.txt"
