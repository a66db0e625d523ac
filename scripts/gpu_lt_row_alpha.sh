#!/usr/bin/env bash
# benchmarks/nvfp4_variants/lt_row_alpha_probe.cu on a GPU (nvcc only): whether cuBLASLt takes a row-major BF16 D
# with a per-row alpha vector on this GPU (a row-scaled NVFP4 product's epilogue inside the GEMM), its values and
# its time against the library's FP32-product + epilogue form. Log in $OUT/lt_row_alpha.txt.
set -o pipefail
OUT=${OUT:-/tmp/gpu_lt_row_alpha_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
B=${PROBE_BUILD:-/tmp/lt_row_alpha_build}
mkdir -p "$B"
# cuBLASLt from the CUDA toolkit, else from the pip wheel torch loads (nvidia/cu13 or nvidia/cublas)
EXTRA=()
LINK=(-lcublasLt)
for d in $(python3 -c "import nvidia, os; [print(os.path.join(p, s)) for p in nvidia.__path__ for s in ('cu13', 'cublas')]" 2>/dev/null); do
  [ -f "$d/include/cublasLt.h" ] && EXTRA=(-I"$d/include" -Xlinker -rpath="$d/lib") && LINK=("$d"/lib/libcublasLt.so.*) && break
done
[ -f "${CUDA_HOME:-/usr/local/cuda}/include/cublasLt.h" ] && EXTRA=() && LINK=(-lcublasLt)
{
  "$NVCC" "${EXTRA[@]}" -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a benchmarks/nvfp4_variants/lt_row_alpha_probe.cu \
    "${LINK[@]}" -o "$B/probe" && "$B/probe"; echo "probe rc=$?"
} 2>&1 | tee "$OUT/lt_row_alpha.txt"
