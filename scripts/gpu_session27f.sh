#!/usr/bin/env bash
# Session 27, run 7: the NVFP4 quantize launches through the torch-linked host path (Nvfp4Launch): the full CUDA
# suite (it is the default there), memcheck over the NVFP4 and FP8 sanitizer drivers, the host time of both paths
# in one process for the NVFP4 recipes (host_phases.py --host-paths both).
#   source .device/setup.sh > $OUT/setup.log 2>&1 && bash scripts/gpu_session27f.sh
set -o pipefail
OUT=${OUT:-/tmp/gpu_session27f_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
{
  nvidia-smi -L
  python3 -m fp_recipes doctor 2>&1 | grep -E "FP8 host path|backend:"
  echo "== pytest -m cuda tests $(date +%T)"
  timeout "${LIM_TEST:-370}" python3 -m pytest -q -m cuda -p no:cacheprovider -rfE --tb=short tests \
    > "$OUT/pytest.txt" 2>&1
  echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -n 30; tail -n 2 "$OUT/pytest.txt"
  echo "== host_phases --host-paths both (NVFP4, 4096) $(date +%T)"
  timeout 80 python3 benchmarks/host_phases.py --recipes off,nvfp4,current --host-paths both --rounds 3 \
    --steps 150 --size 4096 --json "$OUT/phases_both_4096.json" 2>&1 | grep -v -E "Warning|run_backward"
  echo "== compute-sanitizer memcheck tests/sanitize_nvfp4_fast.py $(date +%T)"
  timeout 100 compute-sanitizer --tool memcheck --kernel-name kns=fp_recipes python3 tests/sanitize_nvfp4_fast.py \
    > "$OUT/san_memcheck.txt" 2>&1
  echo "rc=$?"; tail -n 3 "$OUT/san_memcheck.txt"
} 2>&1 | tee "$OUT/log.txt"
