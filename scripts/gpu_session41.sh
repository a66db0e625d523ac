#!/usr/bin/env bash
# After `source .device/setup.sh`: session 41's checks. 0. (TILE=1) the v7 tile benchmark is built in the background
# (nvcc only) with the shipped SR encode (encode16_sr_ceil, object b0) and the one it replaced (encode16_sr_fma,
# object f1); 1. the GPU tests (TEST_FILES, TEST_K); 2. compute-sanitizer (SAN_TOOLS) over SAN_SCRIPTS;
# 3. (TILE=1) the tile benchmark: bytes of every variant against the old tile kernel, times at 16384x6144 and
# 4096x4096 with the copy of the same run; 4. bench_quantize_nvfp4 at QUANT_SHAPES (QUANT_FULL=1: 50 iterations);
# 5. with LINEAR=1, bench_model --linear (LINEAR_ARGS); 6. with MODEL=1, bench_model's rows at SIZES (MODEL_ARGS).
# SANITIZE_QUICK=1: tests/sanitize_nvfp4.py's quick mode. Every stage under `timeout` (LIM_*); logs in $OUT.
set -o pipefail
OUT=${OUT:-/tmp/gpu_session41_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
ARCH=90a
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
B=/tmp/nvfp4_tile_build
S=benchmarks/nvfp4_variants
if [ -n "${TILE:-}" ]; then
  mkdir -p "$B"
  FLAGS=(-O3 -std=c++17 --expt-relaxed-constexpr -fmad=false -Ifp_recipes/csrc -I$S "-gencode=arch=compute_${ARCH},code=sm_${ARCH}")
  (
    t0=$(date +%s); pids=()
    "$NVCC" -c "$S/tile_main.cu" -o "$B/main.o" "${FLAGS[@]}" & pids+=($!)
    for spec in "b0:-DNVFP4_TILE2_MINB=0" "b4:-DNVFP4_TILE2_MINB=4" "m0:-DNVFP4_TILE2_EXP_MAGIC=0 -DNVFP4_TILE2_SHORT=0" \
                "s0:-DNVFP4_TILE2_SHORT=0" "f1:-DNVFP4_SR_CEIL=0" "st4:-DNVFP4_TILE2_STRIP_WAVES=0" \
                "st1:-DNVFP4_TILE2_STRIP_WAVES=1000000" "rs1:-DNVFP4_ROW_SCALED_FREE=1" \
                "ru2:-DNVFP4_TILE2_SR_ROW_UNROLL=2"; do
      tag=${spec%%:*}; defs=${spec#*:}
      "$NVCC" -c "$S/tile_kernels.cu" -o "$B/$tag.o" -DTB_TAG=$tag $defs "${FLAGS[@]}" & pids+=($!)
    done
    "$NVCC" -c fp_recipes/csrc/nvfp4_amax.cu -o "$B/amax.o" "${FLAGS[@]}" & pids+=($!)
    "$NVCC" -c fp_recipes/csrc/fp8_cast.cu -o "$B/fp8.o" "${FLAGS[@]}" & pids+=($!)
    rc=0; for p in "${pids[@]}"; do wait "$p" || rc=1; done
    [ $rc -eq 0 ] && "$NVCC" -o "$B/nvfp4_tile_bench" "$B"/main.o "$B"/b0.o "$B"/b4.o "$B"/m0.o "$B"/s0.o "$B"/f1.o \
        "$B"/st4.o "$B"/st1.o "$B"/rs1.o "$B"/ru2.o "$B"/amax.o "$B"/fp8.o "-gencode=arch=compute_${ARCH},code=sm_${ARCH}" || rc=1
    echo "tile bench build rc=$rc in $(( $(date +%s) - t0 )) s"
  ) > "$OUT/tile_build.log" 2>&1 &
fi
{
  nvidia-smi -L; git log --oneline -1 2>/dev/null || true
  if [ -z "${NO_TESTS:-}" ]; then
    echo "== pytest ${TEST_FILES} ($(date +%T))"
    kfilter=()
    [ -n "${TEST_K:-}" ] && kfilter=(-k "$TEST_K")
    timeout -k 10 "${LIM_TEST:-240}" python3 -m pytest -q -m cuda -p no:cacheprovider --tb=short --durations=5 \
        ${TEST_FILES:-tests/test_cuda_nvfp4_kernels.py} "${kfilter[@]}" > "$OUT/pytest.txt" 2>&1
    echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -n 30; tail -n 8 "$OUT/pytest.txt"
  fi
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  for tool in ${SAN_TOOLS:-}; do
    for script in ${SAN_SCRIPTS:-tests/sanitize_nvfp4_v7.py}; do
      echo "== compute-sanitizer --tool $tool $script ($(date +%T))"
      SANITIZE_QUICK=${SANITIZE_QUICK:-} SANITIZE_REF=$([ "$tool" = racecheck ] && echo 0 || echo 1) timeout -k 10 "${LIM_SAN:-120}" "$SAN" --tool "$tool" \
          python3 "$script" 2>&1 | grep -vE "^========= (Program hit|    Saved host backtrace|        Host Frame)" | tail -n 6
      echo "$tool $script rc=$?"
    done
  done
  if [ -n "${TILE:-}" ]; then
    echo "== tile bench ($(date +%T))"
    # (the build runs beside this pipeline's subshell, not in it: wait for its last line, not its pid)
    for _ in $(seq 1 600); do grep -q "tile bench build rc=" "$OUT/tile_build.log" 2>/dev/null && break; sleep 1; done
    tail -n 5 "$OUT/tile_build.log"
    [ -x "$B/nvfp4_tile_bench" ] && timeout -k 10 "${LIM_TILE:-90}" "$B/nvfp4_tile_bench" "$OUT/tile_bench.json" \
        > "$OUT/tile_bench.log" 2>&1
    echo "tile rc=$?"; grep -E "SR row \+ RHT SR col|2D SR row\+col|mismatch|MISMATCH|differ" "$OUT/tile_bench.log" | head -n 40
  fi
  if [ -n "${QUANT_SHAPES:-}" ]; then
    echo "== bench_quantize_nvfp4 $QUANT_SHAPES ($(date +%T))"
    qflag=--quick; [ -n "${QUANT_FULL:-}" ] && qflag=
    timeout -k 10 "${LIM_QUANT:-120}" python3 benchmarks/bench_quantize_nvfp4.py $qflag --shapes "$QUANT_SHAPES" \
        --json "$OUT/quantize.json" 2>&1 | grep -v Warning | tail -n 40
    echo "quantize rc=$?"
  fi
  if [ -n "${LINEAR:-}" ]; then
    echo "== bench_model --linear ${LINEAR_ARGS:-} ($(date +%T))"
    timeout -k 10 "${LIM_LIN:-200}" python3 benchmarks/bench_model.py --linear ${LINEAR_ARGS:---no-compiled} \
        --json "$OUT/linear.json" 2>&1 | grep -v Warning | tail -n 12
    echo "linear rc=$?"
  fi
  if [ -n "${MODEL:-}" ]; then
    echo "== bench_model ${SIZES} ${MODEL_ARGS} ($(date +%T))"
    timeout -k 10 "${LIM_MODEL:-300}" python3 benchmarks/bench_model.py --sizes "${SIZES:-h2048_t8192}" ${MODEL_ARGS:-} \
        --json "$OUT/model.json" 2>&1 | grep -v Warning | tail -n "${TAIL_MODEL:-60}"
    echo "model rc=$?"
  fi
  echo "== done ($(date +%T))"
} 2>&1 | tee "$OUT/log.txt"
