// NVFP4 rowwise quantize: the rowwise kernel with variant switches, for the one-GPU-call variant
// benchmark (benchmarks/nvfp4_variants/README.md, scripts/gpu_nvfp4_variants.sh). The per-block math
// is the shipped fp_recipes/csrc/nvfp4_device.cuh; this file holds only the loop shapes and the round-2
// per-block changes that were measured and not ported (NOTES_nvfp4.md).
//
// Switches of rowwise_v<kFos, kMinB, kU, kPf, kPack>:
//   kMinB  __launch_bounds__(256, kMinB) (0 = __launch_bounds__(256) only, as the real kernel)
//   kU     16-element blocks in flight per thread per loop iteration
//   kPf    1: software prefetch -- the raw BF16 words of the next iteration are loaded before the
//          current iteration's blocks are quantized (register double buffering)
//   kPack  pack8's switch: 0 byte permutes (ALU pipe), 2 integer multiply-adds (FMA pipe)
#pragma once

#include <cuda_bf16.h>

#include <functional>
#include <string>
#include <vector>

#include "nvfp4_device.cuh"

namespace fp_recipes {
namespace nvfp4 {
namespace vv {

constexpr int kThreads = 256;

struct VParams {
  const void* x;
  int64_t M, N;
  uint8_t* data;
  uint8_t* scale;
  const float* amax;
  int row_scaled;
  float e4m3_max;
  int sr;
  uint64_t seed, offset;
};

// Round 1's packing (kPack 2: IMAD Horner with constant-bank multipliers), the scale / encode paths and
// the per-block 1-D quantization are the shipped ones (nvfp4_device.cuh: pack8, fos_encode16_any,
// quantize_block_1d): this file only adds what the variants change.

__device__ __forceinline__ void load_raw(const __nv_bfloat16* p, uint4 (&r)[2]) {
  r[0] = __ldg(reinterpret_cast<const uint4*>(p));
  r[1] = __ldg(reinterpret_cast<const uint4*>(p) + 1);
}

// load16<__nv_bfloat16> of nvfp4_device.cuh, from words already in registers.
__device__ __forceinline__ void widen(const uint4 (&r)[2], float (&x)[16]) {
#pragma unroll
  for (int v = 0; v < 2; ++v) {
    const uint32_t w[4] = {r[v].x, r[v].y, r[v].z, r[v].w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      x[v * 8 + 2 * k] = __uint_as_float(w[k] << 16);
      x[v * 8 + 2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
    }
  }
}

template <int kFos, int kPack>
__device__ __forceinline__ void one_block(const VParams& p, const float (&x)[16], int64_t g, int64_t blocks_per_row,
                                          const TensorScale& t_all, const float2* tab, float* vt) {
  const TensorScale t =
      p.row_scaled ? make_tensor_scale(__ldg(p.amax + g / blocks_per_row), p.e4m3_max) : t_all;
  uint2 q;
  uint32_t sf;
  quantize_block_1d<kFos, kPack>(x, t, p.sr, static_cast<uint64_t>(g), p.seed, p.offset, q, sf, tab, vt);
  reinterpret_cast<uint2*>(p.data)[g] = q;
  p.scale[g] = static_cast<uint8_t>(sf);
}

// BF16 rowwise kernel (nvfp4_quantize.cu's rowwise_kernel<__nv_bfloat16, kFos>) with the switches.
// kHoist (4over6, kU > 1, no prefetch): the amax and candidate scales (fos_candidates: the shared table
// loads) of all kU blocks first, then the per-warp votes and encodes, so the scale chain of block u+1
// overlaps the encode of block u instead of following it.
template <int kFos, int kPack>
__device__ __forceinline__ void fos_block_hoisted(const VParams& p, const float (&x)[16], int64_t g, float bamax,
                                                  const FosCandidates& c, const TensorScale& t, float* vt) {
  uint2 q4, q6;
  float e4, e6;
  fos_encode16_any<kFos, kPack>(x, bamax, c, t, q4, q6, e4, e6, vt);
  const bool use4 = fos_pick4(e4, e6);
  reinterpret_cast<uint2*>(p.data)[g] = use4 ? q4 : q6;
  p.scale[g] = static_cast<uint8_t>(use4 ? c.sf4 : c.sf6);
}

template <int kFos, int kMinB, int kU, int kPf, int kPack, int kHoist = 0>
__global__ void __launch_bounds__(kThreads, kMinB) rowwise_v(VParams p) {
  static_assert(!kHoist || (kFos != 0 && !kPf), "kHoist: 4over6 without prefetch");
  const int64_t blocks_per_row = p.N / 16;
  const int64_t total = p.M * blocks_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const __nv_bfloat16* src = static_cast<const __nv_bfloat16*>(p.x);
  TensorScale t_all;
  if (!p.row_scaled) t_all = make_tensor_scale(__ldg(p.amax), p.e4m3_max);
  __shared__ float2 enc_tab[kFos != 0 ? 256 : 1];
  const float2* tab = nullptr;
  if (kFos != 0 && !p.row_scaled) {
    fill_enc_table(enc_tab, t_all.s_dec, threadIdx.x, kThreads);
    __syncthreads();
    tab = enc_tab;
  }
  static_assert(kThreads == kValStride, "fos_val addresses entries kValStride floats apart");
  __shared__ float val_tab[fos_fast(kFos) || kFos == 0 ? 1 : kU * 16 * kThreads];
  float* vt[kU];
#pragma unroll
  for (int u = 0; u < kU; ++u) vt[u] = (!fos_fast(kFos) && kFos != 0) ? val_tab + u * 16 * kThreads + threadIdx.x : nullptr;

  int64_t g0 = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (!kPf) {
    for (; g0 < total; g0 += kU * stride) {
      float x[kU][16];
      int64_t g[kU];
      bool has[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        g[u] = g0 + u * stride;
        has[u] = u == 0 || g[u] < total;
      }
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (has[u]) load16(src + g[u] * 16, x[u]);
      if (kHoist) {
        TensorScale t[kU];
        float bam[kU];
        FosCandidates c[kU];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          if (!has[u]) break;
          t[u] = p.row_scaled ? make_tensor_scale(__ldg(p.amax + g[u] / blocks_per_row), p.e4m3_max) : t_all;
          bam[u] = block_absmax16(x[u]);
          c[u] = fos_candidates(bam[u], t[u], tab);
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          if (!has[u]) break;
          fos_block_hoisted<kFos, kPack>(p, x[u], g[u], bam[u], c[u], t[u], vt[u]);
        }
      } else {
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          if (!has[u]) break;
          one_block<kFos, kPack>(p, x[u], g[u], blocks_per_row, t_all, tab, vt[u]);
        }
      }
    }
  } else {
    uint4 raw[kU][2];
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (g0 + u * stride < total) load_raw(src + (g0 + u * stride) * 16, raw[u]);
    for (; g0 < total; g0 += kU * stride) {
      uint4 cur[kU][2];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        cur[u][0] = raw[u][0];
        cur[u][1] = raw[u][1];
      }
      const int64_t gn = g0 + kU * stride;
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (gn + u * stride < total) load_raw(src + (gn + u * stride) * 16, raw[u]);
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int64_t g = g0 + u * stride;
        if (u > 0 && g >= total) break;
        float x[16];
        widen(cur[u], x);
        one_block<kFos, kPack>(p, x, g, blocks_per_row, t_all, tab, vt[u]);
      }
    }
  }
}

// ---- round 2 (fast 4over6, one block per thread per iteration, BF16) -----------------------------
// rowwise_r2<kFos, kMinB, kF>: the v6 fast kernel (u1) with per-block overhead cuts, each a flag of kF:
//   kR2Pt    the loop is instantiated twice, per-tensor (the {sf, enc} table always present) and
//            row-scaled, and chosen once per thread: no per-block row_scaled / table-null tests
//   kR2Hmax  block amax on the raw BF16 words: 7 abs+max.NaN.bf16x2 + 1 swap + 1 max + 1 widen instead
//            of 15 max.NaN.f32 (|x| of a BF16 is a BF16, so the max is the same value; a NaN stays NaN,
//            and nothing downstream looks at a NaN's payload)
//   kR2Sgn   the sign bits of the codes straight from the raw BF16 words: 4 byte permutes + 2 logic ops
//            per 8 elements instead of 6 + 2
//   kR2Cvt   both candidate scale codes with one cvt.rn.satfinite.e4m3x2.f32 (the same conversion
//            nvfp4_e4m3_encode_satfinite emits, one code per instruction) and the div6_rn range test as
//            one unsigned compare on the bits (0 takes the true division, which is exact for it too)
//   kPack    (bits 8..) 0 byte permutes, 2 IMAD packing
constexpr int kR2Pt = 1, kR2Hmax = 2, kR2Sgn = 4, kR2Cvt = 8;

__device__ __forceinline__ uint32_t bf16x2_absmax_nan(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("{\n\t.reg .b32 aa, bb;\n\tabs.bf16x2 aa, %1;\n\tabs.bf16x2 bb, %2;\n\tmax.NaN.bf16x2 %0, aa, bb;\n\t}"
      : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ uint32_t bf16x2_max_nan(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ float block_absmax16_raw(const uint4 (&r)[2]) {
  const uint32_t m0 = bf16x2_absmax_nan(r[0].x, r[0].y), m1 = bf16x2_absmax_nan(r[0].z, r[0].w);
  const uint32_t m2 = bf16x2_absmax_nan(r[1].x, r[1].y), m3 = bf16x2_absmax_nan(r[1].z, r[1].w);
  const uint32_t m = bf16x2_max_nan(bf16x2_max_nan(m0, m1), bf16x2_max_nan(m2, m3));
  const uint32_t mm = bf16x2_max_nan(m, prmt(m, 0u, 0x1032u));  // both halves hold the max
  return __uint_as_float(mm & 0xFFFF0000u);
}

// Sign bits at 4j + 3 of elements 0..7 from the raw words w0..w3 (element 2k: bit 15 of w_k, 2k+1: bit 31).
__device__ __forceinline__ uint32_t signs8_raw(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
  const uint32_t a = prmt(w0, w1, 0xFDB9u), b = prmt(w2, w3, 0xFDB9u);  // sign-replicated bytes s0..s3, s4..s7
  return (prmt(a, b, 0x6420u) & 0x08080808u) | (prmt(a, b, 0x7531u) & 0x80808080u);
}

template <int kPack>
__device__ __forceinline__ uint32_t pack8_sg(const uint32_t* s, uint32_t sg) {
  if (kPack == 0) {
    const uint32_t even = prmt(prmt(s[0], s[2], 0x0040u), prmt(s[4], s[6], 0x0040u), 0x5410u);
    const uint32_t odd = prmt(prmt(s[1], s[3], 0x0040u), prmt(s[5], s[7], 0x0040u), 0x5410u);
    return even | (odd << 4) | sg;
  }
  const uint32_t k16 = pack_k16();
  const uint32_t lo = ((s[2] * k16 + s[1]) * k16 + s[0]) & 0xFFFu;
  uint32_t hi = s[7];
#pragma unroll
  for (int j = 6; j >= 3; --j) hi = hi * k16 + s[j];
  return hi * pack_k4096() + (lo | sg);
}

__device__ __forceinline__ float div6_rn_r2(float b) {
  // b >= +0 or NaN (a block amax): [2^-80, FLT_MAX] as one unsigned compare; 0, tiny, Inf, NaN divide.
  if (__float_as_uint(b) - 0x17800000u <= 0x7F7FFFFFu - 0x17800000u)
    return __fmaf_rn(b, __uint_as_float(0x3E2AAAABu), __fmul_rn(b, __uint_as_float(0xB1AAAAABu)));
  return __fdiv_rn(b, 6.0f);
}

template <bool kCvt>
__device__ __forceinline__ FosCandidates fos_candidates_r2(float bamax, const TensorScale& t, const float2* tab) {
  if (!kCvt) return fos_candidates(bamax, t, tab);
  FosCandidates c;
  const float base = __fmul_rn(div6_rn_r2(bamax), t.s_enc);
  uint16_t pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;"
      : "=h"(pair) : "f"(fmin_bound(__fmul_rn(base, 1.5f), 448.0f)), "f"(fmin_bound(base, 448.0f)));
  c.sf6 = pair & 0xFFu;
  c.sf4 = static_cast<uint32_t>(pair) >> 8;
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

// fos_encode16 (fast modes, no value tables) with precomputed sign words sg[2] and the packing switch.
template <int kFos, bool kShort, int kPack>
__device__ __forceinline__ void fos_encode16_r2(const float (&x)[16], const uint32_t (&sg)[2], const FosCandidates& c,
                                                const TensorScale& t, uint2& q4, uint2& q6, float& err4, float& err6) {
  const float sf4 = c.sf4f, sf6 = c.sf6f;
  uint32_t s4[16], s6[16];
  float e4 = 0.0f, e6 = 0.0f;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const float ax = fabsf(x[j]);
    float a4 = __fmul_rn(ax, c.enc4), a6 = __fmul_rn(ax, c.enc6);
    float m4, m6;
    if (kShort) {
      m4 = e2m1_magic2(a4);
      m6 = e2m1_magic3_exp(a6);
    } else {
      a4 = fminf(a4, 6.0f);
      a6 = fminf(a6, 6.0f);
      m4 = e2m1_magic3(a4);
      m6 = e2m1_magic3(a6);
    }
    const float r4 = __fadd_rn(a4, m4), r6 = __fadd_rn(a6, m6);
    s4[j] = __float_as_uint(r4);
    s6[j] = __float_as_uint(r6);
    const float orig = __fmul_rn(ax, t.s_enc);
    const float v4 = fos_elem_err<kFos, kShort>(__fsub_rn(r4, m4), sf4, ax, orig, t);
    const float v6 = fos_elem_err<kFos, kShort>(__fsub_rn(r6, m6), sf6, ax, orig, t);
    e4 = j == 0 ? v4 : __fadd_rn(e4, v4);
    e6 = j == 0 ? v6 : __fadd_rn(e6, v6);
  }
  q4 = make_uint2(pack8_sg<kPack>(s4, sg[0]), pack8_sg<kPack>(s4 + 8, sg[1]));
  q6 = make_uint2(pack8_sg<kPack>(s6, sg[0]), pack8_sg<kPack>(s6 + 8, sg[1]));
  err4 = e4;
  err6 = e6;
}

// One block; kRow: 0 per-tensor (tab valid), 1 row-scaled, 2 decided per block (p.row_scaled).
template <int kFos, int kF, int kRow>
__device__ __forceinline__ void r2_block(const VParams& p, const uint4 (&raw)[2], int64_t g, int64_t blocks_per_row,
                                         const TensorScale& t_all, const float2* tab) {
  constexpr int kPack = kF >> 8;
  float x[16];
  widen(raw, x);
  const bool rs = kRow == 1 || (kRow == 2 && p.row_scaled);
  const TensorScale t = rs ? make_tensor_scale(__ldg(p.amax + g / blocks_per_row), p.e4m3_max) : t_all;
  const float2* tb = kRow == 0 ? tab : (kRow == 1 ? nullptr : tab);
  const float bamax = (kF & kR2Hmax) ? block_absmax16_raw(raw) : block_absmax16(x);
  const FosCandidates c = fos_candidates_r2<(kF & kR2Cvt) != 0>(bamax, t, tb);
  uint32_t sg[2];
  if (kF & kR2Sgn) {
    sg[0] = signs8_raw(raw[0].x, raw[0].y, raw[0].z, raw[0].w);
    sg[1] = signs8_raw(raw[1].x, raw[1].y, raw[1].z, raw[1].w);
  } else {
    sg[0] = e2m1_signs8(x);
    sg[1] = e2m1_signs8(x + 8);
  }
  uint2 q4, q6;
  float e4, e6;
  if (fos_take_short(fos_short_ok<kFos>(bamax, c, t))) {
    fos_encode16_r2<kFos, true, kPack>(x, sg, c, t, q4, q6, e4, e6);
  } else {
    fos_encode16_r2<kFos, false, kPack>(x, sg, c, t, q4, q6, e4, e6);
  }
  const bool use4 = fos_pick4(e4, e6);
  reinterpret_cast<uint2*>(p.data)[g] = use4 ? q4 : q6;
  p.scale[g] = static_cast<uint8_t>(use4 ? c.sf4 : c.sf6);
}

template <int kFos, int kF, int kRow>
__device__ __forceinline__ void r2_loop(const VParams& p, int64_t g0, int64_t total, int64_t stride,
                                        int64_t blocks_per_row, const TensorScale& t_all, const float2* tab) {
  const __nv_bfloat16* src = static_cast<const __nv_bfloat16*>(p.x);
  for (; g0 < total; g0 += stride) {
    uint4 raw[2];
    load_raw(src + g0 * 16, raw);
    r2_block<kFos, kF, kRow>(p, raw, g0, blocks_per_row, t_all, tab);
  }
}

template <int kFos, int kMinB, int kF>
__global__ void __launch_bounds__(kThreads, kMinB) rowwise_r2(VParams p) {
  static_assert(fos_fast(kFos), "round 2: fast 4over6");
  const int64_t blocks_per_row = p.N / 16;
  const int64_t total = p.M * blocks_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  TensorScale t_all;
  if (!p.row_scaled) t_all = make_tensor_scale(__ldg(p.amax), p.e4m3_max);
  __shared__ float2 enc_tab[256];
  const float2* tab = nullptr;
  if (!p.row_scaled) {
    fill_enc_table(enc_tab, t_all.s_dec, threadIdx.x, kThreads);
    __syncthreads();
    tab = enc_tab;
  }
  const int64_t g0 = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (kF & kR2Pt) {
    if (p.row_scaled) {
      r2_loop<kFos, kF, 1>(p, g0, total, stride, blocks_per_row, t_all, nullptr);
    } else {
      r2_loop<kFos, kF, 0>(p, g0, total, stride, blocks_per_row, t_all, enc_tab);
    }
  } else {
    r2_loop<kFos, kF, 2>(p, g0, total, stride, blocks_per_row, t_all, tab);
  }
}

// ---- registry -----------------------------------------------------------------------------------
// One entry per (variant, mode): launch(p, grid, stream) runs it; blocks_for(total, sms, cap) sizes
// the grid like launch_t (min(ceil(total / (kU * 256)), sms * cap); cap 0 = no cap).
struct Entry {
  std::string variant;
  int fos;
  int per_thread;  // kU
  const void* func;
  std::function<void(const VParams&, unsigned, cudaStream_t)> launch;
};

void register_base(std::vector<Entry>& out);
void register_part(std::vector<Entry>& out);  // one definition per part_*.cu object

}  // namespace vv
}  // namespace nvfp4
}  // namespace fp_recipes

#define NVFP4_VV_ADDH(out, name, FOS, MINB, U, PF, PACK, HOIST)                                       \
  out.push_back(::fp_recipes::nvfp4::vv::Entry{                                                           \
      name, FOS, U,                                                                                       \
      reinterpret_cast<const void*>(&::fp_recipes::nvfp4::vv::rowwise_v<FOS, MINB, U, PF, PACK, HOIST>),  \
      [](const ::fp_recipes::nvfp4::vv::VParams& p, unsigned grid, cudaStream_t s) {                      \
        ::fp_recipes::nvfp4::vv::rowwise_v<FOS, MINB, U, PF, PACK, HOIST><<<grid, 256, 0, s>>>(p);       \
      }})
#define NVFP4_VV_ADD(out, name, FOS, MINB, U, PF, PACK) NVFP4_VV_ADDH(out, name, FOS, MINB, U, PF, PACK, 0)
#define NVFP4_VV_ADDR2(out, name, FOS, MINB, F)                                                          \
  out.push_back(::fp_recipes::nvfp4::vv::Entry{                                                           \
      name, FOS, 1, reinterpret_cast<const void*>(&::fp_recipes::nvfp4::vv::rowwise_r2<FOS, MINB, F>),   \
      [](const ::fp_recipes::nvfp4::vv::VParams& p, unsigned grid, cudaStream_t s) {                      \
        ::fp_recipes::nvfp4::vv::rowwise_r2<FOS, MINB, F><<<grid, 256, 0, s>>>(p);                        \
      }})
