#!/usr/bin/env bash
# NVFP4 rowwise quantize variants in one device call (issue 6): builds benchmarks/nvfp4_variants/ with
# nvcc for sm_90a (setup.py's flags: -O3 -fmad=false ...), objects in parallel, then runs it: byte checks
# of every variant against the real kernel (randn + specials) and the timing table. Log (nvfp4_variants.log) + JSON in $OUT.
# Needs only nvcc and a GPU (no torch, no extension build):
#   FP_RECIPES_SKIP_BUILD=1 source .device/setup.sh && bash scripts/gpu_nvfp4_variants.sh
# (plain `source .device/setup.sh && bash scripts/gpu_nvfp4_variants.sh` works too, it only builds more).
set -o pipefail
OUT=${OUT:-/tmp/gpu_nvfp4_variants_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
ARCH=${NVFP4_VARIANTS_ARCH:-90a}
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
B=${NVFP4_VARIANTS_BUILD:-/tmp/nvfp4_variants_build}
mkdir -p "$B"
FLAGS=(-O3 -std=c++17 --expt-relaxed-constexpr -fmad=false -Ifp_recipes/csrc -Ibenchmarks/nvfp4_variants
       "-gencode=arch=compute_${ARCH},code=sm_${ARCH}")
S=benchmarks/nvfp4_variants
{
  echo "== nvidia-smi -L"; nvidia-smi -L 2>&1 | head -n 4
  echo "== build ($NVCC, sm_$ARCH)"; "$NVCC" --version | tail -n 2
  t0=$(date +%s)
  pids=()
  "$NVCC" -c "$S/base.cu" -o "$B/base.o" "${FLAGS[@]}" & pids+=($!)
  "$NVCC" -c "$S/main.cu" -o "$B/main.o" "${FLAGS[@]}" & pids+=($!)
  # the bias-gradient reduce that nvfp4 quantize() (included by base.cu) calls for a fused bias gradient
  "$NVCC" -c fp_recipes/csrc/fp8_cast.cu -o "$B/fp8.o" "${FLAGS[@]}" & pids+=($!)
  for k in 1 2 3 4 5; do
    "$NVCC" -c "$S/parts.cu" -DPART=$k -o "$B/part$k.o" "${FLAGS[@]}" & pids+=($!)
  done
  rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  [ $rc -eq 0 ] || { echo "build failed"; exit 1; }
  "$NVCC" -o "$B/nvfp4_variants" "$B"/main.o "$B"/base.o "$B"/part1.o "$B"/part2.o "$B"/part3.o "$B"/part4.o \
      "$B"/part5.o "$B"/fp8.o "-gencode=arch=compute_${ARCH},code=sm_${ARCH}" || { echo "link failed"; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
  echo "== run"
  timeout "${LIM_RUN:-150}" "$B/nvfp4_variants" "$OUT/nvfp4_variants.json" --reps "${REPS:-60}"
  echo "run rc=$?"
} 2>&1 | tee "$OUT/nvfp4_variants.log"
