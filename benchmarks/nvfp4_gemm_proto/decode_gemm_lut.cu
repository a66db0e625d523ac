// v2 of the prototype (kept for the A/B in run.py): the decode through a per-lane FP16x2 table in shared memory.
// Prototype (issue 13): the emulated NVFP4 GEMM with the E2M1 x E4M3 decode inside the GEMM's mainloop, so that no
// 16-bit operand is ever written to device memory. C[M, N] = RN_bf16(alpha * sum_k A[m, k] B[n, k]) for NVFP4 A
// (M, K) and B (N, K), each as packed E2M1 codes (rows, K/2 bytes, low nibble first) and E4M3 block scales
// (rows, K/16), alpha an FP32 device value (the product of the global factors, gemm/nvfp4_emulated.py).
//
// Why FP16 operands: code x scale has at most 6 significant bits and lies in [2^-10, 2688] (nvfp4_device.cuh), so it
// is exact in FP16 as in BF16, and an FP16 wgmma runs at the BF16 rate. The decode: a packed byte (two codes) looks
// up its two E2M1 values as one FP16x2 word in a 256-entry table in shared memory, kept once per lane (32 KB: a
// warp's 32 look-ups never share a bank), and one FP16x2 multiply by the block scale (E4M3 -> FP16, exact) gives
// the two exact products. (v0 built E4M3 bytes from the codes and used the E4M3x2 -> FP16x2 conversion: 4
// conversions per 8 values on the quarter-rate conversion pipe made the decode the bottleneck, 366-415 TFLOP/s on
// an H200.) The sum is FP32 (wgmma), then alpha and one rounding to BF16, as cuBLASLt does in the unit path.
//
// Structure (sm_90a): a CTA computes a 128 x 256 tile of C with three warpgroups. Warpgroup 0 is the producer:
// per 64-wide K step it loads the packed codes and scales of 128 rows of A and 256 rows of B (6 x 16 bytes per
// thread, one step ahead in registers), decodes them to FP16 and stores them to shared memory in the 128-byte
// swizzled K-major layout wgmma reads, then signals the stage full (mbarrier). Warpgroups 1 and 2 each issue four
// wgmma m64n256k16 per stage on their 64 rows, keep one stage's wgmmas in flight, and signal the stage before it
// empty. 4 stages of 48 KB.
//
// Limits of the prototype: M % 128 == 0, N % 256 == 0, K % 64 == 0, 16-byte aligned data; no bias, no row-scaled
// operands (the library's path keeps them).
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "wgmma_m64n256.cuh"

namespace {

constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 4;
constexpr int kThreads = 384;
constexpr int kABytes = kBM * kBK * 2;             // 16 KB
constexpr int kBBytes = kBN * kBK * 2;             // 32 KB
constexpr int kStageBytes = kABytes + kBBytes;     // 48 KB
constexpr int kJobs = (kBM + kBN) * 2 / 128;       // (row, 32-code half) pairs per producer thread per stage: 6
constexpr int kSmem = kStages * kStageBytes + 1024 + 2 * kStages * 8;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart (the tile base is
// 1024-byte aligned; a 16-wide K slice starts 32 bytes further into each 128-byte row).
__device__ __forceinline__ uint64_t make_desc(uint32_t saddr) {
  return static_cast<uint64_t>((saddr & 0x3FFFFu) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

__device__ __forceinline__ uint32_t h2_bits(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }


// The E2M1 values of the two codes of byte p as FP16x2 (low nibble in the low half): lut[p * 32 + lane].
__shared__ uint32_t lut[256 * 32];

__device__ __forceinline__ uint32_t e2m1_pair_f16x2(uint32_t p) {
  const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float lo = (p & 8u) ? -mag[p & 7u] : mag[p & 7u];
  const float hi = (p & 0x80u) ? -mag[(p >> 4) & 7u] : mag[(p >> 4) & 7u];
  return h2_bits(__floats2half2_rn(lo, hi));
}

// 8 codes (4 packed bytes, low nibble first) times the block scale (sf2: the FP16 scale in both halves) -> 8 FP16
// values in out[0..3] (element 2i in the low half of out[i]). lane_base: the shared address of this lane's table
// column (smem_addr(lut) + lane * 4). A look-up: the byte moved to the low bits (one PRMT), its address byte * 128 +
// lane_base (one IMAD), the load, the multiply. (An OR with a 32 KB-aligned base instead of the IMAD gave wrong
// addresses on the GPU: a static shared array's alignment is not its address in the shared window.)
__device__ __forceinline__ void decode8(uint32_t w, __half2 sf2, uint32_t lane_base, uint32_t* out) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t byte = __byte_perm(w, 0u, 0x4440u + j);
    uint32_t v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(byte * 128u + lane_base) : "memory");
    out[j] = h2_bits(__hmul2(*reinterpret_cast<const __half2*>(&v), sf2));
  }
}

__device__ __forceinline__ __half2 scale2(uint32_t code) {
  const __half_raw r = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
  return __half2half2(*reinterpret_cast<const __half*>(&r));
}

__device__ __forceinline__ void st_shared_v4(uint32_t addr, const uint32_t (&v)[4]) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3])
               : "memory");
}

struct Operand {
  const uint8_t* data;   // (rows, K/2)
  const uint8_t* scale;  // (rows, K/16)
};

struct Prefetch {
  uint4 q[kJobs];
  uint32_t s[kJobs];
};

// Job j of producer thread t: pair g = j * 128 + t; g < 256: A row g / 2, else B row (g - 256) / 2; half g % 2
// (codes [32 * half, 32 * half + 32) of the 64-wide K step). Consecutive threads read consecutive 16 bytes.
__device__ __forceinline__ void job_of(int j, int t, bool& is_a, int& row, int& half) {
  const int g = j * 128 + t;
  is_a = g < 2 * kBM;
  row = is_a ? g >> 1 : (g - 2 * kBM) >> 1;
  half = g & 1;
}

__device__ __forceinline__ void load_step(Prefetch& p, const Operand& a, const Operand& b, int m0, int n0, int K,
                                          int kt, int t) {
#pragma unroll
  for (int j = 0; j < kJobs; ++j) {
    bool is_a;
    int row, half;
    job_of(j, t, is_a, row, half);
    const Operand& o = is_a ? a : b;
    const int64_t r = static_cast<int64_t>(is_a ? m0 + row : n0 + row);
    p.q[j] = __ldg(reinterpret_cast<const uint4*>(o.data + r * (K / 2) + kt * 32 + half * 16));
    p.s[j] = __ldg(reinterpret_cast<const uint16_t*>(o.scale + r * (K / 16) + kt * 4 + half * 2));
  }
}

__device__ __forceinline__ void store_step(const Prefetch& p, uint32_t stage, int t) {
  const uint32_t lane_base = smem_addr(lut) + static_cast<uint32_t>(t % 32) * 4u;
#pragma unroll
  for (int j = 0; j < kJobs; ++j) {
    bool is_a;
    int row, half;
    job_of(j, t, is_a, row, half);
    const uint32_t base = stage + (is_a ? 0u : static_cast<uint32_t>(kABytes)) + static_cast<uint32_t>(row) * 128u;
    const uint32_t words[4] = {p.q[j].x, p.q[j].y, p.q[j].z, p.q[j].w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const __half2 sf2 = scale2(q < 2 ? (p.s[j] & 0xFFu) : (p.s[j] >> 8));
      uint32_t v[4];
      decode8(words[q], sf2, lane_base, v);
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
  for (int i = threadIdx.x; i < 256 * 32; i += kThreads) lut[i] = e2m1_pair_f16x2(static_cast<uint32_t>(i) / 32u);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full(s), 128);
      mbar_init(empty(s), 2);
    }
  }
  __syncthreads();

  if (wg == 0) {  // producer
    Prefetch cur, nxt;
    load_step(cur, a, b, m0, n0, K, 0, t);
    for (int kt = 0; kt < steps; kt += 2) {
      // (unrolled by two so that the prefetch registers swap roles without copies)
      if (kt + 1 < steps) load_step(nxt, a, b, m0, n0, K, kt + 1, t);
      {
        const int s = kt % kStages;
        if (kt >= kStages) mbar_wait(empty(s), ((kt / kStages) + 1) & 1);
        store_step(cur, tiles + s * kStageBytes, t);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        mbar_arrive(full(s));
      }
      if (kt + 1 >= steps) break;
      if (kt + 2 < steps) load_step(cur, a, b, m0, n0, K, kt + 2, t);
      {
        const int k1 = kt + 1, s = k1 % kStages;
        if (k1 >= kStages) mbar_wait(empty(s), ((k1 / kStages) + 1) & 1);
        store_step(nxt, tiles + s * kStageBytes, t);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        mbar_arrive(full(s));
      }
    }
    return;
  }

  // consumers: warpgroup c (0, 1) owns rows [64 c, 64 c + 64) of the tile
  const int c = wg - 1;
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

}  // namespace

// 0 on success, else a CUDA error code (or -1: unsupported shape / alignment).
extern "C" int nvfp4_decode_gemm(const void* a_data, const void* a_scale, const void* b_data, const void* b_scale,
                                 const float* alpha, void* out, int M, int N, int K, void* stream) {
  if (M % kBM || N % kBN || K % kBK || M <= 0 || N <= 0 || K <= 0) return -1;
  if ((reinterpret_cast<uintptr_t>(a_data) | reinterpret_cast<uintptr_t>(b_data)) & 15u) return -1;
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
