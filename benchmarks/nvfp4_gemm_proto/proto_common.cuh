// Shared by the prototype's kernels (decode_gemm.cu, decode_gemm_tma.cu): the tile constants, the mbarrier / wgmma
// / descriptor helpers, the producer's decode of 8 codes, and the consumer warpgroups' mainloop and epilogue.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "wgmma_m64n256.cuh"

namespace proto {

constexpr int kBM = 128, kBN = 256, kBK = 64;
constexpr int kThreads = 384;  // a producer warpgroup and two consumer warpgroups
constexpr int kABytes = kBM * kBK * 2;             // 16 KB
constexpr int kBBytes = kBN * kBK * 2;             // 32 KB
constexpr int kStageBytes = kABytes + kBBytes;     // 48 KB
constexpr int kJobs = (kBM + kBN) * 2 / 128;       // (row, 32-code half) pairs per producer thread per stage: 6
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

__device__ __forceinline__ __half2 e4m3x2_to_h2(uint32_t two_bytes) {
  const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_bytes), __NV_E4M3);
  return *reinterpret_cast<const __half2*>(&r);
}

// 8 codes (4 packed bytes, low nibble first) times the block scale (sf2: the FP16 scale times 2^6, in both halves)
// -> 8 FP16 values in out[0..3] (element 2i in the low half of out[i]).
__device__ __forceinline__ void decode8(uint32_t w, __half2 sf2, uint32_t* out) {
  const uint32_t lo = ((w << 4) & 0x80808080u) | ((w << 2) & 0x1C1C1C1Cu);  // codes 0, 2, 4, 6 as E4M3 bytes
  const uint32_t hi = (w & 0x80808080u) | ((w >> 2) & 0x1C1C1C1Cu);         // codes 1, 3, 5, 7
  const uint32_t p0 = __byte_perm(lo, hi, 0x5140);                            // codes 0 1 2 3
  const uint32_t p1 = __byte_perm(lo, hi, 0x7362);                            // codes 4 5 6 7
  out[0] = h2_bits(__hmul2(e4m3x2_to_h2(p0 & 0xFFFFu), sf2));
  out[1] = h2_bits(__hmul2(e4m3x2_to_h2(p0 >> 16), sf2));
  out[2] = h2_bits(__hmul2(e4m3x2_to_h2(p1 & 0xFFFFu), sf2));
  out[3] = h2_bits(__hmul2(e4m3x2_to_h2(p1 >> 16), sf2));
}

// decode8 without the two byte permutes: out[0] = codes (0, 2), out[1] = (4, 6), out[2] = (1, 3), out[3] = (5, 7).
// Usable wherever both operands of the GEMM are decoded by it and mapped to K positions the same way (v5): the K order
// of a sum does not change its terms. 11 integer-pipe instructions per 8 codes instead of 13.
__device__ __forceinline__ void decode8_pairs(uint32_t w, __half2 sf2, uint32_t* out) {
  const uint32_t lo = ((w << 4) & 0x80808080u) | ((w << 2) & 0x1C1C1C1Cu);  // codes 0, 2, 4, 6 as E4M3 bytes
  const uint32_t hi = (w & 0x80808080u) | ((w >> 2) & 0x1C1C1C1Cu);         // codes 1, 3, 5, 7
  out[0] = h2_bits(__hmul2(e4m3x2_to_h2(lo & 0xFFFFu), sf2));
  out[1] = h2_bits(__hmul2(e4m3x2_to_h2(lo >> 16), sf2));
  out[2] = h2_bits(__hmul2(e4m3x2_to_h2(hi & 0xFFFFu), sf2));
  out[3] = h2_bits(__hmul2(e4m3x2_to_h2(hi >> 16), sf2));
}

// The integer decode (no conversion instruction; v5 with RS_DECODE=2): an E2M1 code s e1 e0 m placed as the FP16 bits
// s 000 e1 e0 m 000000000 is its value times 2^-14 (0.5: the subnormal 2^-15), so one FP16 multiply by the block scale
// times 2^7 (scale2<128>) gives the unit value times 2^-7, exact in FP16 (lowest set bit >= 2^-17; check_decode.py).
// The GEMM's FP32 sums are then exactly 2^-14 times the unit sums (a power of two; every nonzero product is at least
// 2^-34, far from FP32's subnormals), so the epilogue multiplies by alpha times 2^14. out[q] = codes (q, q + 4).
// 8 LOP3 + 1 right shift on the integer pipe, the 6 left shifts as multiplies, per 8 codes.
__device__ __forceinline__ void decode8_int(uint32_t w, __half2 sf2, uint32_t* out) {
  const uint32_t s = 0x80008000u, m = 0x0E000E00u;
  const uint32_t v[4] = {((w << 12) & s) | ((w << 9) & m), ((w << 8) & s) | ((w << 5) & m),
                         ((w << 4) & s) | ((w << 1) & m), (w & s) | ((w >> 3) & m)};
#pragma unroll
  for (int q = 0; q < 4; ++q) out[q] = h2_bits(__hmul2(*reinterpret_cast<const __half2*>(&v[q]), sf2));
}

// The block scale (E4M3 code) as FP16 times kMul, in both halves (64: the conversion decodes, 128: decode8_int).
template <int kMul = 64>
__device__ __forceinline__ __half2 scale2(uint32_t code) {
  const __half_raw r = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
  const __half s = __hmul(*reinterpret_cast<const __half*>(&r), __float2half(static_cast<float>(kMul)));
  return __half2half2(s);
}

__device__ __forceinline__ void st_shared_v4(uint32_t addr, const uint32_t (&v)[4]) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3])
               : "memory");
}

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
