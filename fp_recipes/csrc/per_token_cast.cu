// Per-token (and per-channel-block) casts to E5M6 (8 codes packed in 12 bytes) and FP8 E4M3, and the
// casts back. Contract (NUMERICS.md, ops/ref_per_token.py): per block of `block_size` channels of a
// token, a = max |x| in FP32 (seed 000: never a narrower accumulator); a_c = max(a, 1e-4);
// sf = RN(a_c / fmt_max); round_sf: sf = 2^e with e = ceil(log2 sf) from the FP32 bits and
// sf_inv = 2^-e, else sf_inv = RN(fmt_max / a_c); data = encode(RN(x * sf_inv)).
//
// One CTA per token: the row is staged in shared memory with cp.async (so no registers are held while
// loads are in flight and many rows stream per SM), then read twice from there: block amaxes, then the
// cast. Units of 8 elements where the shape allows (16-byte accesses), else of 1. Block amaxes: a
// shuffle reduction over the lanes that share a block, then an atomicMax on the block's slot in shared
// memory (dynamic shared memory sized by the row: no fixed arrays). E5M6 rows are packed in shared
// memory and written with 16-byte stores.
#include <algorithm>
#include <cfloat>
#include <string>
#include <type_traits>

#include "common.h"
#include "formats.cuh"
#include "fp8_kernels.h"

namespace fp_recipes {
namespace {

constexpr float kAmaxFloor = 1e-4f;

template <PerTokenFmt FMT>
struct PtTraits;
template <>
struct PtTraits<PerTokenFmt::kE5M6> {
  static constexpr float kMax = kE5M6Max;
};
template <>
struct PtTraits<PerTokenFmt::kE4M3> {
  static constexpr float kMax = kE4M3Max;
};

__device__ __forceinline__ float pt_to_f32(float v) { return v; }
__device__ __forceinline__ float pt_to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float pt_to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename OutT>
__device__ __forceinline__ OutT pt_from_f32(float v);
template <>
__device__ __forceinline__ float pt_from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half pt_from_f32<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 pt_from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// 2^e as an exact FP32 (subnormal and overflow ends included).
__device__ __forceinline__ float exp2_int(int e) {
  if (e >= -126 && e <= 127) return __uint_as_float(uint32_t(e + 127) << 23);
  return ldexpf(1.0f, e);
}

// The scale pair of one block from its amax key. ue8m0 byte: e + 127.
struct BlockScale {
  float sf;
  float sf_inv;
  int e;
};

template <PerTokenFmt FMT>
__device__ __forceinline__ BlockScale block_scale(uint32_t key, bool round_sf) {
  BlockScale s;
  if (key >= 0x7F800000u) {
    // Inf or NaN in the block: sf and sf_inv are NaN, every code NaN, the UE8M0 byte 0xFF.
    s.sf = s.sf_inv = __uint_as_float(0x7FC00000u);
    s.e = int(kUE8M0NaN) - 127;
    return s;
  }
  const float a = __uint_as_float(key);
  const float ac = (a < kAmaxFloor) ? kAmaxFloor : a;
  const float fmt_max = PtTraits<FMT>::kMax;
  s.sf = __fdiv_rn(ac, fmt_max);
  s.e = 0;
  if (round_sf) {
    s.e = int(((__float_as_uint(s.sf) - 1u) >> 23) + 1u) - 127;
    s.sf = exp2_int(s.e);
    s.sf_inv = exp2_int(-s.e);
  } else {
    s.sf_inv = __fdiv_rn(fmt_max, ac);
  }
  return s;
}

// cp.async: 16 bytes global -> shared without passing through registers (sm_80+).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Eight consecutive elements of the staged row (16-byte aligned in shared memory) as FP32.
template <typename T>
__device__ __forceinline__ void smem_unit8(const T* srow, int u, float* f) {
  if constexpr (sizeof(T) == 4) {
    const float4 a = reinterpret_cast<const float4*>(srow)[2 * u];
    const float4 b = reinterpret_cast<const float4*>(srow)[2 * u + 1];
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
  } else {
    const uint4 w = reinterpret_cast<const uint4*>(srow)[u];
    const T* e = reinterpret_cast<const T*>(&w);
#pragma unroll
    for (int j = 0; j < 8; ++j) f[j] = pt_to_f32(e[j]);
  }
}

constexpr int kMaxNT = 512;

__host__ __device__ inline int round16(int bytes) { return (bytes + 15) & ~15; }
__host__ __device__ inline int blk_words(int nblk) { return (nblk + 3) & ~3; }

// Dynamic shared memory: [the token's row, H*sizeof(T) bytes][nblk block slots][E5M6: packed row].
// One CTA per token: the row is copied to shared memory with cp.async (no registers held, so many
// CTAs and many bytes are in flight per SM), then read twice there: amax, then the cast.
template <typename T, PerTokenFmt FMT, int UNIT>
__global__ void __launch_bounds__(kMaxNT) per_token_cast_kernel(const T* __restrict__ x, int H, int bs, bool round_sf,
                                                                bool ue8m0, bool vec, uint8_t* __restrict__ data,
                                                                void* __restrict__ scales) {
  extern __shared__ uint4 smem_vec[];
  uint8_t* sbase = reinterpret_cast<uint8_t*>(smem_vec);
  const T* srow = reinterpret_cast<const T*>(sbase);
  const int row_in_bytes = H * int(sizeof(T));
  const int nblk = H / bs;
  uint32_t* blk = reinterpret_cast<uint32_t*>(sbase + round16(row_in_bytes));  // amax key, then sf_inv bits
  uint32_t* stage = blk + blk_words(nblk);
  const int NT = blockDim.x;
  const int tid = threadIdx.x;
  const int64_t row = blockIdx.x;
  const int units = H / UNIT;
  const unsigned upb = unsigned(bs / UNIT);  // units per block of channels
  const T* xr = x + row * H;

  if (vec) {
    for (int i = tid; i < row_in_bytes / 16; i += NT) {
      cp_async16(sbase + 16 * i, reinterpret_cast<const uint8_t*>(xr) + 16 * i);
    }
  } else {
    for (int i = tid; i < H; i += NT) reinterpret_cast<T*>(sbase)[i] = xr[i];
  }
  for (int b = tid; b < nblk; b += NT) blk[b] = 0u;
  cp_async_wait_all();
  __syncthreads();

  // Block amaxes: lanes sharing a block reduce by shuffles, one shared atomic per segment.
  const int seg = (upb % 32u == 0u) ? 32 : ((32u % upb == 0u) ? int(upb) : 1);
  const int lane = tid % 32;
  for (int u0 = 0; u0 < units; u0 += NT) {  // CTA-uniform trip count
    const int u = u0 + tid;
    uint32_t key = 0;
    if (u < units) {
      if constexpr (UNIT == 8) {
        float f[8];
        smem_unit8<T>(srow, u, f);
#pragma unroll
        for (int j = 0; j < 8; ++j) key = max(key, abs_key(f[j]));
      } else {
        key = abs_key(pt_to_f32(srow[u]));
      }
    }
    for (int off = 1; off < seg; off <<= 1) key = max(key, __shfl_xor_sync(0xFFFFFFFFu, key, off));
    if (u < units && (lane & (seg - 1)) == 0) atomicMax(&blk[unsigned(u) / upb], key);
  }
  __syncthreads();

  // Scales, and sf_inv into the slot.
  for (int b = tid; b < nblk; b += NT) {
    const BlockScale s = block_scale<FMT>(blk[b], round_sf);
    if (ue8m0) {
      static_cast<uint8_t*>(scales)[row * nblk + b] = static_cast<uint8_t>(s.e + 127);
    } else {
      static_cast<float*>(scales)[row * nblk + b] = s.sf;
    }
    blk[b] = __float_as_uint(s.sf_inv);
  }
  __syncthreads();

  // Cast.
  for (int u = tid; u < units; u += NT) {
    const float si = __uint_as_float(blk[unsigned(u) / upb]);
    if constexpr (FMT == PerTokenFmt::kE5M6) {
      float f[8];
      smem_unit8<T>(srow, u, f);
#pragma unroll
      for (int j = 0; j < 8; ++j) f[j] = __fmul_rn(f[j], si);
      uint32_t w[3];
      e5m6_encode_unit(f, (__float_as_uint(si) & 0x7FFFFFFFu) < 0x7F800000u, w);
      stage[3 * u] = w[0];
      stage[3 * u + 1] = w[1];
      stage[3 * u + 2] = w[2];
    } else if constexpr (UNIT == 8) {
      float f[8];
      smem_unit8<T>(srow, u, f);
      uint32_t w[2] = {0u, 0u};
#pragma unroll
      for (int j = 0; j < 8; j += 2) {
        const uint32_t p = encode_fp8x2<Fp8Fmt::kE4M3>(__fmul_rn(f[j], si), __fmul_rn(f[j + 1], si));
        w[j / 4] |= p << (16 * ((j / 2) % 2));
      }
      __stcs(reinterpret_cast<uint2*>(data + row * H + u * 8), make_uint2(w[0], w[1]));
    } else {
      data[row * H + u] = encode_fp8<Fp8Fmt::kE4M3>(__fmul_rn(pt_to_f32(srow[u]), si));
    }
  }
  if constexpr (FMT == PerTokenFmt::kE5M6) {
    __syncthreads();
    const int row_bytes = H / 2 * 3;
    uint8_t* dst = data + row * row_bytes;
    if ((row_bytes & 15) == 0 && (reinterpret_cast<std::uintptr_t>(data) & 15u) == 0) {
      const uint4* src = reinterpret_cast<const uint4*>(stage);
      for (int i = tid; i < row_bytes / 16; i += NT) __stcs(reinterpret_cast<uint4*>(dst) + i, src[i]);
    } else {
      for (int i = tid; i < row_bytes / 4; i += NT) __stcs(reinterpret_cast<uint32_t*>(dst) + i, stage[i]);
    }
  }
}


// ---- E5M6 from 16-bit inputs: one pass from registers ---------------------------------------------
// The E5M6 cast is arithmetic-heavy (12 bytes out per 8 elements, a bit-level encode), so this kernel
// reads each row once into registers (16-byte loads, all issued before the first use), takes the block
// amaxes on packed 16-bit keys, encodes with e5m6_encode_unit, and writes each warp's packed output
// through a small per-warp shared-memory buffer as coalesced 16-byte stores. Thread t of a CTA (one row)
// owns units (8 elements) u = t + k * NT, k < UPT: a warp's 32 units of one k are 512 contiguous input
// bytes and 384 contiguous output bytes.

__device__ __forceinline__ uint32_t max_u16x2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t r;
  asm("max.u16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  return __vmaxu2(a, b);
#endif
}

// Packed max of |x| keys over a unit's 4 words (two 16-bit keys each; NaN keys exceed Inf's).
__device__ __forceinline__ uint32_t unit_max16(const uint4& w) {
  return max_u16x2(max_u16x2(w.x & 0x7FFF7FFFu, w.y & 0x7FFF7FFFu), max_u16x2(w.z & 0x7FFF7FFFu, w.w & 0x7FFF7FFFu));
}

// The FP32 amax key of a packed pair of 16-bit |x| keys (exact: every BF16/FP16 value is an FP32 value).
template <typename T>
__device__ __forceinline__ uint32_t key_from16(uint32_t m) {
  const uint32_t k = max(m & 0xFFFFu, m >> 16);
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    return k << 16;
  } else {
    return abs_key(__half2float(__ushort_as_half(static_cast<unsigned short>(k))));
  }
}

template <typename T>
__device__ __forceinline__ void unpack_unit16(const uint4& w, float f[8]) {
  const uint32_t a[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
      f[2 * q] = __uint_as_float(a[q] << 16);
      f[2 * q + 1] = __uint_as_float(a[q] & 0xFFFF0000u);
    } else {
      const float2 p = __half22float2(*reinterpret_cast<const __half2*>(&a[q]));
      f[2 * q] = p.x;
      f[2 * q + 1] = p.y;
    }
  }
}

constexpr int kE5M6MaxNT = 512;

__host__ __device__ inline int e5m6_smem_words(int nt, int nblk) {
  const int nwarps = nt / 32;
  return nwarps * 192 + blk_words(nblk > nwarps ? nblk : nwarps);
}

// vec_in: x 16-byte aligned (row bytes 2H are a multiple of 16 since H % 8 == 0). vec_out: data 16-byte
// aligned and H % 32 == 0, so every warp's 384-byte output segment is 16-byte aligned and a whole number
// of 16-byte chunks; otherwise each thread stores its 3 words directly.
template <typename T, int UPT>
__global__ void __launch_bounds__(kE5M6MaxNT) e5m6_cast16_kernel(const T* __restrict__ x, int H, int bs, bool round_sf,
                                                                 bool ue8m0, bool vec_in, bool vec_out,
                                                                 uint8_t* __restrict__ data, void* __restrict__ scales) {
  extern __shared__ uint4 smem_vec[];
  uint32_t* smem = reinterpret_cast<uint32_t*>(smem_vec);
  const int NT = blockDim.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = NT >> 5;
  const int units = H >> 3;
  const int upb = bs >> 3;
  const int nblk = H / bs;
  const int upb_shift = __ffs(upb) - 1;  // blocks of a power-of-two unit count (the usual 128 channels): a shift
  const bool upb_pow2 = (upb & (upb - 1)) == 0;
  uint32_t* stage = smem + warp * 192;  // two 96-word buffers for this warp
  uint32_t* blk = smem + nwarps * 192;  // block amax keys, then sf_inv bits (or per-warp keys when nblk == 1)
  const int64_t row = blockIdx.x;
  const T* xr = x + row * H;

  // 1. The row, once: every load in flight before the first use.
  uint4 r[UPT];
#pragma unroll
  for (int k = 0; k < UPT; ++k) {
    const int u = tid + k * NT;
    r[k] = make_uint4(0u, 0u, 0u, 0u);
    if (u < units) {
      if (vec_in) {
        r[k] = __ldcs(reinterpret_cast<const uint4*>(xr) + u);
      } else {
        const uint16_t* e = reinterpret_cast<const uint16_t*>(xr) + 8 * u;
        r[k].x = uint32_t(e[0]) | (uint32_t(e[1]) << 16);
        r[k].y = uint32_t(e[2]) | (uint32_t(e[3]) << 16);
        r[k].z = uint32_t(e[4]) | (uint32_t(e[5]) << 16);
        r[k].w = uint32_t(e[6]) | (uint32_t(e[7]) << 16);
      }
    }
  }

  // 2. Block amaxes (FP32 keys, NaN-propagating), 3. scales.
  // Blocks of a unit count dividing 32 (block_size 8..256, the usual 128): a warp's 32 units of one k
  // start at a multiple of 32, so every block lies inside one warp's slot; its amax, scale and sf_inv
  // are then computed by the warp in step 4 (segment shuffles, every lane of the segment computing the
  // same scale), with no shared memory and no barrier. Longer rows in flight per SM beat the shared
  // atomics + two barriers of the general path, which left each CTA's loads idle between phases.
  const bool warp_blocks = nblk > 1 && (32 % upb) == 0;
  float row_si = 0.0f;
  if (warp_blocks) {
    // scales in step 4
  } else if (nblk == 1) {
    uint32_t m = 0u;
#pragma unroll
    for (int k = 0; k < UPT; ++k) m = max_u16x2(m, unit_max16(r[k]));  // zeros past the row end
    uint32_t key = key_from16<T>(m);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) key = max(key, __shfl_xor_sync(0xFFFFFFFFu, key, off));
    if (lane == 0) blk[warp] = key;
    __syncthreads();
    key = 0u;
    for (int i = 0; i < nwarps; ++i) key = max(key, blk[i]);
    const BlockScale s = block_scale<PerTokenFmt::kE5M6>(key, round_sf);
    if (tid == 0) {
      if (ue8m0) {
        static_cast<uint8_t*>(scales)[row] = static_cast<uint8_t>(s.e + 127);
      } else {
        static_cast<float*>(scales)[row] = s.sf;
      }
    }
    row_si = s.sf_inv;
  } else {
    for (int b = tid; b < nblk; b += NT) blk[b] = 0u;
    __syncthreads();
    // Lanes sharing a block reduce by shuffles, one shared atomic per segment (a warp's units of one k
    // are 32 consecutive units starting at a multiple of 32).
    const int seg = (upb % 32 == 0) ? 32 : ((32 % upb == 0) ? upb : 1);
#pragma unroll
    for (int k = 0; k < UPT; ++k) {
      const int base = warp * 32 + k * NT;
      if (base >= units) break;  // warp-uniform
      const int u = base + lane;
      uint32_t key = key_from16<T>(unit_max16(r[k]));
      for (int off = 1; off < seg; off <<= 1) key = max(key, __shfl_xor_sync(0xFFFFFFFFu, key, off));
      if (u < units && (lane & (seg - 1)) == 0) atomicMax(&blk[u / upb], key);
    }
    __syncthreads();
    for (int b = tid; b < nblk; b += NT) {
      const BlockScale s = block_scale<PerTokenFmt::kE5M6>(blk[b], round_sf);
      if (ue8m0) {
        static_cast<uint8_t*>(scales)[row * nblk + b] = static_cast<uint8_t>(s.e + 127);
      } else {
        static_cast<float*>(scales)[row * nblk + b] = s.sf;
      }
      blk[b] = __float_as_uint(s.sf_inv);
    }
    __syncthreads();
  }

  // 4. Encode and store.
  const int row_bytes = H / 2 * 3;
  uint8_t* drow = data + row * row_bytes;
#pragma unroll
  for (int k = 0; k < UPT; ++k) {
    const int base = warp * 32 + k * NT;
    if (base >= units) break;  // warp-uniform
    const int u = base + lane;
    const int uc = min(u, units - 1);
    float si;
    if (warp_blocks) {
      uint32_t key = key_from16<T>(unit_max16(r[k]));  // zeros past the row end: a whole block there
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        if (off < upb) key = max(key, __shfl_xor_sync(0xFFFFFFFFu, key, off));  // upb warp-uniform
      }
      const BlockScale s = block_scale<PerTokenFmt::kE5M6>(key, round_sf);
      if (u < units && (lane & (upb - 1)) == 0) {
        const int64_t b = row * nblk + (u >> upb_shift);
        if (ue8m0) {
          static_cast<uint8_t*>(scales)[b] = static_cast<uint8_t>(s.e + 127);
        } else {
          static_cast<float*>(scales)[b] = s.sf;
        }
      }
      si = s.sf_inv;
    } else {
      si = (nblk == 1) ? row_si : __uint_as_float(blk[upb_pow2 ? (uc >> upb_shift) : uc / upb]);
    }
    float f[8];
    unpack_unit16<T>(r[k], f);
#pragma unroll
    for (int j = 0; j < 8; ++j) f[j] = __fmul_rn(f[j], si);
    uint32_t w[3];
    e5m6_encode_unit(f, (__float_as_uint(si) & 0x7FFFFFFFu) < 0x7F800000u, w);
    if (vec_out) {
      uint32_t* buf = stage + (k & 1) * 96;  // alternate buffers: the __syncwarp of slot k + 1 orders
                                             // slot k's reads before slot k + 2's writes
      if (u < units) {
        buf[3 * lane] = w[0];
        buf[3 * lane + 1] = w[1];
        buf[3 * lane + 2] = w[2];
      }
      __syncwarp();
      const int chunks = (min(32, units - base) * 3) / 4;  // units % 4 == 0 here
      if (lane < chunks) {
        __stcs(reinterpret_cast<uint4*>(drow + 12 * base) + lane, reinterpret_cast<const uint4*>(buf)[lane]);
      }
    } else if (u < units) {
      uint32_t* dst = reinterpret_cast<uint32_t*>(drow + 12 * u);
      __stcs(dst, w[0]);
      __stcs(dst + 1, w[1]);
      __stcs(dst + 2, w[2]);
    }
  }
}

// Cast back: one thread per unit of 8 (or 1) elements, grid-stride.
template <PerTokenFmt FMT, typename OutT, int UNIT>
__global__ void per_token_cast_back_kernel(const uint8_t* __restrict__ data, const void* __restrict__ scales,
                                           bool ue8m0, int64_t tokens, int64_t H, int64_t bs,
                                           OutT* __restrict__ out) {
  const int64_t upr = H / UNIT, nblk = H / bs, total = tokens * upr;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / upr, u = i % upr, b = (u * UNIT) / bs;
    const float sf = ue8m0 ? ue8m0_to_float(static_cast<const uint8_t*>(scales)[row * nblk + b])
                           : static_cast<const float*>(scales)[row * nblk + b];
    float v[UNIT];
    if constexpr (FMT == PerTokenFmt::kE5M6) {
      const uint32_t* src = reinterpret_cast<const uint32_t*>(data + row * (H / 2 * 3) + u * 12);
      uint32_t h[8];
      unpack_e5m6x8(make_uint3(__ldcs(src), __ldcs(src + 1), __ldcs(src + 2)), h);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = __fmul_rn(decode_e5m6(h[j]), sf);
    } else if constexpr (UNIT == 8) {
      const uint2 w = __ldcs(reinterpret_cast<const uint2*>(data + row * H + u * 8));
#pragma unroll
      for (int j = 0; j < 8; j += 2) {
        const uint32_t word = (j < 4) ? w.x : w.y;
        const float2 f = decode_fp8x2<Fp8Fmt::kE4M3>(static_cast<uint16_t>(word >> (16 * ((j / 2) % 2))));
        v[j] = __fmul_rn(f.x, sf);
        v[j + 1] = __fmul_rn(f.y, sf);
      }
    } else {
      v[0] = __fmul_rn(decode_fp8<Fp8Fmt::kE4M3>(data[row * H + u]), sf);
    }
    OutT* dst = out + row * H + u * UNIT;
    if constexpr (UNIT == 8 && sizeof(OutT) == 2) {
      uint32_t w[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const OutT lo = pt_from_f32<OutT>(v[2 * q]), hi = pt_from_f32<OutT>(v[2 * q + 1]);
        w[q] = uint32_t(*reinterpret_cast<const uint16_t*>(&lo)) |
               (uint32_t(*reinterpret_cast<const uint16_t*>(&hi)) << 16);
      }
      __stcs(reinterpret_cast<uint4*>(dst), make_uint4(w[0], w[1], w[2], w[3]));
    } else if constexpr (UNIT == 8) {
      __stcs(reinterpret_cast<float4*>(dst), make_float4(v[0], v[1], v[2], v[3]));
      __stcs(reinterpret_cast<float4*>(dst) + 1, make_float4(v[4], v[5], v[6], v[7]));
    } else {
      dst[0] = pt_from_f32<OutT>(v[0]);
    }
  }
}

inline bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

template <typename Fn>
void pt_dispatch_float(DType t, const char* what, Fn&& fn) {
  switch (t) {
    case DType::kFloat32: fn(float{}); break;
    case DType::kFloat16: fn(__half{}); break;
    case DType::kBFloat16: fn(__nv_bfloat16{}); break;
    default:
      require(false, std::string(what) + " must be float32, float16 or bfloat16, got " + dtype_name(t));
  }
}

template <typename Fn>
void pt_dispatch_fmt(PerTokenFmt f, Fn&& fn) {
  if (f == PerTokenFmt::kE5M6) {
    fn(std::integral_constant<PerTokenFmt, PerTokenFmt::kE5M6>{});
  } else {
    fn(std::integral_constant<PerTokenFmt, PerTokenFmt::kE4M3>{});
  }
}

void check_per_token_shape(PerTokenFmt fmt, int64_t tokens, int64_t hidden, int64_t block_size) {
  require(fmt == PerTokenFmt::kE5M6 || fmt == PerTokenFmt::kE4M3, "per-token fmt must be e5m6 or e4m3");
  require(tokens >= 0 && hidden >= 0, "per-token cast: negative shape");
  require(block_size > 0 && hidden % block_size == 0,
          "per-token cast: block_size " + std::to_string(block_size) + " must be positive and divide hidden " +
              std::to_string(hidden));
  if (fmt == PerTokenFmt::kE5M6) {
    require(hidden % 8 == 0 && block_size % 8 == 0,
            "per-token e5m6 cast needs hidden and block_size multiples of 8 (8 codes pack into 12 bytes), got "
            "hidden " + std::to_string(hidden) + ", block_size " + std::to_string(block_size));
  }
}



// E5M6 from BF16/FP16 rows: units per thread UPT in {2, 4, 8} so that a CTA has at most 512 threads and
// long rows get 8 units (128 bytes of loads) in flight per thread.
void launch_e5m6_cast16(const void* x, DType in_dtype, int64_t tokens, int64_t hidden, bool round_sf, bool ue8m0,
                        int64_t block_size, void* data, void* scales, cudaStream_t stream) {
  const int units = int(hidden / 8);
  const int upt = units >= 512 ? 8 : (units >= 128 ? 4 : 2);
  const int nt = std::max(32, std::min(kE5M6MaxNT, ((units + upt - 1) / upt + 31) / 32 * 32));
  require(int64_t(nt) * upt >= units, "per-token e5m6 cast: hidden too large for the register kernel");
  const int nblk = int(hidden / block_size);
  const size_t smem = sizeof(uint32_t) * size_t(e5m6_smem_words(nt, nblk));
  const bool vec_in = aligned16(x);
  const bool vec_out = aligned16(data) && hidden % 32 == 0;
  auto launch = [&](auto kernel, auto tag) {
    using T = decltype(tag);
    if (smem > 48 * 1024) {
      check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
                 "cudaFuncSetAttribute(e5m6_cast16_kernel smem)");
    }
    kernel<<<unsigned(tokens), unsigned(nt), smem, stream>>>(static_cast<const T*>(x), int(hidden), int(block_size),
                                                             round_sf, ue8m0, vec_in, vec_out,
                                                             static_cast<uint8_t*>(data), scales);
    check_launch("e5m6_cast16_kernel");
  };
  auto by_upt = [&](auto tag) {
    using T = decltype(tag);
    if (upt == 8) {
      launch(e5m6_cast16_kernel<T, 8>, tag);
    } else if (upt == 4) {
      launch(e5m6_cast16_kernel<T, 4>, tag);
    } else {
      launch(e5m6_cast16_kernel<T, 2>, tag);
    }
  };
  if (in_dtype == DType::kBFloat16) {
    by_upt(__nv_bfloat16{});
  } else {
    by_upt(__half{});
  }
}

}  // namespace

// Largest hidden size the per-token cast kernel takes (its shared memory holds one FP32 row, the
// block slots and the packed E5M6 row). fp_recipes.ops falls back to the reference beyond it.
int64_t per_token_max_hidden(bool unit8) { return unit8 ? 32768 : 16384; }

void launch_per_token_cast(const void* x, DType in_dtype, int64_t tokens, int64_t hidden, PerTokenFmt fmt,
                           bool round_sf, bool ue8m0_scales, int64_t block_size, void* data, void* scales,
                           cudaStream_t stream) {
  check_per_token_shape(fmt, tokens, hidden, block_size);
  require(!ue8m0_scales || round_sf, "per-token cast: ue8m0 scales require round_sf=True");
  if (tokens == 0 || hidden == 0) return;
  const bool unit8 = hidden % 8 == 0 && block_size % 8 == 0;
  require(hidden <= per_token_max_hidden(unit8),
          "per-token cast kernel supports hidden <= " + std::to_string(per_token_max_hidden(unit8)) +
              (unit8 ? "" : " (when hidden or block_size is not a multiple of 8)") + ", got " +
              std::to_string(hidden));
  require(tokens <= 0x7FFFFFFF, "per-token cast: too many tokens");
  const int units = int(hidden / (unit8 ? 8 : 1));
  // About 8 units per thread: enough work per thread, and small CTAs so that many rows are in flight.
  int nt = ((units + 7) / 8 + 31) / 32 * 32;
  nt = std::max(64, std::min(kMaxNT, nt));
  const int nblk = int(hidden / block_size);
  if (fmt == PerTokenFmt::kE5M6 && in_dtype != DType::kFloat32 && hidden <= int64_t(kE5M6MaxNT) * 8 * 8) {
    launch_e5m6_cast16(x, in_dtype, tokens, hidden, round_sf, ue8m0_scales, block_size, data, scales, stream);
    return;
  }
  pt_dispatch_float(in_dtype, "per_token_cast input", [&](auto tag) {
    using T = decltype(tag);
    const bool vec = aligned16(x) && (hidden * int64_t(sizeof(T))) % 16 == 0;
    const size_t smem = size_t(round16(int(hidden * sizeof(T)))) + sizeof(uint32_t) * size_t(blk_words(nblk)) +
                        (fmt == PerTokenFmt::kE5M6 ? size_t(hidden) / 2 * 3 : 0);
    pt_dispatch_fmt(fmt, [&](auto ftag) {
      constexpr PerTokenFmt F = decltype(ftag)::value;
      auto launch = [&](auto kernel) {
        if (smem > 48 * 1024) {
          check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
                     "cudaFuncSetAttribute(per_token_cast_kernel smem)");
        }
        kernel<<<unsigned(tokens), unsigned(nt), smem, stream>>>(static_cast<const T*>(x), int(hidden),
                                                                 int(block_size), round_sf, ue8m0_scales, vec,
                                                                 static_cast<uint8_t*>(data), scales);
        check_launch("per_token_cast_kernel");
      };
      if (unit8) {
        launch(per_token_cast_kernel<T, F, 8>);
      } else if constexpr (F == PerTokenFmt::kE4M3) {
        launch(per_token_cast_kernel<T, F, 1>);
      }
    });
  });
}

void launch_per_token_cast_back(const void* data, const void* scales, PerTokenFmt fmt, bool ue8m0_scales,
                                int64_t tokens, int64_t hidden, int64_t block_size, void* out, DType out_dtype,
                                cudaStream_t stream) {
  check_per_token_shape(fmt, tokens, hidden, block_size);
  if (tokens == 0 || hidden == 0) return;
  const bool unit8 = hidden % 8 == 0 && block_size % 8 == 0;
  const int64_t total = tokens * (hidden / (unit8 ? 8 : 1));
  const int threads = 256;
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>((total + threads - 1) / threads, 132 * 64));
  pt_dispatch_float(out_dtype, "cast_back out_dtype", [&](auto tag) {
    using OutT = decltype(tag);
    pt_dispatch_fmt(fmt, [&](auto ftag) {
      constexpr PerTokenFmt F = decltype(ftag)::value;
      auto launch = [&](auto kernel) {
        kernel<<<unsigned(grid), threads, 0, stream>>>(static_cast<const uint8_t*>(data), scales, ue8m0_scales,
                                                       tokens, hidden, block_size, static_cast<OutT*>(out));
        check_launch("per_token_cast_back_kernel");
      };
      if (unit8) {
        launch(per_token_cast_back_kernel<F, OutT, 8>);
      } else if constexpr (F == PerTokenFmt::kE4M3) {
        launch(per_token_cast_back_kernel<F, OutT, 1>);
      }
    });
  });
}

}  // namespace fp_recipes
