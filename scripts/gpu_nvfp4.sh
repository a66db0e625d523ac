#!/usr/bin/env bash
# The NVFP4 kernels' whole GPU check in one device call (run after `source .device/setup.sh`):
# device, tests (kernels vs reference, and the reference's own CUDA twin tests), the benchmark, then
# compute-sanitizer memcheck and racecheck over tests/sanitize_nvfp4.py. Everything goes to $OUT.
# Each stage has its own time limit so a slow one cannot swallow the rest.
set -o pipefail
OUT=${OUT:-/tmp/gpu_nvfp4_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
LIM_TEST=${LIM_TEST:-200}
LIM_BENCH=${LIM_BENCH:-90}
LIM_SAN=${LIM_SAN:-70}
{
  echo "== nvidia-smi -L"; nvidia-smi -L
  python3 -c "import fp_recipes; print(fp_recipes.backend_info()['summary'])"
  echo "== pytest -m cuda (kernels + reference twin on CUDA)"
  timeout "$LIM_TEST" python3 -m pytest -q -m cuda -p no:cacheprovider --durations=8 \
      tests/test_cuda_nvfp4_kernels.py tests/test_nvfp4_reference_cuda.py 2>&1 | tail -n 60
  echo "pytest rc=$?"
  echo "== benchmark"
  timeout "$LIM_BENCH" python3 benchmarks/bench_quantize_nvfp4.py --json "$OUT/bench_quantize_nvfp4.json"
  echo "bench rc=$?"
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool"
    quick=0; [ "$tool" = racecheck ] && quick=1
    SANITIZE_QUICK=$quick timeout "$LIM_SAN" "$SAN" --tool "$tool" --target-processes all \
        python3 tests/sanitize_nvfp4.py 2>&1 \
        | grep -vE "^========= (Program hit|    Saved host backtrace|        Host Frame)" | tail -n 25
    echo "$tool rc=$?"
  done
} 2>&1 | tee "$OUT/log.txt"
