// NVFP4 recipe math for one 16-element block (NUMERICS.md "NVFP4" and "4over6"), shared by the
// quantize kernels. Every reference-critical FP32 operation is an explicit round-to-nearest
// intrinsic in the contract's order (the files are also compiled with -fmad=false).
#pragma once

#include <atomic>
#include <cfloat>
#include <cstdint>

#include "formats.cuh"

namespace fp_recipes {
namespace nvfp4 {

// Host side: the multiprocessor count of the current device, which the launchers size their grids from.
// Queried once per device (cudaDeviceGetAttribute costs microseconds of host time per launch, and a
// device's SM count never changes); thread-safe (relaxed atomics: every thread stores the same value).
// 132 where a query fails, as the launchers assumed before.
inline int sm_count_cached() {
  static std::atomic<int> cached[64];  // static storage: zero-initialised
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 132;
  const bool slot = dev >= 0 && dev < 64;
  if (slot) {
    const int known = cached[dev].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  int sms = 132;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return 132;
  if (slot && sms > 0) cached[dev].store(sms, std::memory_order_relaxed);
  return sms;
}

// The contract's min(v, bound) is fminf (torch.fmin): a NaN operand yields the other one.
__device__ __forceinline__ float fmin_bound(float a, float b) { return fminf(a, b); }

// NaN-propagating max of |x| over FP32 bit patterns: |x| bits order like the values, and every
// NaN pattern is above +Inf, so a NaN anywhere wins (like torch.amax).
__device__ __forceinline__ uint32_t abs_bits(float v) { return __float_as_uint(v) & 0x7FFFFFFFu; }

// max(m, |v|) with NaN propagation: one max.NaN.f32 (sm_80+) with the |.| folded into the operand.
// m >= +0 and |v| >= +0, so the result is a non-negative float or NaN, and its bit pattern orders
// like abs_bits (NaN above Inf), which the 2-D tile max relies on.
__device__ __forceinline__ float absmax_nan(float m, float v) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(m), "f"(fabsf(v)));
  return r;
#else
  const float a = fabsf(v);
  return (m != m || a != a) ? __uint_as_float(0x7FC00000u) : fmaxf(m, a);
#endif
}

// max |x_i| of a block as a pairwise tree (short dependency chains), NaN propagating.
__device__ __forceinline__ float block_absmax16(const float (&x)[16]) {
  float m[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) m[i] = absmax_nan(absmax_nan(absmax_nan(fabsf(x[i]), x[i + 4]), x[i + 8]), x[i + 12]);
  return absmax_nan(absmax_nan(m[0], m[1]), absmax_nan(m[2], m[3]));
}

// Per-tensor (or per-row) encode/decode factors of NUMERICS.md steps 2-3.
struct TensorScale {
  float s_enc;  // S_enc = RN(6E / amax), clamped to FLT_MAX; 1 if amax == 0 or S_enc == 0
  float s_dec;  // RN(1 / S_enc)
  float mult;   // RN(S_enc * RN(1/6)): the block-scale multiplier
  float amax;   // the amax itself (4over6 strict error path)
  float six_e;  // 6E, exact
  float zh, zl;  // RN(1/6E) and RN(1/6E - zh) for div_6e (0 when E is neither 448 nor 256)
};

__device__ __forceinline__ TensorScale make_tensor_scale(float amax, float e4m3_max) {
  TensorScale t;
  t.six_e = __fmul_rn(6.0f, e4m3_max);
  float s = fmin_bound(__fdiv_rn(t.six_e, amax), FLT_MAX);
  if (amax == 0.0f || s == 0.0f) s = 1.0f;
  t.s_enc = s;
  t.s_dec = __fdiv_rn(1.0f, s);
  t.mult = __fmul_rn(s, __fdiv_rn(1.0f, 6.0f));
  t.amax = amax;
  if (e4m3_max == 448.0f) {
    t.zh = __uint_as_float(0x39C30C31u);  // RN(1/2688)
    t.zl = __uint_as_float(0xACF3CF3Du);  // RN(1/2688 - zh)
  } else if (e4m3_max == 256.0f) {
    t.zh = __uint_as_float(0x3A2AAAABu);  // RN(1/1536)
    t.zl = __uint_as_float(0xADAAAAABu);  // RN(1/1536 - zh)
  } else {
    t.zh = t.zl = 0.0f;
  }
  return t;
}

// RN(w / 6E) without a division: fma(w, zh, RN(w * zl)) (Brisebarre, Muller & Raina, "Accelerating
// correctly rounded floating-point division when the divisor is known in advance", 2004). For
// 6E = 2688 and 1536 scripts/nvfp4_check_div6e.py checks every FP32 significand exhaustively (0
// mismatches); the identity holds while w and w*zl are normal, so zero-free |w| < 2^-80, Inf and NaN
// take the true division (zero is exact either way up to the sign of a zero quotient, which no error
// term can see: |RN(+-0 - x)| and its square do not depend on it).
__device__ __forceinline__ float div_6e(float w, const TensorScale& t) {
  const float aw = fabsf(w);
  if (t.zh != 0.0f && aw <= FLT_MAX && (aw >= 0x1p-80f || aw == 0.0f))
    return __fmaf_rn(w, t.zh, __fmul_rn(w, t.zl));
  return __fdiv_rn(w, t.six_e);
}

// Step 3: E4M3 code of the block decode scale.
__device__ __forceinline__ uint32_t plain_scale_code(float bamax, const TensorScale& t) {
  return nvfp4_e4m3_encode_satfinite(fmin_bound(__fmul_rn(bamax, t.mult), FLT_MAX));
}

// Step 4: enc = min(RN(1 / RN(fp32(sf) * S_dec)), FLT_MAX); a zero sf gives FLT_MAX.
__device__ __forceinline__ float block_enc(float sf, float s_dec) {
  return fmin_bound(__frcp_rn(__fmul_rn(sf, s_dec)), FLT_MAX);
}

// Packing of 8 magic sums (e2m1_round_magic / fos_encode16) into one word of codes, two ways with the
// same result: kPack 0 = e2m1_pack8 (byte permutes, ALU pipe); kPack 2 = integer multiply-adds (FMA
// pipe): w = hi * 4096 + (lo | signs) with lo = (s0 + 16 s1 + 256 s2) & 0xFFF and hi = s3 + 16 s4 +
// ... + 16^4 s7 (Horner), where s_j = exponent bits | idx_j (idx_j <= 7, so bits 3..22 are zero): the
// exponent bits of s_j * 16^j leave the 32-bit word for j >= 3 (bit 23 + 4j >= 35), every idx_j lands
// in nibble j without carries, and the low 12 bits of s0 + 16 s1 + 256 s2 are exactly idx0 | idx1 << 4
// | idx2 << 8. The multipliers 16 and 4096 come from constant memory so that ptxas keeps IMADs with a
// constant-bank operand (immediate multipliers become LEAs / shifts on the ALU pipe).
// NVFP4_CONST_OPERAND(name, value): `name()` returns `value` read from constant memory in device code, so
// that ptxas keeps a multiply by it on IMAD (the FMA pipe) instead of turning an immediate into a shift or a
// LEA on the ALU pipe; host code (tests/nvfp4_host) gets the plain value.
#if defined(__CUDA_ARCH__)
#define NVFP4_CONST_READ(sym, value) (sym)
#else
#define NVFP4_CONST_READ(sym, value) (value)
#endif
#if defined(__CUDACC__)
#define NVFP4_CONST_OPERAND(name, value)             \
  static __constant__ uint32_t c_##name = (value);   \
  __device__ __forceinline__ uint32_t name() { return NVFP4_CONST_READ(c_##name, (value)); }
#else
#define NVFP4_CONST_OPERAND(name, value) \
  __device__ __forceinline__ uint32_t name() { return (value); }
#endif
NVFP4_CONST_OPERAND(pack_k16, 16u)
NVFP4_CONST_OPERAND(pack_k4096, 4096u)

// The sign bits of 8 elements at bits 4j + 3, exactly the sign part of e2m1_pack8.
__device__ __forceinline__ uint32_t e2m1_signs8(const float* x) {
  const uint32_t seven = prmt(prmt(__float_as_uint(x[0]), __float_as_uint(x[2]), 0x00FBu),
                              prmt(__float_as_uint(x[4]), __float_as_uint(x[6]), 0x00FBu), 0x5410u);
  const uint32_t sodd = prmt(prmt(__float_as_uint(x[1]), __float_as_uint(x[3]), 0x00FBu),
                             prmt(__float_as_uint(x[5]), __float_as_uint(x[7]), 0x00FBu), 0x5410u);
  return (seven & 0x08080808u) | (sodd & 0x80808080u);
}

template <int kPack>
__device__ __forceinline__ uint32_t pack8(const uint32_t* s, const float* x) {
  static_assert(kPack == 0 || kPack == 2, "kPack: 0 (byte permutes) or 2 (integer multiply-adds)");
  if (kPack == 0) return e2m1_pack8(s, x);
  const uint32_t k16 = pack_k16();
  const uint32_t lo = ((s[2] * k16 + s[1]) * k16 + s[0]) & 0xFFFu;
  uint32_t hi = s[7];
#pragma unroll
  for (int j = 6; j >= 3; --j) hi = hi * k16 + s[j];
  return hi * pack_k4096() + (lo | e2m1_signs8(x));
}

// e2m1_round_magic with the binade magic taken from the exponent e of max(a, 1) (e2m1_magic3_exp's
// formula, the same magic for every a in [0, 6]): 0x4A800000 + (e - 127) * 0x800002, with e from an
// integer multiply-high by 512 (= bits >> 23) whose multiplier comes from constant memory so that ptxas
// keeps it on the FMA pipe (IMAD.HI) instead of a shift. Two ALU ops (the clamp and max(a, 1)) and two
// IMADs per element in place of two compares and two selects (four ALU ops): the tile kernels, which
// quantize every element twice, are bound by the ALU pipe.
NVFP4_CONST_OPERAND(exp_k512, 512u)
__device__ __forceinline__ float e2m1_round_magic_exp(float y, float& m) {
  const float a = fminf(fabsf(y), 6.0f);
  const uint32_t e = __umulhi(__float_as_uint(fmaxf(a, 1.0f)), exp_k512());
  m = __uint_as_float(e * 0x800002u + (0x4A800000u - 127u * 0x800002u));
  return __fadd_rn(a, m);
}

// Step 5, round to nearest, in software: magic-add rounding, then byte permutes (or IMADs) gather the
// 16 codes into 8 bytes (two little-endian words). What every arch below sm_100 runs. kExpMagic:
// e2m1_round_magic_exp instead of e2m1_round_magic (the same sums).
template <int kPack = 0, bool kExpMagic = false>
__device__ __forceinline__ uint2 encode16_rn_sw(const float (&x)[16], float enc) {
  uint2 out;
  uint32_t s[16];
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    float m;
    s[j] = __float_as_uint(kExpMagic ? e2m1_round_magic_exp(__fmul_rn(x[j], enc), m)
                                     : e2m1_round_magic(__fmul_rn(x[j], enc), m));
  }
  out.x = pack8<kPack>(s, x);
  out.y = pack8<kPack>(s + 8, x + 8);
  return out;
}

// Runtime switch of the sm_100-family hardware conversion (cvt.rn.satfinite.e2m1x2): nonzero makes
// encode16_rn run the software path above even where the hardware one is compiled. Set per device by
// set_software_e2m1() (nvfp4_quantize.cu) when the first-use self-check of fp_recipes/ops/cuda_nvfp4.py
// finds the hardware bytes differing from the contract's. A uniform constant-bank read per block.
#if defined(__CUDACC__)
static __constant__ int c_e2m1_software = 0;
#endif

// Step 5, round to nearest: 16 codes packed into 8 bytes (two little-endian words).
template <int kPack = 0, bool kExpMagic = false>
__device__ __forceinline__ uint2 encode16_rn(const float (&x)[16], float enc) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FAMILY_SPECIFIC__) && (__CUDA_ARCH_FAMILY_SPECIFIC__ >= 1000)
  if (!c_e2m1_software) {
    uint32_t w0 = 0, w1 = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      w0 |= e2m1x2_encode_rn(__fmul_rn(x[2 * k], enc), __fmul_rn(x[2 * k + 1], enc), x[2 * k],
                             x[2 * k + 1]) << (8 * k);
      w1 |= e2m1x2_encode_rn(__fmul_rn(x[8 + 2 * k], enc), __fmul_rn(x[8 + 2 * k + 1], enc), x[8 + 2 * k],
                             x[8 + 2 * k + 1]) << (8 * k);
    }
    return make_uint2(w0, w1);
  }
#endif
  return encode16_rn_sw<kPack, kExpMagic>(x, enc);
}

// Philox4x32-10 (Salmon et al.; the same rounds and constants as Random123 / curand).
__device__ __forceinline__ uint4 philox4x32_10(uint4 ctr, uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    const uint32_t lo0 = 0xD2511F53u * ctr.x, hi0 = __umulhi(0xD2511F53u, ctr.x);
    const uint32_t lo1 = 0xCD9E8D57u * ctr.z, hi1 = __umulhi(0xCD9E8D57u, ctr.z);
    ctr = make_uint4(hi1 ^ ctr.y ^ k0, lo1, hi0 ^ ctr.w ^ k1, lo0);
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return ctr;
}

// The 16 random bytes of block `b` (INTERFACES.md): key = (seed lo, seed hi),
// counter = (b lo, b hi, offset lo, offset hi); element j uses byte j%4 of word j/4.
__device__ __forceinline__ uint4 sr_block_bits(uint64_t b, uint64_t seed, uint64_t offset) {
  return philox4x32_10(make_uint4(static_cast<uint32_t>(b), static_cast<uint32_t>(b >> 32),
                                  static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32)),
                       static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

__device__ __forceinline__ uint32_t sr_word(const uint4& w, int j) {
  return j < 4 ? w.x : (j < 8 ? w.y : (j < 12 ? w.z : w.w));
}

// Step 5 with stochastic rounding, the decisions of e2m1_encode_sr (formats.cuh) with the per-element work on
// the FMA pipe (IMAD, IMAD.HI, FMUL, FADD in directed roundings) instead of the half-rate ALU pipe
// (compares, selects, conversions), which bounds the SR tile kernels (session 25 measured an integer form
// with MORE ALU work 1.2x slower). With a = min(|y|, 7) and b its binade (0 below 2, 1 in [2, 4), 2 from 4):
//   T  = a * 2^(10 - b)                     = t * 512, exact (t = a / step of e2m1_encode_sr)
//   kf = RZ(T + 2^32 + 1024)                = 2^32 + 512 (floor(t) + 2): bits 0x4F800002 + floor(t)
//   F  = T - (kf - 2^32 - 1024)             = frac * 512, exact
//   g  = RU(F + 2^23)                       = 2^23 + ceil(F): bits 0x4B000000 + ceil(F)
//   up = (0x4B000001 + 2r) < bits(g)        <=> 2r + 1 < ceil(F) <=> 2r + 1 < F (2r + 1 is an integer)
//   code = min(floor(t) + 2b + up, 7)       (|y| >= 6 and NaN: 7, as e2m1_encode_sr sets it)
// The codes sit in the low byte of 0x4F800000 + 256 + code, the form pack8 gathers (signs from x, as
// e2m1_sign). scripts/nvfp4_check_sr_fma.py checks the decisions on every a in [0, 7]; the CPU suite checks
// encode16_sr against e2m1_encode_sr through tests/nvfp4_host. Measured on an H100 (session 26, 16384x6144
// BF16): SR row + RHT SR col 360.9 -> 312.8 us, 2-D SR row+col 342.4 -> 292.5 us, the same bytes. On by
// default; NVFP4_SR_FMA_PIPE=0 builds the compare/select form (benchmarks/nvfp4_variants compares both).
#ifndef NVFP4_SR_FMA_PIPE
#define NVFP4_SR_FMA_PIPE 1
#endif
#if NVFP4_SR_FMA_PIPE
NVFP4_CONST_OPERAND(sr_k2, 2u)
NVFP4_CONST_OPERAND(sr_kneg1, 0xFFFFFFFFu)
template <int kPack = 0>
__device__ __forceinline__ uint2 encode16_sr_fma(const float (&x)[16], float enc, const uint4& rnd) {
  const uint32_t k2 = sr_k2(), kneg1 = sr_kneg1();
  uint32_t s[16];
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const float a = fminf(fabsf(__fmul_rn(x[j], enc)), 7.0f);
    const uint32_t e = __umulhi(__float_as_uint(fmaxf(a, 1.0f)), exp_k512());  // 127 + b
    const float t512 = __fmul_rn(a, __uint_as_float(e * (0u - 0x800000u) + (264u << 23)));  // a * 2^(137 - e)
    // 2^32 + 1024 + 512 floor(t): bits 0x4F800002 + floor(t) (the +2 of the code's offset 2e + 2 - 256)
    const float kf = __fadd_rz(t512, 4294968320.0f);
    const float f512 = __fsub_rn(t512, __fsub_rn(kf, 4294968320.0f));
    const uint32_t g = __float_as_uint(__fadd_ru(f512, 8388608.0f));
    const uint32_t r = __byte_perm(sr_word(rnd, j), 0u, 0x4440u | (j % 4));  // byte j % 4, one PRMT
    // the sign bit of thr - bits(g), thr = 0x4B000001 + 2r: 1 iff thr < bits(g)
    const uint32_t up = __umulhi(g * kneg1 + (r * k2 + 0x4B000001u), k2);
    s[j] = min(__float_as_uint(kf) + e * k2 + up, 0x4F800000u + 256u + 7u);
  }
  return make_uint2(pack8<kPack>(s, x), pack8<kPack>(s + 8, x + 8));
}
#endif  // NVFP4_SR_FMA_PIPE

// Step 5 with stochastic rounding as one directed rounding to the grid (10 instructions an element against
// encode16_sr_fma's 16). With a = min(|y|, 6), e the exponent of max(a, 1) (127 + b), step = 2^(e - 128) (the
// E2M1 spacing of a's binade) and the element's random byte r:
//   d    = RU(a - (2r + 1) * 2^(e - 137))     one FFMA.RU: a - (2r + 1) step / 512, exact before its one rounding
//   sum  = RU(d + M_e)                        M_e = 2^22 * 2^b + 128 * 2^b + 2b * step: a magic whose ulp is step
// sum = M_e + step * ceil((a - (2r + 1) step / 512) / step) (RU is monotone and every multiple of step in
// (-step, 6] is a float, so rounding d up first changes no ceiling), and with frac = a / step - floor(a / step)
// that ceiling is floor(a / step) + [frac > (2r + 1) / 512]: e2m1_encode_sr's decision (up iff 2r + 1 < frac * 512)
// on its index floor(t) + 2b (+ up). a >= 6 and NaN (fminf takes the 6) land on index 7. The magic sits 256 ulps
// above its binade's start, so a negative d (a < (2r + 1) / 1024 in the lowest binade) stays inside the binade
// (ulp 0.5) and rounds up to index 0; bits(sum) = bits(M_e) + index, whose low byte is the index (bit 8 set, as
// encode16_sr_fma's sums have it; pack8<0> gathers low bytes only). -(2r + 1) is made exactly by one PRMT (byte r
// into 0x4B0000rr = 2^23 + r) and one FFMA (-2 (2^23 + r) + 2^24 - 1). scripts/nvfp4_check_sr_ceil.py checks the
// sums exactly for every FP32 a in [2^-12, 6] (a = 6 standing for a >= 6) against e2m1_encode_sr; the CPU suite checks
// encode16_sr against the elementwise twin through tests/nvfp4_host. On by default; NVFP4_SR_CEIL=0 builds
// encode16_sr_fma (the benchmark's comparison).
#ifndef NVFP4_SR_CEIL
#define NVFP4_SR_CEIL 1
#endif
#if NVFP4_SR_CEIL
NVFP4_CONST_OPERAND(sr_kexp, 0x800000u)
NVFP4_CONST_OPERAND(sr_kmagic, 0x800002u)
__device__ __forceinline__ uint2 encode16_sr_ceil(const float (&x)[16], float enc, const uint4& rnd) {
  const uint32_t kexp = sr_kexp(), kmagic = sr_kmagic();
  uint32_t s[16];
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const float a = fminf(fabsf(__fmul_rn(x[j], enc)), 6.0f);
    const uint32_t e = __umulhi(__float_as_uint(fmaxf(a, 1.0f)), exp_k512());  // 127 + b
    const float magic = __uint_as_float(e * kmagic + (0x4A800100u - 127u * 0x800002u));
    const float step512 = __uint_as_float(e * kexp - (10u << 23));  // 2^(e - 137)
    // 0x4B0000rr: byte j % 4 of its word under the exponent bits of 2^23 (one PRMT); then -(2r + 1), exact
    const float r23 = __uint_as_float(__byte_perm(sr_word(rnd, j), 0x4B000000u, 0x7650u | (j % 4)));
    const float neg = __fmaf_rn(r23, -2.0f, 16777215.0f);
    s[j] = __float_as_uint(__fadd_ru(__fmaf_ru(neg, step512, a), magic));
  }
  return make_uint2(pack8<0>(s, x), pack8<0>(s + 8, x + 8));
}
#endif  // NVFP4_SR_CEIL

// Step 5 with stochastic rounding.
__device__ __forceinline__ uint2 encode16_sr(const float (&x)[16], float enc, const uint4& rnd) {
#if NVFP4_SR_CEIL
  return encode16_sr_ceil(x, enc, rnd);
#endif
#if NVFP4_SR_FMA_PIPE
  return encode16_sr_fma<0>(x, enc, rnd);
#endif
  uint32_t w[2] = {0u, 0u};
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const uint32_t byte = (sr_word(rnd, j) >> (8 * (j % 4))) & 0xFFu;
    w[j / 8] |= e2m1_encode_sr(__fmul_rn(x[j], enc), x[j], byte) << (4 * (j % 8));
  }
  return make_uint2(w[0], w[1]);
}

// ---- 4over6 -----------------------------------------------------------------------------------
// kFos: 0 off, 1 strict MAE, 2 fast MAE, 3 strict MSE, 4 fast MSE (compile-time: the error path is
// the inner loop).
__host__ __device__ constexpr bool fos_fast(int fos) { return fos == 2 || fos == 4; }
__host__ __device__ constexpr bool fos_mse(int fos) { return fos >= 3; }
inline int fos_mode(bool on, bool fast, bool mse) { return on ? (1 + (fast ? 1 : 0) + (mse ? 2 : 0)) : 0; }

// RN(b / 6) without a division, like div_6e: 6 has the significand of 1536 (6 = 1536 / 2^8), so the
// exhaustive check of the 1536 constants carries over to zh = RN(1/6), zl = RN(1/6 - zh) wherever b,
// b*zl and the quotient are normal; tiny, Inf and NaN b take the true division (zero is exact).
__device__ __forceinline__ float div6_rn(float b) {
  const float ab = fabsf(b);
  if (ab <= FLT_MAX && (ab >= 0x1p-80f || ab == 0.0f))
    return __fmaf_rn(b, __uint_as_float(0x3E2AAAABu), __fmul_rn(b, __uint_as_float(0xB1AAAAABu)));
  return __fdiv_rn(b, 6.0f);
}

// Binade magics of the E2M1 magic-add rounding (formats.cuh, e2m1_round_magic) for a >= 0, without its
// saturating clamp. Three binades: exact for a < 7 (a in [6, 7) rounds to 6 at quantum 2, as the clamp
// would make it; 7 itself would tie up to 8). Two binades (quantum 0.5 below 2, quantum 1 above): exact
// for a <= 4.5, because quantum 1 rounds [4, 4.5] to 4 (4.5 ties to the even 4) just like quantum 2.
// In both, a threshold anywhere in [1.75, 2] / [3.5, 4] would do: both quanta round those values alike.
__device__ __forceinline__ float e2m1_magic3(float a) {
  return __uint_as_float(a < 2.0f ? 0x4A800000u : (a < 4.0f ? 0x4B000002u : 0x4B800004u));
}
__device__ __forceinline__ float e2m1_magic2(float a) {
  return __uint_as_float(a < 2.0f ? 0x4A800000u : 0x4B000002u);
}
// e2m1_magic3 for 0 <= a < 8 from the exponent e of max(a, 1) (127, 128 or 129): the three magics are
// 0x4A800000 + (e - 127) * 0x800002, one integer multiply-add (FMA pipe) in place of two compares and
// two selects (ALU pipe).
__device__ __forceinline__ float e2m1_magic3_exp(float a) {
  const uint32_t e = __float_as_uint(fmaxf(a, 1.0f)) >> 23;
  return __uint_as_float(e * 0x800002u + (0x4A800000u - 127u * 0x800002u));
}

struct FosCandidates {
  uint32_t sf4, sf6;  // E4M3 codes
  float sf4f, sf6f;   // their FP32 values
  float enc4, enc6;
};

// A per-tensor table of {fp32(sf), enc(sf)} over all 256 E4M3 codes (step 4 for a fixed S_dec), built
// once per thread block in shared memory: a block's scale code then costs one 8-byte shared load instead
// of a decode and a correctly rounded reciprocal. Row-scaled tensors (an S_dec per row) pass no table.
__device__ __forceinline__ void fill_enc_table(float2* tab, float s_dec, int tid, int nthreads) {
  for (int code = tid; code < 256; code += nthreads) {
    const float sf = nvfp4_e4m3_decode(static_cast<uint32_t>(code));
    tab[code] = make_float2(sf, block_enc(sf, s_dec));
  }
}

// base = RN(RN(bamax / 6) * S); sf6 = e4m3(min(base, 448)); sf4 = e4m3(min(RN(base * 1.5), 448)).
// tab: fill_enc_table for t.s_dec, or nullptr (computed here).
__device__ __forceinline__ FosCandidates fos_candidates(float bamax, const TensorScale& t, const float2* tab) {
  FosCandidates c;
  const float base = __fmul_rn(div6_rn(bamax), t.s_enc);
  c.sf6 = nvfp4_e4m3_encode_satfinite(fmin_bound(base, 448.0f));
  c.sf4 = nvfp4_e4m3_encode_satfinite(fmin_bound(__fmul_rn(base, 1.5f), 448.0f));
  if (tab != nullptr) {
    const float2 e6 = tab[c.sf6], e4 = tab[c.sf4];
    c.sf6f = e6.x;
    c.enc6 = e6.y;
    c.sf4f = e4.x;
    c.enc4 = e4.y;
  } else {
    c.sf6f = nvfp4_e4m3_decode(c.sf6);
    c.sf4f = nvfp4_e4m3_decode(c.sf4);
    c.enc6 = block_enc(c.sf6f, t.s_dec);
    c.enc4 = block_enc(c.sf4f, t.s_dec);
  }
  return c;
}

// The strict error's RN(w / 6E) may use the division-free identity of div_6e for every element of the
// block (no per-element range test) when all nonzero |w| = RN(RN(q * sf) * |A|) lie in
// [2^-80, FLT_MAX]: with q in {0.5, ..., 6} they lie between RN(RN(0.5 sf) |A|) and RN(RN(6 sf) |A|)
// (both products of sf are exact). sf == 0 makes every w = 0 * A, which both ways give alike.
__device__ __forceinline__ bool fos_div_ok(float sf, float amax) {
  const float a = fabsf(amax);
  const float lo = __fmul_rn(__fmul_rn(sf, 0.5f), a), hi = __fmul_rn(__fmul_rn(sf, 6.0f), a);
  return sf == 0.0f || (lo >= 0x1p-80f && hi <= FLT_MAX);
}

// The short path of a block (fos_encode16<kFos, true>) is exact when the largest scaled magnitudes
// RN(bamax * enc) (monotone bounds of every RN(|x_i| * enc)) stay below 4.5 (map-to-4: two binades, no
// clamp) and below 7 (map-to-6: no clamp), and, for the strict error, fos_div_ok holds for both
// candidates. A NaN or Inf element makes bamax NaN/Inf and fails the tests.
template <int kFos>
__device__ __forceinline__ bool fos_short_ok(float bamax, const FosCandidates& c, const TensorScale& t) {
  bool ok = __fmul_rn(bamax, c.enc4) < 4.5f && __fmul_rn(bamax, c.enc6) < 7.0f;
  if (!fos_fast(kFos)) ok = ok && t.zh != 0.0f && fos_div_ok(c.sf4f, t.amax) && fos_div_ok(c.sf6f, t.amax);
  return ok;
}

// Path choice for a block, made per warp (the 32 lanes run one path): the short path only if every
// active lane's block qualifies. Lanes outside the active mask vote on their own, so a lane never takes
// the short path unless its own block qualifies. The host harness can force the general path.
#if defined(NVFP4_HOST_HARNESS)
extern int g_fos_force_general;
#endif
__device__ __forceinline__ bool fos_take_short(bool ok) {
#if defined(__CUDA_ARCH__)
  return __all_sync(__activemask(), ok);
#elif defined(NVFP4_HOST_HARNESS)
  return ok && !g_fos_force_general;
#else
  return ok;
#endif
}

// Error of one candidate for one element (q: the E2M1 magnitude, ax = |x|), accumulated in element order
// by the caller. Fast math: cand = q * sf is exact (q has 2 significant bits, sf 4; |q*sf| <= 2688 and
// its smallest non-zero value 2^-10, also the FP16 product of the contract), so d = RN(cand - RN(|x| S))
// is one FMA with the exact product. Strict: val = RN(RN(RN(q * sf) * amax) / 6E), d = RN(val - |x|);
// kDivOk: the block passed fos_div_ok, so RN(w / 6E) is the FMA identity with no range test.
template <int kFos, bool kDivOk>
__device__ __forceinline__ float fos_elem_err(float q, float sf, float ax, float orig, const TensorScale& t) {
  float d;
  if (fos_fast(kFos)) {
    d = __fmaf_rn(q, sf, -orig);
  } else {
    const float w = __fmul_rn(__fmul_rn(q, sf), t.amax);
    const float val = kDivOk ? __fmaf_rn(w, t.zh, __fmul_rn(w, t.zl)) : div_6e(w, t);
    d = __fsub_rn(val, ax);
  }
  return fos_mse(kFos) ? __fmul_rn(d, d) : fabsf(d);
}

// Strict short path: the eight values val(idx) = RN(RN(RN(q_idx * sf) * amax) / 6E) of a candidate in a
// per-thread table, entry idx at vt[idx * kValStride] (kValStride floats = 1 KiB apart, so the byte
// offset of entry idx is the magic sum's bits << 10: idx sits in the low byte and the exponent bits shift
// out). Under fos_div_ok every RN(q * sf * amax) is normal and finite, so scaling q by a power of two
// scales w and val exactly: val(q = 2^k) = 2^k val(1) and val(1.5 * 2^k) = 2^k val(1.5) = 2^(k-1) val(3)
// (3 sf is exact), and val(0) = RN(0 * amax) / 6E (NaN when amax is not finite, as element by element).
constexpr int kValStride = 256;
__device__ __forceinline__ void fos_fill_vals(float* vt, float sf, const TensorScale& t) {
  const float w0 = __fmul_rn(0.0f, t.amax), w1 = __fmul_rn(sf, t.amax);
  const float w3 = __fmul_rn(__fmul_rn(sf, 3.0f), t.amax);
  const float v0 = __fmaf_rn(w0, t.zh, __fmul_rn(w0, t.zl));
  const float v1 = __fmaf_rn(w1, t.zh, __fmul_rn(w1, t.zl));
  const float v3 = __fmaf_rn(w3, t.zh, __fmul_rn(w3, t.zl));
  vt[0 * kValStride] = v0;
  vt[1 * kValStride] = __fmul_rn(v1, 0.5f);
  vt[2 * kValStride] = v1;
  vt[3 * kValStride] = __fmul_rn(v3, 0.5f);
  vt[4 * kValStride] = __fmul_rn(v1, 2.0f);
  vt[5 * kValStride] = v3;
  vt[6 * kValStride] = __fmul_rn(v1, 4.0f);
  vt[7 * kValStride] = __fmul_rn(v3, 2.0f);
}
__device__ __forceinline__ float fos_val(const float* vt, uint32_t magic_sum_bits) {
  return *reinterpret_cast<const float*>(reinterpret_cast<const char*>(vt) + (magic_sum_bits << 10));
}

// Codes of both candidates for 16 elements plus their summed errors (element order). The error runs
// on |x|: RN is sign-symmetric, so RN(|x| * enc) = |RN(x * enc)|, and with q carrying x's sign,
// |RN(q*sf - x*S)| = |RN(|q|*sf - |x|*S)| (likewise for the strict path and for d*d): the errors are
// bitwise the contract's. Codes come from the magic sums, signs from x (e2m1_pack8).
// kShort: the block passed fos_short_ok (no clamps, two binades for map-to-4, no per-element range
// test in the strict division); otherwise every value is clamped to 6 and rounded over three binades.
// kVals (strict short path only): vt holds 16 * kValStride floats of shared scratch for this thread, the
// value tables of both candidates; otherwise the values are computed per element and vt is unused.
template <int kFos, bool kShort, bool kVals = false, int kPack = 0>
__device__ __forceinline__ void fos_encode16(const float (&x)[16], const FosCandidates& c,
                                             const TensorScale& t, uint2& q4, uint2& q6, float& err4,
                                             float& err6, float* vt) {
  const float sf4 = c.sf4f, sf6 = c.sf6f;
  uint32_t s4[16], s6[16];
  float e4 = 0.0f, e6 = 0.0f;
  static_assert(!kVals || (kShort && !fos_fast(kFos)), "value tables serve the strict short path");
  float* vt4 = vt;
  float* vt6 = vt + 8 * kValStride;
  if (kVals) {
    fos_fill_vals(vt4, sf4, t);
    fos_fill_vals(vt6, sf6, t);
  }
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const float ax = fabsf(x[j]);
    float a4 = __fmul_rn(ax, c.enc4), a6 = __fmul_rn(ax, c.enc6);
    float m4, m6;
    if (kShort) {
      m4 = e2m1_magic2(a4);
      m6 = e2m1_magic3_exp(a6);
    } else {
      a4 = fminf(a4, 6.0f);  // NaN -> 6 (index 7)
      a6 = fminf(a6, 6.0f);
      m4 = e2m1_magic3(a4);
      m6 = e2m1_magic3(a6);
    }
    const float r4 = __fadd_rn(a4, m4), r6 = __fadd_rn(a6, m6);
    s4[j] = __float_as_uint(r4);
    s6[j] = __float_as_uint(r6);
    const float orig = fos_fast(kFos) ? __fmul_rn(ax, t.s_enc) : 0.0f;
    float v4, v6;
    if (kVals) {
      const float d4 = __fsub_rn(fos_val(vt4, s4[j]), ax), d6 = __fsub_rn(fos_val(vt6, s6[j]), ax);
      v4 = fos_mse(kFos) ? __fmul_rn(d4, d4) : fabsf(d4);
      v6 = fos_mse(kFos) ? __fmul_rn(d6, d6) : fabsf(d6);
    } else {
      v4 = fos_elem_err<kFos, kShort>(__fsub_rn(r4, m4), sf4, ax, orig, t);
      v6 = fos_elem_err<kFos, kShort>(__fsub_rn(r6, m6), sf6, ax, orig, t);
    }
    // err = e_0, then RN(err + e_i): the two candidates' chains interleave.
    e4 = j == 0 ? v4 : __fadd_rn(e4, v4);
    e6 = j == 0 ? v6 : __fadd_rn(e6, v6);
  }
  q4 = make_uint2(pack8<kPack>(s4, x), pack8<kPack>(s4 + 8, x + 8));
  q6 = make_uint2(pack8<kPack>(s6, x), pack8<kPack>(s6 + 8, x + 8));
  err4 = e4;
  err6 = e6;
}

// Both candidates of a block with the path chosen per warp (fos_short_ok / fos_take_short).
template <int kFos, int kPack = 0>
__device__ __forceinline__ void fos_encode16_any(const float (&x)[16], float bamax, const FosCandidates& c,
                                                 const TensorScale& t, uint2& q4, uint2& q6, float& err4,
                                                 float& err6, float* vt) {
  if (fos_take_short(fos_short_ok<kFos>(bamax, c, t))) {
    if (!fos_fast(kFos) && vt != nullptr) {
      fos_encode16<kFos, true, !fos_fast(kFos), kPack>(x, c, t, q4, q6, err4, err6, vt);
    } else {
      fos_encode16<kFos, true, false, kPack>(x, c, t, q4, q6, err4, err6, nullptr);
    }
  } else {
    fos_encode16<kFos, false, false, kPack>(x, c, t, q4, q6, err4, err6, nullptr);
  }
}

// Map-to-4 only when strictly better (ties and NaN keep map-to-6).
__device__ __forceinline__ bool fos_pick4(float err4, float err6) { return err4 < err6; }

// The code packing (pack8) of the rowwise kernel per mode (nvfp4_quantize.cu, RowwiseCfg): also the
// default of quantize_block_1d, so the host harness (tests/nvfp4_host) runs the rowwise kernel's packing.
template <int kFos>
struct RowPack {
  static constexpr int value = 0;
};

// v6 plain: IMAD packing (with RowwiseCfg<0>'s prefetch).
template <>
struct RowPack<0> {
  static constexpr int value = 2;
};

// v6 4over6 strict: IMAD packing (with RowwiseCfg<1/3>'s one block per iteration).
template <>
struct RowPack<1> {
  static constexpr int value = 2;
};
template <>
struct RowPack<3> {
  static constexpr int value = 2;
};

// One 1x16 block of 16 FP32 values -> 8 packed bytes + 1 scale code (1-D; any mode).
// tab: the 4over6 scale table of t (fill_enc_table) or nullptr; vt: the strict value scratch of
// fos_encode16 or nullptr. kPack: pack8 (the same bytes either way).
template <int kFos, int kPack = RowPack<kFos>::value, bool kExpMagic = false>
__device__ __forceinline__ void quantize_block_1d(const float (&x)[16], const TensorScale& t, bool sr,
                                                  uint64_t b, uint64_t seed, uint64_t offset, uint2& q,
                                                  uint32_t& sf, const float2* tab, float* vt) {
  const float bamax = block_absmax16(x);
  if (kFos == 0) {
    sf = plain_scale_code(bamax, t);
    const float enc = block_enc(nvfp4_e4m3_decode(sf), t.s_dec);
    if (sr) {
      q = encode16_sr(x, enc, sr_block_bits(b, seed, offset));
    } else {
      q = encode16_rn<kPack, kExpMagic>(x, enc);
    }
  } else {
    const FosCandidates c = fos_candidates(bamax, t, tab);
    uint2 q4, q6;
    float e4, e6;
    fos_encode16_any<kFos, kPack>(x, bamax, c, t, q4, q6, e4, e6, vt);
    const bool use4 = fos_pick4(e4, e6);
    q = use4 ? q4 : q6;
    sf = use4 ? c.sf4 : c.sf6;
  }
}

// 2-D 4over6: combine the 16 per-row sums of a tile in the contract's fixed tree order.
__device__ __forceinline__ float tree16(const float* r, int stride) {
#define R(i) r[(i) * stride]
  const float a = __fadd_rn(__fadd_rn(R(0), R(8)), __fadd_rn(R(4), R(12)));
  const float b = __fadd_rn(__fadd_rn(R(2), R(10)), __fadd_rn(R(6), R(14)));
  const float c = __fadd_rn(__fadd_rn(R(1), R(9)), __fadd_rn(R(5), R(13)));
  const float d = __fadd_rn(__fadd_rn(R(3), R(11)), __fadd_rn(R(7), R(15)));
#undef R
  return __fadd_rn(__fadd_rn(a, b), __fadd_rn(c, d));
}

// ---- Random Hadamard transform of one 16-element group ----------------------------------------
// Sign vector s of NUMERICS.md as a bit mask (bit i set = negate element i).
constexpr uint32_t kRhtSignMask = (1u << 3) | (1u << 5) | (1u << 6) | (1u << 7) | (1u << 8) |
                                  (1u << 9) | (1u << 10) | (1u << 12) | (1u << 14) | (1u << 15);

// v = H16 diag(s) v in FP32, the fixed butterfly order of the reference (not yet scaled or rounded).
__device__ __forceinline__ void rht16_butterfly(float (&v)[16]) {
#pragma unroll
  for (int i = 0; i < 16; ++i)
    if (kRhtSignMask & (1u << i)) v[i] = -v[i];
#pragma unroll
  for (int h = 1; h < 16; h <<= 1) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      if ((i & h) == 0) {
        const float a = v[i], b = v[i + h];
        v[i] = __fadd_rn(a, b);
        v[i + h] = __fsub_rn(a, b);
      }
    }
  }
}

// y = (H16 diag(s) x) * 0.25 with the fixed butterfly order of the reference, each output rounded to
// BF16 and returned as FP32.
__device__ __forceinline__ void rht16_bf16(float (&v)[16]) {
  rht16_butterfly(v);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float y = __bfloat162float(__float2bfloat16_rn(__fmul_rn(v[i], 0.25f)));
    v[i] = (y != y) ? __uint_as_float(0x7FC00000u) : y;  // the contract makes RHT NaNs positive
  }
}

// ---- loads ----------------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }

// 16 contiguous elements from a 16-byte aligned address, as FP32.
template <typename T>
__device__ __forceinline__ void load16(const T* p, float (&x)[16]) {
  constexpr int kPerVec = 16 / sizeof(T);
#pragma unroll
  for (int v = 0; v < 16 / kPerVec; ++v) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p) + v);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int k = 0; k < kPerVec; ++k) x[v * kPerVec + k] = to_f32<T>(e[k]);
  }
}

// BF16 widening straight from the 32-bit words, one integer op per element (the generic conversion of
// the high half costs a byte permute and a multiply): low half << 16, high half masked in place.
template <>
__device__ __forceinline__ void load16<__nv_bfloat16>(const __nv_bfloat16* p, float (&x)[16]) {
#pragma unroll
  for (int v = 0; v < 2; ++v) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p) + v);
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      x[v * 8 + 2 * k] = __uint_as_float(w[k] << 16);
      x[v * 8 + 2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
    }
  }
}

// ---- the emulated GEMM's BF16 "unit" operand: E2M1 code x E4M3 block scale, no global factor ----
// The product has at most 6 significant bits and lies in [2^-10, 2688], so the FP32 product is exact
// and its top 16 bits are its BF16 value. A NaN scale code (0x7F/0xFF) gives torch's canonical BF16 NaN,
// as gemm.decode_nvfp4_unit's BF16 multiply does. The decode kernel and the quantize kernels (which
// write the operand next to the packed copy) share this code.
constexpr uint32_t kUnitBf16NaN = 0x7FC0u;

// Nibble k (0..7) of `codes` times sf as FP32 bits, in six instructions (no int-to-float conversion, no selects):
// the nibble's three magnitude bits placed at FP32 bits 22-24 are mag * 2^-126 exactly (a subnormal for exponent 0:
// 0.5 -> 2^-127), times 2^126 is mag, times sf the exact unit; the code's sign bit is XORed in, as IEEE gives
// (-mag) * sf the XOR of the signs (sf may be negative or zero: every E4M3 code is decoded). The same bits as
// e2m1_decode(nibble) * sf for every (code, scale code) pair (the arithmetic: tests/test_nvfp4_unit_arith.py; the
// kernels' bytes: the GPU tests). With it the decode kernel took 66.5 instead of 95 us per Linear 4096^3 step on an
// H200, at the floor of its loads and stores (benchmarks/RESULTS.md, session 34).
__device__ __forceinline__ uint32_t unit_f32_bits(uint32_t codes, int k, float sf) {
  const uint32_t mag = (k <= 5 ? codes << (22 - 4 * k) : codes >> (4 * k - 22)) & (7u << 22);
  const uint32_t sign = (codes << (28 - 4 * k)) & 0x80000000u;
  return __float_as_uint(__fmul_rn(__fmul_rn(__uint_as_float(mag), 0x1p126f), sf)) ^ sign;
}

// 8 BF16 unit values (codes: 4 bytes of a packed block, low nibble first) as four words, element pairs low first.
__device__ __forceinline__ void unit8_words(uint32_t codes, float sf, bool sf_nan, uint32_t (&w)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = unit_f32_bits(codes, 2 * i, sf), hi = unit_f32_bits(codes, 2 * i + 1, sf);
    w[i] = sf_nan ? (kUnitBf16NaN | (kUnitBf16NaN << 16)) : __byte_perm(lo, hi, 0x7632);  // both high halves
  }
}

// The same to out[0..7] (16 bytes, 16-byte aligned): one 16-byte store.
__device__ __forceinline__ void store_unit8(uint32_t codes, float sf, bool sf_nan, uint16_t* out) {
  uint32_t w[4];
  unit8_words(codes, sf, sf_nan, w);
  *reinterpret_cast<uint4*>(out) = make_uint4(w[0], w[1], w[2], w[3]);
}

// Half a block (codes: 4 bytes; sf_code: the block's E4M3 scale code) to out[0..7] with one st.global.v4: the
// decode kernel's store, whose lanes each write half a block so that a warp's store covers 512 contiguous bytes
// (inline PTX: NVVM splits a conditional vector store into four 4-byte stores).
__device__ __forceinline__ void store_unit8_v4(uint32_t codes, uint32_t sf_code, uint16_t* out) {
  uint32_t w[4];
  unit8_words(codes, nvfp4_e4m3_decode(sf_code), (sf_code & 0x7Fu) == 0x7Fu, w);
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(out), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3])
               : "memory");
}

// The 16 BF16 unit values of one packed block (q: 8 bytes, low nibble first) to out[0..15]
// (32 bytes, 16-byte aligned).
__device__ __forceinline__ void store_unit16(const uint2& q, uint32_t sf_code, uint16_t* out) {
  const float sf = nvfp4_e4m3_decode(sf_code);
  const bool sf_nan = (sf_code & 0x7Fu) == 0x7Fu;
  store_unit8(q.x, sf, sf_nan, out);
  store_unit8(q.y, sf, sf_nan, out + 8);
}

}  // namespace nvfp4
}  // namespace fp_recipes
