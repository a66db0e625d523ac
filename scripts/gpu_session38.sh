#!/usr/bin/env bash
# After `source .device/setup.sh`: session 38's checks. 1. the reduce-overhead tests of tests/test_compile_cuda.py
# (TEST_K); 2. where one Linear step's host time goes (profile_host.py, eager and compiled, a small shape so that
# the GPU never holds the host back: PROFILE_SHAPE, PROFILE_RECIPES; NO_PROFILE=1 skips it); 3. with DIAG=1,
# scripts/diag_reduce_overhead.py (which variant of the NVFP4 step crashes under reduce-overhead); 4. with MODEL=1,
# bench_model's NVFP4 rows eager and compiled at SIZES. Logs in $OUT.
set -o pipefail
OUT=${OUT:-/tmp/gpu_session38_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
{
  echo "== ${TEST_FILES:-tests/test_compile_cuda.py} -k ${TEST_K:-reduce_overhead} ($(date +%T))"
  kfilter=(-k "${TEST_K:-reduce_overhead}")
  [ "${TEST_K:-}" = all ] && kfilter=()
  timeout -k 10 "${LIM_TEST:-240}" python3 -m pytest -q -m cuda -p no:cacheprovider --tb=short ${TEST_FILES:-tests/test_compile_cuda.py} \
      "${kfilter[@]}" > "$OUT/pytest_compile.txt" 2>&1
  echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|Error:" "$OUT/pytest_compile.txt" | head -n 20; tail -n 1 "$OUT/pytest_compile.txt"
  if [ -z "${NO_PROFILE:-}" ] && [ -z "${COMPILED_PROFILE_ONLY:-}" ]; then
    echo "== profile_host eager ($(date +%T))"
    timeout -k 10 "${LIM_PROF:-150}" python3 benchmarks/profile_host.py --recipes "${PROFILE_RECIPES:-off,current,nvfp4}" \
        --shape "${PROFILE_SHAPE:-1024,1024,1024}" --steps 300 --top 45 > "$OUT/profile_host_eager.txt" 2>&1
    echo "rc=$?"; grep "=====" "$OUT/profile_host_eager.txt"
  fi
  if [ -z "${NO_PROFILE:-}" ]; then
    echo "== profile_host compiled ($(date +%T))"
    timeout -k 10 "${LIM_PROF:-150}" python3 benchmarks/profile_host.py --recipes nvfp4 --compiled \
        --shape "${PROFILE_SHAPE:-1024,1024,1024}" --steps 300 --top 45 > "$OUT/profile_host_compiled.txt" 2>&1
    echo "rc=$?"; grep "=====" "$OUT/profile_host_compiled.txt"
  fi
  if [ -n "${DIAG:-}" ]; then
    echo "== diag_reduce_overhead ($(date +%T))"
    timeout -k 10 "${LIM_DIAG:-400}" python3 scripts/diag_reduce_overhead.py ${DIAG_VARIANTS:+--variants "$DIAG_VARIANTS"} --log-dir "$OUT/diag" \
        2>&1 | tee "$OUT/diag_reduce_overhead.txt"
    if [ -n "${DIAG_GDB:-}" ]; then
      if command -v gdb >/dev/null; then
        timeout -k 10 "${LIM_GDB:-200}" python3 scripts/diag_reduce_overhead.py --variants "$DIAG_GDB" --gdb --log-dir "$OUT/diag" 2>&1 | tee -a "$OUT/diag_reduce_overhead.txt"
      else echo "no gdb on this machine"; fi
    fi
  fi
  if [ -n "${MODEL:-}" ]; then
    echo "== bench_model NVFP4 eager + compiled ($(date +%T))"
    timeout -k 10 "${LIM_MODEL:-300}" python3 benchmarks/bench_model.py --sizes "${SIZES:-h2048_t8192}" \
        --rows NVFP4 --compiled-nvfp4 --json "$OUT/model_compiled_nvfp4.json" 2>&1 | grep -v Warning | tail -n 12
  fi
  echo "== done ($(date +%T))"
} 2>&1 | tee "$OUT/log.txt"
