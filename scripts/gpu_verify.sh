#!/usr/bin/env bash
# The release check in one device call (after `source .device/setup.sh`): every CUDA test of the suite,
# compute-sanitizer over both kernel families, then the quantization benchmark (FP8, per-token,
# grouped, NVFP4). Each stage has its own time limit; everything is tee'd into $OUT.
#   source .device/setup.sh && bash scripts/gpu_verify.sh
set -o pipefail
OUT=${OUT:-/tmp/gpu_verify_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
{
  echo "== nvidia-smi -L"; nvidia-smi -L
  echo "== commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  python3 -c "import fp_recipes; print(fp_recipes.backend_info()['summary'])"
  echo "== pytest -m cuda tests (every CUDA test of the suite)"
  # (the whole CUDA suite ran past 280 s on an H200 in session 34: most of it test_cuda_nvfp4_kernels.py's matrix)
  timeout "${LIM_TEST:-480}" python3 -m pytest -q -m cuda -p no:cacheprovider --tb=short tests 2>&1 | tail -n 40
  echo "tests rc=$?"
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool: FP8 family"
    timeout "${LIM_SAN:-90}" "$SAN" --tool "$tool" --kernel-name kns=fp_recipes --error-exitcode 9 \
        python3 tests/sanitize_fp8.py 2>&1 | tail -n 4
    echo "fp8 $tool rc=$?"
    echo "== compute-sanitizer --tool $tool: NVFP4 family"
    quick=0; [ "$tool" = racecheck ] && quick=1
    SANITIZE_QUICK=$quick timeout "${LIM_SAN:-90}" "$SAN" --tool "$tool" --error-exitcode 9 \
        python3 tests/sanitize_nvfp4.py 2>&1 | tail -n 4
    echo "nvfp4 $tool rc=$?"
  done
  echo "== benchmark: quantization"
  timeout "${LIM_BENCH:-240}" python3 benchmarks/bench_quantize.py --json "$OUT/quantize.json" ${BENCH_ARGS:-} 2>&1 \
      | grep -v "Warning\|warn\|\"\"\"" | tail -n 80
  echo "bench rc=$?"
} 2>&1 | tee "$OUT/log.txt"
