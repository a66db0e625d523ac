#!/usr/bin/env bash
# benchmarks/nvfp4_variants/row_scaled_check.cu on a GPU (nvcc only, no setup.sh): row_scaled_kernel built with
# NVFP4_ROW_SCALED_FREE=${FREE:-1} byte-checked against rowwise_kernel, then under compute-sanitizer memcheck and
# racecheck. Log in $OUT/log.txt.
set -o pipefail
OUT=${OUT:-/tmp/gpu_row_scaled_check_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
B=${RSC_BUILD:-/tmp/row_scaled_check_build}
mkdir -p "$B"
F=(-O3 -std=c++17 --expt-relaxed-constexpr -fmad=false -Ifp_recipes/csrc -gencode=arch=compute_90a,code=sm_90a)
{
  echo "== build ($(date +%T))"
  "$NVCC" -c fp_recipes/csrc/nvfp4_amax.cu -o "$B/amax.o" "${F[@]}" & a=$!
  "$NVCC" -c fp_recipes/csrc/fp8_cast.cu -o "$B/fp8.o" "${F[@]}" & b=$!
  "$NVCC" -c -DNVFP4_ROW_SCALED_FREE="${FREE:-1}" benchmarks/nvfp4_variants/row_scaled_check.cu -o "$B/rsc.o" "${F[@]}" & c=$!
  wait $a && wait $b && wait $c && "$NVCC" -o "$B/rsc" "$B/rsc.o" "$B/amax.o" "$B/fp8.o" "${F[@]}" && echo "build ok"
  echo "== run ($(date +%T))"
  "$B/rsc"; echo "run rc=$?"
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool ($(date +%T))"
    timeout "${LIM_SAN:-40}" "$SAN" --tool "$tool" "$B/rsc" 2>&1 | tail -n 4
    echo "$tool rc=$?"
  done
  echo "== done ($(date +%T))"
} 2>&1 | tee "$OUT/log.txt"
