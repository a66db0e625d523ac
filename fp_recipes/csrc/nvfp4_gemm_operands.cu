// The emulated NVFP4 GEMM's own kernels (Hopper and older have no FP4 tensor cores).
//
// decode_unit_bf16: E2M1 code x E4M3 block scale, WITHOUT the global factor, written as BF16 in the
// (rows, K) row-major layout cuBLASLt reads. The product has at most 6 significant bits and lies in
// [2^-10, 2688], so the FP32 product is exact and its top 16 bits are its BF16 value (no rounding).
// Up to kMaxUnitJobs copies decode in one launch (a GEMM's two operands), and the first thread
// also writes the GEMM's FP32 alpha (NUMERICS.md "GEMM alpha") and a zero beta, so that cuBLASLt reads
// both from device memory: no host synchronisation and no separate scaling kernel.
//
// row_scale_epilogue: the row-scaled output rule, y = RN(RN(d * RN(sa * sb)) + bias) cast once, where
// d = RN(acc * alpha_unit) is the GEMM's FP32 output.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "nvfp4_device.cuh"
#include "nvfp4_kernels.h"

namespace fp_recipes {
namespace nvfp4 {
namespace {

constexpr int kThreads = 256;

struct DecodeParams {
  UnitDecodeJob jobs[kMaxUnitJobs];
  int64_t cta_start[kMaxUnitJobs + 1];  // first CTA of each job; cta_start[num] = grid size
  int num;
  GemmAlphaArgs alpha;
};

__global__ void __launch_bounds__(kThreads) decode_unit_kernel(const __grid_constant__ DecodeParams p) {
  if (blockIdx.x == 0 && threadIdx.x == 0 && p.alpha.out != nullptr) {
    // alpha = RN(RN(amax_a * amax_b) * RN(1 / (36 E_a E_b))); 36 E_a E_b < 2^24 is exact in FP32.
    const float a = p.alpha.amax_a != nullptr ? *p.alpha.amax_a : 1.0f;
    const float b = p.alpha.amax_b != nullptr ? *p.alpha.amax_b : 1.0f;
    const float denom = __fmul_rn(__fmul_rn(36.0f, p.alpha.e_a), p.alpha.e_b);
    p.alpha.out[0] = __fmul_rn(__fmul_rn(a, b), __frcp_rn(denom));
    p.alpha.out[1] = 0.0f;
  }
  const int64_t cta = blockIdx.x;
  const uint8_t* data = nullptr;
  const uint8_t* scale = nullptr;
  uint16_t* out = nullptr;
  int64_t blocks = 0, first = 0;
#pragma unroll
  for (int j = 0; j < kMaxUnitJobs; ++j) {
    if (j < p.num && cta >= p.cta_start[j] && cta < p.cta_start[j + 1]) {
      data = p.jobs[j].data;
      scale = p.jobs[j].scale;
      out = p.jobs[j].out;
      blocks = p.jobs[j].blocks;
      first = p.cta_start[j];
    }
  }
  // A CTA takes kThreads blocks, a warp 32: lane l decodes half (l & 1) of blocks w + l / 2 and w + 16 + l / 2, so
  // each of the warp's two stores writes 512 contiguous bytes. With one whole block a lane (two 16-byte stores 32
  // bytes apart) the stores alone ran at 1.7 TB/s on an H200 against 3.4-4.1 for this pattern (RESULTS.md session 34).
  const int lane = static_cast<int>(threadIdx.x & 31u), half = lane & 1;
  const int64_t w = (cta - first) * kThreads + (threadIdx.x & ~31u);
  const uint32_t* codes = reinterpret_cast<const uint32_t*>(data);
  uint32_t c[2], sf[2];
  int64_t b[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {  // both loads in flight before the first decode
    b[i] = w + 16 * i + (lane >> 1);
    c[i] = b[i] < blocks ? __ldg(codes + 2 * b[i] + half) : 0u;
    sf[i] = b[i] < blocks ? __ldg(scale + b[i]) : 0u;
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (b[i] < blocks) store_unit8_v4(c[i], sf[i], out + b[i] * 16 + half * 8);
  }
}

template <typename T>
__device__ __forceinline__ float load_f32(const void* p, int64_t i) {
  return to_f32<T>(static_cast<const T*>(p)[i]);
}

__device__ __forceinline__ float bias_value(const void* bias, DType t, int64_t n) {
  switch (t) {
    case DType::kFloat32: return load_f32<float>(bias, n);
    case DType::kBFloat16: return load_f32<__nv_bfloat16>(bias, n);
    default: return load_f32<__half>(bias, n);
  }
}

template <typename T>
__device__ __forceinline__ T cast_out(float v);
template <>
__device__ __forceinline__ float cast_out<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 cast_out<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half cast_out<__half>(float v) { return __float2half_rn(v); }

template <typename T>
__global__ void __launch_bounds__(kThreads) row_scale_kernel(const float* d, int64_t M, int64_t N,
                                                             const float* amax_a, bool a_rows,
                                                             const float* amax_b, bool b_cols, const void* bias,
                                                             DType bias_t, T* out) {
  const int64_t total = M * N;
  const float sa0 = a_rows ? 0.0f : __ldg(amax_a);
  const float sb0 = b_cols ? 0.0f : __ldg(amax_b);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t m = i / N, n = i - m * N;
    const float sa = a_rows ? __ldg(amax_a + m) : sa0;
    const float sb = b_cols ? __ldg(amax_b + n) : sb0;
    float y = __fmul_rn(__ldg(d + i), __fmul_rn(sa, sb));
    if (bias != nullptr) y = __fadd_rn(y, bias_value(bias, bias_t, n));
    out[i] = cast_out<T>(y);
  }
}

// The same rule, 4 columns per thread (N % 4 == 0, d 16-byte and out 4-element aligned): blockIdx.x picks
// 4 * kThreads columns, the rows are walked with a stride of gridDim.y, so a thread loads its column
// factors and bias once and has no index division (the scalar kernel divides per element).
// Four results to out[0..3] in one store (8 bytes for 16-bit outputs, 16 for FP32), each rounded once to
// nearest even as cast_out does. Inline PTX: NVVM split the plain vector assignment into four scalar stores.
__device__ __forceinline__ void st_v2(void* p, uint32_t a, uint32_t b) {
  asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(p), "r"(a), "r"(b) : "memory");
}
__device__ __forceinline__ void store4(float* out, const float (&y)[4]) {
  asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(out), "f"(y[0]), "f"(y[1]), "f"(y[2]), "f"(y[3])
               : "memory");
}
__device__ __forceinline__ void store4(__nv_bfloat16* out, const float (&y)[4]) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(y[0], y[1]), hi = __floats2bfloat162_rn(y[2], y[3]);
  st_v2(out, *reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
}
__device__ __forceinline__ void store4(__half* out, const float (&y)[4]) {
  const __half2 lo = __floats2half2_rn(y[0], y[1]), hi = __floats2half2_rn(y[2], y[3]);
  st_v2(out, *reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
}

template <typename T, bool kBias>
__global__ void __launch_bounds__(kThreads) row_scale_vec4_kernel(const float* d, int64_t M, int64_t N,
                                                                  const float* amax_a, bool a_rows,
                                                                  const float* amax_b, bool b_cols,
                                                                  const void* bias, DType bias_t, T* out) {
  const int64_t n0 = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * 4;
  if (n0 >= N) return;
  const float sa0 = a_rows ? 0.0f : __ldg(amax_a);
  float sb[4], bv[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    sb[j] = b_cols ? __ldg(amax_b + n0 + j) : __ldg(amax_b);
    bv[j] = kBias ? bias_value(bias, bias_t, n0 + j) : 0.0f;
  }
  for (int64_t m = blockIdx.y; m < M; m += gridDim.y) {
    const float sa = a_rows ? __ldg(amax_a + m) : sa0;
    const float4 x = __ldg(reinterpret_cast<const float4*>(d + m * N + n0));
    float y[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      y[j] = __fmul_rn(y[j], __fmul_rn(sa, sb[j]));
      if (kBias) y[j] = __fadd_rn(y[j], bv[j]);  // (a branch on the pointer here split the vector store)
    }
    store4(out + m * N + n0, y);
  }
}

template <typename T>
void launch_row_scale(const float* d, int64_t M, int64_t N, const float* amax_a, bool a_rows, const float* amax_b,
                      bool b_cols, const void* bias, DType bias_t, void* out, cudaStream_t stream) {
  const int sms = sm_count_cached();
  const int64_t cap = static_cast<int64_t>(sms) * 16;
  if (N % 4 == 0 && reinterpret_cast<std::uintptr_t>(d) % 16 == 0 &&
      reinterpret_cast<std::uintptr_t>(out) % (4 * sizeof(T)) == 0) {
    const int64_t gx = (N / 4 + kThreads - 1) / kThreads;
    int64_t gy = cap / gx;
    gy = gy < 1 ? 1 : (gy > M ? M : (gy > 65535 ? 65535 : gy));
    require(gx <= 0x7FFFFFFF, "nvfp4 row_scale_epilogue: too many columns");
    const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
    if (bias != nullptr) {
      row_scale_vec4_kernel<T, true><<<grid, kThreads, 0, stream>>>(d, M, N, amax_a, a_rows, amax_b, b_cols, bias,
                                                                    bias_t, static_cast<T*>(out));
    } else {
      row_scale_vec4_kernel<T, false><<<grid, kThreads, 0, stream>>>(d, M, N, amax_a, a_rows, amax_b, b_cols,
                                                                     nullptr, bias_t, static_cast<T*>(out));
    }
    check_launch("nvfp4 row_scale_vec4_kernel");
    return;
  }
  const int64_t want = (M * N + kThreads - 1) / kThreads;
  row_scale_kernel<T><<<static_cast<unsigned>(want < cap ? want : cap), kThreads, 0, stream>>>(
      d, M, N, amax_a, a_rows, amax_b, b_cols, bias, bias_t, static_cast<T*>(out));
  check_launch("nvfp4 row_scale_kernel");
}

}  // namespace

void decode_unit_bf16(const UnitDecodeJob* jobs, int num_jobs, const GemmAlphaArgs& alpha, cudaStream_t stream) {
  require(num_jobs >= 0 && num_jobs <= kMaxUnitJobs, "nvfp4 decode_unit_bf16: 0 to 4 jobs per launch");
  DecodeParams p{};
  p.num = num_jobs;
  p.alpha = alpha;
  int64_t ctas = 0;
  for (int j = 0; j < num_jobs; ++j) {
    const UnitDecodeJob& job = jobs[j];
    require(job.blocks >= 0, "nvfp4 decode_unit_bf16: negative block count");
    require(job.blocks == 0 || (job.data && job.scale && job.out), "nvfp4 decode_unit_bf16: null pointer");
    require(reinterpret_cast<std::uintptr_t>(job.data) % 8 == 0 && reinterpret_cast<std::uintptr_t>(job.out) % 16 == 0,
            "nvfp4 decode_unit_bf16: data must be 8-byte and out 16-byte aligned");
    p.jobs[j] = job;
    p.cta_start[j] = ctas;
    ctas += (job.blocks + kThreads - 1) / kThreads;
  }
  for (int j = num_jobs; j <= kMaxUnitJobs; ++j) p.cta_start[j] = ctas;
  if (ctas == 0 && alpha.out != nullptr) ctas = 1;  // empty operands: still write alpha and beta
  if (ctas == 0) return;
  require(ctas <= 0x7FFFFFFF, "nvfp4 decode_unit_bf16: too many blocks for one launch");
  decode_unit_kernel<<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(p);
  check_launch("nvfp4 decode_unit_kernel");
}

void row_scale_epilogue(const float* d, int64_t M, int64_t N, const float* amax_a, bool a_rows, const float* amax_b,
                        bool b_cols, const void* bias, DType bias_dtype, void* out, DType out_dtype,
                        cudaStream_t stream) {
  require(amax_a != nullptr && amax_b != nullptr && d != nullptr && out != nullptr,
          "nvfp4 row_scale_epilogue: null pointer");
  require(bias == nullptr || bias_dtype == DType::kFloat32 || bias_dtype == DType::kBFloat16 ||
              bias_dtype == DType::kFloat16,
          "nvfp4 row_scale_epilogue: bias must be float32, bfloat16 or float16");
  if (M * N == 0) return;
  switch (out_dtype) {
    case DType::kFloat32:
      launch_row_scale<float>(d, M, N, amax_a, a_rows, amax_b, b_cols, bias, bias_dtype, out, stream);
      break;
    case DType::kBFloat16:
      launch_row_scale<__nv_bfloat16>(d, M, N, amax_a, a_rows, amax_b, b_cols, bias, bias_dtype, out, stream);
      break;
    case DType::kFloat16:
      launch_row_scale<__half>(d, M, N, amax_a, a_rows, amax_b, b_cols, bias, bias_dtype, out, stream);
      break;
    default:
      require(false, std::string("nvfp4 row_scale_epilogue: unsupported output dtype ") + dtype_name(out_dtype));
  }
}

}  // namespace nvfp4
}  // namespace fp_recipes
