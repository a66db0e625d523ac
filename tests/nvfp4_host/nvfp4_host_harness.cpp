// Host (g++) build of the NVFP4 device math -- formats.cuh's E2M1 section and nvfp4_device.cuh, the
// code every NVFP4 kernel runs per block -- so that CI machines without a GPU check it against the
// torch reference (tests/test_cuda_nvfp4_hostmath.py). x86-64 SSE arithmetic is IEEE RN like the GPU's
// __f*_rn intrinsics; the shims below give those intrinsics their host meaning. The loops emulate the
// kernels' per-block work (1-D rows, 2-D tiles with the tree-ordered 4over6 error, RHT, SR).
#include <cfenv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
using std::max;
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
static inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
static inline uint32_t __float_as_uint(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t __umulhi(uint32_t a, uint32_t b) { return (uint32_t)(((uint64_t)a * b) >> 32); }
static inline float __frcp_rn(float a) { volatile float r = 1.0f / a; return r; }

static inline uint32_t min(uint32_t a, unsigned b) { return a < b ? a : b; }
static inline float __fmaf_rn(float a, float b, float c) { volatile float r = std::fma(a, b, c); return r; }
// The directed-rounding adds of encode16_sr_fma: the host FPU in that rounding mode for one add.
static inline float add_in_mode(float a, float b, int mode) {
  const int old = std::fegetround();
  std::fesetround(mode);
  volatile float va = a, vb = b;
  volatile float r = va + vb;
  std::fesetround(old);
  return r;
}
static inline float __fadd_rz(float a, float b) { return add_in_mode(a, b, FE_TOWARDZERO); }
static inline float __fadd_ru(float a, float b) { return add_in_mode(a, b, FE_UPWARD); }
// encode16_sr_ceil's FFMA.RU: the exact a * b + c rounded up once (fmaf in that rounding mode).
static inline float __fmaf_ru(float a, float b, float c) {
  const int old = std::fegetround();
  std::fesetround(FE_UPWARD);
  volatile float va = a, vb = b, vc = c;
  volatile float r = std::fma(va, vb, vc);
  std::fesetround(old);
  return r;
}
// PRMT's default mode: result byte i is byte (s >> 4i) & 7 of {y:x}, or that byte's sign replicated when bit 3
// of the selector nibble is set.
static inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t xy = (uint64_t)y << 32 | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t sel = (s >> (4 * i)) & 0xFu;
    uint32_t byte = (uint32_t)(xy >> (8 * (sel & 7u))) & 0xFFu;
    if (sel & 8u) byte = (byte & 0x80u) ? 0xFFu : 0u;
    r |= byte << (8 * i);
  }
  return r;
}
#undef __device__
#define __device__
#undef __forceinline__
#define __forceinline__ inline
template <typename T> static inline T __ldg(const T* p) { return *p; }
#define NVFP4_HOST_HARNESS 1
#include "nvfp4_device.cuh"
int fp_recipes::nvfp4::g_fos_force_general = 0;
using namespace fp_recipes::nvfp4;
using fp_recipes::e2m1_decode;
using fp_recipes::E2M1Rounded;
using fp_recipes::nvfp4_e4m3_decode;

template <int F>
static void rows_impl(const float* x, int64_t M, int64_t N, const float* amax, int row_scaled,
                      float E, int sr, uint64_t seed, uint64_t offset, uint8_t* data, uint8_t* scale) {
  const int64_t bpr = N / 16;
  // Like the rowwise kernel: one tensor scale -> the 4over6 code table; row-scaled -> computed per block.
  float2 tab[256];
  static float vt[16 * kValStride];  // the strict short path's value tables (one thread's column)
  if (!row_scaled) fill_enc_table(tab, make_tensor_scale(amax[0], E).s_dec, 0, 1);
  for (int64_t g = 0; g < M * bpr; ++g) {
    float v[16];
    for (int k = 0; k < 16; ++k) v[k] = x[g * 16 + k];
    const TensorScale t = make_tensor_scale(row_scaled ? amax[g / bpr] : amax[0], E);
    uint2 q; uint32_t sf;
    quantize_block_1d<F>(v, t, sr, (uint64_t)g, seed, offset, q, sf, row_scaled ? nullptr : tab, vt);
    memcpy(data + g * 8, &q, 8);
    scale[g] = (uint8_t)sf;
  }
}

extern "C" {
// 1-D rowwise over (M, N) FP32 (pass x^T for a columnwise copy; rht applies the transform first).
void h_rows(const float* x, int64_t M, int64_t N, const float* amax, int row_scaled, int fos, int mse,
            float E, int sr, uint64_t seed, uint64_t offset, uint8_t* data, uint8_t* scale) {
  const int mode = fos_mode(fos != 0, fos == 2, mse != 0);
  if (mode == 0) rows_impl<0>(x, M, N, amax, row_scaled, E, sr, seed, offset, data, scale);
  if (mode == 1) rows_impl<1>(x, M, N, amax, row_scaled, E, sr, seed, offset, data, scale);
  if (mode == 2) rows_impl<2>(x, M, N, amax, row_scaled, E, sr, seed, offset, data, scale);
  if (mode == 3) rows_impl<3>(x, M, N, amax, row_scaled, E, sr, seed, offset, data, scale);
  if (mode == 4) rows_impl<4>(x, M, N, amax, row_scaled, E, sr, seed, offset, data, scale);
}

// RHT of each 16-group along rows of (M, N) in place (result BF16-rounded FP32).
void h_rht(float* x, int64_t M, int64_t N) {
  for (int64_t g = 0; g < M * N / 16; ++g) {
    float v[16];
    for (int k = 0; k < 16; ++k) v[k] = x[g * 16 + k];
    rht16_bf16(v);
    for (int k = 0; k < 16; ++k) x[g * 16 + k] = v[k];
  }
}

// 2-D: tile scales (M/16, N/16) and both copies, as the tile kernel does it.
void h_2d(const float* x, int64_t M, int64_t N, float amax, int fos, int mse, float E, int sr, uint64_t seed,
          uint64_t offset, uint8_t* data, uint8_t* scale, uint8_t* data_t, uint8_t* scale_t) {
  const TensorScale t = make_tensor_scale(amax, E);
  for (int64_t ti = 0; ti < M / 16; ++ti)
    for (int64_t tj = 0; tj < N / 16; ++tj) {
      float v[16][16];
      uint32_t bits = 0;
      for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 16; ++c) {
          v[r][c] = x[(ti * 16 + r) * N + tj * 16 + c];
          bits = std::max(bits, abs_bits(v[r][c]));
        }
      const float tamax = __uint_as_float(bits);
      uint32_t sf;
      float enc;
      if (fos == 0) {
        sf = plain_scale_code(tamax, t);
        enc = block_enc(nvfp4_e4m3_decode(sf), t.s_dec);
      } else {
        const FosCandidates c = fos_candidates(tamax, t, nullptr);
        float e4[16], e6[16];
        for (int r = 0; r < 16; ++r) {
          uint2 q4, q6;
          switch (fos_mode(true, fos == 2, mse != 0)) {
            case 1: fos_encode16_any<1>(v[r], tamax, c, t, q4, q6, e4[r], e6[r], nullptr); break;
            case 2: fos_encode16_any<2>(v[r], tamax, c, t, q4, q6, e4[r], e6[r], nullptr); break;
            case 3: fos_encode16_any<3>(v[r], tamax, c, t, q4, q6, e4[r], e6[r], nullptr); break;
            case 4: fos_encode16_any<4>(v[r], tamax, c, t, q4, q6, e4[r], e6[r], nullptr); break;
          }
        }
        const bool use4 = fos_pick4(tree16(e4, 1), tree16(e6, 1));
        sf = use4 ? c.sf4 : c.sf6;
        enc = use4 ? c.enc4 : c.enc6;
      }
      for (int r = 0; r < 16; ++r) {
        const int64_t row = ti * 16 + r, b = row * (N / 16) + tj;
        uint2 q = sr ? encode16_sr(v[r], enc, sr_block_bits(b, seed, offset)) : encode16_rn(v[r], enc);
        memcpy(data + b * 8, &q, 8);
        scale[b] = (uint8_t)sf;
      }
      for (int c = 0; c < 16; ++c) {
        float col[16];
        for (int r = 0; r < 16; ++r) col[r] = v[r][c];
        const int64_t b = (tj * 16 + c) * (M / 16) + ti;
        uint2 q = sr ? encode16_sr(col, enc, sr_block_bits(b, seed, offset)) : encode16_rn(col, enc);
        memcpy(data_t + b * 8, &q, 8);
        scale_t[b] = (uint8_t)sf;
      }
    }
}

void h_dequant(const uint8_t* data, const uint8_t* scale, const float* amax, int row_scaled, int64_t M,
               int64_t N, float E, float* out) {
  for (int64_t g = 0; g < M * N / 16; ++g) {
    const float a = row_scaled ? amax[g / (N / 16)] : amax[0];
    const float factor = __fmul_rn(__fmul_rn(nvfp4_e4m3_decode(scale[g]), a), __fdiv_rn(1.0f, __fmul_rn(6.0f, E)));
    for (int j = 0; j < 16; ++j) {
      const uint32_t code = (data[g * 8 + j / 2] >> (4 * (j % 2))) & 0xF;
      out[g * 16 + j] = __fmul_rn(e2m1_decode(code), factor);
    }
  }
}

void h_e2m1(const float* y, int64_t n, uint8_t* idx, float* mag) {
  for (int64_t i = 0; i < n; ++i) {
    E2M1Rounded r = fp_recipes::e2m1_round_rn(y[i]);
    idx[i] = (uint8_t)r.idx;
    mag[i] = r.mag;
  }
}

void h_philox(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1, uint32_t* out) {
  uint4 r = philox4x32_10(make_uint4(c0, c1, c2, c3), k0, k1);
  out[0] = r.x; out[1] = r.y; out[2] = r.z; out[3] = r.w;
}
}
extern "C" void h_div6e(const float* w, int64_t n, float E, float* out) {
  const TensorScale t = make_tensor_scale(1.0f, E);
  for (int64_t i = 0; i < n; ++i) out[i] = div_6e(w[i], t);
}
extern "C" void h_sr(const float* y, const int64_t* bytes, int64_t n, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = (uint8_t)fp_recipes::e2m1_encode_sr(y[i], y[i], (uint32_t)bytes[i]);
}
// encode16_sr (the kernels' SR encode of a block: encode16_sr_fma unless built with NVFP4_SR_FMA_PIPE=0) of
// n blocks of 16 values x, multiplier enc[b], random words rnd[4b..4b+3]: 8 packed bytes per block.
extern "C" void h_encode16_sr(const float* x, const float* enc, const uint32_t* rnd, int64_t n, uint8_t* out) {
  for (int64_t b = 0; b < n; ++b) {
    float v[16];
    for (int k = 0; k < 16; ++k) v[k] = x[b * 16 + k];
    const uint2 q = encode16_sr(v, enc[b], make_uint4(rnd[4 * b], rnd[4 * b + 1], rnd[4 * b + 2], rnd[4 * b + 3]));
    memcpy(out + b * 8, &q, 8);
  }
}
extern "C" int h_sr_fma_pipe() { return NVFP4_SR_FMA_PIPE; }
extern "C" int h_sr_ceil() { return NVFP4_SR_CEIL; }

// 1: every 4over6 block takes the general path (fos_take_short answers false), so a test can check
// both paths of fos_encode16 on the same data; 0: each block's own fos_short_ok decides.
extern "C" void h_set_force_general(int v) { g_fos_force_general = v; }
extern "C" void h_div6(const float* w, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = div6_rn(w[i]);
}
// The short paths' clamp-free magic-add rounding of a >= 0: levels 2 (valid a <= 4.5), 3 (a < 7; 4 = the
// exponent form of the three binades).
extern "C" void h_e2m1_short(const float* a, int64_t n, int levels, uint8_t* idx, float* mag) {
  for (int64_t i = 0; i < n; ++i) {
    const float m = levels == 2 ? e2m1_magic2(a[i]) : (levels == 3 ? e2m1_magic3(a[i]) : e2m1_magic3_exp(a[i]));
    const float s = __fadd_rn(a[i], m);
    idx[i] = (uint8_t)(__float_as_uint(s) & 0xFFu);
    mag[i] = __fsub_rn(s, m);
  }
}
