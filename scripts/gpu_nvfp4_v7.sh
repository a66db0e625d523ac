#!/usr/bin/env bash
# NVFP4 v7 quantize kernels (issue 13, target 2) in one device call, after `source .device/setup.sh`:
#   source .device/setup.sh && bash scripts/gpu_nvfp4_v7.sh
# 1. the tile benchmark (benchmarks/nvfp4_variants/tile_main.cu) is built in the background (nvcc only);
# 2. pytest -m cuda: quantize kernels vs the reference twin, unit operands, the fast GEMM;
# 3. compute-sanitizer memcheck + racecheck over tests/sanitize_nvfp4.py (quick) and the v7 cases of
#    tests/sanitize_nvfp4_v7.py;
# 4. the tile benchmark: v6 tile kernel vs v7 tile2 kernel (bytes compared, timings at 16384x6144 and
#    4096x4096 BF16, 4096x4096 FP32; copy bandwidth of the same run), row-scaled v6 / v7 / fused;
# 5. bench_quantize_nvfp4.py --quick --shapes 16384x6144 (the shipped kernels through the extension).
# EXTRA_TESTS: more pytest arguments. TILE_ONLY=1: the tile benchmark alone (nvcc only: no setup.sh needed).
# Every stage runs under `timeout` (LIM_TEST 140, LIM_SAN 35 per tool, LIM_TILE 40, LIM_BENCH 45 s; override by
# env); logs and JSON in $OUT (log.txt, tile_bench.log, bench_quantize.log, *.json); the tile table prints last.
set -o pipefail
OUT=${OUT:-/tmp/gpu_nvfp4_v7_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
ARCH=${NVFP4_V7_ARCH:-90a}
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
B=${NVFP4_V7_BUILD:-/tmp/nvfp4_v7_build}
mkdir -p "$B"
FLAGS=(-O3 -std=c++17 --expt-relaxed-constexpr -fmad=false -Ifp_recipes/csrc -Ibenchmarks/nvfp4_variants
       "-gencode=arch=compute_${ARCH},code=sm_${ARCH}")
S=benchmarks/nvfp4_variants
(
  t0=$(date +%s)
  pids=()
  "$NVCC" -c "$S/tile_main.cu" -o "$B/main.o" "${FLAGS[@]}" & pids+=($!)
  "$NVCC" -c "$S/tile_kernels.cu" -o "$B/b0.o" -DTB_TAG=b0 -DNVFP4_TILE2_MINB=0 "${FLAGS[@]}" & pids+=($!)
  "$NVCC" -c "$S/tile_kernels.cu" -o "$B/b4.o" -DTB_TAG=b4 -DNVFP4_TILE2_MINB=4 "${FLAGS[@]}" & pids+=($!)
  "$NVCC" -c "$S/tile_kernels.cu" -o "$B/m0.o" -DTB_TAG=m0 -DNVFP4_TILE2_EXP_MAGIC=0 -DNVFP4_TILE2_SHORT=0 \
      "${FLAGS[@]}" & pids+=($!)
  "$NVCC" -c "$S/tile_kernels.cu" -o "$B/s0.o" -DTB_TAG=s0 -DNVFP4_TILE2_SHORT=0 "${FLAGS[@]}" & pids+=($!)
  "$NVCC" -c "$S/tile_kernels.cu" -o "$B/f1.o" -DTB_TAG=f1 -DNVFP4_SR_CEIL=0 "${FLAGS[@]}" & pids+=($!)
  "$NVCC" -c "$S/tile_kernels.cu" -o "$B/st4.o" -DTB_TAG=st4 -DNVFP4_TILE2_STRIP_WAVES=0 "${FLAGS[@]}" & pids+=($!)
  "$NVCC" -c "$S/tile_kernels.cu" -o "$B/st1.o" -DTB_TAG=st1 -DNVFP4_TILE2_STRIP_WAVES=1000000 "${FLAGS[@]}" & pids+=($!)
  "$NVCC" -c "$S/tile_kernels.cu" -o "$B/rs1.o" -DTB_TAG=rs1 -DNVFP4_ROW_SCALED_FREE=1 "${FLAGS[@]}" & pids+=($!)
  "$NVCC" -c "$S/tile_kernels.cu" -o "$B/ru2.o" -DTB_TAG=ru2 -DNVFP4_TILE2_SR_ROW_UNROLL=2 "${FLAGS[@]}" & pids+=($!)
  "$NVCC" -c fp_recipes/csrc/nvfp4_amax.cu -o "$B/amax.o" "${FLAGS[@]}" & pids+=($!)
  # fp8_cast.cu: the bias-gradient reduce that nvfp4 quantize() calls for a fused bias gradient (session 25)
  "$NVCC" -c fp_recipes/csrc/fp8_cast.cu -o "$B/fp8.o" "${FLAGS[@]}" & pids+=($!)
  rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  [ $rc -eq 0 ] && "$NVCC" -o "$B/nvfp4_tile_bench" "$B/main.o" "$B/b0.o" "$B/b4.o" "$B/m0.o" "$B/s0.o" "$B/f1.o" "$B/st4.o" "$B/st1.o" "$B/rs1.o" "$B/ru2.o" "$B/amax.o" "$B/fp8.o" \
      "-gencode=arch=compute_${ARCH},code=sm_${ARCH}" || rc=1
  echo "tile bench build rc=$rc in $(( $(date +%s) - t0 )) s"
) > "$OUT/tile_build.log" 2>&1 &
BUILD_PID=$!
{
  echo "== nvidia-smi -L"; nvidia-smi -L
  git log --oneline -1 2>/dev/null || true
  python3 -c "import fp_recipes; print(fp_recipes.backend_info()['summary'])"
  if [ -z "${TILE_ONLY:-}" ]; then
  echo "== pytest -m cuda"
  timeout "${LIM_TEST:-140}" python3 -m pytest -q -m cuda -p no:cacheprovider --durations=5 --maxfail=10 \
      tests/test_cuda_nvfp4_kernels.py tests/test_cuda_nvfp4_units.py tests/test_nvfp4_fast_gemm.py ${EXTRA_TESTS:-} 2>&1 \
      | tail -n 30
  echo "pytest rc=$?"
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool (sanitize_nvfp4_v7.py)"
    ref=1; [ "$tool" = racecheck ] && ref=0  # racecheck instruments the twin's torch kernels too: slow
    SANITIZE_REF=$ref timeout "${LIM_SAN:-35}" "$SAN" --tool "$tool" python3 tests/sanitize_nvfp4_v7.py 2>&1 \
        | grep -vE "^========= (Program hit|    Saved host backtrace|        Host Frame)" | tail -n 15
    echo "$tool rc=$?"
  done
  fi
  echo "== tile benchmark"
  # the build runs outside this piped block (not its child: `wait` cannot see it): poll its log
  for _ in $(seq 1 120); do grep -q "tile bench build rc=" "$OUT/tile_build.log" 2>/dev/null && break; sleep 1; done
  cat "$OUT/tile_build.log"
  if [ -x "$B/nvfp4_tile_bench" ]; then
    timeout "${LIM_TILE:-40}" "$B/nvfp4_tile_bench" "$OUT/nvfp4_tile_bench.json" --reps "${REPS:-40}" \
        > "$OUT/tile_bench.log" 2>&1
    echo "tile bench rc=$?"
    grep -E "^(device|byte checks|MISMATCH)" "$OUT/tile_bench.log" | head -n 20
  fi
  [ -z "${TILE_ONLY:-}" ] && {
  echo "== bench_quantize_nvfp4 --quick --shapes 16384x6144"
  timeout "${LIM_BENCH:-45}" python3 benchmarks/bench_quantize_nvfp4.py --quick --shapes 16384x6144 \
      --json "$OUT/bench_quantize_nvfp4.json" > "$OUT/bench_quantize.log" 2>&1
  echo "bench rc=$?"
  grep -E "^16384x6144" "$OUT/bench_quantize.log" | head -n 40
  }
  echo "== tile benchmark table"
  sed -n '/^== /,$p' "$OUT/tile_bench.log" | grep -vE "^wrote" | head -n 170
} 2>&1 | tee "$OUT/log.txt"
