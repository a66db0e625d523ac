#!/usr/bin/env bash
# After `source .device/setup.sh`: session 43's measurements. 1. (PROFILE=1) profile_host.py over the eager FP8 Linear
# 4096^3 step (cProfile, PROF_STEPS steps: where the host time goes); 2. session 41's stages (scripts/gpu_session41.sh:
# tests, sanitizers, bench_quantize_nvfp4, bench_model --linear, the model rows), with the same knobs; 3. (LAYERS=1)
# host_costs.py --layers: host us per layer of an eager FP8 Linear step; 4. (DEMO_FA=1) the demo's loss curves with
# the default fast accumulation and with FP_RECIPES_FP8_FAST_ACCUMULATION=all (docs/recipes.md's comparison):
# DEMO_ARGS (default: --model small --steps 300 --recipes delayed,current).
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
if [ -n "${LAYERS:-}" ]; then
  echo "== host_costs --layers ($(date +%T))"
  timeout -k 10 "${LIM_LAYERS:-90}" python3 benchmarks/host_costs.py --layers --json "$OUT/layers.json" 2>&1 \
      | grep -v Warning | tail -n 20
  echo "layers rc=$?"
fi
if [ -n "${DEMO_FA:-}" ]; then
  for fa in default all; do
    echo "== demo, fast accumulation $fa ($(date +%T))"
    env $([ "$fa" = all ] && echo FP_RECIPES_FP8_FAST_ACCUMULATION=all) timeout -k 10 "${LIM_DEMO:-120}" \
        python3 -m fp_recipes demo ${DEMO_ARGS:---model small --steps 300 --recipes delayed,current} --no-plot \
        --no-progress --out "$OUT/demo_$fa" --json "$OUT/demo_$fa.json" > "$OUT/demo_$fa.log" 2>&1
    echo "demo rc=$?"; tail -n 14 "$OUT/demo_$fa.log"
  done
fi
