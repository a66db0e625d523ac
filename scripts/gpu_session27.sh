#!/usr/bin/env bash
# The first device call of the session after 26 (see benchmarks/NOTES_fp8.md "After session 26"): what session 26
# changed after its last GPU run, then the opt-in compiled amax measured against the default in one call.
#   source .device/setup.sh > $OUT/setup.log 2>&1 && bash scripts/gpu_session27.sh
# 1. pytest -m cuda tests (the full suite, ~290 s on an H100): 7981e0d (delayed casts keep their memset), db4f377
#    (no amax workspace inside graph captures), a575baf/8492c10 (compile_visible_amax: bytes, bit-for-bit, op counts),
#    7c76cb2 (the planned FP8 casts: every eager FP8 cast on CUDA takes them);
# 2. bench_model.py --linear;
# 3. the compiled model rows at h2048 with and without --fp8-compile-visible-amax (the A/B of the opt-in).
# Writes log.txt, pytest.txt, linear.json, model_default.json, model_visible.json under $OUT (the device tool
# returns at most 8 files). All stages together take ~10 minutes with setup: over one call's limit on a cold
# machine, so run it as two calls (SKIP_TESTS=1 in the second, on the warm machine: FP_RECIPES_SKIP_BUILD=1).
set -o pipefail
OUT=${OUT:-/tmp/gpu_session27_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
{
  nvidia-smi -L
  if [ -z "${SKIP_TESTS:-}" ]; then
    echo "== pytest -m cuda tests"
    timeout "${LIM_TEST:-330}" python3 -m pytest -q -m cuda -p no:cacheprovider -rfE --tb=short tests > "$OUT/pytest.txt" 2>&1
    echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -n 30; tail -n 2 "$OUT/pytest.txt"
  fi
  echo "== bench_model --linear"
  timeout "${LIM_LIN:-60}" python3 benchmarks/bench_model.py --linear --json "$OUT/linear.json" 2>&1 | grep -v Warning | tail -n 9
  for mode in default visible; do
    flag=""; [ "$mode" = visible ] && flag="--fp8-compile-visible-amax"
    echo "== bench_model --sizes h2048_t8192 ($mode)"
    timeout "${LIM_MODEL:-90}" python3 benchmarks/bench_model.py --sizes h2048_t8192 $flag --json "$OUT/model_$mode.json" \
      2>&1 | grep -v Warning | grep -E "^h2048" | head -n 12
  done
} 2>&1 | tee "$OUT/log.txt"
