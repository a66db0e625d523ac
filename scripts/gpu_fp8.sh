#!/usr/bin/env bash
# The one script a device call runs for the FP8 kernel family (H4):
#   source .device/setup.sh && bash scripts/gpu_fp8.sh [tests|sanitize|bench|all|cpu]...
# Env: TEST_TIMEOUT, SAN_TOOLS, SAN_TIMEOUT, BENCH_TIMEOUT, BENCH_ARGS (e.g. "--quick --only fp8,grouped").
# Everything is tee'd into $OUT (log_*.txt, quantize.json).
set -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
steps=${*:-all}
has() { [[ " $steps " == *" $1 "* || " $steps " == *" all "* ]]; }
export PYTHONUNBUFFERED=1

echo "== nvidia-smi -L"; nvidia-smi -L
python3 -c "import fp_recipes; print(fp_recipes.backend_info()['summary'])"

if has tests; then
  echo "== pytest -m cuda (FP8 family)"
  timeout ${TEST_TIMEOUT:-170} python3 -m pytest -q --maxfail=40 -m cuda tests/test_cuda_fp8_kernels.py -p no:cacheprovider 2>&1 | tee "$OUT/log_tests.txt" | tail -40
  echo "== pytest CPU-side FP8 tests"
  timeout 60 python3 -m pytest -q tests/test_cuda_fp8_cpu.py tests/test_cuda_fp8_hostmath.py -p no:cacheprovider 2>&1 | tail -3 | tee -a "$OUT/log_tests.txt"
fi

if [[ " $steps " == *" cpu "* ]]; then  # only when asked: the whole CPU suite (~70 s)
  echo "== pytest (whole suite, CPU-side tests)"
  timeout ${CPU_TIMEOUT:-150} python3 -m pytest -q -m "not cuda" tests -p no:cacheprovider 2>&1 | tee "$OUT/log_cpu_suite.txt" | tail -3
fi

if has sanitize; then
  CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  for tool in ${SAN_TOOLS:-memcheck racecheck synccheck}; do
    echo "== compute-sanitizer --tool $tool (fp_recipes kernels)"
    timeout ${SAN_TIMEOUT:-100} "$CS" --tool "$tool" --kernel-name kns=fp_recipes --error-exitcode 9 \
      python3 tests/sanitize_fp8.py 2>&1 | tee "$OUT/log_sanitize_$tool.txt" | tail -6
    echo "rc=$? ($tool)"
  done
fi

if has bench; then
  echo "== benchmark"
  timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/bench_quantize.py --json "$OUT/quantize.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/log_bench.txt" | tail -60
fi
