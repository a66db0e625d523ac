#!/usr/bin/env bash
# Issue 17 (and issue 12's one-GPU example) in one call on a 2-GPU machine, after
# `source .device/setup.sh`:
#   1. NCCL: delayed-scaling amax reduction over 2 GPUs (tests/test_faults_dist_amax.py, cuda test),
#      Megatron TP=2 / TP=2+SP against TP=1 and dist-checkpoint resharding TP=2 <-> TP=1 (the gloo
#      workers of tests/test_megatron_tp.py with FP_RECIPES_TEST_DEVICE=cuda: one GPU per rank);
#   2. examples/megatron_gpt.py under torchrun at TP=1 (DP=2), TP=2 and TP=2+SP, every recipe, then
#      scripts/compare_megatron_layouts.py (loss curves against TP=1, state identical on ranks);
#   3. examples/megatron_gpt.py on one GPU (issue 12's loss table).
# Logs and JSON in $OUT. Stage limits: LIM_TESTS, LIM_LAYOUT (each layout), LIM_ONE; STEPS2, STEPS1;
# SKIP_TESTS=1, SKIP_ONE=1 skip stages 1 and 3; LAYOUTS="1: 2: 2:--sp" picks the layouts of stage 2.
set -o pipefail
OUT=${OUT:-/tmp/gpu_two_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STEPS2=${STEPS2:-200}
STEPS1=${STEPS1:-300}
{
  echo "== nvidia-smi -L"; nvidia-smi -L
  git log --oneline -1 2>/dev/null || true
  python3 -c "import fp_recipes, megatron.core as m; print(fp_recipes.backend_info()['summary']); print('megatron-core', m.__version__)"
  if [ -z "${SKIP_TESTS:-}" ]; then
    echo "== NCCL: amax reduction (cuda test), Megatron TP/SP and checkpoint workers on 2 GPUs"
    FP_RECIPES_TEST_DEVICE=cuda timeout "${LIM_TESTS:-150}" python3 -m pytest -q -p no:cacheprovider --tb=short \
        tests/test_faults_dist_amax.py tests/test_megatron_tp.py 2>&1 | tail -n 25
    echo "nccl tests rc=$?"
  fi
  for layout in ${LAYOUTS:-1: 2: 2:--sp}; do
    tp=${layout%%:*}; sp=${layout#*:}; tag="tp${tp}${sp:+_sp}"
    echo "== megatron_gpt.py torchrun x2 --tp $tp $sp ($STEPS2 steps per recipe)"
    timeout "${LIM_LAYOUT:-120}" torchrun --standalone --nproc-per-node 2 examples/megatron_gpt.py \
        --tp "$tp" $sp --steps "$STEPS2" --json "$OUT/megatron_$tag.json" 2>&1 | grep -v Warning | tail -n 12
    echo "$tag rc=$?"
  done
  echo "== layouts compared"
  python3 scripts/compare_megatron_layouts.py "$OUT/megatron_layouts.json" "$OUT/megatron_tp1.json" \
      "$OUT/megatron_tp2.json" "$OUT/megatron_tp2_sp.json"
  echo "compare rc=$?"
  if [ -z "${SKIP_ONE:-}" ]; then
    echo "== megatron_gpt.py on one GPU ($STEPS1 steps per recipe)"
    timeout "${LIM_ONE:-120}" python3 examples/megatron_gpt.py --steps "$STEPS1" --json "$OUT/megatron_1gpu.json" 2>&1 \
        | grep -v Warning | tail -n 12
    echo "one-gpu rc=$?"
  fi
} 2>&1 | tee "$OUT/log.txt"
