// FP8 per-tensor casts (delayed and current scaling) with the amax fused into the same pass, the
// optional transposed (columnwise) copy, dequantize, and the grouped (many tensors, one launch)
// variants. Numerics: data = satRN(RN(x * scale)); amax is max |x| in FP32 (NaN propagates);
// scale_inv = RN(1 / scale). Compiled with -fmad=false; the products use __fmul_rn anyway.
//
// Memory-bound design: a persistent grid, each block streaming a contiguous range of tiles; a tile
// is kThreads x kUnroll 16-byte vectors, all loads of a tile issued before the first use. The amax
// is kept per thread as an unsigned key (the bits of |x|; NaN keys exceed +Inf's), reduced per block
// and merged with one atomicMax per block and group. Groups: a block looks up the group of each tile
// from the offsets; a tile inside one group takes the vector path; a tile that straddles group
// boundaries (at most one per boundary) walks its elements one by one. No per-group arrays anywhere.
// The tile-level device code is in fp8_device.cuh, shared with fp8_multi_cast.cu.
#include <algorithm>
#include <cfloat>
#include <climits>
#include <mutex>
#include <string>
#include <type_traits>

#include "common.h"
#include "formats.cuh"
#include "fp8_device.cuh"
#include "fp8_kernels.h"

namespace fp_recipes {
namespace {

// ---------------------------------------------------------------------------------------------
// Where the scale comes from: a given FP32 scale (delayed scaling), or computed from an amax on the
// device (current scaling). Block 0 writes scale (current) and scale_inv.
struct ScaleSpec {
  const float* scale;     // delayed: the scale to use
  const float* amax_in;   // current: compute the scale from this amax
  float fmt_max;
  float amax_epsilon;
  int power_2;
  float* scale_out;       // current: written
  float* scale_inv_out;   // written
};

__device__ __forceinline__ float resolve_scale(const ScaleSpec& spec) {
  float s = spec.amax_in != nullptr
                ? fp8_current_scale(*spec.amax_in, spec.fmt_max, spec.amax_epsilon, spec.power_2)
                : *spec.scale;
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
    if (spec.scale_out != nullptr) *spec.scale_out = s;
    if (spec.scale_inv_out != nullptr) *spec.scale_inv_out = __fdiv_rn(1.0f, s);
  }
  return s;
}

template <typename T, bool kVec, typename Act = NoActivation>
__global__ void __launch_bounds__(kThreads) amax_kernel(const T* __restrict__ x, int64_t n,
                                                        uint32_t* __restrict__ amax_bits, float* record,
                                                        uint32_t* ws) {
  constexpr int64_t kTile = int64_t(kThreads) * kUnroll * Vec16<T>::kElems;
  int64_t t0, t1;
  block_tile_range((n + kTile - 1) / kTile, t0, t1);
  uint32_t key = 0;
  for (int64_t t = t0; t < t1; ++t) amax_tile<T, kVec, Act>(x, t * kTile, min(n, (t + 1) * kTile), key);
  flush_amax_record(key, amax_bits, record, ws);
}

// Single tensor, row-major flat: rowwise copy only.
// reverse: walk this block's tiles last to first. Current scaling runs this right after the amax
// kernel on the same grid, whose blocks read their ranges first to last: the tiles each block read
// last are still in L2, and reading them first turns part of the second pass into L2 hits.
template <typename T, Fp8Fmt F, bool kAmax, bool kVec>
__global__ void __launch_bounds__(kThreads) cast_kernel(const T* __restrict__ x, int64_t n, ScaleSpec spec,
                                                        bool reverse, uint8_t* __restrict__ out,
                                                        uint32_t* __restrict__ amax_bits, float* record) {
  constexpr int64_t kTile = int64_t(kThreads) * kUnroll * Vec16<T>::kElems;
  const float s = resolve_scale(spec);
  int64_t t0, t1;
  block_tile_range((n + kTile - 1) / kTile, t0, t1);
  uint32_t key = 0;
  for (int64_t i = 0; i < t1 - t0; ++i) {
    const int64_t t = reverse ? t1 - 1 - i : t0 + i;
    cast_tile<T, F, kAmax, kVec>(x, out, t * kTile, min(n, (t + 1) * kTile), s, key);
  }
  if (kAmax) flush_amax_record(key, amax_bits, record);
}

// Rowwise and/or transposed copies in one pass: one 64x64 tile (cast_transpose_tile) per block.
// kBias: also the tile's column sums of a fused bias gradient into row blockIdx.y of partials (T, N).
template <typename T, Fp8Fmt F, bool kAmax, bool kBias, typename Act = NoActivation>
__global__ void __launch_bounds__(kThreads) cast_transpose_kernel(const T* __restrict__ x, int64_t M,
                                                                  int64_t N, ScaleSpec spec, bool vec_ok,
                                                                  uint8_t* __restrict__ out,
                                                                  uint8_t* __restrict__ out_t,
                                                                  uint32_t* __restrict__ amax_bits,
                                                                  float* record, float* __restrict__ partials) {
  const float s = resolve_scale(spec);
  uint32_t key = 0;
  cast_transpose_tile<T, F, kAmax, kBias, false, Act>(x, M, N, int64_t(blockIdx.y) * kTR, int64_t(blockIdx.x) * kTC, s,
                                          vec_ok, M % 16 == 0, out, out_t, key,
                                          kBias ? partials + int64_t(blockIdx.y) * N : nullptr);
  if (kAmax) flush_amax_record(key, amax_bits, record);
}

// ---------------------------------------------------------------------------------------------
// Bias gradient without a cast (any quantizer, or none): the same staged tiles and column sums as the
// cast kernel's kBias variant, so the partials are the same numbers.
// vec_ok: x 16-byte aligned and N % V == 0 (full tiles then load 16-byte vectors, all issued first).
template <typename T>
__global__ void __launch_bounds__(kThreads) bias_partials_kernel(const T* __restrict__ x, int64_t M, int64_t N,
                                                                 bool vec_ok, float* __restrict__ partials) {
  constexpr int V = Vec16<T>::kElems;
  constexpr int kVPR = kTC / V;
  constexpr int kIters = kTR * kVPR / kThreads;
  __shared__ float vals[kTR][kTC + 1];
  const int64_t r0 = int64_t(blockIdx.y) * kTR, c0 = int64_t(blockIdx.x) * kTC;
  if (vec_ok && r0 + kTR <= M && c0 + kTC <= N) {
    uint4 in[kIters];
#pragma unroll
    for (int k = 0; k < kIters; ++k) {
      const int i = k * kThreads + threadIdx.x, r = i / kVPR, cv = i % kVPR;
      in[k] = __ldg(reinterpret_cast<const uint4*>(x + (r0 + r) * N + c0 + cv * V));
    }
#pragma unroll
    for (int k = 0; k < kIters; ++k) {
      const int i = k * kThreads + threadIdx.x, r = i / kVPR, cv = i % kVPR;
      float f[V];
      unpack16<T>(in[k], f);
#pragma unroll
      for (int j = 0; j < V; ++j) vals[r][cv * V + j] = f[j];
    }
  } else {
    for (int i = threadIdx.x; i < kTR * kTC; i += kThreads) {
      const int r = i / kTC, c = i % kTC;
      vals[r][c] = (r0 + r < M && c0 + c < N) ? to_f32(x[(r0 + r) * N + c0 + c]) : 0.0f;
    }
  }
  __syncthreads();
  bias_tile_sums(vals, c0, N, partials + int64_t(blockIdx.y) * N);
}

// db[c] = (((p[0][c] + p[1][c]) + p[2][c]) + ...) over the T tile rows in order (0 when T == 0), rounded
// once to the bias dtype.
template <typename OutT>
__global__ void __launch_bounds__(kThreads) bias_reduce_kernel(const float* __restrict__ partials, int64_t T,
                                                               int64_t N, OutT* __restrict__ out) {
  const int64_t c = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= N) return;
  float acc = T > 0 ? partials[c] : 0.0f;
  // The adds are a chain; the loads are not: issue kBatch of them before adding (latency, not bandwidth,
  // bounds this kernel: one thread per column).
  constexpr int kBatch = 16;
  int64_t t = 1;
  for (; t + kBatch <= T; t += kBatch) {
    float v[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) v[j] = __ldg(partials + (t + j) * N + c);
#pragma unroll
    for (int j = 0; j < kBatch; ++j) acc = __fadd_rn(acc, v[j]);
  }
  for (; t < T; ++t) acc = __fadd_rn(acc, partials[t * N + c]);
  out[c] = from_f32<OutT>(acc);
}

// ---------------------------------------------------------------------------------------------
// Grouped quantize: member g = [offsets[g], offsets[g+1]) of the flat buffer, scale scales[g].
__device__ __forceinline__ int64_t group_of(const int64_t* __restrict__ offsets, int64_t G, int64_t pos) {
  // The last g with offsets[g] <= pos (empty members skipped: their offsets[g+1] == offsets[g]).
  int64_t lo = 0, hi = G - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= pos) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Straddle tiles of the grouped kernels: a warp-uniform running (member, key) pair. Lane 0 merges
// it into the member's amax slot when the warp moves on to a later member and at the end of a tile.
__device__ __forceinline__ void warp_flush_key(int wmg, uint32_t& wkey, uint32_t* amax_bits) {
  if (wmg >= 0 && wkey != 0u && (threadIdx.x % 32) == 0) atomicMax(amax_bits + wmg, canonical_key(wkey));
  wkey = 0;
}

// Folds each lane's key (for its member mg) into the warp's running pair. Lanes' members are
// nondecreasing with the lane index, so the loop visits the distinct members (usually one) in order;
// all intrinsics run on the full, converged warp.
__device__ __forceinline__ void warp_merge_key(int mg, uint32_t key, int& wmg, uint32_t& wkey,
                                               uint32_t* amax_bits) {
  uint32_t rest = 0xFFFFFFFFu;
  while (rest != 0u) {
    const int m = __shfl_sync(0xFFFFFFFFu, mg, __ffs(rest) - 1);
    const bool in = (mg == m);
    rest &= ~__ballot_sync(0xFFFFFFFFu, in);
    const uint32_t r = __reduce_max_sync(0xFFFFFFFFu, in ? key : 0u);
    if (m != wmg) {
      warp_flush_key(wmg, wkey, amax_bits);
      wmg = m;
    }
    wkey = max(wkey, r);
  }
}

// kCast = false: the per-member amax only (the first pass of grouped current scaling).
template <typename T, Fp8Fmt F, bool kVec, bool kCast>
__global__ void __launch_bounds__(kThreads, 8) grouped_cast_kernel(
    const T* __restrict__ x, int64_t n, const int64_t* __restrict__ offsets, int64_t G,
    const float* __restrict__ scales, uint8_t* __restrict__ out, float* __restrict__ scale_inv,
    uint32_t* __restrict__ amax_bits) {
  constexpr int64_t kTile = int64_t(kThreads) * kUnroll * Vec16<T>::kElems;
  if constexpr (kCast) {
    for (int64_t g = int64_t(blockIdx.x) * kThreads + threadIdx.x; g < G; g += int64_t(gridDim.x) * kThreads) {
      scale_inv[g] = __fdiv_rn(1.0f, scales[g]);
    }
  }
  int64_t t0, t1;
  block_tile_range((n + kTile - 1) / kTile, t0, t1);
  if (t0 >= t1) return;
  int g = int(group_of(offsets, G, t0 * kTile));  // block-uniform from here on; G <= INT32_MAX
  int cur = -1;
  float s = 0.0f;
  uint32_t key = 0;
  // A 32-bit tile counter (a block's range is ntiles / grid, with grid >= the SM count, far below 2^31)
  // frees the register pair that kept the hot loop of the 90a build from spilling.
  const int block_tiles = int(t1 - t0);
  for (int i = 0; i < block_tiles; ++i) {
    const int64_t ts = (t0 + i) * kTile, te = min(n, ts + kTile);
    while (g + 1 < G && offsets[g + 1] <= ts) ++g;
    if (g + 1 >= G || offsets[g + 1] >= te) {
      // The whole tile belongs to member g: the single-tensor fast path.
      if (g != cur) {
        if (cur >= 0) flush_amax(key, amax_bits + cur);
        cur = g;
        if constexpr (kCast) s = scales[g];
        key = 0;
      }
      if constexpr (kCast) {
        cast_tile<T, F, true, kVec>(x, out, ts, te, s, key);
      } else {
        amax_tile<T, kVec>(x, ts, te, key);
      }
    } else {
      // The tile straddles member boundaries. All of a full tile's 16-byte loads are issued first, as
      // on the single-member path, so a boundary tile costs about what any tile costs (in a persistent
      // grid the slowest block sets the kernel's time). Then per vector: each lane finds its member
      // (positions increase with lane and k, so members do too), casts inside one member with that
      // member's scale, and the warp merges the vector keys per member with a warp reduction into a
      // warp-uniform running (wmg, wkey), flushed by one atomic from lane 0 when the warp moves on to a
      // later member and at the end of the tile. One atomic per (warp, member) instead of one per
      // (thread, member): with hundreds of small members the per-thread atomics all hit the same few
      // L2 lines and set the kernel's time.
      // A vector that crosses a boundary (boundary not a multiple of the vector width) goes element by
      // element from the (cached) input with its own direct atomics (at most one such vector per
      // boundary). Partial or misaligned tiles take the per-thread element path.
      constexpr int V = Vec16<T>::kElems;
      int mg = g;
      int64_t nb = (g + 1 < G) ? offsets[g + 1] : INT64_MAX;  // where the next member starts
      float ms = kCast ? scales[g] : 0.0f;
      auto to_member_of = [&](int64_t pos) {
        while (pos >= nb) {  // empty members are skipped
          ++mg;
          nb = (mg + 1 < G) ? offsets[mg + 1] : INT64_MAX;
          if constexpr (kCast) ms = scales[mg];
        }
      };
      if (kVec && te - ts == kTile) {
        uint4 in[kUnroll];
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
          in[k] = __ldcs(reinterpret_cast<const uint4*>(x + ts + (int64_t(k) * kThreads + threadIdx.x) * V));
        }
        int wmg = -1;       // this warp's running member (warp-uniform) ...
        uint32_t wkey = 0;  // ... and its key, not yet merged into amax_bits[wmg]
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
          const int64_t e0 = ts + (int64_t(k) * kThreads + threadIdx.x) * V;
          to_member_of(e0);
          uint32_t vkey = 0;
          if (e0 + V <= nb) {
            cast_vec<T, F, true, kCast>(in[k], ms, out + e0, vkey);
          } else {
            uint32_t ekey = 0;
#pragma unroll 1
            for (int j = 0; j < V; ++j) {
              if (e0 + j >= nb) {
                if (ekey != 0u) atomicMax(amax_bits + mg, canonical_key(ekey));
                ekey = 0;
                to_member_of(e0 + j);
              }
              const float f = to_f32(x[e0 + j]);
              ekey = max(ekey, abs_key(f));
              if constexpr (kCast) out[e0 + j] = encode_fp8<F>(__fmul_rn(f, ms));
            }
            if (ekey != 0u) atomicMax(amax_bits + mg, canonical_key(ekey));
          }
          warp_merge_key(mg, vkey, wmg, wkey, amax_bits);
        }
        warp_flush_key(wmg, wkey, amax_bits);  // per tile: nothing live across the single-member path
      } else {
        uint32_t mkey = 0;
        for (int64_t i = ts + threadIdx.x; i < te; i += kThreads) {
          if (i >= nb) {
            if (mkey != 0u) atomicMax(amax_bits + mg, canonical_key(mkey));
            mkey = 0;
            to_member_of(i);
          }
          const float f = to_f32(x[i]);
          mkey = max(mkey, abs_key(f));
          if constexpr (kCast) out[i] = encode_fp8<F>(__fmul_rn(f, ms));
        }
        if (mkey != 0u) atomicMax(amax_bits + mg, canonical_key(mkey));
      }
    }
  }
  if (cur >= 0) flush_amax(key, amax_bits + cur);
}

// ---------------------------------------------------------------------------------------------
// Dequantize: out = cast(RN(fp32(q) * scale_inv)). Each thread turns 16/sizeof(OutT) FP8 bytes into one
// 16-byte store, so that every store instruction of a warp covers whole contiguous sectors.
constexpr int kDqUnroll = 8;

template <typename OutT>
struct DqVec {
  static constexpr int kElems = 16 / sizeof(OutT);  // 8 for 16-bit outputs, 4 for FP32
  static constexpr int64_t kTile = int64_t(kThreads) * kDqUnroll * kElems;
};

template <typename OutT>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  const OutT lo = from_f32<OutT>(a), hi = from_f32<OutT>(b);
  return uint32_t(*reinterpret_cast<const uint16_t*>(&lo)) | (uint32_t(*reinterpret_cast<const uint16_t*>(&hi)) << 16);
}

template <Fp8Fmt F, typename OutT>
__device__ __forceinline__ uint4 dequant_vec(uint2 w, float si) {
  float v[8];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = decode_fp8x2<F>(static_cast<uint16_t>((j < 2 ? w.x : w.y) >> (16 * (j % 2))));
    v[2 * j] = __fmul_rn(f.x, si);
    v[2 * j + 1] = __fmul_rn(f.y, si);
  }
  return make_uint4(pack2<OutT>(v[0], v[1]), pack2<OutT>(v[2], v[3]), pack2<OutT>(v[4], v[5]),
                    pack2<OutT>(v[6], v[7]));
}

template <Fp8Fmt F>
__device__ __forceinline__ float4 dequant_vec4(uint32_t w, float si) {
  const float2 a = decode_fp8x2<F>(static_cast<uint16_t>(w));
  const float2 b = decode_fp8x2<F>(static_cast<uint16_t>(w >> 16));
  return make_float4(__fmul_rn(a.x, si), __fmul_rn(a.y, si), __fmul_rn(b.x, si), __fmul_rn(b.y, si));
}

template <Fp8Fmt F, typename OutT, bool kVec>
__device__ __forceinline__ void dequant_tile(const uint8_t* __restrict__ q, OutT* __restrict__ out, int64_t ts,
                                             int64_t te, float si) {
  constexpr int E = DqVec<OutT>::kElems;
  if (kVec && te - ts == DqVec<OutT>::kTile) {
    if constexpr (E == 8) {
      uint2 in[kDqUnroll];
#pragma unroll
      for (int k = 0; k < kDqUnroll; ++k) {
        in[k] = __ldcs(reinterpret_cast<const uint2*>(q + ts + (int64_t(k) * kThreads + threadIdx.x) * E));
      }
#pragma unroll
      for (int k = 0; k < kDqUnroll; ++k) {
        __stcs(reinterpret_cast<uint4*>(out + ts + (int64_t(k) * kThreads + threadIdx.x) * E),
               dequant_vec<F, OutT>(in[k], si));
      }
    } else {
      uint32_t in[kDqUnroll];
#pragma unroll
      for (int k = 0; k < kDqUnroll; ++k) {
        in[k] = __ldcs(reinterpret_cast<const unsigned int*>(q + ts + (int64_t(k) * kThreads + threadIdx.x) * E));
      }
#pragma unroll
      for (int k = 0; k < kDqUnroll; ++k) {
        __stcs(reinterpret_cast<float4*>(out + ts + (int64_t(k) * kThreads + threadIdx.x) * E),
               dequant_vec4<F>(in[k], si));
      }
    }
  } else {
    for (int64_t i = ts + threadIdx.x; i < te; i += kThreads) {
      out[i] = from_f32<OutT>(__fmul_rn(decode_fp8<F>(q[i]), si));
    }
  }
}

template <Fp8Fmt F, typename OutT, bool kGrouped, bool kVec>
__global__ void __launch_bounds__(kThreads, 8) dequant_kernel(const uint8_t* __restrict__ q, int64_t n,
                                                           const int64_t* __restrict__ offsets, int64_t G,
                                                           const float* __restrict__ scale_inv,
                                                           OutT* __restrict__ out) {
  constexpr int64_t kDqTile = DqVec<OutT>::kTile;
  int64_t t0, t1;
  block_tile_range((n + kDqTile - 1) / kDqTile, t0, t1);
  if (t0 >= t1) return;
  int64_t g = kGrouped ? group_of(offsets, G, t0 * kDqTile) : 0;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t ts = t * kDqTile, te = min(n, ts + kDqTile);
    if constexpr (!kGrouped) {
      dequant_tile<F, OutT, kVec>(q, out, ts, te, scale_inv[0]);
    } else {
      while (g + 1 < G && offsets[g + 1] <= ts) ++g;
      if (g + 1 >= G || offsets[g + 1] >= te) {
        dequant_tile<F, OutT, kVec>(q, out, ts, te, scale_inv[g]);
      } else {
        // Straddles member boundaries: all of a full tile's loads first (as on the single-member path, so
        // a boundary tile costs about what any tile costs), then per vector inside one member the vector
        // path, across a boundary element by element from the (cached) input.
        constexpr int E = DqVec<OutT>::kElems;
        int64_t mg = g;
        int64_t nb = (g + 1 < G) ? offsets[g + 1] : INT64_MAX;  // where the next member starts
        auto advance = [&](int64_t pos) {
          while (pos >= nb) {  // empty members are skipped
            ++mg;
            nb = (mg + 1 < G) ? offsets[mg + 1] : INT64_MAX;
          }
        };
        if (kVec && te - ts == DqVec<OutT>::kTile) {
          using InVec = typename std::conditional<E == 8, uint2, unsigned int>::type;
          InVec in[kDqUnroll];
#pragma unroll
          for (int k = 0; k < kDqUnroll; ++k) {
            in[k] = __ldcs(reinterpret_cast<const InVec*>(q + ts + (int64_t(k) * kThreads + threadIdx.x) * E));
          }
#pragma unroll
          for (int k = 0; k < kDqUnroll; ++k) {
            const int64_t e0 = ts + (int64_t(k) * kThreads + threadIdx.x) * E;
            advance(e0);
            if (e0 + E <= nb) {
              if constexpr (E == 8) {
                __stcs(reinterpret_cast<uint4*>(out + e0), dequant_vec<F, OutT>(in[k], scale_inv[mg]));
              } else {
                __stcs(reinterpret_cast<float4*>(out + e0), dequant_vec4<F>(in[k], scale_inv[mg]));
              }
            } else {
#pragma unroll 1
              for (int j = 0; j < E; ++j) {
                advance(e0 + j);
                out[e0 + j] = from_f32<OutT>(__fmul_rn(decode_fp8<F>(q[e0 + j]), scale_inv[mg]));
              }
            }
          }
        } else {
          for (int64_t i = ts + threadIdx.x; i < te; i += kThreads) {
            advance(i);
            out[i] = from_f32<OutT>(__fmul_rn(decode_fp8<F>(q[i]), scale_inv[mg]));
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side (the shared helpers are in fp8_device.cuh)

// grid > 0: use that many blocks (current scaling gives the amax kernel the cast kernel's grid, so
// that both split the tensor into the same per-block ranges).
// record: a delayed-scaling history slot the amax is also max-merged into (null: none).
void run_amax(const void* x, DType in_dtype, int64_t n, float* amax, cudaStream_t stream, int64_t grid_blocks = 0,
              float* record = nullptr, uint32_t* ws = nullptr) {
  dispatch_input(in_dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int64_t kTile = int64_t(kThreads) * kUnroll * Vec16<T>::kElems;
    dispatch_bool(aligned16(x), [&](auto vec) {
      auto kernel = amax_kernel<T, decltype(vec)::value>;
      const int64_t grid = grid_blocks > 0 ? grid_blocks : persistent_grid(kernel, (n + kTile - 1) / kTile);
      kernel<<<grid, kThreads, 0, stream>>>(static_cast<const T*>(x), n, reinterpret_cast<uint32_t*>(amax), record,
                                            ws);
      check_launch("fp8 amax_kernel");
    });
  });
}

// The cast itself (rowwise flat kernel, or the tiled kernel when a transposed copy is wanted).
// The grid run_cast's rowwise kernel uses for n elements of in_dtype (current scaling hands it to run_amax).
int64_t rowwise_cast_grid(DType in_dtype, int64_t n, Fp8Fmt fmt, const void* x, const void* out) {
  int64_t grid = 1;
  dispatch_input(in_dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int64_t kTile = int64_t(kThreads) * kUnroll * Vec16<T>::kElems;
    dispatch_fmt(fmt, [&](auto ftag) {
      dispatch_bool(aligned16(x) && aligned16(out), [&](auto vec) {
        grid = persistent_grid(cast_kernel<T, decltype(ftag)::value, false, decltype(vec)::value>,
                               (n + kTile - 1) / kTile);
      });
    });
  });
  return grid;
}

void run_cast(const void* x, DType in_dtype, int64_t rows, int64_t cols, const ScaleSpec& spec, Fp8Fmt fmt,
              bool with_amax, void* out, void* out_t, float* amax, cudaStream_t stream, bool reverse = false,
              int64_t grid_blocks = 0, float* record = nullptr, float* partials = nullptr) {
  const int64_t n = rows * cols;
  dispatch_input(in_dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = Vec16<T>::kElems;
    dispatch_fmt(fmt, [&](auto ftag) {
      constexpr Fp8Fmt F = decltype(ftag)::value;
      dispatch_bool(with_amax, [&](auto amax_tag) {
        constexpr bool kAmax = decltype(amax_tag)::value;
        if (out_t == nullptr && partials == nullptr) {
          constexpr int64_t kTile = int64_t(kThreads) * kUnroll * V;
          dispatch_bool(aligned16(x) && aligned16(out), [&](auto vec) {
            auto kernel = cast_kernel<T, F, kAmax, decltype(vec)::value>;
            const int64_t grid = grid_blocks > 0 ? grid_blocks : persistent_grid(kernel, (n + kTile - 1) / kTile);
            kernel<<<grid, kThreads, 0, stream>>>(static_cast<const T*>(x), n, spec, reverse,
                                                  static_cast<uint8_t*>(out), reinterpret_cast<uint32_t*>(amax),
                                                  record);
            check_launch("fp8 cast_kernel");
          });
        } else {
          const int64_t gx = std::max<int64_t>(1, (cols + kTC - 1) / kTC);
          const int64_t gy = std::max<int64_t>(1, (rows + kTR - 1) / kTR);
          require(gy <= 65535 && gx <= 0x7FFFFFFF,
                  "fp8 transposed cast supports at most 65535*64 rows, got " + std::to_string(rows));
          const bool vec_ok = aligned16(x) && (out == nullptr || aligned16(out)) && aligned16(out_t) &&
                              cols % V == 0;
          dispatch_bool(partials != nullptr, [&](auto bias_tag) {
            cast_transpose_kernel<T, F, kAmax, decltype(bias_tag)::value>
                <<<dim3(unsigned(gx), unsigned(gy)), kThreads, 0, stream>>>(
                    static_cast<const T*>(x), rows, cols, spec, vec_ok, static_cast<uint8_t*>(out),
                    static_cast<uint8_t*>(out_t), reinterpret_cast<uint32_t*>(amax), record, partials);
            check_launch("fp8 cast_transpose_kernel");
          });
        }
      });
    });
  });
}

void check_shape(int64_t rows, int64_t cols) {
  require(rows >= 0 && cols >= 0, "shape must be non-negative, got (" + std::to_string(rows) + ", " +
                                      std::to_string(cols) + ")");
}

int64_t bias_tile_rows(int64_t rows) { return (rows + kTR - 1) / kTR; }

void check_bias_grad(const BiasGradOut* bias, int64_t rows, int64_t cols) {
  if (bias == nullptr) return;
  require(bias->out_dtype == DType::kFloat32 || bias->out_dtype == DType::kFloat16 ||
              bias->out_dtype == DType::kBFloat16,
          std::string("bias gradient dtype must be float32, float16 or bfloat16, got ") + dtype_name(bias->out_dtype));
  require(cols == 0 || bias->out != nullptr, "bias gradient: null output");
  require(bias_tile_rows(rows) * cols == 0 || bias->partials != nullptr, "bias gradient: null partials workspace");
  require(bias_tile_rows(rows) <= 65535, "bias gradient supports at most 65535*64 rows, got " + std::to_string(rows));
}

// db from the partials (T = ceil(rows / 64) tile rows of cols floats).
void run_bias_reduce(const BiasGradOut& bias, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (cols == 0) return;
  const int64_t T = bias_tile_rows(rows);
  const int64_t grid = (cols + kThreads - 1) / kThreads;
  auto go = [&](auto tag) {
    using OutT = decltype(tag);
    bias_reduce_kernel<OutT><<<unsigned(grid), kThreads, 0, stream>>>(bias.partials, T, cols,
                                                                      static_cast<OutT*>(bias.out));
  };
  if (bias.out_dtype == DType::kFloat32) go(float{});
  else if (bias.out_dtype == DType::kFloat16) go(__half{});
  else go(__nv_bfloat16{});
  check_launch("bias_reduce_kernel");
}

// The fused activation's passes (launch_fp8_act_quantize): its amax over act(x), and its tiled cast of act(x).
template <typename Act>
void run_act_amax(const void* x, DType in_dtype, int64_t n, float* amax, cudaStream_t stream) {
  dispatch_input(in_dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int64_t kTile = int64_t(kThreads) * kUnroll * Vec16<T>::kElems;
    dispatch_bool(aligned16(x), [&](auto vec) {
      auto kernel = amax_kernel<T, decltype(vec)::value, Act>;
      kernel<<<persistent_grid(kernel, (n + kTile - 1) / kTile), kThreads, 0, stream>>>(
          static_cast<const T*>(x), n, reinterpret_cast<uint32_t*>(amax), nullptr, nullptr);
      check_launch("fp8 amax_kernel (activation)");
    });
  });
}

template <typename Act>
void run_act_cast(const void* x, DType in_dtype, int64_t rows, int64_t cols, const ScaleSpec& spec, Fp8Fmt fmt,
                  bool with_amax, void* out, void* out_t, float* amax, float* record, cudaStream_t stream) {
  const int64_t gx = std::max<int64_t>(1, (cols + kTC - 1) / kTC);
  const int64_t gy = std::max<int64_t>(1, (rows + kTR - 1) / kTR);
  require(gy <= 65535 && gx <= 0x7FFFFFFF,
          "fp8 cast of an activation supports at most 65535*64 rows, got " + std::to_string(rows));
  dispatch_input(in_dtype, [&](auto tag) {
    using T = decltype(tag);
    const bool vec_ok = aligned16(x) && (out == nullptr || aligned16(out)) && (out_t == nullptr || aligned16(out_t)) &&
                        cols % Vec16<T>::kElems == 0;
    dispatch_fmt(fmt, [&](auto ftag) {
      dispatch_bool(with_amax, [&](auto amax_tag) {
        cast_transpose_kernel<T, decltype(ftag)::value, decltype(amax_tag)::value, false, Act>
            <<<dim3(unsigned(gx), unsigned(gy)), kThreads, 0, stream>>>(
                static_cast<const T*>(x), rows, cols, spec, vec_ok, static_cast<uint8_t*>(out),
                static_cast<uint8_t*>(out_t), reinterpret_cast<uint32_t*>(amax), record, nullptr);
        check_launch("fp8 cast_transpose_kernel (activation)");
      });
    });
  });
}

}  // namespace

void launch_fp8_act_quantize(const void* x, DType in_dtype, int64_t rows, int64_t cols, int act, const float* scale,
                             DType out_dtype, bool power_2_scale, float amax_epsilon, void* out, void* out_t,
                             float* scale_out, float* scale_inv, float* amax, float* amax_record, cudaStream_t stream) {
  require_input_dtype(in_dtype, "fp8_act_quantize input");
  check_shape(rows, cols);
  const Fp8Fmt fmt = fp8_fmt_of(out_dtype, "fp8_act_quantize output dtype");
  require(act == kActGeluTanh, "fp8_act_quantize: act must be " + std::to_string(kActGeluTanh) +
                                   " (GELU, tanh approximation), got " + std::to_string(act));
  const bool current = scale == nullptr;
  require(scale_inv != nullptr && amax != nullptr && (!current || scale_out != nullptr),
          "fp8_act_quantize: null scale_inv/amax (or scale output, for current scaling)");
  require(current || amax_record != nullptr, "fp8_act_quantize: delayed scaling records into amax_record");
  zero_amax(amax, 1, stream);
  const float fmt_max = fmt == Fp8Fmt::kE4M3 ? kE4M3Max : kE5M2Max;
  const ScaleSpec spec = current ? ScaleSpec{nullptr, amax, fmt_max, amax_epsilon, power_2_scale ? 1 : 0, scale_out,
                                             scale_inv}
                                 : ScaleSpec{scale, nullptr, 0.0f, 0.0f, 0, nullptr, scale_inv};
  if (rows * cols == 0) {  // nothing to cast: the scale outputs (and an empty record merge), as the plain casts
    if (!current) run_amax(x, in_dtype, 0, amax, stream, 0, amax_record);
    run_cast(x, in_dtype, 0, 0, spec, fmt, false, nullptr, nullptr, amax, stream);
    return;
  }
  if (current) run_act_amax<GeluTanh>(x, in_dtype, rows * cols, amax, stream);
  run_act_cast<GeluTanh>(x, in_dtype, rows, cols, spec, fmt, !current, out, out_t, amax,
                         current ? nullptr : amax_record, stream);
}

void launch_fp8_amax(const void* x, DType in_dtype, int64_t n, float* amax_out, cudaStream_t stream) {
  require_input_dtype(in_dtype, "fp8_amax input");
  require(n >= 0, "element count must be non-negative");
  zero_amax(amax_out, 1, stream);
  if (n > 0) run_amax(x, in_dtype, n, amax_out, stream);
}

void launch_bias_reduce(const BiasGradOut& bias, int64_t rows, int64_t cols, cudaStream_t stream) {
  require(rows >= 0 && cols >= 0, "bias_reduce: negative shape");
  check_bias_grad(&bias, rows, cols);
  run_bias_reduce(bias, rows, cols, stream);
}

void launch_bias_grad(const void* x, DType in_dtype, int64_t rows, int64_t cols, const BiasGradOut& bias,
                      cudaStream_t stream) {
  require_input_dtype(in_dtype, "bias_grad input");
  check_shape(rows, cols);
  check_bias_grad(&bias, rows, cols);
  const int64_t T = bias_tile_rows(rows);
  if (T > 0 && cols > 0) {
    const int64_t gx = (cols + kTC - 1) / kTC;
    require(gx <= 0x7FFFFFFF, "bias_grad: too many columns");
    dispatch_input(in_dtype, [&](auto tag) {
      using T_ = decltype(tag);
      const bool vec_ok = aligned16(x) && cols % Vec16<T_>::kElems == 0;
      bias_partials_kernel<T_><<<dim3(unsigned(gx), unsigned(T)), kThreads, 0, stream>>>(
          static_cast<const T_*>(x), rows, cols, vec_ok, bias.partials);
      check_launch("bias_partials_kernel");
    });
  }
  run_bias_reduce(bias, rows, cols, stream);
}

void launch_fp8_quantize(const void* x, DType in_dtype, int64_t rows, int64_t cols, const float* scale,
                         DType out_dtype, void* out, void* out_t, float* scale_inv, float* amax,
                         cudaStream_t stream, float* amax_record, const BiasGradOut* bias) {
  require_input_dtype(in_dtype, "fp8_quantize input");
  check_shape(rows, cols);
  const Fp8Fmt fmt = fp8_fmt_of(out_dtype, "fp8_quantize output dtype");
  require(scale != nullptr && scale_inv != nullptr && amax != nullptr, "fp8_quantize: null scale/scale_inv/amax");
  check_bias_grad(bias, rows, cols);
  zero_amax(amax, 1, stream);
  ScaleSpec spec{scale, nullptr, 0.0f, 0.0f, 0, nullptr, scale_inv};
  if (bias != nullptr) {
    // One pass: the copies (either may be null), the amax and the bias gradient's tile sums.
    if (rows * cols > 0) {
      run_cast(x, in_dtype, rows, cols, spec, fmt, true, out, out_t, amax, stream, false, 0, amax_record,
               bias->partials);
    } else {
      if (amax_record != nullptr) run_amax(x, in_dtype, 0, amax, stream, 0, amax_record);
      run_cast(x, in_dtype, 0, 0, spec, fmt, false, nullptr, nullptr, amax, stream);
    }
    run_bias_reduce(*bias, rows, cols, stream);
    return;
  }
  if (out == nullptr && out_t == nullptr) {
    // Neither copy wanted: still report amax and scale_inv (and merge the amax into amax_record).
    if (rows * cols > 0 || amax_record != nullptr) run_amax(x, in_dtype, rows * cols, amax, stream, 0, amax_record);
    run_cast(x, in_dtype, 0, 0, spec, fmt, false, nullptr, nullptr, amax, stream);
    return;
  }
  run_cast(x, in_dtype, rows, cols, spec, fmt, true, out, out_t, amax, stream, false, 0, amax_record);
}

void launch_fp8_current_scaling_quantize(const void* x, DType in_dtype, int64_t rows, int64_t cols,
                                         DType out_dtype, bool power_2_scale, float amax_epsilon,
                                         void* out, void* out_t, float* scale, float* scale_inv,
                                         float* amax, cudaStream_t stream, const BiasGradOut* bias,
                                         uint32_t* amax_ws) {
  require_input_dtype(in_dtype, "fp8_current_scaling_quantize input");
  check_shape(rows, cols);
  const Fp8Fmt fmt = fp8_fmt_of(out_dtype, "fp8_current_scaling_quantize output dtype");
  require(scale != nullptr && scale_inv != nullptr && amax != nullptr,
          "fp8_current_scaling_quantize: null scale/scale_inv/amax");
  check_bias_grad(bias, rows, cols);
  if (rows * cols == 0) amax_ws = nullptr;  // no amax kernel runs: the memset writes the zero amax
  if (amax_ws == nullptr) zero_amax(amax, 1, stream);
  const float fmt_max = fmt == Fp8Fmt::kE4M3 ? kE4M3Max : kE5M2Max;
  ScaleSpec spec{nullptr, amax, fmt_max, amax_epsilon, power_2_scale ? 1 : 0, scale, scale_inv};
  if (bias != nullptr) {
    // The amax pass, then one pass for the copies (either may be null) and the bias gradient's tile sums.
    if (rows * cols > 0) {
      run_amax(x, in_dtype, rows * cols, amax, stream, 0, nullptr, amax_ws);
      run_cast(x, in_dtype, rows, cols, spec, fmt, false, out, out_t, amax, stream, false, 0, nullptr,
               bias->partials);
    } else {
      run_cast(x, in_dtype, 0, 0, spec, fmt, false, nullptr, nullptr, amax, stream);
    }
    run_bias_reduce(*bias, rows, cols, stream);
    return;
  }
  if (out == nullptr && out_t == nullptr) {
    if (rows * cols > 0) run_amax(x, in_dtype, rows * cols, amax, stream, 0, nullptr, amax_ws);
    run_cast(x, in_dtype, 0, 0, spec, fmt, false, nullptr, nullptr, amax, stream);
    return;
  }
  if (out_t == nullptr) {
    // Rowwise only: amax and cast on one grid, the cast walking each block's range backwards (L2 hits).
    const int64_t grid = rowwise_cast_grid(in_dtype, rows * cols, fmt, x, out);
    if (rows * cols > 0) run_amax(x, in_dtype, rows * cols, amax, stream, grid, nullptr, amax_ws);
    run_cast(x, in_dtype, rows, cols, spec, fmt, false, out, nullptr, amax, stream, true, grid);
    return;
  }
  if (rows * cols > 0) run_amax(x, in_dtype, rows * cols, amax, stream, 0, nullptr, amax_ws);
  run_cast(x, in_dtype, rows, cols, spec, fmt, false, out, out_t, amax, stream);
}

void launch_fp8_cast_from_amax(const void* x, DType in_dtype, int64_t rows, int64_t cols, DType out_dtype,
                               bool power_2_scale, float amax_epsilon, void* out, void* out_t, float* scale,
                               float* scale_inv, const float* amax_in, cudaStream_t stream, const BiasGradOut* bias) {
  require_input_dtype(in_dtype, "fp8_cast_from_amax input");
  check_shape(rows, cols);
  const Fp8Fmt fmt = fp8_fmt_of(out_dtype, "fp8_cast_from_amax output dtype");
  require(scale != nullptr && scale_inv != nullptr && amax_in != nullptr,
          "fp8_cast_from_amax: null scale/scale_inv/amax");
  check_bias_grad(bias, rows, cols);
  const float fmt_max = fmt == Fp8Fmt::kE4M3 ? kE4M3Max : kE5M2Max;
  ScaleSpec spec{nullptr, amax_in, fmt_max, amax_epsilon, power_2_scale ? 1 : 0, scale, scale_inv};
  const bool copies = rows * cols > 0 && (out != nullptr || out_t != nullptr || bias != nullptr);
  if (!copies) {
    // nothing to cast: one block still writes scale and scale_inv
    run_cast(x, in_dtype, 0, 0, spec, fmt, false, nullptr, nullptr, nullptr, stream);
  } else {
    run_cast(x, in_dtype, rows, cols, spec, fmt, false, out, out_t, nullptr, stream, false, 0, nullptr,
             bias != nullptr ? bias->partials : nullptr);
  }
  if (bias != nullptr) run_bias_reduce(*bias, rows, cols, stream);
}

void launch_fp8_dequantize(const void* data, DType fp8_dtype, int64_t n, const float* scale_inv, void* out,
                           DType out_dtype, cudaStream_t stream) {
  const Fp8Fmt fmt = fp8_fmt_of(fp8_dtype, "fp8_dequantize data dtype");
  require_input_dtype(out_dtype, "fp8_dequantize out_dtype");
  require(n >= 0, "element count must be non-negative");
  if (n == 0) return;
  dispatch_input(out_dtype, [&](auto tag) {
    using OutT = decltype(tag);
    dispatch_fmt(fmt, [&](auto ftag) {
      dispatch_bool(aligned16(data) && aligned16(out), [&](auto vec) {
        auto kernel = dequant_kernel<decltype(ftag)::value, OutT, false, decltype(vec)::value>;
        const int64_t grid = persistent_grid(kernel, (n + DqVec<OutT>::kTile - 1) / DqVec<OutT>::kTile);
        kernel<<<grid, kThreads, 0, stream>>>(static_cast<const uint8_t*>(data), n, nullptr, 1, scale_inv,
                                              static_cast<OutT*>(out));
        check_launch("fp8 dequant_kernel");
      });
    });
  });
}

void launch_fp8_grouped_quantize(const void* x, DType in_dtype, int64_t n, const int64_t* offsets,
                                 int64_t num_groups, const float* scales, DType out_dtype, void* out,
                                 float* scale_inv, float* amax, cudaStream_t stream) {
  require_input_dtype(in_dtype, "fp8_grouped_quantize input");
  const Fp8Fmt fmt = fp8_fmt_of(out_dtype, "fp8_grouped_quantize output dtype");
  require(n >= 0 && num_groups >= 0, "fp8_grouped_quantize: negative size");
  require(num_groups > 0 || n == 0,
          "fp8_grouped_quantize: " + std::to_string(n) + " elements but no groups");
  require(num_groups <= INT32_MAX, "fp8_grouped_quantize: at most 2^31 - 1 groups, got " + std::to_string(num_groups));
  if (num_groups == 0) return;
  zero_amax(amax, num_groups, stream);
  dispatch_input(in_dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int64_t kTile = int64_t(kThreads) * kUnroll * Vec16<T>::kElems;
    dispatch_fmt(fmt, [&](auto ftag) {
      dispatch_bool(aligned16(x) && aligned16(out), [&](auto vec) {
        auto kernel = grouped_cast_kernel<T, decltype(ftag)::value, decltype(vec)::value, true>;
        int64_t grid = persistent_grid(kernel, (n + kTile - 1) / kTile);
        // Enough threads to write every scale_inv even when there is no data.
        grid = std::max<int64_t>(grid, std::min<int64_t>((num_groups + kThreads - 1) / kThreads, 65535));
        kernel<<<grid, kThreads, 0, stream>>>(static_cast<const T*>(x), n, offsets, num_groups, scales,
                                              static_cast<uint8_t*>(out), scale_inv,
                                              reinterpret_cast<uint32_t*>(amax));
        check_launch("fp8 grouped_cast_kernel");
      });
    });
  });
}

void launch_fp8_grouped_amax(const void* x, DType in_dtype, int64_t n, const int64_t* offsets, int64_t num_groups,
                             float* amax, cudaStream_t stream) {
  require_input_dtype(in_dtype, "fp8_grouped_amax input");
  require(n >= 0 && num_groups >= 0, "fp8_grouped_amax: negative size");
  require(num_groups > 0 || n == 0, "fp8_grouped_amax: " + std::to_string(n) + " elements but no groups");
  require(num_groups <= INT32_MAX, "fp8_grouped_amax: at most 2^31 - 1 groups, got " + std::to_string(num_groups));
  if (num_groups == 0) return;
  zero_amax(amax, num_groups, stream);
  if (n == 0) return;
  dispatch_input(in_dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int64_t kTile = int64_t(kThreads) * kUnroll * Vec16<T>::kElems;
    dispatch_bool(aligned16(x), [&](auto vec) {
      auto kernel = grouped_cast_kernel<T, Fp8Fmt::kE4M3, decltype(vec)::value, false>;
      const int64_t grid = persistent_grid(kernel, (n + kTile - 1) / kTile);
      kernel<<<grid, kThreads, 0, stream>>>(static_cast<const T*>(x), n, offsets, num_groups, nullptr, nullptr,
                                            nullptr, reinterpret_cast<uint32_t*>(amax));
      check_launch("fp8 grouped amax kernel");
    });
  });
}

void launch_fp8_grouped_dequantize(const void* data, DType fp8_dtype, int64_t n, const int64_t* offsets,
                                   int64_t num_groups, const float* scale_inv, void* out, DType out_dtype,
                                   cudaStream_t stream) {
  const Fp8Fmt fmt = fp8_fmt_of(fp8_dtype, "fp8_grouped_dequantize data dtype");
  require_input_dtype(out_dtype, "fp8_grouped_dequantize out_dtype");
  require(n >= 0 && num_groups >= 0, "fp8_grouped_dequantize: negative size");
  require(num_groups > 0 || n == 0,
          "fp8_grouped_dequantize: " + std::to_string(n) + " elements but no groups");
  if (n == 0) return;
  dispatch_input(out_dtype, [&](auto tag) {
    using OutT = decltype(tag);
    dispatch_fmt(fmt, [&](auto ftag) {
      dispatch_bool(aligned16(data) && aligned16(out), [&](auto vec) {
        auto kernel = dequant_kernel<decltype(ftag)::value, OutT, true, decltype(vec)::value>;
        const int64_t grid = persistent_grid(kernel, (n + DqVec<OutT>::kTile - 1) / DqVec<OutT>::kTile);
        kernel<<<grid, kThreads, 0, stream>>>(static_cast<const uint8_t*>(data), n, offsets, num_groups,
                                              scale_inv, static_cast<OutT*>(out));
        check_launch("fp8 grouped dequant_kernel");
      });
    });
  });
}

}  // namespace fp_recipes
