#!/bin/bash
# One device call for the prototype: build + check + time the variants ($VARIANTS), then Nsight Compute on one
# variant's 4096^3 launch ($NCU_VARIANT) and compute-sanitizer memcheck of one variant on a small shape ($SAN_VARIANT) (both only after a
# clean run.py).
# Usage (after `source .device/setup.sh`): VARIANTS=v4,rs [NCU_VARIANT=rs [NCU_SOURCE=1]] [SAN_VARIANT=rs] bash benchmarks/nvfp4_gemm_proto/device_run.sh
# Each step runs under a time limit (LIM_RUN, LIM_NCU, LIM_SAN seconds): a kernel that hangs costs the limit, not the call.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
O=${OUT:-/tmp}
timeout ${LIM_RUN:-150} python3 "$HERE/run.py" --variants "${VARIANTS:-v4,rs}" --json "$O/proto.json" > "$O/proto.log" 2>&1
RC=$?
echo "run.py exit $RC"
tail -8 "$O/proto.log"
V=${NCU_VARIANT:-}
if [ -n "$V" ] && [ "$RC" = 0 ]; then
  METRICS=sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,\
sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,\
sm__inst_executed_pipe_uniform.avg.pct_of_peak_sustained_active,sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active,\
l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,\
smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_short_scoreboard_per_warp_active.pct,\
smsp__warp_issue_stalled_barrier_per_warp_active.pct,smsp__warp_issue_stalled_wait_per_warp_active.pct,\
smsp__warp_issue_stalled_math_pipe_throttle_per_warp_active.pct,smsp__warp_issue_stalled_mio_throttle_per_warp_active.pct
  timeout ${LIM_NCU:-120} ncu -k regex:decode_gemm -c 1 --section SpeedOfLight --section WarpStateStats \
    --section ComputeWorkloadAnalysis --metrics "$METRICS" \
    python3 "$HERE/run.py" --variants "$V" --shapes 4096x4096x4096 --iters 1 > "$O/ncu_$V.txt" 2>&1
  echo "ncu exit $?"
  grep -E "Duration|Throughput|Busy|Cycles Per Issued|sm__|l1tex__|smsp__|ERR" "$O/ncu_$V.txt" | head -30
  if [ -n "${NCU_SOURCE:-}" ]; then  # where the warps stall, per SASS instruction (sampled), as CSV
    timeout ${LIM_NCU:-120} ncu -k regex:decode_gemm -c 1 --section WarpStateStats --section SourceCounters \
      --import-source yes -f -o "$O/prof_$V" python3 "$HERE/run.py" --variants "$V" --shapes 4096x4096x4096 --iters 1 \
      > "$O/ncu_source_$V.log" 2>&1
    ncu -i "$O/prof_$V.ncu-rep" --page source --csv --print-source sass > "$O/source_$V.csv" 2>&1
    echo "ncu source exit $?, $(wc -l < "$O/source_$V.csv") lines"
    gzip -f "$O/source_$V.csv"
  fi
fi
S=${SAN_VARIANT:-}
if [ -n "$S" ] && [ "$RC" = 0 ]; then
  timeout ${LIM_SAN:-90} compute-sanitizer --tool memcheck --print-limit 5 python3 "$HERE/run.py" --variants "$S" \
    --shapes 512x256x512 --iters 1 > "$O/sanitizer_memcheck_$S.txt" 2>&1
  echo "memcheck exit $?"; grep -E "ERROR SUMMARY|Error" "$O/sanitizer_memcheck_$S.txt" | head -5
fi
