// Shared by the prototype's kernels (decode_gemm.cu: v4, decode_gemm_rs.cu: v5): the K step and thread count, the
// mbarrier / wgmma / descriptor helpers, the decodes of 8 codes and the block scale.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace proto {

constexpr int kBK = 64;        // the K step: 64 codes, 32 bytes a row
constexpr int kThreads = 384;  // a producer warpgroup and two consumer warpgroups
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

// The 8 codes of w (4 packed bytes, low nibble first) as E4M3 bytes, each its code's value x 2^-6 (the code
// s e1 e0 m as s 0 e1 e0 m 0 0): lo = codes 0, 2, 4, 6, hi = codes 1, 3, 5, 7.
__device__ __forceinline__ void e4m3_bytes(uint32_t w, uint32_t& lo, uint32_t& hi) {
  lo = ((w << 4) & 0x80808080u) | ((w << 2) & 0x1C1C1C1Cu);
  hi = (w & 0x80808080u) | ((w >> 2) & 0x1C1C1C1Cu);
}

// Two words of E4M3 byte pairs -> four FP16x2 words times sf2 (the FP16 scale times 2^6, in both halves): out[0], out[1]
// from a's low and high halves, out[2], out[3] from b's.
__device__ __forceinline__ void scale_e4m3_pairs(uint32_t a, uint32_t b, __half2 sf2, uint32_t* out) {
  out[0] = h2_bits(__hmul2(e4m3x2_to_h2(a & 0xFFFFu), sf2));
  out[1] = h2_bits(__hmul2(e4m3x2_to_h2(a >> 16), sf2));
  out[2] = h2_bits(__hmul2(e4m3x2_to_h2(b & 0xFFFFu), sf2));
  out[3] = h2_bits(__hmul2(e4m3x2_to_h2(b >> 16), sf2));
}

// 8 codes times the block scale -> 8 FP16 values in order in out[0..3] (element 2i in the low half of out[i]).
__device__ __forceinline__ void decode8(uint32_t w, __half2 sf2, uint32_t* out) {
  uint32_t lo, hi;
  e4m3_bytes(w, lo, hi);
  scale_e4m3_pairs(__byte_perm(lo, hi, 0x5140), __byte_perm(lo, hi, 0x7362), sf2, out);  // codes 0-3, 4-7
}

// decode8 without the two byte permutes: out[0] = codes (0, 2), out[1] = (4, 6), out[2] = (1, 3), out[3] = (5, 7).
// Usable wherever both operands of the GEMM are decoded by it and mapped to K positions the same way (v5): the K order
// of a sum does not change its terms. 11 integer-pipe instructions per 8 codes instead of 13.
__device__ __forceinline__ void decode8_pairs(uint32_t w, __half2 sf2, uint32_t* out) {
  uint32_t lo, hi;
  e4m3_bytes(w, lo, hi);
  scale_e4m3_pairs(lo, hi, sf2, out);
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

}  // namespace proto
