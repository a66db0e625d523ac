// NVFP4 dequantization (NUMERICS.md step 7): x ~= q * RN(RN(fp32(sf) * amax) * RN(1/(6E))),
// computed in FP32 and rounded once to the output dtype. One thread per 1x16 block.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "nvfp4_device.cuh"
#include "nvfp4_kernels.h"

namespace fp_recipes {
namespace nvfp4 {
namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }

template <typename T>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(const uint8_t* data, const uint8_t* scale,
                                                              const float* amax, bool row_scaled,
                                                              int64_t M, int64_t N, float e4m3_max,
                                                              T* out) {
  const int64_t blocks_per_row = N / 16;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (g >= M * blocks_per_row) return;
  const float a = row_scaled ? __ldg(amax + g / blocks_per_row) : __ldg(amax);
  const float inv_6e = __fdiv_rn(1.0f, __fmul_rn(6.0f, e4m3_max));
  const float factor = __fmul_rn(__fmul_rn(nvfp4_e4m3_decode(scale[g]), a), inv_6e);
  const uint2 q = __ldg(reinterpret_cast<const uint2*>(data) + g);
  alignas(16) T v[16];
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const uint32_t word = j < 8 ? q.x : q.y;
    v[j] = from_f32<T>(__fmul_rn(e2m1_decode((word >> (4 * (j % 8))) & 0xFu), factor));
  }
  uint4* dst = reinterpret_cast<uint4*>(out + g * 16);
#pragma unroll
  for (int k = 0; k < static_cast<int>(16 * sizeof(T) / 16); ++k) dst[k] = reinterpret_cast<const uint4*>(v)[k];
}

template <typename T>
void launch(const uint8_t* data, const uint8_t* scale, const float* amax, bool row_scaled, int64_t M,
            int64_t N, float e4m3_max, void* out, cudaStream_t stream) {
  const int64_t total = M * (N / 16);
  if (total == 0) return;
  dequantize_kernel<T><<<static_cast<unsigned>((total + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      data, scale, amax, row_scaled, M, N, e4m3_max, static_cast<T*>(out));
  check_launch("nvfp4 dequantize_kernel");
}

}  // namespace

void dequantize(const uint8_t* data, const uint8_t* scale, const float* amax, bool row_scaled,
                int64_t M, int64_t N, float e4m3_max, void* out, DType out_dtype, cudaStream_t stream) {
  require(N % 16 == 0, "nvfp4 dequantize: N must be a multiple of 16");
  switch (out_dtype) {
    case DType::kFloat32: launch<float>(data, scale, amax, row_scaled, M, N, e4m3_max, out, stream); break;
    case DType::kBFloat16: launch<__nv_bfloat16>(data, scale, amax, row_scaled, M, N, e4m3_max, out, stream); break;
    case DType::kFloat16: launch<__half>(data, scale, amax, row_scaled, M, N, e4m3_max, out, stream); break;
    default: require(false, std::string("nvfp4 dequantize: unsupported output dtype ") + dtype_name(out_dtype));
  }
}

}  // namespace nvfp4
}  // namespace fp_recipes
