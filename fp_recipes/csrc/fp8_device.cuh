// Device building blocks (and their host-side launch helpers) of the FP8 per-tensor cast kernels,
// shared by fp8_cast.cu (single tensor, grouped buffer) and fp8_multi_cast.cu (many tensors, one
// launch), so that every path computes each byte with the same code. Numerics: fp8_cast.cu's header.
// Each including .cu gets its own copy (anonymous namespace; no relocatable device code).
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <climits>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>

#include "common.h"
#include "formats.cuh"

namespace fp_recipes {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

// ---------------------------------------------------------------------------------------------
// Input element helpers
template <typename T>
struct Vec16 {
  static constexpr int kElems = 16 / sizeof(T);
};

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ void unpack16(const uint4& u, float* f);

template <>
__device__ __forceinline__ void unpack16<float>(const uint4& u, float* f) {
  f[0] = __uint_as_float(u.x);
  f[1] = __uint_as_float(u.y);
  f[2] = __uint_as_float(u.z);
  f[3] = __uint_as_float(u.w);
}

template <>
__device__ __forceinline__ void unpack16<__half>(const uint4& u, float* f) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __half2 h = *reinterpret_cast<const __half2*>(&w[i]);
    float2 p = __half22float2(h);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

template <>
__device__ __forceinline__ void unpack16<__nv_bfloat16>(const uint4& u, float* f) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    // bf16 -> fp32 is a 16-bit shift: exact, NaN payloads kept.
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
  }
}

template <typename OutT>
__device__ __forceinline__ OutT from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// ---------------------------------------------------------------------------------------------
// An activation applied to each loaded value of T before its amax and cast: the cast of a tensor that the
// activation's kernel would have written in T (the fused producer of a layer's input). Each result is rounded
// to T, as that kernel's output is.
struct NoActivation {
  template <typename T>
  __device__ __forceinline__ static float apply(float f) { return f; }
};

// torch's F.gelu(x, approximate="tanh") on CUDA, operation for operation (aten's GeluCUDAKernelImpl: x^3 as two
// products, x + kappa * x^3 as one FMA, which nvcc contracts it into there; this file is built with
// -fmad=false, so the FMA is written out), then rounded to T.
struct GeluTanh {
  template <typename T>
  __device__ __forceinline__ static float apply(float x) {
    constexpr float kBeta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5);
    constexpr float kKappa = 0.044715f;
    const float cube = __fmul_rn(__fmul_rn(x, x), x);
    const float inner = __fmul_rn(kBeta, __fmaf_rn(kKappa, cube, x));
    return to_f32(from_f32<T>(__fmul_rn(__fmul_rn(0.5f, x), __fadd_rn(1.0f, tanhf(inner)))));
  }
};

// ---------------------------------------------------------------------------------------------
// Block-wide max of unsigned keys; the result is valid in thread 0. Ends with a barrier so the
// shared scratch may be reused immediately (no iteration-to-iteration race: seed 001).
__device__ __forceinline__ uint32_t block_max_key(uint32_t key) {
  __shared__ uint32_t warp_keys[kThreads / 32];
  key = __reduce_max_sync(0xFFFFFFFFu, key);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_keys[warp] = key;
  __syncthreads();
  if (warp == 0) {
    key = lane < kThreads / 32 ? warp_keys[lane] : 0u;
    key = __reduce_max_sync(0xFFFFFFFFu, key);
  }
  __syncthreads();
  return key;
}

__device__ __forceinline__ void flush_amax(uint32_t key, uint32_t* amax_bits) {
  key = block_max_key(canonical_key(key));
  if (threadIdx.x == 0 && key != 0u) atomicMax(amax_bits, key);
}

// *slot = torch.maximum(*slot, v) for v = the FP32 of a canonical key (a non-negative amax or the
// canonical NaN): a NaN slot stays as it is, a NaN v replaces any other slot, else the larger value (the
// slot may hold any float). Merging the blocks' partial maxima one by one gives the maximum of the whole
// tensor's amax, as the one torch.maximum after the kernel did (NaN wins whichever block finds it).
__device__ __forceinline__ void record_max(float* slot, uint32_t key) {
  unsigned int* const p = reinterpret_cast<unsigned int*>(slot);
  const float v = __uint_as_float(key);
  unsigned int cur = *reinterpret_cast<volatile unsigned int*>(p);
  while (true) {
    const float o = __uint_as_float(cur);
    if (o != o || !(v != v || v > o)) return;
    const unsigned int prev = atomicCAS(p, cur, key);
    if (prev == cur) return;
    cur = prev;
  }
}

// flush_amax, and the block's maximum also merged into a delayed-scaling history slot (record: null for
// none). Every block merges, a zero maximum included (torch.maximum(slot, 0) of a negative slot is 0).
// ws (null: the caller zeroed *amax_bits): memset-free, as nvfp4_amax.cu's kernels: the blocks combine in a
// zeroed per-stream workspace {max, -, ticket, -} and the last block to take a ticket writes *amax_bits and
// zeroes the workspace again for the next launch on the stream (one launch instead of memset + kernel).
__device__ __forceinline__ void flush_amax_record(uint32_t key, uint32_t* amax_bits, float* record,
                                                  uint32_t* ws = nullptr) {
  key = block_max_key(canonical_key(key));
  if (threadIdx.x == 0) {
    if (ws == nullptr) {
      if (key != 0u) atomicMax(amax_bits, key);
      if (record != nullptr) record_max(record, key);
      return;
    }
    if (record != nullptr) record_max(record, key);
    if (key != 0u) atomicMax(ws, key);
    __threadfence();
    const unsigned blocks = gridDim.x * gridDim.y * gridDim.z;
    if (atomicAdd(ws + 2, 1u) == blocks - 1) {  // every other block has merged (fence above)
      __threadfence();
      *amax_bits = atomicExch(ws, 0u);
      atomicExch(ws + 2, 0u);
    }
  }
}

// The current-scaling rule of the reference (ops/ref_fp8.py, fp8_current_scaling_quantize):
// a = max(amax, eps) (NaN stays NaN); scale = RN(fmt_max / a), +Inf -> FLT_MAX; a == 0 or a not
// finite -> 1; power of two: keep only sign and exponent bits (2^floor(log2 scale), exact).
__device__ __forceinline__ float fp8_current_scale(float amax, float fmt_max, float eps, int pow2) {
  float a = (amax < eps) ? eps : amax;  // NaN compares false: NaN kept
  float scale;
  if (!(a > 0.0f) || !isfinite(a)) {
    scale = 1.0f;
  } else {
    scale = __fdiv_rn(fmt_max, a);
    if (isinf(scale)) scale = FLT_MAX;
  }
  if (pow2) scale = __uint_as_float(__float_as_uint(scale) & 0xFF800000u);
  return scale;
}

// ---------------------------------------------------------------------------------------------
// One 16-byte vector of inputs -> V FP8 bytes at dst (with the amax folded into key).
template <typename T, Fp8Fmt F, bool kAmax, bool kStore>
__device__ __forceinline__ void cast_vec(const uint4& in, float s, uint8_t* __restrict__ dst, uint32_t& key) {
  constexpr int V = Vec16<T>::kElems;
  float f[V];
  unpack16<T>(in, f);
  uint32_t w[V / 4];
#pragma unroll
  for (int j = 0; j < V; j += 2) {
    if (kAmax) key = max(key, max(abs_key(f[j]), abs_key(f[j + 1])));
    if (kStore) {
      uint32_t p = encode_fp8x2<F>(__fmul_rn(f[j], s), __fmul_rn(f[j + 1], s));
      if ((j & 2) == 0) {
        w[j / 4] = p;
      } else {
        w[j / 4] |= p << 16;
      }
    }
  }
  if constexpr (kStore) {
    if constexpr (V == 8) {
      __stcs(reinterpret_cast<uint2*>(dst), make_uint2(w[0], w[1]));
    } else {
      __stcs(reinterpret_cast<unsigned int*>(dst), w[0]);
    }
  }
}

// One tile [ts, te) of elements that all use scale s. Full aligned tiles: 16-byte vectors, all
// kUnroll loads in flight before use. Otherwise (tail, misaligned base): element by element.
template <typename T, Fp8Fmt F, bool kAmax, bool kVec>
__device__ __forceinline__ void cast_tile(const T* __restrict__ x, uint8_t* __restrict__ out,
                                          int64_t ts, int64_t te, float s, uint32_t& key) {
  constexpr int V = Vec16<T>::kElems;
  constexpr int64_t kTile = int64_t(kThreads) * kUnroll * V;
  if (kVec && te - ts == kTile) {
    uint4 in[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      in[k] = __ldcs(reinterpret_cast<const uint4*>(x + ts + (int64_t(k) * kThreads + threadIdx.x) * V));
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      cast_vec<T, F, kAmax, true>(in[k], s, out + ts + (int64_t(k) * kThreads + threadIdx.x) * V, key);
    }
  } else {
    for (int64_t i = ts + threadIdx.x; i < te; i += kThreads) {
      float f = to_f32(x[i]);
      if (kAmax) key = max(key, abs_key(f));
      out[i] = encode_fp8<F>(__fmul_rn(f, s));
    }
  }
}

template <typename T, bool kVec, typename Act = NoActivation>
__device__ __forceinline__ void amax_tile(const T* __restrict__ x, int64_t ts, int64_t te, uint32_t& key) {
  constexpr int V = Vec16<T>::kElems;
  constexpr int64_t kTile = int64_t(kThreads) * kUnroll * V;
  if (kVec && te - ts == kTile) {
    uint4 in[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      in[k] = __ldg(reinterpret_cast<const uint4*>(x + ts + (int64_t(k) * kThreads + threadIdx.x) * V));
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      float f[V];
      unpack16<T>(in[k], f);
#pragma unroll
      for (int j = 0; j < V; ++j) key = max(key, abs_key(Act::template apply<T>(f[j])));
    }
  } else {
    for (int64_t i = ts + threadIdx.x; i < te; i += kThreads)
      key = max(key, abs_key(Act::template apply<T>(to_f32(x[i]))));
  }
}

// The contiguous tile range [t0, t1) of this block in a persistent grid.
__device__ __forceinline__ void block_tile_range(int64_t ntiles, int64_t& t0, int64_t& t1) {
  t0 = ntiles * blockIdx.x / gridDim.x;
  t1 = ntiles * (blockIdx.x + 1) / gridDim.x;
}

// Rowwise and/or transposed copies in one pass over 64x64 tiles staged in shared memory.
constexpr int kTR = 64, kTC = 64, kTPad = 2;
constexpr int kBiasSegment = 16;  // rows summed sequentially before the segments of a tile are added

// The column sums of one staged kTR x kTC tile of FP32 values (rows past M already +0.0), in the order
// of the reference (ops/ref_fp8.py, bias_grad): partials[c0 + c] = ((S0 + S1) + S2) + S3 for the
// columns c0 + c < N, S_q the sequential __fadd_rn sum of rows 16q .. 16q + 15. Thread -> (column c,
// segment q); all threads of the block call it (it has a barrier). partials: this tile row's (N,) slice.
__device__ __forceinline__ void bias_tile_sums(const float (*vals)[kTC + 1], int64_t c0, int64_t N,
                                               float* __restrict__ partials) {
  static_assert(kThreads == 4 * kTC && kTR == 4 * kBiasSegment, "bias sums: 4 segments of 16 rows per column");
  __shared__ float seg_sum[kTR / kBiasSegment][kTC];
  const int c = threadIdx.x % kTC, q = threadIdx.x / kTC;
  float acc = vals[q * kBiasSegment][c];
#pragma unroll
  for (int j = 1; j < kBiasSegment; ++j) acc = __fadd_rn(acc, vals[q * kBiasSegment + j][c]);
  seg_sum[q][c] = acc;
  __syncthreads();
  if (threadIdx.x < kTC && c0 + threadIdx.x < N) {
    const int cc = threadIdx.x;
    partials[c0 + cc] =
        __fadd_rn(__fadd_rn(__fadd_rn(seg_sum[0][cc], seg_sum[1][cc]), seg_sum[2][cc]), seg_sum[3][cc]);
  }
}

// One kTR x kTC tile (rows [r0, r0 + kTR), columns [c0, c0 + kTC)) of the (M, N) row-major x with
// scale s: the rowwise bytes to out (if not null), the transposed bytes to out_t (N, M) (if not
// null), |x| folded into key. vec_ok: x 16-byte aligned, out (if any) aligned for V-byte stores and
// N % V == 0; t_vec_ok: the 16-byte stores of out_t are aligned (M % 16 == 0 and out_t aligned).
// Ends without a barrier after the last shared-memory read; the caller's flush_amax has one.
//
// kBias: also this tile's column sums for a fused bias gradient, in the order of the reference
// (ops/ref_fp8.py, bias_grad): with the rows past M counted as +0.0, partials[c0 + c] =
// ((S0 + S1) + S2) + S3, S_q the sequential FP32 sum of rows 16q .. 16q + 15 of column c (rows in
// order, __fadd_rn). The FP32 values are staged in shared memory so the order does not depend on which
// thread loaded which row. partials points at this tile row's slice (row r0 / kTR of (T, N)).
//
// kPadT: out_t is (N, Mt) with row stride Mt (M <= Mt <= M rounded up to kTR, so the padding lies in the
// last row tile) and its columns [M, Mt) are written as zeros. The grouped layer's wgrad GEMMs then
// contract over Mt (a multiple of 16: what cuBLASLt FP8 needs) and every store is a 16-byte vector
// (t_vec_ok: Mt % 16 == 0 and out_t aligned). The tile's rows past M are not staged as zeros (that cost
// the FP16 multi kernel 8 registers): the stores mask them out. Without kPadT, Mt is not read and out_t
// is the dense (N, M) of the single-tensor casts, stored exactly as before.
template <typename T, Fp8Fmt F, bool kAmax, bool kBias = false, bool kPadT = false, typename Act = NoActivation>
__device__ __forceinline__ void cast_transpose_tile(const T* __restrict__ x, int64_t M, int64_t N, int64_t r0,
                                                    int64_t c0, float s, bool vec_ok, bool t_vec_ok,
                                                    uint8_t* __restrict__ out, uint8_t* __restrict__ out_t,
                                                    uint32_t& key, float* __restrict__ partials = nullptr,
                                                    int64_t Mt = 0) {
  constexpr int V = Vec16<T>::kElems;
  constexpr int kVPR = kTC / V;                  // vectors per tile row
  constexpr int kIters = kTR * kVPR / kThreads;  // vector loads per thread
  static_assert(kTR * kVPR % kThreads == 0, "tile must split evenly");
  __shared__ uint8_t tile[kTR][kTC + kTPad];
  __shared__ float vals[kBias ? kTR : 1][kTC + 1];  // kBias: the tile's FP32 values
  const bool full = r0 + kTR <= M && c0 + kTC <= N;
  if (vec_ok && full) {
    uint4 in[kIters];
#pragma unroll
    for (int k = 0; k < kIters; ++k) {
      const int i = k * kThreads + threadIdx.x, r = i / kVPR, cv = i % kVPR;
      in[k] = __ldcs(reinterpret_cast<const uint4*>(x + (r0 + r) * N + c0 + cv * V));
    }
#pragma unroll
    for (int k = 0; k < kIters; ++k) {
      const int i = k * kThreads + threadIdx.x, r = i / kVPR, cv = i % kVPR;
      float f[V];
      unpack16<T>(in[k], f);
#pragma unroll
      for (int j = 0; j < V; ++j) f[j] = Act::template apply<T>(f[j]);
      if constexpr (kBias) {
#pragma unroll
        for (int j = 0; j < V; ++j) vals[r][cv * V + j] = f[j];
      }
      uint32_t w[V / 4];
#pragma unroll
      for (int j = 0; j < V; j += 2) {
        if (kAmax) key = max(key, max(abs_key(f[j]), abs_key(f[j + 1])));
        uint32_t p = encode_fp8x2<F>(__fmul_rn(f[j], s), __fmul_rn(f[j + 1], s));
        tile[r][cv * V + j] = static_cast<uint8_t>(p);
        tile[r][cv * V + j + 1] = static_cast<uint8_t>(p >> 8);
        if ((j & 2) == 0) {
          w[j / 4] = p;
        } else {
          w[j / 4] |= p << 16;
        }
      }
      if (out != nullptr) {
        uint8_t* dst = out + (r0 + r) * N + c0 + cv * V;
        if constexpr (V == 8) {
          __stcs(reinterpret_cast<uint2*>(dst), make_uint2(w[0], w[1]));
        } else {
          __stcs(reinterpret_cast<unsigned int*>(dst), w[0]);
        }
      }
    }
  } else {
    for (int i = threadIdx.x; i < kTR * kTC; i += kThreads) {
      const int r = i / kTC, c = i % kTC;
      if (r0 + r < M && c0 + c < N) {
        const float f = Act::template apply<T>(to_f32(x[(r0 + r) * N + c0 + c]));
        if (kAmax) key = max(key, abs_key(f));
        const uint8_t b = encode_fp8<F>(__fmul_rn(f, s));
        tile[r][c] = b;
        if (out != nullptr) out[(r0 + r) * N + c0 + c] = b;
        if constexpr (kBias) vals[r][c] = f;
      } else if constexpr (kBias) {
        vals[r][c] = 0.0f;  // rows past M count as +0.0 (columns past N are never summed)
      }
    }
  }
  __syncthreads();
  if (out_t != nullptr) {
    // Thread -> (column c of the tile, 16-row segment seg): one 16-byte store of out_t[c0 + c, r0 + seg*16 ...].
    const int c = threadIdx.x / 4, seg = threadIdx.x % 4;
    const int64_t ld = kPadT ? Mt : M;  // out_t's row stride, and the rows of the tile it takes
    if (c0 + c < N) {
      const int64_t base = (c0 + c) * ld + r0 + seg * 16;
      if (kPadT ? (t_vec_ok && r0 + seg * 16 < Mt) : (r0 + kTR <= M && t_vec_ok)) {  // (Mt % 16 == 0)
        uint32_t w[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          w[q] = uint32_t(tile[seg * 16 + 4 * q][c]) | (uint32_t(tile[seg * 16 + 4 * q + 1][c]) << 8) |
                 (uint32_t(tile[seg * 16 + 4 * q + 2][c]) << 16) |
                 (uint32_t(tile[seg * 16 + 4 * q + 3][c]) << 24);
        }
        if constexpr (kPadT) {  // the bytes of rows past M (never staged) are stored as the zero padding
          const int64_t left = M - (r0 + seg * 16);
          const int valid = left < 16 ? int(left) : 16;
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const int v = min(max(valid - 4 * q, 0), 4);
            w[q] &= v == 4 ? 0xFFFFFFFFu : (1u << (8 * v)) - 1u;
          }
        }
        __stcs(reinterpret_cast<uint4*>(out_t + base), make_uint4(w[0], w[1], w[2], w[3]));
      } else {
        for (int j = 0; j < 16; ++j) {
          const int64_t r = r0 + seg * 16 + j;
          if (r < ld) out_t[base + j] = (!kPadT || r < M) ? tile[seg * 16 + j][c] : uint8_t(0);
        }
      }
    }
  }
  if constexpr (kBias) bias_tile_sums(vals, c0, N, partials);
}

// ---------------------------------------------------------------------------------------------
// Host side
inline bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

int sm_count() {
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  static int cached[64] = {0};
  if (dev < 64 && cached[dev] > 0) return cached[dev];
  int n = 0;
  check_cuda(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
  if (dev < 64) cached[dev] = n;
  return n;
}

// Persistent grid: as many resident blocks as the kernel's occupancy allows, at most one per tile. The
// occupancy query costs microseconds of host time, paid per launch before: it is cached per device and
// kernel (a kernel's occupancy on a device never changes).
template <typename Kernel>
int64_t persistent_grid(Kernel kernel, int64_t ntiles) {
  static std::mutex mu;
  static std::unordered_map<const void*, int64_t> cache[64];
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  const void* key = reinterpret_cast<const void*>(kernel);
  int64_t resident = 0;
  if (dev < 64) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache[dev].find(key);
    if (it != cache[dev].end()) resident = it->second;
  }
  if (resident == 0) {
    int per_sm = 0;
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0),
               "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    resident = int64_t(std::max(per_sm, 1)) * sm_count();
    if (dev < 64) {
      std::lock_guard<std::mutex> lock(mu);
      cache[dev][key] = resident;
    }
  }
  return std::max<int64_t>(1, std::min<int64_t>(ntiles, resident));
}

Fp8Fmt fp8_fmt_of(DType t, const char* what) {
  if (t == DType::kFloat8E4M3) return Fp8Fmt::kE4M3;
  if (t == DType::kFloat8E5M2) return Fp8Fmt::kE5M2;
  throw std::invalid_argument(std::string("fp_recipes: ") + what + " must be float8_e4m3fn or float8_e5m2, got " +
                              dtype_name(t));
}

void require_input_dtype(DType t, const char* what) {
  require(t == DType::kFloat32 || t == DType::kFloat16 || t == DType::kBFloat16,
          std::string(what) + " must be float32, float16 or bfloat16, got " + dtype_name(t));
}

template <typename Fn>
void dispatch_input(DType t, Fn&& fn) {
  switch (t) {
    case DType::kFloat32: fn(float{}); break;
    case DType::kFloat16: fn(__half{}); break;
    case DType::kBFloat16: fn(__nv_bfloat16{}); break;
    default: require(false, std::string("unsupported input dtype ") + dtype_name(t));
  }
}

template <typename Fn>
void dispatch_fmt(Fp8Fmt f, Fn&& fn) {
  if (f == Fp8Fmt::kE4M3) {
    fn(std::integral_constant<Fp8Fmt, Fp8Fmt::kE4M3>{});
  } else {
    fn(std::integral_constant<Fp8Fmt, Fp8Fmt::kE5M2>{});
  }
}

template <typename Fn>
void dispatch_bool(bool b, Fn&& fn) {
  if (b) fn(std::true_type{}); else fn(std::false_type{});
}

void zero_amax(float* amax, int64_t count, cudaStream_t stream) {
  check_cuda(cudaMemsetAsync(amax, 0, sizeof(float) * size_t(count), stream), "cudaMemsetAsync(amax)");
}

}  // namespace
}  // namespace fp_recipes
