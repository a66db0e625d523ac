// Device-side number-format encoders and decoders: the one CUDA source of truth for formats.
// Every kernel includes this header; fp_recipes/formats.py is its Python twin. Each encoder is
// round-to-nearest-even and documents its NaN/Inf/saturation behaviour.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace fp_recipes {

// ---- section: FP8 (E4M3, E5M2), E5M6, UE8M0 — owned by the FP8 kernel family -----------------
// Float-to-FP8 encoders are RN and SATURATE: finite overflow and +-Inf become +-max (448 for E4M3,
// 57344 for E5M2); NaN stays NaN (0x7F | sign for E4M3, canonical 0x7F for E5M2 from the hardware
// cvt). This is the hardware `cvt.rn.satfinite` behaviour (__NV_SATFINITE), equal to the reference's
// clamp-then-RN cast.

constexpr float kE4M3Max = 448.0f;
constexpr float kE5M2Max = 57344.0f;
constexpr float kE5M6Max = 65024.0f;

// Which FP8 encoding an output uses. Values are independent of the DType table on purpose.
enum class Fp8Fmt : int { kE4M3 = 0, kE5M2 = 1 };

template <Fp8Fmt F>
struct Fp8Traits;
template <>
struct Fp8Traits<Fp8Fmt::kE4M3> {
  static constexpr __nv_fp8_interpretation_t kInterp = __NV_E4M3;
  static constexpr float kMax = kE4M3Max;
};
template <>
struct Fp8Traits<Fp8Fmt::kE5M2> {
  static constexpr __nv_fp8_interpretation_t kInterp = __NV_E5M2;
  static constexpr float kMax = kE5M2Max;
};

// Two FP32 values -> two saturating RN FP8 bytes (low byte = a).
template <Fp8Fmt F>
__device__ __forceinline__ uint16_t encode_fp8x2(float a, float b) {
  return static_cast<uint16_t>(
      __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, Fp8Traits<F>::kInterp));
}

template <Fp8Fmt F>
__device__ __forceinline__ uint8_t encode_fp8(float a) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(a, __NV_SATFINITE, Fp8Traits<F>::kInterp));
}

// Two FP8 bytes (low byte first) -> two exact FP32 values.
template <Fp8Fmt F>
__device__ __forceinline__ float2 decode_fp8x2(uint16_t v) {
  __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v),
                                             Fp8Traits<F>::kInterp);
  __half2 hh = *reinterpret_cast<__half2*>(&h);
  return __half22float2(hh);
}

template <Fp8Fmt F>
__device__ __forceinline__ float decode_fp8(uint8_t v) {
  __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(v), Fp8Traits<F>::kInterp);
  return __half2float(__half(h));
}

// |x| as an ordered unsigned key: for non-negative floats (and NaN, whose key exceeds +Inf's),
// unsigned comparison of the bit pattern is float comparison. max over keys = NaN-propagating amax.
__device__ __forceinline__ uint32_t abs_key(float x) { return __float_as_uint(x) & 0x7FFFFFFFu; }
// Any NaN key -> the key of the canonical quiet NaN 0x7FC00000 (what the reference's amax holds).
__device__ __forceinline__ uint32_t canonical_key(uint32_t key) { return key > 0x7F800000u ? 0x7FC00000u : key; }

// Bit casts and RN arithmetic usable on the host too (the CPU harness tests/fp8_host/ compiles the E5M6
// encoders below with g++; on the GPU they are the explicit round-to-nearest intrinsics, so neither
// -fmad nor the host compiler can contract or reassociate them).
__host__ __device__ __forceinline__ uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
#endif
}
__host__ __device__ __forceinline__ float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
#endif
}
__host__ __device__ __forceinline__ float rn_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
__host__ __device__ __forceinline__ float rn_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
__host__ __device__ __forceinline__ float rn_sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

// E5M6: the top 12 bits of an FP16. h = fp16_bits(RZ(v)); c = h >> 4; r = the 17 FP32 mantissa bits
// below the kept ones; round half to even on them (exact RNE in the FP16-normal range).
// Defined for values the per-token cast never produces (as ops/formats.py does): NaN -> 0x7FF,
// |v| >= 65536 (and +-Inf) -> +-Inf (0x7C0 | sign). Integer-only (RZ to FP16 below 2^-14 is a right
// shift of the significand, as formats.py computes it), so the host harness runs this very code.
__host__ __device__ __forceinline__ uint32_t encode_e5m6(float v) {
  const uint32_t bits = f32_bits(v);
  const uint32_t a = bits & 0x7FFFFFFFu;
  const uint32_t sign12 = (bits >> 20) & 0x800u;
  if (a >= 0x47800000u) return a > 0x7F800000u ? 0x7FFu : (sign12 | 0x7C0u);  // NaN; |v| >= 65536, Inf
  uint32_t c;
  if (a >= 0x38800000u) {
    // FP16-normal range (|v| >= 2^-14): RZ to FP16 is truncation, so h >> 4 is sign, rebiased
    // exponent and the top 6 mantissa bits, in integer arithmetic.
    c = sign12 | ((a - 0x38000000u) >> 17);
  } else {
    // FP16-subnormal range: RZ(v) = floor(|v| * 2^24) * 2^-24; h >> 4 = floor(|v| * 2^20).
    const uint32_t e = a >> 23;
    const uint32_t sig = e ? ((a & 0x7FFFFFu) | 0x800000u) : a;
    const uint32_t shift = 126u - (e ? e : 1u);  // >= 14
    c = sign12 | ((shift >= 32u ? 0u : (sig >> shift)) >> 4);
  }
  const uint32_t r = bits & 0x1FFFFu;
  if ((c & 1u) + r > 0x10000u) c += 1u;  // at most 0x7C0 | sign (Inf): stays within 12 bits
  return c;
}

// The per-token kernels' E5M6 fast path, for v = 0 or 2^-14 <= |v| < 65536 (the only values a finite
// block produces below 2^-14 being handled by e5m6_fast_ok): returns the code shifted to the top of a
// word (code << 20, so its sign is v's sign bit), equal to encode_e5m6(v) << 20 there. Five FP32
// operations and two integer ones instead of about twenty integer ones:
// * in the FP16-normal range the contract is RNE of v to 7 significant bits, which Veltkamp's
//   splitting computes exactly: g = v * (2^17 + 1), w = g + (v - g) (checked over every FP32 value of
//   that range by tests/test_cuda_fp8_hostmath.py);
// * w * 2^-112 rebiases the exponent from 127 to 15 without rounding (w is a 7-bit value >= 2^-14, or
//   0), leaving the 5 exponent and 6 mantissa bits of the code at bits 27..17; << 3 moves them to
//   30..20, and the sign comes from v.
__host__ __device__ __forceinline__ uint32_t e5m6_top_fast(float v) {
#if defined(__CUDA_ARCH__)
  const float a = fabsf(v);  // an operand modifier of the FMUL and FADD below
#else
  const float a = f32_from_bits(f32_bits(v) & 0x7FFFFFFFu);
#endif
  const float g = rn_mul(a, 131073.0f);
  const float w = rn_add(g, rn_sub(a, g));
  const float s = rn_mul(w, 0x1p-112f);  // 2^-112: exact
  return (f32_bits(s) << 3) | (f32_bits(v) & 0x80000000u);
}

// The fast path's range check as an order key: 2|v| - 1 in FP32 bits, so +-0 -> 0xFFFFFFFF and
// 0 < |v| < 2^-14 <=> key < kE5M6FastKeyMin. The minimum over a unit decides fast path or exact path.
__host__ __device__ __forceinline__ uint32_t e5m6_fast_key(float v) { return f32_bits(v) * 2u - 1u; }
constexpr uint32_t kE5M6FastKeyMin = 2u * 0x38800000u - 1u;

// Eight scaled values v[0..7] -> three little-endian words of the packed 96-bit stream (the layout of
// pack_e5m6x8). Fast path unless a value lies in the FP16-subnormal range (0 < |v| < 2^-14) or the
// block is not finite (NaN scale); then the exact encoder, for this unit only.
__host__ __device__ __forceinline__ void e5m6_encode_unit(const float v[8], bool finite, uint32_t w[3]) {
  uint32_t t[8];
  uint32_t kmin = 0xFFFFFFFFu;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    t[j] = e5m6_top_fast(v[j]);
    const uint32_t k = e5m6_fast_key(v[j]);
    kmin = kmin < k ? kmin : k;
  }
  if (!finite || kmin < kE5M6FastKeyMin) {
#pragma unroll
    for (int j = 0; j < 8; ++j) t[j] = encode_e5m6(v[j]) << 20;
  }
  // t = code << 20: w0 = h0<<20 | h1<<8 | h2>>4; w1 = h2<<28 | h3<<16 | h4<<4 | h5>>8;
  // w2 = h5<<24 | h6<<12 | h7 (all mod 2^32).
  w[0] = t[0] | (t[1] >> 12) | (t[2] >> 24);
  w[1] = (t[2] << 8) | (t[3] >> 4) | (t[4] >> 16) | (t[5] >> 28);
  w[2] = (t[5] << 4) | (t[6] >> 8) | (t[7] >> 20);
}

__device__ __forceinline__ float decode_e5m6(uint32_t code) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>((code & 0xFFFu) << 4)));
}

// Eight 12-bit codes -> three little-endian uint32 words of one big-endian 96-bit stream.
__host__ __device__ __forceinline__ uint3 pack_e5m6x8(const uint32_t h[8]) {
  uint3 w;
  w.x = (h[0] << 20) | (h[1] << 8) | (h[2] >> 4);
  w.y = ((h[2] & 0xFu) << 28) | (h[3] << 16) | (h[4] << 4) | (h[5] >> 8);
  w.z = ((h[5] & 0xFFu) << 24) | (h[6] << 12) | h[7];
  return w;
}

__host__ __device__ __forceinline__ void unpack_e5m6x8(uint3 w, uint32_t h[8]) {
  h[0] = w.x >> 20;
  h[1] = (w.x >> 8) & 0xFFFu;
  h[2] = ((w.x & 0xFFu) << 4) | (w.y >> 28);
  h[3] = (w.y >> 16) & 0xFFFu;
  h[4] = (w.y >> 4) & 0xFFFu;
  h[5] = ((w.y & 0xFu) << 8) | (w.z >> 24);
  h[6] = (w.z >> 12) & 0xFFFu;
  h[7] = w.z & 0xFFFu;
}

// UE8M0: a power-of-two scale 2^e stored as the byte e + 127; 0xFF is NaN.
constexpr uint8_t kUE8M0NaN = 0xFF;
__device__ __forceinline__ float ue8m0_to_float(uint8_t b) {
  // 2^(b-127) exactly; b == 0 is the subnormal 2^-127; 0xFF is NaN.
  if (b == kUE8M0NaN) return __uint_as_float(0x7FC00000u);
  return b == 0 ? __uint_as_float(0x00400000u) : __uint_as_float(static_cast<uint32_t>(b) << 23);
}

// ---- section: E2M1 (NVFP4) — owned by the NVFP4 kernel family ---------------------------------

// E2M1 magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}; a code is sign<<3 | index. Two codes per byte:
// element 2k in the low nibble, 2k+1 in the high nibble.

// Decode one 4-bit code to FP32 (exact; code 0x8 is -0.0).
__host__ __device__ __forceinline__ float e2m1_decode(uint32_t code) {
  const uint32_t idx = code & 0x7u;
  // 0, 0.5, 1, 1.5 for idx < 4; 2, 3, 4, 6 above: m = idx<4 ? idx*0.5 : (idx<6 ? idx-2 : 2*(idx-4))
  const float mag = idx < 4u ? 0.5f * static_cast<float>(idx)
                             : (idx < 6u ? static_cast<float>(idx - 2u) : 2.0f * static_cast<float>(idx - 4u));
  return (code & 0x8u) ? -mag : mag;
}

// Sign nibble bit (0x8) of the element being quantized: the contract takes the sign from the
// unscaled element, never from a product (a NaN product's sign is not portable).
__device__ __forceinline__ uint32_t e2m1_sign(float x) { return (__float_as_uint(x) >> 28) & 0x8u; }

// Round-to-nearest-even E2M1 in software (Hopper has no FP4 conversion instruction), a few
// instructions per element: a = min(|y|, 6) (fminf turns NaN into 6, so NaN and Inf saturate like any
// |y| >= 6). The E2M1 quantum in a's binade is 0.5 below 2, 1 in [2, 4) and 2 from 4 on, which is the
// FP32 ulp of 2^22, 2^23 and 2^24: s = RN(a + M) with M = 2^22, 2^23 + 2 or 2^24 + 8 rounds a onto the
// E2M1 grid with FP32's ties-to-even (E2M1 index parity = ulp-count parity in every binade, and the
// offsets 2 and 8 are an even number of ulps), and leaves the E2M1 index itself in s's low mantissa
// bits: the low byte of bits(s) is the index (0..7, bits 3..7 zero); s - M is the rounded value.
__device__ __forceinline__ float e2m1_round_magic(float y, float& m) {
  const float a = fminf(fabsf(y), 6.0f);
  m = __uint_as_float(a < 2.0f ? 0x4A800000u : (a < 4.0f ? 0x4B000002u : 0x4B800004u));
  return __fadd_rn(a, m);
}

struct E2M1Rounded {
  uint32_t idx;  // magnitude index 0..7
  float mag;     // its value {0, 0.5, ..., 6}
};

__device__ __forceinline__ E2M1Rounded e2m1_round_rn(float y) {
  float m;
  const float s = e2m1_round_magic(y, m);
  E2M1Rounded r;
  r.idx = __float_as_uint(s) & 0x7u;
  r.mag = __fsub_rn(s, m);
  return r;
}

__device__ __forceinline__ uint32_t e2m1_mag_rn_sw(float y) { return e2m1_round_rn(y).idx; }

// PTX prmt.b32 (default mode): result byte n = byte (sel >> 4n) & 7 of {b:a}; when bit 3 of that
// selector nibble is set, the selected byte's most significant bit is replicated over the byte.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
#else
  const uint64_t pool = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t r = 0;
  for (int n = 0; n < 4; ++n) {
    const uint32_t c = (sel >> (4 * n)) & 0xFu;
    uint32_t byte = static_cast<uint32_t>(pool >> (8 * (c & 7u))) & 0xFFu;
    if (c & 8u) byte = (byte & 0x80u) ? 0xFFu : 0u;
    r |= byte << (8 * n);
  }
  return r;
#endif
}

// 8 E2M1 codes as one word (byte k = code 2k | code 2k+1 << 4): magnitude indices from the low bytes
// of the magic sums s[0..7], sign bits from the unscaled elements x[0..7] (the contract's sign source).
__device__ __forceinline__ uint32_t e2m1_pack8(const uint32_t* s, const float* x) {
  const uint32_t even = prmt(prmt(s[0], s[2], 0x0040u), prmt(s[4], s[6], 0x0040u), 0x5410u);
  const uint32_t odd = prmt(prmt(s[1], s[3], 0x0040u), prmt(s[5], s[7], 0x0040u), 0x5410u);
  const uint32_t seven = prmt(prmt(__float_as_uint(x[0]), __float_as_uint(x[2]), 0x00FBu),
                              prmt(__float_as_uint(x[4]), __float_as_uint(x[6]), 0x00FBu), 0x5410u);
  const uint32_t sodd = prmt(prmt(__float_as_uint(x[1]), __float_as_uint(x[3]), 0x00FBu),
                             prmt(__float_as_uint(x[5]), __float_as_uint(x[7]), 0x00FBu), 0x5410u);
  return even | (odd << 4) | (seven & 0x08080808u) | (sodd & 0x80808080u);
}

// Two codes packed as one byte (element a -> low nibble): magnitudes of the scaled values ya, yb,
// signs of the unscaled elements xa, xb. On sm_100-family targets the hardware conversion
// cvt.rn.satfinite.e2m1x2.f32 rounds the magnitudes; NaN is patched to the contract's 7.
__device__ __forceinline__ uint32_t e2m1x2_encode_rn(float ya, float yb, float xa, float xb) {
  const uint32_t signs = e2m1_sign(xa) | (e2m1_sign(xb) << 4);
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FAMILY_SPECIFIC__) && (__CUDA_ARCH_FAMILY_SPECIFIC__ >= 1000)
  uint32_t packed;
  asm("{\n\t.reg .b8 b;\n\tcvt.rn.satfinite.e2m1x2.f32 b, %1, %2;\n\tcvt.u32.u8 %0, b;\n\t}"
      : "=r"(packed)
      : "f"(yb), "f"(ya));
  packed &= 0x77u;
  if (ya != ya) packed |= 0x07u;
  if (yb != yb) packed |= 0x70u;
  return packed | signs;
#else
  return (e2m1_mag_rn_sw(ya) | (e2m1_mag_rn_sw(yb) << 4)) | signs;
#endif
}

// Stochastic E2M1 encode of the scaled value y (sign from the unscaled element x), branch-free:
// |y| lies between grid neighbours lo < hi with hi - lo = step (0.5 below 2, 1 in [2, 4), 2 in [4, 6));
// t = |y| / step is exact (a power-of-two scaling), lo = floor(t) * step, and
// frac = RN((|y| - lo) / (hi - lo)) = t - floor(t), also exact. Round up iff 2*rbyte + 1 < frac * 512,
// i.e. with probability frac. |y| >= 6 (Inf too) -> 6, NaN -> 7.
__device__ __forceinline__ uint32_t e2m1_encode_sr(float y, float x, uint32_t rbyte) {
  const float ay = fabsf(y);
  const float a = fminf(ay, 7.0f);  // keeps the arithmetic finite; >= 6 and NaN are set below
  const bool p2 = a >= 2.0f, p4 = a >= 4.0f;
  const float t = __fmul_rn(a, p4 ? 0.5f : (p2 ? 1.0f : 2.0f));
  const float k = truncf(t);
  const float frac = __fsub_rn(t, k);
  const uint32_t up = static_cast<float>(2u * rbyte + 1u) < __fmul_rn(frac, 512.0f) ? 1u : 0u;
  uint32_t idx = static_cast<uint32_t>(k) + (p4 ? 4u : (p2 ? 2u : 0u)) + up;
  if (!(ay < 6.0f)) idx = 7u;
  return e2m1_sign(x) | idx;
}

// E4M3 (e4m3fn) round-to-nearest-even with saturation to +-448 (Inf too); NaN -> 0x7F.
__device__ __forceinline__ uint32_t nvfp4_e4m3_encode_satfinite(float v) {
  return static_cast<uint32_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ float nvfp4_e4m3_decode(uint32_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
  return __half2float(__half(h));
}

}  // namespace fp_recipes
