#!/usr/bin/env bash
# GroupedLinear FP8 launch path in one device call (after `source .device/setup.sh`): the multi-tensor
# cast and cuBLASLt GEMM-list tests, the module tests on CUDA, the FP8 cast tests (shared device code),
# the multi-cast benchmark, the GroupedLinear benchmark and the profile of one step.
# Each stage has its own limit (LIM_* seconds); everything is tee'd into $OUT.
#   source .device/setup.sh && bash scripts/gpu_grouped.sh
set -o pipefail
OUT=${OUT:-/tmp/gpu_grouped_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
{
  echo "== nvidia-smi -L"; nvidia-smi -L
  python3 -c "import fp_recipes; i=fp_recipes.backend_info(); print(i['summary']); print('grouped gemm:', i['grouped_gemm'])"
  echo "== does cuBLASLt take an FP8 scale pointer that is not 16-byte aligned? (torch._scaled_mm)"
  python3 - <<'PY' 2>&1 | tail -n 3
import torch
a = torch.randn(64, 64, device="cuda").to(torch.float8_e4m3fn)
b = torch.randn(32, 64, device="cuda").to(torch.float8_e4m3fn)
packed = torch.tensor([1.0, 2.0], device="cuda")
for off in (0, 1):
    try:
        torch._scaled_mm(a, b.t(), scale_a=packed[off], scale_b=packed[0], out_dtype=torch.bfloat16)
        print(f"scale at byte offset {4 * off}: ok")
    except RuntimeError as exc:
        print(f"scale at byte offset {4 * off}: {str(exc)[:90]}")
PY
  echo "== pytest -m cuda (gemm cublaslt, multi-cast, FP8 kernels, modules)"
  timeout "${LIM_TEST:-150}" python3 -m pytest -q -m cuda -p no:cacheprovider --tb=short -x \
      tests/test_gemm_lt.py tests/test_cuda_fp8_multi.py tests/test_cuda_fp8_kernels.py \
      tests/test_modules_linear.py tests/test_modules_gemm.py tests/test_modules_delayed.py 2>&1 | tail -n 40
  echo "tests rc=$?"
  echo "== benchmark: multi-tensor cast"
  timeout "${LIM_QBENCH:-60}" python3 benchmarks/bench_quantize.py --only ${QBENCH_ONLY:-multi} --no-compile \
      --json "$OUT/quantize_multi.json" 2>&1 | grep -v "Warning\|warn" | tail -n 30
  echo "qbench rc=$?"
  echo "== benchmark: GroupedLinear"
  timeout "${LIM_BENCH:-200}" python3 benchmarks/bench_linear.py --only grouped --no-nvfp4 --no-generic \
      ${BENCH_ARGS:-} --json "$OUT/grouped.json" 2>&1 | tail -n 40
  echo "bench rc=$?"
  echo "== profile GroupedLinear M=16k"
  timeout "${LIM_PROF:-60}" python3 benchmarks/profile_linear.py --only grouped --no-torch-profiler 2>&1 | tail -n 20
  echo "profile rc=$?"
} 2>&1 | tee "$OUT/log.txt"
