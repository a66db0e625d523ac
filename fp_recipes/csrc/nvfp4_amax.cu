// NVFP4 amax kernels: per-tensor amax (optionally fused with the post-RHT amax of the columnwise
// operand) and per-row amax (row-scaled activations). FP32 accumulation whatever the input dtype;
// NaN propagates (written as the canonical NaN 0x7FC00000). Blocks combine through an atomic max
// on the FP32 bit pattern of |x| (order-independent, hence race-free and deterministic).
//
// Memset-free mode (ws != nullptr): the blocks combine in a zero-initialised workspace {max0, max1,
// counter} instead of the (then unzeroed) outputs; the last block to finish (counter ticket ==
// gridDim - 1) copies the maxima to the outputs and resets the workspace to zero, so the next launch on
// the same stream finds it zeroed again. One launch instead of memset + kernel.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "nvfp4_device.cuh"
#include "nvfp4_kernels.h"

namespace fp_recipes {
namespace nvfp4 {
namespace {

constexpr int kThreads = 256;
constexpr uint32_t kCanonicalNaN = 0x7FC00000u;

__device__ __forceinline__ uint32_t canonical(uint32_t bits) {
  return bits > 0x7F800000u ? kCanonicalNaN : bits;
}

// Block-wide max of one value per thread; thread 0 gets the result.
__device__ __forceinline__ uint32_t block_max(uint32_t v) {
  __shared__ uint32_t warp_max[kThreads / 32];
  v = __reduce_max_sync(0xFFFFFFFFu, v);
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < kThreads / 32 ? warp_max[threadIdx.x] : 0u;
    v = __reduce_max_sync(0xFFFFFFFFu, v);
  }
  return v;
}

// Thread 0 of each block: combine this block's maxima (v0 -> out0, v1 -> out1; a null output is
// skipped) directly into the outputs, or through the workspace (memset-free mode, see above).
__device__ __forceinline__ void publish_block_max(uint32_t* out0, uint32_t v0, uint32_t* out1, uint32_t v1,
                                                  uint32_t* ws) {
  if (ws == nullptr) {
    if (out0 != nullptr) atomicMax(out0, v0);
    if (out1 != nullptr) atomicMax(out1, v1);
    return;
  }
  if (out0 != nullptr) atomicMax(ws, v0);
  if (out1 != nullptr) atomicMax(ws + 1, v1);
  __threadfence();
  if (atomicAdd(ws + 2, 1u) == gridDim.x - 1) {  // every other block has published (fence above)
    __threadfence();
    const uint32_t a = atomicExch(ws, 0u), b = atomicExch(ws + 1, 0u);
    if (out0 != nullptr) *out0 = a;
    if (out1 != nullptr) *out1 = b;
    atomicExch(ws + 2, 0u);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) amax_kernel(const T* x, int64_t n, bool vec_ok,
                                                        uint32_t* out, uint32_t* ws) {
  constexpr int kPerVec = 16 / sizeof(T);
  uint32_t m = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  int64_t scalar_from = 0;
  if (vec_ok) {
    const int64_t nvec = n / kPerVec;
    for (int64_t i = tid; i < nvec; i += stride) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(x) + i);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int k = 0; k < kPerVec; ++k) m = max(m, abs_bits(to_f32<T>(e[k])));
    }
    scalar_from = nvec * kPerVec;
  }
  for (int64_t i = scalar_from + tid; i < n; i += stride) m = max(m, abs_bits(to_f32<T>(x[i])));
  m = block_max(m);
  if (threadIdx.x == 0) publish_block_max(out, canonical(m), nullptr, 0u, ws);
}

// Post-RHT amax: each thread transforms kVec adjacent columns over one 16-row group (kVec 8, 4, 2: one 16-, 8- or
// 4-byte load a row; 1: element loads).
template <int kVec>
__global__ void __launch_bounds__(kThreads) rht_amax_kernel(const __nv_bfloat16* x, int64_t M,
                                                            int64_t N, uint32_t* rht_out,
                                                            uint32_t* plain_out, uint32_t* ws) {
  const int64_t col_groups = (N + kVec - 1) / kVec;
  const int64_t total = (M / 16) * col_groups;
  uint32_t m_rht = 0, m_plain = 0;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; g < total;
       g += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t rg = g / col_groups, c0 = (g % col_groups) * kVec;
    float v[kVec][16];
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      const __nv_bfloat16* src = x + (rg * 16 + k) * N + c0;
      if constexpr (kVec == 8) {
        const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src));
        const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
        for (int j = 0; j < kVec; ++j) v[j][k] = __bfloat162float(e[j]);
      } else if constexpr (kVec == 4) {
        const uint2 raw = __ldg(reinterpret_cast<const uint2*>(src));
        const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
        for (int j = 0; j < kVec; ++j) v[j][k] = __bfloat162float(e[j]);
      } else if constexpr (kVec == 2) {
        const uint32_t raw = __ldg(reinterpret_cast<const unsigned int*>(src));
        v[0][k] = __uint_as_float(raw << 16);
        v[1][k] = __uint_as_float(raw & 0xFFFF0000u);
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j) v[j][k] = __bfloat162float(src[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
#pragma unroll
      for (int k = 0; k < 16; ++k) m_plain = max(m_plain, abs_bits(v[j][k]));
      rht16_butterfly(v[j]);  // the scaling and BF16 rounding of rht16_bf16 come once, below
#pragma unroll
      for (int k = 0; k < 16; ++k) m_rht = max(m_rht, abs_bits(v[j][k]));
    }
  }
  // rht16_bf16's per-element tail y -> BF16(RN(y / 4)) is monotone in |y| (NaN maps to NaN), so applied to
  // this thread's largest |butterfly output| it gives the largest |rht16_bf16 value|: one rounding per
  // thread instead of one per element, the same amax bits.
  if (m_rht <= 0x7F800000u)
    m_rht = abs_bits(__bfloat162float(__float2bfloat16_rn(__fmul_rn(__uint_as_float(m_rht), 0.25f))));
  m_rht = block_max(m_rht);
  if (plain_out != nullptr) {
    __syncthreads();  // block_max's shared slots are reused
    const uint32_t r = m_rht;
    m_plain = block_max(m_plain);
    m_rht = r;
  }
  if (threadIdx.x == 0) publish_block_max(plain_out, canonical(m_plain), rht_out, canonical(m_rht), ws);
}

// One warp per row.
template <typename T>
__global__ void __launch_bounds__(kThreads) row_amax_kernel(const T* x, int64_t M, int64_t N,
                                                            bool vec_ok, float* row_out,
                                                            uint32_t* global_out, uint32_t* ws) {
  constexpr int kPerVec = 16 / sizeof(T);
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  uint32_t m = 0;
  if (row < M) {
    const T* src = x + row * N;
    int64_t scalar_from = 0;
    if (vec_ok) {
      const int64_t nvec = N / kPerVec;
      for (int64_t i = lane; i < nvec; i += 32) {
        const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src) + i);
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int k = 0; k < kPerVec; ++k) m = max(m, abs_bits(to_f32<T>(e[k])));
      }
      scalar_from = nvec * kPerVec;
    }
    for (int64_t i = scalar_from + lane; i < N; i += 32) m = max(m, abs_bits(to_f32<T>(src[i])));
  }
  m = canonical(__reduce_max_sync(0xFFFFFFFFu, m));
  if (row < M && lane == 0) {
    row_out[row] = __uint_as_float(m);
    if (global_out != nullptr) atomicMax(ws != nullptr ? ws : global_out, m);
  }
  if (global_out != nullptr && ws != nullptr) {
    __threadfence();  // this warp's atomicMax before the block's ticket
    __syncthreads();
    if (threadIdx.x == 0) publish_block_max(global_out, 0u, nullptr, 0u, ws);  // 0: adds nothing to the max
  }
}

int grid_for(int64_t work_items) {
  const int sms = sm_count_cached();
  const int64_t want = (work_items + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(sms) * 8;
  return static_cast<int>(want < 1 ? 1 : (want < cap ? want : cap));
}

template <typename T>
void launch_amax(const void* x, int64_t n, float* out, uint32_t* ws, cudaStream_t stream) {
  constexpr int kPerVec = 16 / sizeof(T);
  const bool vec_ok = reinterpret_cast<uintptr_t>(x) % 16 == 0;
  amax_kernel<T><<<grid_for(n / kPerVec + 1), kThreads, 0, stream>>>(
      static_cast<const T*>(x), n, vec_ok, reinterpret_cast<uint32_t*>(out), ws);
  check_launch("nvfp4 amax_kernel");
}

template <typename T>
void launch_row_amax(const void* x, int64_t M, int64_t N, float* row_out, float* global_out, uint32_t* ws,
                     cudaStream_t stream) {
  const bool vec_ok = reinterpret_cast<uintptr_t>(x) % 16 == 0 && (N * sizeof(T)) % 16 == 0;
  const int64_t grid = (M + kThreads / 32 - 1) / (kThreads / 32);
  row_amax_kernel<T><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
      static_cast<const T*>(x), M, N, vec_ok, row_out, reinterpret_cast<uint32_t*>(global_out), ws);
  check_launch("nvfp4 row_amax_kernel");
}

}  // namespace

void amax(const void* x, DType in_dtype, int64_t M, int64_t N, float* amax_out, float* rht_amax_out,
          cudaStream_t stream, uint32_t* ws) {
  if (M * N == 0) ws = nullptr;  // no kernel runs: the memsets write the zero amaxes
  if (ws != nullptr) {
    // memset-free: the kernel's last block writes the outputs
  } else if (amax_out && rht_amax_out == amax_out + 1) {  // adjacent outputs: one memset (one launch fewer)
    check_cuda(cudaMemsetAsync(amax_out, 0, 2 * sizeof(float), stream), "nvfp4 amax memset");
  } else {
    if (amax_out) check_cuda(cudaMemsetAsync(amax_out, 0, sizeof(float), stream), "nvfp4 amax memset");
    if (rht_amax_out)
      check_cuda(cudaMemsetAsync(rht_amax_out, 0, sizeof(float), stream), "nvfp4 amax memset");
  }
  if (M * N == 0) return;
  if (rht_amax_out != nullptr) {
    require(in_dtype == DType::kBFloat16, "nvfp4 post-RHT amax needs bfloat16 input");
    require(M % 16 == 0, "nvfp4 post-RHT amax needs M % 16 == 0");
    const auto* xb = static_cast<const __nv_bfloat16*>(x);
    uint32_t* ro = reinterpret_cast<uint32_t*>(rht_amax_out);
    uint32_t* po = reinterpret_cast<uint32_t*>(amax_out);
    // 4 columns a thread: 3-5 % faster than 8 on an H200 (64 registers instead of 128: more warps in flight;
    // benchmarks/nvfp4_variants/rht_amax_bench.cu, RESULTS.md session 34), 2 no faster than 4.
    const auto addr = reinterpret_cast<uintptr_t>(x);
    if (N % 4 == 0 && addr % 8 == 0) {
      rht_amax_kernel<4><<<grid_for((M / 16) * (N / 4)), kThreads, 0, stream>>>(xb, M, N, ro, po, ws);
    } else if (N % 2 == 0 && addr % 4 == 0) {
      rht_amax_kernel<2><<<grid_for((M / 16) * (N / 2)), kThreads, 0, stream>>>(xb, M, N, ro, po, ws);
    } else {
      rht_amax_kernel<1><<<grid_for((M / 16) * N), kThreads, 0, stream>>>(xb, M, N, ro, po, ws);
    }
    check_launch("nvfp4 rht_amax_kernel");
    return;
  }
  if (amax_out == nullptr) return;
  switch (in_dtype) {
    case DType::kFloat32: launch_amax<float>(x, M * N, amax_out, ws, stream); break;
    case DType::kBFloat16: launch_amax<__nv_bfloat16>(x, M * N, amax_out, ws, stream); break;
    case DType::kFloat16: launch_amax<__half>(x, M * N, amax_out, ws, stream); break;
    default: require(false, std::string("nvfp4 amax: unsupported input dtype ") + dtype_name(in_dtype));
  }
}

void row_amax(const void* x, DType in_dtype, int64_t M, int64_t N, float* row_out, float* amax_out,
              cudaStream_t stream, uint32_t* ws) {
  if (M == 0 || amax_out == nullptr) ws = nullptr;
  if (amax_out && ws == nullptr) check_cuda(cudaMemsetAsync(amax_out, 0, sizeof(float), stream), "nvfp4 amax memset");
  if (M == 0) return;
  switch (in_dtype) {
    case DType::kFloat32: launch_row_amax<float>(x, M, N, row_out, amax_out, ws, stream); break;
    case DType::kBFloat16: launch_row_amax<__nv_bfloat16>(x, M, N, row_out, amax_out, ws, stream); break;
    case DType::kFloat16: launch_row_amax<__half>(x, M, N, row_out, amax_out, ws, stream); break;
    default: require(false, std::string("nvfp4 row_amax: unsupported input dtype ") + dtype_name(in_dtype));
  }
}

}  // namespace nvfp4
}  // namespace fp_recipes
