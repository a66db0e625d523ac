#!/usr/bin/env bash
# Issue 17 item 4 / issue 16's GPU run, after `source .device/setup.sh`: examples/hf_fsdp_train.py
# (a transformers Llama, FSDP2 over 2 GPUs, torch.autocast BF16, recipe from the environment) per
# recipe, with and without the quantized all-gather (and that with each weight's amax all-reduced per gather
# instead of precompute_weight_amaxes), beside the BF16 baseline. Step time, tokens/s
# and bytes per all-gather in $OUT/fsdp_*.json and the table printed last.
set -o pipefail
OUT=${OUT:-/tmp/gpu_fsdp2_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NPROC=${NPROC:-2}
SIZE=${SIZE:-small}
STEPS=${STEPS:-30}
for recipe in ${RECIPES:-none delayed current nvfp4}; do
  for qag in "" "--quantized-all-gather" "--quantized-all-gather --no-precompute-amaxes"; do
    [ "$recipe" = none ] && [ -n "$qag" ] && continue
    tag="${recipe}${qag:+_qag}"; case $qag in *no-precompute*) tag="${tag}_noprec";; esac
    echo "== FP_RECIPES_RECIPE=$recipe $qag"
    FP_RECIPES_RECIPE=$recipe timeout "${LIM_RUN:-60}" torchrun --standalone --nproc-per-node "$NPROC" \
        examples/hf_fsdp_train.py --size "$SIZE" --steps "$STEPS" $qag --json "$OUT/fsdp_$tag.json" 2>&1 \
        | grep -v Warning | tail -n 3
  done
done
python3 - "$OUT" <<'PY'
import json, pathlib, sys
rows = [json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("fsdp_*.json"))]
base = next((r for r in rows if r["recipe"] == "none"), None)
print("| recipe | quantized all-gather | step ms | x BF16 | tokens/s | all-gather bytes/rank | vs ordinary | final loss |")
print("|---|---|---|---|---|---|---|---|")
for r in sorted(rows, key=lambda r: (r["recipe"] != "none", r["recipe"], r["quantized_all_gather"],
                                     r.get("precompute_amaxes", False))):
    ratio = base["step_ms"] / r["step_ms"] if base else float("nan")
    b = f"{r['bytes_sent_per_rank']:,}" if r["bytes_sent_per_rank"] else "-"
    v = f"{r['bytes_sent_per_rank'] / r['bytes_high_precision']:.3f}" if r["bytes_sent_per_rank"] else "-"
    qag = "no" if not r["quantized_all_gather"] else \
        f"yes, amaxes {'precomputed' if r.get('precompute_amaxes') else 'per gather'} " \
        f"({r.get('amax_precomputed', 0)} / {r.get('amax_reduces', 0)})"
    print(f"| {r['recipe']} | {qag} | {r['step_ms']:.2f} | {ratio:.2f} | "
          f"{r['tokens_per_s']:,.0f} | {b} | {v} | {r['losses'][-1]:.4f} |")
PY
