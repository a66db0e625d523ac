#!/usr/bin/env bash
# After `source .device/setup.sh`: session 43's measurements. 1. (PROFILE=1) profile_host.py over the eager FP8 Linear
# 4096^3 step (cProfile, PROF_STEPS steps: where the host time goes); 2. session 41's stages (scripts/gpu_session41.sh:
# tests, sanitizers, bench_quantize_nvfp4, bench_model --linear, the model rows), with the same knobs.
set -o pipefail
OUT=${OUT:-/tmp/gpu_session43_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if [ -n "${PROFILE:-}" ]; then
  echo "== profile_host ${PROF_ARGS:-} ($(date +%T))"
  timeout -k 10 "${LIM_PROF:-90}" python3 benchmarks/profile_host.py --recipes "${PROF_RECIPES:-off,current,delayed}" \
      --steps "${PROF_STEPS:-150}" --top "${PROF_TOP:-30}" ${PROF_ARGS:-} > "$OUT/profile_host.txt" 2>&1
  echo "profile rc=$?"; grep -E "host ms|ms a step|^recipe|^==" "$OUT/profile_host.txt" | head -n 20
fi
OUT="$OUT" bash scripts/gpu_session41.sh
