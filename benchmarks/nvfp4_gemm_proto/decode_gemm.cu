// Prototype (issue 13): the emulated NVFP4 GEMM with the E2M1 x E4M3 decode inside the GEMM's mainloop, so that no
// 16-bit operand is ever written to device memory. C[M, N] = RN_bf16(alpha * sum_k A[m, k] B[n, k]) for NVFP4 A
// (M, K) and B (N, K), each as packed E2M1 codes (rows, K/2 bytes, low nibble first) and E4M3 block scales
// (rows, K/16), alpha an FP32 device value (the product of the global factors, gemm/nvfp4_emulated.py).
//
// Why FP16 operands: code x scale has at most 6 significant bits and lies in [2^-10, 2688] (nvfp4_device.cuh), so it
// is exact in FP16 as in BF16, and an FP16 wgmma runs at the BF16 rate. The decode then uses the hardware
// E4M3 -> FP16 conversion: an E2M1 code s e1 e0 m placed as the E4M3 byte s 0 e1 e0 m 0 0 is the code's value
// times 2^-6 (subnormals included), and the block scale enters as E4M3 -> FP16 times 2^6; the FP16 product of the
// two is exact. The sum is FP32 (wgmma), then alpha and one rounding to BF16, as cuBLASLt does in the unit path.
//
// Structure (sm_90a): a CTA computes a 128 x 256 tile of C with three warpgroups. Warpgroup 0 is the producer:
// per 64-wide K step it loads the packed codes and scales of 128 rows of A and 256 rows of B (6 x 16 bytes per
// thread, one step ahead in registers), decodes them to FP16 and stores them to shared memory in the 128-byte
// swizzled K-major layout wgmma reads, then signals the stage full (mbarrier). Warpgroups 1 and 2 each issue four
// wgmma m64n256k16 per stage on their 64 rows, keep one stage's wgmmas in flight, and signal the stage before it
// empty. 4 stages of 48 KB.
//
// v4: the scales of four K steps in one 16-byte load per row, a block of four steps ahead (v0 loaded 2 bytes per row
// and step: half of the producer's global load requests, each touching 16 cache lines per warp).
//
// Limits of the prototype: M % 128 == 0, N % 256 == 0, K % 256 == 0, 16-byte aligned data and scales; no bias, no
// row-scaled operands (the library's path keeps them).
#include <cuda_runtime.h>

#include <cstdint>

#include "proto_common.cuh"
#include "wgmma_m64n256.cuh"

namespace proto {  // v4's tile, its producer's jobs, its consumers' mainloop and epilogue

constexpr int kBM = 128, kBN = 256;
constexpr int kABytes = kBM * kBK * 2;             // 16 KB
constexpr int kBBytes = kBN * kBK * 2;             // 32 KB
constexpr int kStageBytes = kABytes + kBBytes;     // 48 KB
constexpr int kJobs = (kBM + kBN) * 2 / 128;       // (row, 32-code half) pairs per producer thread per stage: 6

// Job j of producer thread t: pair g = j * 128 + t; g < 256: A row g / 2, else B row (g - 256) / 2; half g % 2
// (codes [32 * half, 32 * half + 32) of the 64-wide K step). Consecutive threads read consecutive 16 bytes.
__device__ __forceinline__ void job_of(int j, int t, bool& is_a, int& row, int& half) {
  const int g = j * 128 + t;
  is_a = g < 2 * kBM;
  row = is_a ? g >> 1 : (g - 2 * kBM) >> 1;
  half = g & 1;
}

// The decoded stages' mbarriers: full(s) completes when the producer warpgroup's 128 threads have stored stage s,
// empty(s) when both consumer warpgroups have finished reading it. (One thread, before the CTA's first barrier.)
template <int kStages, typename Full, typename Empty>
__device__ __forceinline__ void init_stage_barriers(Full full, Empty empty) {
  for (int s = 0; s < kStages; ++s) {
    mbar_init(full(s), 128);
    mbar_init(empty(s), 2);
  }
}

// Consumer warpgroup c (0, 1) of a CTA: rows [64 c, 64 c + 64) of the 128 x 256 tile, over `steps` K steps of the
// kStages-deep ring of decoded stages at `tiles` (full(s) / empty(s): the stages' mbarrier addresses), then
// out = RN_bf16(alpha * acc) with direct stores.
template <int kStages, typename Full, typename Empty>
__device__ __forceinline__ void consume(uint32_t tiles, Full full, Empty empty, int c, int t, int m0, int n0, int N,
                                        int steps, const float* __restrict__ alpha, __nv_bfloat16* __restrict__ out) {
  // consumers: warpgroup c (0, 1) owns rows [64 c, 64 c + 64) of the tile
  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
  for (int kt = 0; kt < steps; ++kt) {
    const int s = kt % kStages;
    mbar_wait(full(s), (kt / kStages) & 1);
    const uint32_t sa = tiles + s * kStageBytes + static_cast<uint32_t>(c) * 64u * 128u;
    const uint32_t sb = tiles + s * kStageBytes + kABytes;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      wgmma_m64n256k16_f16(acc, make_desc(sa + kk * 32), make_desc(sb + kk * 32), 1);
    }
    wgmma_commit();
    wgmma_wait<1>();  // the previous stage's wgmmas are done: release its buffers
    if (kt > 0 && t == 0) mbar_arrive(empty((kt - 1) % kStages));
  }
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(acc[i])::"memory");

  const float al = __ldg(alpha);
  const int warp = t / 32, lane = t % 32;
  const int64_t row = m0 + c * 64 + warp * 16 + lane / 4;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    const int col = n0 + j * 8 + (lane % 4) * 2;
    const __nv_bfloat162 lo = __floats2bfloat162_rn(__fmul_rn(acc[4 * j], al), __fmul_rn(acc[4 * j + 1], al));
    const __nv_bfloat162 hi = __floats2bfloat162_rn(__fmul_rn(acc[4 * j + 2], al), __fmul_rn(acc[4 * j + 3], al));
    *reinterpret_cast<__nv_bfloat162*>(out + row * N + col) = lo;
    *reinterpret_cast<__nv_bfloat162*>(out + (row + 8) * N + col) = hi;
  }
}

// The shapes and alignments the kernels take: M % 128, N % 256, K % 256 (16-byte scale rows), 16-byte aligned
// codes and scales.
inline bool supported(int M, int N, int K, const void* a_data, const void* a_scale, const void* b_data,
                      const void* b_scale) {
  if (M <= 0 || N <= 0 || K <= 0 || M % kBM || N % kBN || K % 256) return false;
  return ((reinterpret_cast<uintptr_t>(a_data) | reinterpret_cast<uintptr_t>(b_data) |
           reinterpret_cast<uintptr_t>(a_scale) | reinterpret_cast<uintptr_t>(b_scale)) & 15u) == 0;
}

}  // namespace proto

namespace {

using namespace proto;

constexpr int kStages = 4;
constexpr int kSmem = kStages * kStageBytes + 1024 + 2 * kStages * 8;

struct Operand {
  const uint8_t* data;   // (rows, K/2)
  const uint8_t* scale;  // (rows, K/16)
};

struct Prefetch {
  uint4 q[kJobs];
};
struct Scales {  // per job: the 16 scale bytes of its row for K steps 4b .. 4b + 3 (4 bytes a step)
  uint4 v[kJobs];
};

// Job j's row in its operand (global row index) and the operand; half: see job_of.
__device__ __forceinline__ const Operand& job_row(int j, int t, const Operand& a, const Operand& b, int m0, int n0,
                                                  int64_t& r, int& half) {
  bool is_a;
  int row;
  job_of(j, t, is_a, row, half);
  r = static_cast<int64_t>(is_a ? m0 + row : n0 + row);
  return is_a ? a : b;
}

// Each job's 16 bytes of step or block `index`: the codes of K step `index` (kScales false: 16 of a row's 32 bytes,
// by half) or the scales of the block of four steps `index` (kScales true: a row's 16 scale bytes).
template <bool kScales>
__device__ __forceinline__ void load_jobs(uint4 (&v)[kJobs], const Operand& a, const Operand& b, int m0, int n0,
                                          int K, int index, int t) {
#pragma unroll
  for (int j = 0; j < kJobs; ++j) {
    int64_t r;
    int half;
    const Operand& o = job_row(j, t, a, b, m0, n0, r, half);
    const uint8_t* src = kScales ? o.scale + r * (K / 16) + index * 16 : o.data + r * (K / 2) + index * 32 + half * 16;
    v[j] = __ldg(reinterpret_cast<const uint4*>(src));
  }
}

__device__ __forceinline__ void store_step(const Prefetch& p, const Scales& sc, int sub, uint32_t stage, int t) {
#pragma unroll
  for (int j = 0; j < kJobs; ++j) {
    bool is_a;
    int row, half;
    job_of(j, t, is_a, row, half);
    // this step's 4 scale bytes (sub: the step within its block of four), then this half's two
    const uint32_t w4 = sub == 0 ? sc.v[j].x : sub == 1 ? sc.v[j].y : sub == 2 ? sc.v[j].z : sc.v[j].w;
    const uint32_t s2 = half ? (w4 >> 16) : (w4 & 0xFFFFu);
    const uint32_t base = stage + (is_a ? 0u : static_cast<uint32_t>(kABytes)) + static_cast<uint32_t>(row) * 128u;
    const uint32_t words[4] = {p.q[j].x, p.q[j].y, p.q[j].z, p.q[j].w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const __half2 sf2 = scale2(q < 2 ? (s2 & 0xFFu) : (s2 >> 8));
      uint32_t v[4];
      decode8(words[q], sf2, v);
      const uint32_t chunk = static_cast<uint32_t>(half * 4 + q) ^ static_cast<uint32_t>(row & 7);
      st_shared_v4(base + chunk * 16u, v);
    }
  }
}

__global__ void __launch_bounds__(kThreads, 1)
    decode_gemm_kernel(Operand a, Operand b, const float* __restrict__ alpha, __nv_bfloat16* __restrict__ out, int M,
                       int N, int K) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t tiles = (raw + 1023u) & ~1023u;  // 1024-byte aligned stages
  const uint32_t bars = tiles + kStages * kStageBytes;
  auto full = [&](int s) { return bars + 8u * s; };
  auto empty = [&](int s) { return bars + 8u * (kStages + s); };
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  const int m0 = blockIdx.y * kBM, n0 = blockIdx.x * kBN;
  const int steps = K / kBK;
  if (threadIdx.x == 0) init_stage_barriers<kStages>(full, empty);
  __syncthreads();

  if (wg == 0) {  // producer
    Prefetch cur, nxt;
    Scales sc, sc_next;
    const int blocks = steps / 4;
    load_jobs<false>(cur.q, a, b, m0, n0, K, 0, t);
    load_jobs<true>(sc.v, a, b, m0, n0, K, 0, t);
    if (blocks > 1) load_jobs<true>(sc_next.v, a, b, m0, n0, K, 1, t);
    for (int kt = 0; kt < steps; ++kt) {
      if (kt + 1 < steps) load_jobs<false>(nxt.q, a, b, m0, n0, K, kt + 1, t);
      if (kt > 0 && kt % 4 == 0) {  // a new block of four steps: its scales arrived during the last block
        sc = sc_next;
        if (kt / 4 + 1 < blocks) load_jobs<true>(sc_next.v, a, b, m0, n0, K, kt / 4 + 1, t);
      }
      const int s = kt % kStages;
      if (kt >= kStages) mbar_wait(empty(s), ((kt / kStages) + 1) & 1);
      store_step(cur, sc, kt % 4, tiles + s * kStageBytes, t);
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      mbar_arrive(full(s));
      cur = nxt;
    }
    return;
  }

  proto::consume<kStages>(tiles, full, empty, wg - 1, t, m0, n0, N, steps, alpha, out);
}

}  // namespace

// 0 on success, else a CUDA error code (or -1: unsupported shape / alignment).
extern "C" int nvfp4_decode_gemm(const void* a_data, const void* a_scale, const void* b_data, const void* b_scale,
                                 const float* alpha, void* out, int M, int N, int K, void* stream) {
  if (!proto::supported(M, N, K, a_data, a_scale, b_data, b_scale)) return -1;
  static bool configured = false;
  if (!configured) {
    const cudaError_t e = cudaFuncSetAttribute(decode_gemm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (e != cudaSuccess) return static_cast<int>(e);
    configured = true;
  }
  const Operand a{static_cast<const uint8_t*>(a_data), static_cast<const uint8_t*>(a_scale)};
  const Operand b{static_cast<const uint8_t*>(b_data), static_cast<const uint8_t*>(b_scale)};
  decode_gemm_kernel<<<dim3(N / kBN, M / kBM), kThreads, kSmem, static_cast<cudaStream_t>(stream)>>>(
      a, b, alpha, static_cast<__nv_bfloat16*>(out), M, N, K);
  return static_cast<int>(cudaGetLastError());
}
