#!/usr/bin/env bash
# Session 35, after `source .device/setup.sh`: (1) how to chunk a row-scaled NVFP4 GEMM (benchmarks/nvfp4_row_chunks.py:
# the FP32 scratch in L2 or not), (2) the row-scaled+4over6 model rows with the scratch budget against the default
# chunks in one process (bench_model.py --nvfp4-row-scratch-ab), (3) where an FP8 Linear step's host time goes now
# (profile_host.py). Logs and JSON in $OUT; STAGES picks stages (default "chunks model host").
set -o pipefail
OUT=${OUT:-/tmp/gpu_session35_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
STAGES=${STAGES:-chunks model host}
{
  for stage in $STAGES; do
    echo "== $stage ($(date +%T))"
    case $stage in
      chunks) timeout "${LIM_CHUNKS:-120}" python3 benchmarks/nvfp4_row_chunks.py \
                  --rows "${CHUNK_ROWS:-lib,1024,512,256,l2:8,l2:16,l2:24}" --json "$OUT/row_chunks.json" 2>&1 \
                  | grep -v Warning ;;
      model) timeout "${LIM_MODEL:-200}" python3 benchmarks/bench_model.py --sizes h2048_t8192,h4096_t4096 --no-compiled \
                  --rows "row-scaled" --nvfp4-row-scratch-ab "${ROW_SCRATCH:-16777216}" --json "$OUT/model.json" 2>&1 \
                  | grep -v Warning | tail -n 10 ;;
      host) timeout "${LIM_HOST:-120}" python3 benchmarks/profile_host.py --recipes off,current,delayed --steps 200 \
                  --top 25 > "$OUT/profile_host.txt" 2>&1; echo "profile_host rc=$?"; grep "^=====" "$OUT/profile_host.txt" ;;
      linear) timeout "${LIM_LIN:-70}" python3 benchmarks/bench_model.py --linear --no-compiled --json "$OUT/linear.json" 2>&1 \
                  | grep -v Warning | tail -n 7 ;;
    esac
    echo "$stage rc=$?"
  done
  echo "== done ($(date +%T))"
} 2>&1 | tee "$OUT/log.txt"
