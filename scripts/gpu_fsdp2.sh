#!/usr/bin/env bash
# Issue 17 item 4 / issue 16's GPU run, after `source .device/setup.sh`: examples/hf_fsdp_train.py
# (a transformers Llama, FSDP2 over 2 GPUs, torch.autocast BF16, recipe from the environment) per
# recipe, with and without the quantized all-gather (and that with each weight's amax all-reduced per gather
# instead of precompute_weight_amaxes), beside the BF16 baseline. Step time, tokens/s
# and bytes per all-gather in $OUT/fsdp_*.json and the table printed last.
# FORMS: which of plain / qag (quantized all-gather, amaxes precomputed) / noprec (the same, each gather's own
# all-reduce) run per recipe (default all three); REPEAT=N runs the forms N times, alternating, for an A/B on a host
# whose step time drifts.
set -o pipefail
OUT=${OUT:-/tmp/gpu_fsdp2_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NPROC=${NPROC:-2}
SIZE=${SIZE:-small}
STEPS=${STEPS:-30}
for rep in $(seq 1 "${REPEAT:-1}"); do
  for recipe in ${RECIPES:-none delayed current nvfp4}; do
    for form in ${FORMS:-plain qag noprec}; do
      case $form in
        plain) qag="";;
        qag) qag="--quantized-all-gather";;
        noprec) qag="--quantized-all-gather --no-precompute-amaxes";;
        *) echo "FORMS: unknown form $form (allowed: plain qag noprec)"; exit 2;;
      esac
      [ "$recipe" = none ] && [ -n "$qag" ] && continue
      tag="${recipe}${qag:+_qag}"; case $qag in *no-precompute*) tag="${tag}_noprec";; esac
      [ "${REPEAT:-1}" -gt 1 ] && tag="${tag}_r${rep}"
      echo "== FP_RECIPES_RECIPE=$recipe $qag (run $rep)"
      FP_RECIPES_RECIPE=$recipe timeout "${LIM_RUN:-60}" torchrun --standalone --nproc-per-node "$NPROC" \
          examples/hf_fsdp_train.py --size "$SIZE" --steps "$STEPS" $qag --json "$OUT/fsdp_$tag.json" 2>&1 \
          | grep -v Warning | tail -n 3
    done
  done
done
python3 - "$OUT" <<'PY'
import json, pathlib, sys
rows = [(p.stem, json.loads(p.read_text())) for p in sorted(pathlib.Path(sys.argv[1]).glob("fsdp_*.json"))]
base = next((r for _, r in rows if r["recipe"] == "none"), None)
print("| run | recipe | quantized all-gather | step ms | x BF16 | tokens/s | all-gather bytes/rank | vs ordinary "
      "| precompute host ms | final loss |")
print("|---|---|---|---|---|---|---|---|---|---|")
for stem, r in sorted(rows, key=lambda t: (t[1]["recipe"] != "none", t[1]["recipe"], t[1]["quantized_all_gather"],
                                           t[1].get("precompute_amaxes", False), t[0])):
    ratio = base["step_ms"] / r["step_ms"] if base else float("nan")
    b = f"{r['bytes_sent_per_rank']:,}" if r["bytes_sent_per_rank"] else "-"
    v = f"{r['bytes_sent_per_rank'] / r['bytes_high_precision']:.3f}" if r["bytes_sent_per_rank"] else "-"
    qag = "no" if not r["quantized_all_gather"] else \
        f"yes, amaxes {'precomputed' if r.get('precompute_amaxes') else 'per gather'} " \
        f"(gathers: {r.get('amax_precomputed', 0)} precomputed, {r.get('amax_reduces', 0)} own all-reduce)"
    pre = f"{r['precompute_host_ms']:.3f}" if r.get("precompute_host_ms") is not None else "-"
    print(f"| {stem.removeprefix('fsdp_')} | {r['recipe']} | {qag} | {r['step_ms']:.2f} | {ratio:.2f} | "
          f"{r['tokens_per_s']:,.0f} | {b} | {v} | {pre} | {r['losses'][-1]:.4f} |")
PY
