// NVFP4 quantization kernels: rowwise 1x16 (direct loads) and a 64x64 shared-memory tile kernel
// that writes the rowwise and the columnwise (x^T) copies in one pass, with 2-D 16x16 tiles,
// 4over6, RHT on the columnwise copy, stochastic rounding and per-row (row-scaled) amax.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "fp8_kernels.h"
#include "nvfp4_device.cuh"
#include "nvfp4_kernels.h"

namespace fp_recipes {
namespace nvfp4 {
namespace {

constexpr int kThreads = 256;

struct KParams {
  const void* x;
  int64_t M, N;
  uint8_t* data;
  uint8_t* scale;
  const float* amax;
  int row_scaled;
  uint8_t* data_t;
  uint8_t* scale_t;
  const float* amax_t;
  int rht;
  int block_2d;
  int mse;
  float e4m3_max;
  int sr;
  uint64_t seed, offset;
  uint16_t* unit;    // optional BF16 unit operand of the rowwise copy, (M, N)
  uint16_t* unit_t;  // optional BF16 unit operand of the columnwise copy, (N, M)
  float* bias_partials;  // optional (tile2, columnwise): the bias gradient's 64-row tile sums, ((M + 63) / 64, N)
  const uint64_t* rng;   // optional device (seed, offset), read instead of seed/offset (QuantizeArgs::rng_state):
                         // by tile2_kernel's SR instantiations only, which quantize() routes such a launch to
};

// The stochastic-rounding key of a tile2_kernel<kSR> launch: its own values, or the device pair a CUDA graph
// replays with the counter of that replay. (rowwise_kernel and tile_kernel read p.seed/p.offset: their SR code
// shares the RN instantiations, and a read there cost the plain rowwise cast 11 % on an H200, session 40.)
__device__ __forceinline__ uint64_t sr_seed(const KParams& p) {
  return p.rng != nullptr ? __ldg(reinterpret_cast<const unsigned long long*>(p.rng)) : p.seed;
}
__device__ __forceinline__ uint64_t sr_offset(const KParams& p) {
  return p.rng != nullptr ? __ldg(reinterpret_cast<const unsigned long long*>(p.rng) + 1) : p.offset;
}

// Per-mode shape of the rowwise kernel's loop (benchmarks/nvfp4_variants measured the options, all with
// the same bytes): kU 16-element blocks in flight per thread per iteration; kPf 1 = the raw input words
// of the next iteration are loaded before this iteration's blocks are quantized (register double
// buffering); the code packing is RowPack<kFos> (nvfp4_device.cuh).
template <int kFos>
struct RowwiseCfg {
  static constexpr int kU = 2;
  static constexpr int kPf = 0;
};

// v6 plain: prefetch, 2 blocks per iteration (+ IMAD packing, RowPack<0>); the variant benchmark's
// pf_imad_lb (benchmarks/NOTES_nvfp4.md, v6): 77.4 -> 69.8 us at 16384 x 6144 BF16 on H200.
template <>
struct RowwiseCfg<0> {
  static constexpr int kU = 2;
  static constexpr int kPf = 1;
};

// v6 4over6 fast: one block per thread per iteration (48 instead of 79 registers: 5 thread blocks per
// SM instead of 3); the variant benchmark's u1: fast MAE 108.1 -> 101.3 us at 16384 x 6144 BF16 on H200.
template <>
struct RowwiseCfg<2> {
  static constexpr int kU = 1;
  static constexpr int kPf = 0;
};
template <>
struct RowwiseCfg<4> {
  static constexpr int kU = 1;
  static constexpr int kPf = 0;
};

// v6 4over6 strict: one block per thread per iteration (80 instead of 125 registers, 3 thread blocks
// per SM instead of 2, half the shared value tables) + IMAD packing (RowPack); the variant benchmark's
// u1_imad: strict MAE 153.7 -> 135.1 us at 16384 x 6144 BF16 on H200.
template <>
struct RowwiseCfg<1> {
  static constexpr int kU = 1;
  static constexpr int kPf = 0;
};
template <>
struct RowwiseCfg<3> {
  static constexpr int kU = 1;
  static constexpr int kPf = 0;
};

// The raw 16-byte words of one 16-element block (kPf) and their conversion, as load16 does it.
template <typename T>
struct RawBlock {
  uint4 w[16 * sizeof(T) / 16];
};
template <typename T>
__device__ __forceinline__ void load_raw(const T* p, RawBlock<T>& r) {
#pragma unroll
  for (int v = 0; v < 16 * static_cast<int>(sizeof(T)) / 16; ++v) r.w[v] = __ldg(reinterpret_cast<const uint4*>(p) + v);
}
template <typename T>
__device__ __forceinline__ void widen_raw(const RawBlock<T>& r, float (&x)[16]) {
  constexpr int kPerVec = 16 / sizeof(T);
#pragma unroll
  for (int v = 0; v < 16 / kPerVec; ++v) {
    const T* e = reinterpret_cast<const T*>(&r.w[v]);
#pragma unroll
    for (int k = 0; k < kPerVec; ++k) x[v * kPerVec + k] = to_f32<T>(e[k]);
  }
}
// BF16: load16<__nv_bfloat16>'s one integer op per element.
template <>
__device__ __forceinline__ void widen_raw<__nv_bfloat16>(const RawBlock<__nv_bfloat16>& r, float (&x)[16]) {
#pragma unroll
  for (int v = 0; v < 2; ++v) {
    const uint32_t w[4] = {r.w[v].x, r.w[v].y, r.w[v].z, r.w[v].w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      x[v * 8 + 2 * k] = __uint_as_float(w[k] << 16);
      x[v * 8 + 2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
    }
  }
}

// One block of the rowwise kernel: quantize and store.
template <int kFos>
__device__ __forceinline__ void rowwise_block(const KParams& p, const float (&x)[16], int64_t g, int64_t blocks_per_row,
                                              const TensorScale& t_all, const float2* tab, float* vt) {
  const TensorScale t = p.row_scaled ? make_tensor_scale(__ldg(p.amax + g / blocks_per_row), p.e4m3_max) : t_all;
  uint2 q;
  uint32_t sf;
  quantize_block_1d<kFos>(x, t, p.sr, static_cast<uint64_t>(g), p.seed, p.offset, q, sf, tab, vt);
  reinterpret_cast<uint2*>(p.data)[g] = q;
  p.scale[g] = static_cast<uint8_t>(sf);
  if (p.unit != nullptr) store_unit16(q, sf, p.unit + g * 16);
}

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FAMILY_SPECIFIC__) && (__CUDA_ARCH_FAMILY_SPECIFIC__ >= 1000)
constexpr bool kHwE2M1 = true;  // encode16_rn is cvt.rn.satfinite.e2m1x2 (sm_100-family)
#else
constexpr bool kHwE2M1 = false;
#endif

// Rowwise, 1-D blocks: a grid-stride loop over 1x16 blocks, RowwiseCfg<kFos>::kU blocks in flight per
// thread; consecutive threads take consecutive blocks (coalesced 16-byte loads).
template <typename T, int kFos>
__global__ void __launch_bounds__(kThreads) rowwise_kernel(KParams p) {
  constexpr int kU = RowwiseCfg<kFos>::kU;
  // The prefetch holds kU raw blocks per thread: 2 x 8 registers for 16-bit inputs. FP32 inputs (2 x 16:
  // 104 instead of 58 registers on sm_90a) and the sm_100a hardware encode (64 -> 123 registers) would
  // halve the thread blocks per SM, unmeasured, so they load directly.
  constexpr bool kPf = RowwiseCfg<kFos>::kPf && sizeof(T) <= 2 && !kHwE2M1;
  const int64_t blocks_per_row = p.N / 16;
  const int64_t total = p.M * blocks_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const T* src = static_cast<const T*>(p.x);
  TensorScale t_all;
  if (!p.row_scaled) t_all = make_tensor_scale(__ldg(p.amax), p.e4m3_max);
  // 4over6 with one tensor scale: the {fp32(sf), enc} table of its two candidate codes per block.
  __shared__ float2 enc_tab[kFos != 0 ? 256 : 1];
  const float2* tab = nullptr;
  if (kFos != 0 && !p.row_scaled) {
    fill_enc_table(enc_tab, t_all.s_dec, threadIdx.x, kThreads);
    __syncthreads();
    tab = enc_tab;
  }
  // Strict 4over6: per-thread value tables of both candidates, one set per block in flight (u).
  static_assert(kThreads == kValStride, "fos_val addresses entries kValStride floats apart");
  __shared__ float val_tab[fos_fast(kFos) || kFos == 0 ? 1 : kU * 16 * kThreads];
  float* vt[kU];
#pragma unroll
  for (int u = 0; u < kU; ++u)
    vt[u] = (!fos_fast(kFos) && kFos != 0) ? val_tab + u * 16 * kThreads + threadIdx.x : nullptr;
  int64_t g0 = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (!kPf) {
    for (; g0 < total; g0 += kU * stride) {
      float x[kU][16];
      int64_t g[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) g[u] = g0 + u * stride;
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (u == 0 || g[u] < total) load16(src + g[u] * 16, x[u]);
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        if (u > 0 && g[u] >= total) break;
        rowwise_block<kFos>(p, x[u], g[u], blocks_per_row, t_all, tab, vt[u]);
      }
    }
  } else {
    RawBlock<T> raw[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (g0 + u * stride < total) load_raw(src + (g0 + u * stride) * 16, raw[u]);
    for (; g0 < total; g0 += kU * stride) {
      RawBlock<T> cur[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) cur[u] = raw[u];
      const int64_t gn = g0 + kU * stride;
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (gn + u * stride < total) load_raw(src + (gn + u * stride) * 16, raw[u]);
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int64_t g = g0 + u * stride;
        if (u > 0 && g >= total) break;
        float x[16];
        widen_raw(cur[u], x);
        rowwise_block<kFos>(p, x, g, blocks_per_row, t_all, tab, vt[u]);
      }
    }
  }
}

// ---- tile kernel ------------------------------------------------------------------------------
constexpr int kTile = 64;

template <typename T, int kFos>
__global__ void __launch_bounds__(kThreads) tile_kernel(KParams p) {
  __shared__ float tile[kTile][kTile + 1];
  __shared__ uint32_t tile_amax_bits[4][4];   // 2-D: [row tile][col tile]
  __shared__ float fos_err[2][kTile][4];      // 2-D 4over6: per-row errors [cand][row][col tile]
  __shared__ uint8_t fos_use4[4][4];          // 2-D 4over6: decision per tile

  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int tid = threadIdx.x;
  const bool do_row = p.data != nullptr;
  const bool do_col = p.data_t != nullptr;

  // Row unit: row rr of the tile, 16 columns starting at cb*16.
  const int rr = tid / 4, cb = tid % 4;
  const int64_t row = r0 + rr, col16 = c0 + cb * 16;
  float x[16];
  {
    const T* src = static_cast<const T*>(p.x);
    const bool full = row < p.M && col16 + 16 <= p.N && (p.N * sizeof(T)) % 16 == 0;
    if (full) {
      load16(src + row * p.N + col16, x);
    } else {
#pragma unroll
      for (int k = 0; k < 16; ++k)
        x[k] = (row < p.M && col16 + k < p.N) ? to_f32<T>(src[row * p.N + col16 + k]) : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < 16; ++k) tile[rr][cb * 16 + k] = x[k];
  }
  const bool row_valid = row < p.M && col16 + 16 <= p.N;

  const uint32_t row_bits = __float_as_uint(block_absmax16(x));

  if (p.block_2d) {
    if (tid < 16) tile_amax_bits[tid / 4][tid % 4] = 0u;
    __syncthreads();
    atomicMax(&tile_amax_bits[rr / 16][cb], row_bits);
  }
  __syncthreads();

  // ---- rowwise copy
  if (p.block_2d) {
    const float tamax = __uint_as_float(tile_amax_bits[rr / 16][cb]);
    const float amax = __ldg(p.amax);
    const TensorScale t = make_tensor_scale(amax, p.e4m3_max);
    uint2 q = make_uint2(0u, 0u);
    uint32_t sf = 0;
    if (kFos == 0) {
      sf = plain_scale_code(tamax, t);
      const float enc = block_enc(nvfp4_e4m3_decode(sf), t.s_dec);
      if (do_row && row_valid) {
        q = p.sr ? encode16_sr(x, enc,
                               sr_block_bits(static_cast<uint64_t>(row * (p.N / 16) + col16 / 16),
                                             p.seed, p.offset))
                 : encode16_rn(x, enc);
      }
    } else {
      // The tile decision needs every row's error, also when only the columnwise copy is wanted.
      const FosCandidates c = fos_candidates(tamax, t, nullptr);
      uint2 q4, q6;
      float e4, e6;
      fos_encode16_any<kFos>(x, tamax, c, t, q4, q6, e4, e6, nullptr);
      fos_err[0][rr][cb] = e4;
      fos_err[1][rr][cb] = e6;
      __syncthreads();
      if (tid < 16) {
        const int ti = tid / 4, tj = tid % 4;
        const float s4 = tree16(&fos_err[0][ti * 16][tj], 4);
        const float s6 = tree16(&fos_err[1][ti * 16][tj], 4);
        fos_use4[ti][tj] = fos_pick4(s4, s6) ? 1 : 0;
      }
      __syncthreads();
      const bool use4 = fos_use4[rr / 16][cb] != 0;
      q = use4 ? q4 : q6;
      sf = use4 ? c.sf4 : c.sf6;
    }
    if (do_row && row_valid) {
      reinterpret_cast<uint2*>(p.data + row * (p.N / 2) + col16 / 2)[0] = q;
      p.scale[row * (p.N / 16) + col16 / 16] = static_cast<uint8_t>(sf);
      if (p.unit != nullptr) store_unit16(q, sf, p.unit + row * p.N + col16);
    }
  } else if (do_row && row_valid) {
    const float amax = p.row_scaled ? __ldg(p.amax + row) : __ldg(p.amax);
    const TensorScale t = make_tensor_scale(amax, p.e4m3_max);
    uint2 q;
    uint32_t sf;
    quantize_block_1d<kFos, 0>(x, t, p.sr, static_cast<uint64_t>(row * (p.N / 16) + col16 / 16),
                            p.seed, p.offset, q, sf, nullptr, nullptr);
    reinterpret_cast<uint2*>(p.data + row * (p.N / 2) + col16 / 2)[0] = q;
    p.scale[row * (p.N / 16) + col16 / 16] = static_cast<uint8_t>(sf);
    if (p.unit != nullptr) store_unit16(q, sf, p.unit + row * p.N + col16);
  }

  if (!do_col) return;
  // ---- columnwise copy: column cc of the tile, rows rb*16 .. rb*16+15 (a 1x16 block of x^T).
  // rb varies fastest across lanes: 4 neighbouring lanes write one 32-byte run of a data_t row.
  const int cc = tid / 4, rb = tid % 4;
  const int64_t col = c0 + cc, row16 = r0 + rb * 16;
  if (col >= p.N || row16 + 16 > p.M) return;
  float v[16];
#pragma unroll
  for (int k = 0; k < 16; ++k) v[k] = tile[rb * 16 + k][cc];
  if (p.rht) rht16_bf16(v);
  const TensorScale t = make_tensor_scale(__ldg(p.amax_t), p.e4m3_max);
  const uint64_t b = static_cast<uint64_t>(col * (p.M / 16) + row16 / 16);
  uint2 q;
  uint32_t sf;
  if (p.block_2d) {
    // The same tile amax (and, with 4over6, the same tile decision) as the rowwise copy.
    const float tamax = __uint_as_float(tile_amax_bits[rb][cc / 16]);
    if (kFos == 0) {
      sf = plain_scale_code(tamax, t);
      const float enc = block_enc(nvfp4_e4m3_decode(sf), t.s_dec);
      q = p.sr ? encode16_sr(v, enc, sr_block_bits(b, p.seed, p.offset)) : encode16_rn(v, enc);
    } else {
      const FosCandidates c = fos_candidates(tamax, t, nullptr);
      const bool use4 = fos_use4[rb][cc / 16] != 0;
      sf = use4 ? c.sf4 : c.sf6;
      q = encode16_rn(v, use4 ? c.enc4 : c.enc6);
    }
  } else {
    quantize_block_1d<kFos, 0>(v, t, p.sr, b, p.seed, p.offset, q, sf, nullptr, nullptr);
  }
  reinterpret_cast<uint2*>(p.data_t + col * (p.M / 2) + row16 / 2)[0] = q;
  p.scale_t[col * (p.M / 16) + row16 / 16] = static_cast<uint8_t>(sf);
  if (p.unit_t != nullptr) store_unit16(q, sf, p.unit_t + col * p.M + row16);
}

// ---- v7 tile kernel: plain (non-4over6) row + column copies at copy bandwidth (issue 13, target 2) ----
// The same bytes as tile_kernel<T, 0> (benchmarks/nvfp4_variants/tile_main.cu checks both against each
// other; tests/test_cuda_nvfp4_kernels.py against the reference twin), reorganised for memory-level
// parallelism and fewer instructions per element:
// - the mode is compile-time (2-D, stochastic rounding, RHT columnwise), so each gets its own registers;
// - a persistent 1-D grid (one wave of resident thread blocks) walks tiles of 64 columns x kRows rows
//   (128 for 16-bit inputs, 64 for FP32: 16 KB either way); the raw input words of the next tile are
//   loaded into registers while the current tile is quantized (register double buffering);
// - the tile sits in shared memory in the input's own type (BF16: half the bytes of an FP32 tile),
//   double buffered (one __syncthreads per tile), with an XOR swizzle of its 16-byte chunks that makes
//   both the 16-byte row stores and the 4-byte column loads conflict-free (16-bit inputs);
// - the column pass reads one 4-byte word per row: two columns per thread for 16-bit inputs;
// - IMAD code packing (RowPack<0>) in both passes, as the plain rowwise kernel.
// RN encode of the tile2 kernel: the exponent-based binade magic (nvfp4_device.cuh, e2m1_round_magic_exp).
#ifndef NVFP4_TILE2_EXP_MAGIC
#define NVFP4_TILE2_EXP_MAGIC 1
#endif
constexpr bool kT2ExpMagic = NVFP4_TILE2_EXP_MAGIC != 0;

// Short path of the tile2 RN encode (per warp): when RN(bamax * enc) < 7 for every active lane's block,
// every |RN(x_i * enc)| < 7 (RN is monotone), where the exponent magic rounds exactly like the clamped
// encode (a in [6, 7) rounds to 6 at quantum 2, as the clamp to 6 would), so the clamp to 6 is left out:
// one ALU op per element fewer. A NaN or Inf element makes bamax NaN / Inf and fails the test; a zero scale
// (enc = FLT_MAX) fails it too. Software encode only (sm_100a keeps encode16_rn's hardware conversion).
#ifndef NVFP4_TILE2_SHORT
#define NVFP4_TILE2_SHORT 1
#endif
constexpr bool kT2Short = NVFP4_TILE2_SHORT != 0;

// Strips (kStrip = kT2Strip): each thread block quantizes 4 consecutive 64-column tiles of one tile row (its next
// tile's copy in flight while it quantizes one) and stages their rowwise scale codes in shared memory, written after
// the strip's last tile as one 16-byte run a row instead of 4-byte pieces of one sector from 4 thread blocks
// (store_bench.cu's tile section: the rowwise scale bytes alone took 30 us at 16384 x 6144, 210 GB/s). The same
// bytes. Measured on an H200 (benchmarks/RESULTS.md session 35 runs 3-4) against one tile a block: 16384 x 6144
// BF16 row+col 141.2 vs 154.4 us, 2-D 148.4 vs 158.9, row + RHT col 163.5 vs 172.1, col 82.9 vs 97.5 (12288 tiles,
// 23 waves of 4 blocks an SM); 4096 x 4096 (2048 tiles, 4 waves) slower: SR row + RHT SR col 59.4 vs 56.2 in a
// Linear step. So the launcher takes strips from NVFP4_TILE2_STRIP_WAVES waves of tiles on
// (nvfp4_set_tile2_strip_min_waves; 0: always, as the tests force them on small shapes).
constexpr int kT2Strip = 4;
#ifndef NVFP4_TILE2_STRIP_WAVES
#define NVFP4_TILE2_STRIP_WAVES 16
#endif
std::atomic<int> g_tile2_strip_min_waves{NVFP4_TILE2_STRIP_WAVES};

__device__ __forceinline__ uint2 t2_encode16_short(const float (&x)[16], float enc) {
  uint32_t s[16];
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const float a = fabsf(__fmul_rn(x[j], enc));
    const uint32_t e = __umulhi(__float_as_uint(fmaxf(a, 1.0f)), exp_k512());
    s[j] = __float_as_uint(__fadd_rn(a, __uint_as_float(e * 0x800002u + (0x4A800000u - 127u * 0x800002u))));
  }
  return make_uint2(pack8<RowPack<0>::value>(s, x), pack8<RowPack<0>::value>(s + 8, x + 8));
}

// Plain RN quantization of one block whose scale comes from `bamax` (the block's own max |x|, or the 2-D
// tile's): quantize_block_1d<0>'s bytes.
__device__ __forceinline__ void t2_quant_rn(const float (&x)[16], float bamax, const TensorScale& t, uint2& q,
                                            uint32_t& sf);

template <typename T>
struct Tile2Cfg {
  static constexpr int kCpt = 4 / static_cast<int>(sizeof(T));  // columns per thread, column pass
  static constexpr int kRows = 64 * kCpt;                       // rows per tile
  static constexpr int kRbt = kCpt;                             // 1x16 row blocks per thread
  static constexpr int kWords = 16 * static_cast<int>(sizeof(T));  // 4-byte words per tile row
  static constexpr int kRb = kRows / 16;                        // 16-row blocks per tile column
  static constexpr int kTileWords = kRows * kWords;             // 4096 (16 KB)
  static constexpr int kVec = static_cast<int>(sizeof(T));      // uint4 per 16-element block
};

// Chunk swizzle of tile row r, a function of the 16-row block r >> 4 only, so that a thread's 16 column
// loads are one base address plus immediate row offsets. 16-bit: chunk ^ (r >> 4): the 32 lanes of a
// column load (8 row blocks x 4 words of one chunk) hit 32 distinct banks; the row blocks' 16-byte
// copies and loads (two rows of one row block per quarter warp) are 2-way. FP32: chunk ^ 2 ((r >> 4) & 3):
// column loads (4 row blocks x 8 consecutive words) conflict-free, row accesses 2-way.
template <typename T>
__device__ __forceinline__ int t2_swz(int r) {
  return sizeof(T) == 2 ? ((r >> 4) & 7) : (((r >> 4) & 3) << 1);
}
template <typename T>
__device__ __forceinline__ int t2_word(int r, int w) {
  return r * Tile2Cfg<T>::kWords + ((((w >> 2) ^ t2_swz<T>(r))) << 2) + (w & 3);
}
// Block cb (16 elements) of tile row r, read back through the swizzle and widened to FP32.
template <typename T>
__device__ __forceinline__ void t2_row_block(const uint32_t* tb, int r, int cb, float (&x)[16]) {
  using C = Tile2Cfg<T>;
  RawBlock<T> rb;
  const uint4* s4 = reinterpret_cast<const uint4*>(tb + r * C::kWords);
#pragma unroll
  for (int v = 0; v < C::kVec; ++v) rb.w[v] = s4[(cb * C::kVec + v) ^ t2_swz<T>(r)];
  widen_raw(rb, x);
}

// rht16_bf16 (nvfp4_device.cuh) with each pair's BF16 rounding in one cvt.rn.bf16x2.f32 and the NaN sign
// fix as one max.NaN.bf16x2 of the pair with itself (a NaN becomes the canonical, positive BF16 NaN;
// every other value, -0 included, is unchanged), where rht16_bf16 spends a conversion, a compare and a
// select per element. The values are rht16_bf16's but for a NaN's payload (0x7FFF0000 instead of
// 0x7FC00000), which no byte of the quantization reads: the block amax (max.NaN) makes any NaN the
// canonical one, RN(NaN * enc) clamps to 6 (code 7) whatever the payload, and the code's sign bit is the
// element's sign bit, positive either way.
__device__ __forceinline__ void rht16_bf16_pk(float (&v)[16]) {
  rht16_butterfly(v);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    __nv_bfloat162 p = __floats2bfloat162_rn(__fmul_rn(v[2 * i], 0.25f), __fmul_rn(v[2 * i + 1], 0.25f));
    p = __hmax2_nan(p, p);
    uint32_t w;
    memcpy(&w, &p, 4);
    v[2 * i] = __uint_as_float(w << 16);
    v[2 * i + 1] = __uint_as_float(w & 0xFFFF0000u);
  }
}

// The two (16-bit) or one (FP32) column values of a tile word.
template <typename T>
__device__ __forceinline__ float t2_col(uint32_t w, int j);
template <>
__device__ __forceinline__ float t2_col<__nv_bfloat16>(uint32_t w, int j) {
  return __uint_as_float(j == 0 ? (w << 16) : (w & 0xFFFF0000u));
}
template <>
__device__ __forceinline__ float t2_col<__half>(uint32_t w, int j) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(j == 0 ? (w & 0xFFFFu) : (w >> 16))));
}
template <>
__device__ __forceinline__ float t2_col<float>(uint32_t w, int) {
  return __uint_as_float(w);
}

// cp.async (sm_80+): 16 bytes global -> shared, bypassing registers; src_bytes 0 writes 16 zero bytes.
__device__ __forceinline__ void t2_cp_async16(void* smem, const void* gmem, int src_bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void t2_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void t2_cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Start the copy of this thread's row blocks of the tile at (r0, c0) into tb (rows r0 + tid / 4 + 64 i,
// columns c0 + (tid % 4) * 16 ...). Out-of-range elements become zero (as in tile_kernel). vec_ok
// (N * sizeof(T) % 16 == 0): each 16-byte chunk lies wholly inside or outside the tensor, and cp.async
// copies it; otherwise the elements are copied one by one (synchronously).
template <typename T>
__device__ __forceinline__ void t2_issue(const KParams& p, int64_t r0, int64_t c0, int tid, bool vec_ok,
                                         uint32_t* tb) {
  using C = Tile2Cfg<T>;
  const T* src = static_cast<const T*>(p.x);
  const int cb = tid % 4;
  const int64_t col16 = c0 + cb * 16;
  constexpr int kPerChunk = 16 / static_cast<int>(sizeof(T));
  if (vec_ok && r0 + C::kRows <= p.M && c0 + 64 <= p.N) {
    // A whole tile: one base pointer, no range tests.
    const T* g = src + (r0 + tid / 4) * p.N + col16;
#pragma unroll
    for (int i = 0; i < C::kRbt; ++i) {
      const int r = tid / 4 + 64 * i;
      uint4* dst = reinterpret_cast<uint4*>(tb + r * C::kWords);
#pragma unroll
      for (int v = 0; v < C::kVec; ++v)
        t2_cp_async16(dst + ((cb * C::kVec + v) ^ t2_swz<T>(r)), g + i * 64 * p.N + v * kPerChunk, 16);
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < C::kRbt; ++i) {
    const int r = tid / 4 + 64 * i;
    const int64_t row = r0 + r;
    uint4* dst = reinterpret_cast<uint4*>(tb + r * C::kWords);
    if (vec_ok) {
#pragma unroll
      for (int v = 0; v < C::kVec; ++v) {
        const int64_t c = col16 + v * (16 / static_cast<int>(sizeof(T)));
        const bool in = row < p.M && c < p.N;
        t2_cp_async16(dst + ((cb * C::kVec + v) ^ t2_swz<T>(r)), in ? static_cast<const void*>(src + row * p.N + c)
                                                                     : p.x, in ? 16 : 0);
      }
    } else {
      using U = typename std::conditional<sizeof(T) == 2, uint16_t, uint32_t>::type;
      const U* s = reinterpret_cast<const U*>(src);
#pragma unroll
      for (int v = 0; v < C::kVec; ++v) {
        constexpr int kPer = 16 / static_cast<int>(sizeof(T));
        U e[kPer];
#pragma unroll
        for (int k = 0; k < kPer; ++k) {
          const int64_t c = col16 + v * kPer + k;
          e[k] = (row < p.M && c < p.N) ? s[row * p.N + c] : U(0);
        }
        uint32_t w[4];
#pragma unroll
        for (int q = 0; q < 4; ++q)
          w[q] = sizeof(T) == 2 ? (static_cast<uint32_t>(e[2 * q]) | (static_cast<uint32_t>(e[(2 * q + 1) % kPer]) << 16))
                                : static_cast<uint32_t>(e[q]);
        dst[(cb * C::kVec + v) ^ t2_swz<T>(r)] = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
  }
}

__device__ __forceinline__ void t2_quant_rn(const float (&x)[16], float bamax, const TensorScale& t, uint2& q,
                                            uint32_t& sf) {
  sf = plain_scale_code(bamax, t);
  const float enc = block_enc(nvfp4_e4m3_decode(sf), t.s_dec);
  if (kT2Short && !kHwE2M1 && __all_sync(__activemask(), __fmul_rn(bamax, enc) < 7.0f)) {
    q = t2_encode16_short(x, enc);
  } else {
    q = encode16_rn<RowPack<0>::value, kT2ExpMagic>(x, enc);
  }
}

// Thread blocks per SM asked of ptxas. Default (0): 4 for the RN modes (64 registers, no spill; unbounded
// the short/general encode pair takes 80 = 3 blocks/SM) and 3 with stochastic rounding (70-80 registers, no
// spill; (256, 4) spills 32-80 bytes there). NVFP4_TILE2_MINB > 0 asks that for every mode (benchmarks).
#ifndef NVFP4_TILE2_MINB
#define NVFP4_TILE2_MINB 0
#endif
// The fused bias gradient's tile sums (QuantizeArgs::bias_partials) from the tile in shared memory: this
// thread's 16-row segment of its kCpt columns summed in order (+0 below the last row: M % 16 == 0, so a
// segment is all in or all out), then the four segments of a 64-row tile, which sit in four neighbouring
// lanes (crb 4q .. 4q + 3), as ((S0 + S1) + S2) + S3 by the lane of S0. Every lane of the warp takes part
// in the shuffles. ops/ref_fp8.py bias_grad is the order.
template <typename T>
__device__ __forceinline__ void t2_bias_partials(const KParams& p, const uint32_t* tb, int64_t r0, int64_t c0,
                                                 int crb, int cu) {
  using C = Tile2Cfg<T>;
  const int64_t row16 = r0 + crb * 16;
  float s[C::kCpt];
#pragma unroll
  for (int j = 0; j < C::kCpt; ++j) s[j] = 0.0f;
  if (row16 + 16 <= p.M) {
    const uint32_t* cw = tb + t2_word<T>(crb * 16, cu);
#pragma unroll
    for (int j = 0; j < C::kCpt; ++j) s[j] = t2_col<T>(cw[0], j);
#pragma unroll
    for (int k = 1; k < 16; ++k) {
      const uint32_t w = cw[k * C::kWords];
#pragma unroll
      for (int j = 0; j < C::kCpt; ++j) s[j] = __fadd_rn(s[j], t2_col<T>(w, j));
    }
  }
#pragma unroll
  for (int j = 0; j < C::kCpt; ++j) {
    const float s1 = __shfl_down_sync(0xFFFFFFFFu, s[j], 1);
    const float s2 = __shfl_down_sync(0xFFFFFFFFu, s[j], 2);
    const float s3 = __shfl_down_sync(0xFFFFFFFFu, s[j], 3);
    const int64_t col = c0 + cu * C::kCpt + j;
    if ((crb & 3) == 0 && row16 < p.M && col < p.N)
      p.bias_partials[(row16 / 64) * p.N + col] = __fadd_rn(__fadd_rn(__fadd_rn(s[j], s1), s2), s3);
  }
}

// The tiles a tile2 thread block quantizes, in order. T2Walk<1>: tile t = ty * gx + tx, the grid stride G =
// gridDim.x advancing (ty, tx) by (G / gx, G % gx) with a carry (no 64-bit division per tile). T2Walk<S>: strips
// of S consecutive tiles of one tile row (the row's last strip may be shorter), the grid striding over strips.
template <int S>
struct T2Walk {
  int64_t gx, gs, strips, st, ty, tx0;
  int s = 0;
  __device__ T2Walk(int64_t gx_, int64_t tiles) : gx(gx_), gs((gx_ + S - 1) / S), strips(gs * (tiles / gx_)) {
    st = blockIdx.x;
    place();
  }
  __device__ void place() {
    ty = st / gs;
    tx0 = (st - ty * gs) * S;
  }
  __device__ bool valid() const { return st < strips; }
  __device__ int64_t tx() const { return tx0 + s; }
  __device__ int slot() const { return s; }
  __device__ bool last_in_strip() const { return s == S - 1 || tx0 + s + 1 >= gx; }
  __device__ void next() {
    if (last_in_strip()) {
      s = 0;
      st += gridDim.x;
      place();
    } else {
      ++s;
    }
  }
};

template <>
struct T2Walk<1> {
  int64_t gx, tiles, dq, dr, t, ty, tx_;
  __device__ T2Walk(int64_t gx_, int64_t tiles_)
      : gx(gx_), tiles(tiles_), dq(gridDim.x / gx_), dr(gridDim.x % gx_), t(blockIdx.x), ty(t / gx_), tx_(t % gx_) {}
  __device__ bool valid() const { return t < tiles; }
  __device__ int64_t tx() const { return tx_; }
  __device__ int slot() const { return 0; }
  __device__ bool last_in_strip() const { return true; }
  __device__ void next() {
    t += gridDim.x;
    tx_ += dr;
    ty += dq;
    if (tx_ >= gx) {
      tx_ -= gx;
      ++ty;
    }
  }
};

// A strip's staged rowwise scale codes (4 a tile, kStrip tiles a row in srow), written from column c0s on: the
// threads of a row (2 for 16-bit input) each a part, with vector stores where the run is whole and aligned, else byte
// stores of the whole blocks.
template <typename T, int kStrip>
__device__ __forceinline__ void t2_flush_row_scales(const KParams& p, const uint8_t* srow, int64_t r0, int64_t c0s,
                                                    int tid) {
  using C = Tile2Cfg<T>;
  constexpr int kRun = 4 * kStrip;
  constexpr int kPer = kThreads / C::kRows;  // threads a row (2 for 16-bit input)
  constexpr int kPart = kRun / kPer;         // bytes each
  const int r = tid / kPer, part = tid % kPer;
  const int64_t row = r0 + r;
  if (r >= C::kRows || row >= p.M) return;
  const int64_t bpr = p.N / 16, first = c0s / 16;  // blocks a row; the strip's first block
  uint8_t* dst = p.scale + row * bpr + first + part * kPart;
  const uint8_t* src = srow + r * kRun + part * kPart;
  if constexpr (kPart % 16 == 0) {
    if (first + kRun <= bpr && (reinterpret_cast<uintptr_t>(dst) & 15u) == 0) {
#pragma unroll
      for (int k = 0; k < kPart / 16; ++k)
        reinterpret_cast<uint4*>(dst)[k] = reinterpret_cast<const uint4*>(src)[k];
      return;
    }
  } else if constexpr (kPart % 8 == 0) {
    if (first + kRun <= bpr && (reinterpret_cast<uintptr_t>(dst) & 7u) == 0) {
#pragma unroll
      for (int k = 0; k < kPart / 8; ++k)
        reinterpret_cast<uint2*>(dst)[k] = reinterpret_cast<const uint2*>(src)[k];
      return;
    }
  }
  for (int k = 0; k < kPart && first + part * kPart + k < bpr; ++k) dst[k] = src[k];
}

#ifndef NVFP4_TILE2_SR_ROW_UNROLL
#define NVFP4_TILE2_SR_ROW_UNROLL 1
#endif
constexpr int kTile2SrRowUnroll = NVFP4_TILE2_SR_ROW_UNROLL;  // (a #pragma does not expand macros)
template <bool kSR, int kFos>
constexpr int tile2_min_blocks() {
  return NVFP4_TILE2_MINB > 0 ? NVFP4_TILE2_MINB : (kFos != 0 ? (fos_fast(kFos) ? 3 : 2) : (kSR ? 3 : 4));
}
// kFos != 0: 1-D 4over6 (quantize_block_1d<kFos>, the per-block code of tile_kernel and the rowwise
// kernel: the same bytes), used for a grad_output cast with the fused bias gradient; 3 blocks per SM for
// the fast error (80 registers, no spill), 2 for the strict one (128; bounded to 80 it spills 60-104 bytes).
// kStrip: 1, a tile a step of the grid stride, or kT2Strip, strips of that many tiles (T2Walk).
template <typename T, bool k2D, bool kSR, bool kRHT, int kFos = 0, int kStrip = 1>
__global__ void __launch_bounds__(kThreads, tile2_min_blocks<kSR, kFos>()) tile2_kernel(KParams p) {
  using C = Tile2Cfg<T>;
  static_assert(!(k2D && kRHT), "2-D excludes RHT");
  static_assert(kFos == 0 || !(k2D || kSR || kRHT), "tile2 4over6 is 1-D, round to nearest, no RHT");
  __shared__ __align__(16) uint32_t tile[2][C::kTileWords];
  __shared__ uint32_t part[k2D ? C::kRows / 8 : 1][4];  // 2-D: max |x| bits of 8 rows x 16 columns
  // kStrip > 1: the strip's rowwise scale codes, 4 * kStrip a tile row
  __shared__ __align__(16) uint8_t srow[kStrip > 1 ? C::kRows * 4 * kStrip : 1];

  const int tid = threadIdx.x;
  const bool do_row = p.data != nullptr, do_col = p.data_t != nullptr;
  const int64_t gx = (p.N + 63) / 64;
  const int64_t tiles = gx * ((p.M + C::kRows - 1) / C::kRows);
  const bool vec_ok = (p.N * static_cast<int64_t>(sizeof(T))) % 16 == 0;
  TensorScale t_row, t_col;
  if (k2D || (do_row && !p.row_scaled)) t_row = make_tensor_scale(__ldg(p.amax), p.e4m3_max);
  if (do_col) t_col = make_tensor_scale(__ldg(p.amax_t), p.e4m3_max);
  const int cb = tid % 4;
  // Column pass: 16-row block crb (fastest across lanes: neighbouring lanes write one data_t run),
  // word (column unit) cu.
  const int crb = tid % C::kRb, cu = tid / C::kRb;

  // The walk over tiles: T2Walk<1> (the grid strides over tiles) or strips of kStrip tiles.
  T2Walk<kStrip> walk(gx, tiles);
  if (walk.valid()) t2_issue<T>(p, walk.ty * C::kRows, walk.tx() * 64, tid, vec_ok, tile[0]);
  t2_cp_commit();
  int buf = 0;
  for (; walk.valid(); buf ^= 1) {
    const int64_t r0 = walk.ty * C::kRows, c0 = walk.tx() * 64;
    const int slot = walk.slot();  // the tile's place in its strip
    const bool strip_end = walk.last_in_strip();
    uint32_t* tb = tile[buf];
    // The next tile's copy, in flight while this one is quantized (its buffer was last read in the
    // previous iteration, which every thread finished before the __syncthreads at its end).
    walk.next();
    if (walk.valid()) t2_issue<T>(p, walk.ty * C::kRows, walk.tx() * 64, tid, vec_ok, tile[buf ^ 1]);
    t2_cp_commit();
    t2_cp_wait<1>();  // this thread's copies of the current tile have landed
    __syncthreads();  // ... and every other thread's
    if (k2D) {
      // Max |x| over 16 x 16 tiles: per block, then over the 8 rows of this warp with the same cb (lanes
      // 4 apart), then (readers below) over the two warps of a 16-row tile.
#pragma unroll
      for (int i = 0; i < C::kRbt; ++i) {
        const int r = tid / 4 + 64 * i;
        float x[16];
        t2_row_block<T>(tb, r, cb, x);
        uint32_t m = __float_as_uint(block_absmax16(x));
        m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 4));
        m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 8));
        m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 16));
        if ((tid & 31) < 4) part[8 * i + tid / 32][cb] = m;
      }
      __syncthreads();
    }
    // Rowwise copy, from the tile (this thread's own blocks). One block at a time; NVFP4_TILE2_SR_ROW_UNROLL=2 (a
    // benchmark variant, session 41) unrolls the 1-D SR instantiations' two blocks so their Philox chains can overlap.
    if (do_row) {
#pragma unroll(kSR && !k2D ? kTile2SrRowUnroll : 1)
      for (int i = 0; i < C::kRbt; ++i) {
        const int r = tid / 4 + 64 * i;
        const int64_t row = r0 + r, col16 = c0 + cb * 16;
        if (row >= p.M || col16 + 16 > p.N) continue;
        float x[16];
        t2_row_block<T>(tb, r, cb, x);
        const int64_t b = row * (p.N / 16) + col16 / 16;
        uint2 q;
        uint32_t sf;
        if (k2D) {
          const float tamax = __uint_as_float(max(part[(r / 8) & ~1][cb], part[(r / 8) | 1][cb]));
          if (kSR) {
            sf = plain_scale_code(tamax, t_row);
            const float enc = block_enc(nvfp4_e4m3_decode(sf), t_row.s_dec);
            q = encode16_sr(x, enc, sr_block_bits(static_cast<uint64_t>(b), sr_seed(p), sr_offset(p)));
          } else {
            t2_quant_rn(x, tamax, t_row, q, sf);
          }
        } else {
          const TensorScale ts = p.row_scaled ? make_tensor_scale(__ldg(p.amax + row), p.e4m3_max) : t_row;
          if (kFos != 0) {
            quantize_block_1d<kFos, 0>(x, ts, false, static_cast<uint64_t>(b), 0, 0, q, sf, nullptr, nullptr);
          } else if (kSR) {
            quantize_block_1d<0, RowPack<0>::value, kT2ExpMagic>(x, ts, true, static_cast<uint64_t>(b), sr_seed(p),
                                                                 sr_offset(p), q, sf, nullptr, nullptr);
          } else {
            t2_quant_rn(x, block_absmax16(x), ts, q, sf);
          }
        }
        reinterpret_cast<uint2*>(p.data)[b] = q;
        if constexpr (kStrip > 1) {
          srow[r * (4 * kStrip) + slot * 4 + cb] = static_cast<uint8_t>(sf);
        } else {
          p.scale[b] = static_cast<uint8_t>(sf);
        }
        if (p.unit != nullptr) store_unit16(q, sf, p.unit + row * p.N + col16);
      }
    }
    // Columnwise copy: C::kCpt columns x 16 rows per thread, one word per row.
    if (do_col) {
      if (!k2D && p.bias_partials != nullptr) t2_bias_partials<T>(p, tb, r0, c0, crb, cu);
      const int64_t row16 = r0 + crb * 16;
      if (row16 + 16 <= p.M) {
        // One word per row for all kCpt columns: a base address and immediate offsets (t2_swz).
        const uint32_t* cw = tb + t2_word<T>(crb * 16, cu);
        uint32_t w[16];
#pragma unroll
        for (int k = 0; k < 16; ++k) w[k] = cw[k * C::kWords];
#pragma unroll
        for (int j = 0; j < C::kCpt; ++j) {
          const int64_t col = c0 + cu * C::kCpt + j;
          if (col >= p.N) continue;
          float v[16];
#pragma unroll
          for (int k = 0; k < 16; ++k) v[k] = t2_col<T>(w[k], j);
          if (kRHT) rht16_bf16_pk(v);
          const uint64_t b = static_cast<uint64_t>(col * (p.M / 16) + row16 / 16);
          uint2 q;
          uint32_t sf;
          if (k2D) {
            // The tile amax of rows crb*16.. and columns (cu*kCpt + j) / 16 of the tile.
            const int tc = (cu * C::kCpt + j) / 16;
            const float tamax = __uint_as_float(max(part[2 * crb][tc], part[2 * crb + 1][tc]));
            if (kSR) {
              sf = plain_scale_code(tamax, t_col);
              const float enc = block_enc(nvfp4_e4m3_decode(sf), t_col.s_dec);
              q = encode16_sr(v, enc, sr_block_bits(b, sr_seed(p), sr_offset(p)));
            } else {
              t2_quant_rn(v, tamax, t_col, q, sf);
            }
          } else if (kFos != 0) {
            quantize_block_1d<kFos, 0>(v, t_col, false, b, 0, 0, q, sf, nullptr, nullptr);
          } else if (kSR) {
            quantize_block_1d<0, RowPack<0>::value, kT2ExpMagic>(v, t_col, true, b, sr_seed(p), sr_offset(p), q, sf,
                                                                 nullptr, nullptr);
          } else {
            t2_quant_rn(v, block_absmax16(v), t_col, q, sf);
          }
          reinterpret_cast<uint2*>(p.data_t + col * (p.M / 2) + row16 / 2)[0] = q;
          p.scale_t[col * (p.M / 16) + row16 / 16] = static_cast<uint8_t>(sf);
          if (p.unit_t != nullptr) store_unit16(q, sf, p.unit_t + col * p.M + row16);
        }
      }
    }
    __syncthreads();  // the tile (and the 2-D partial maxima) are reused two iterations on
    if constexpr (kStrip > 1) {
      // After the strip's last tile (every code staged before the barrier above; the next strip's first
      // codes are written after the next iteration's barrier): each tile row's codes as one run.
      if (do_row && strip_end) t2_flush_row_scales<T, kStrip>(p, srow, r0, c0 - slot * 64, tid);
    }
  }
  t2_cp_wait<0>();
}

// ---- v7 row-scaled rowwise: one thread block per row ------------------------------------------
// A row's blocks are spread over the 256 threads (kPer blocks each at most: N <= 16 * 256 * kPer) and
// all loaded before any is quantized; the row's TensorScale (two correctly rounded divisions) is made
// once per row by thread 0 and shared through shared memory, where rowwise_kernel makes it per 16-element
// block after a 64-bit division (block -> row). kFused: the row amax is computed here from
// the registers (max |x| bits over the row, NaN -> the canonical NaN, exactly what row_amax_kernel
// writes) and written to amax_out[row]: "row amax + quantize" reads x once. The per-block math is
// rowwise_block's (quantize_block_1d<kFos>, no scale table, no strict value table: the same bytes).
// NVFP4_ROW_SCALED_FREE (1, the library's form since session 36): with a given amax (kFused false), every thread
// makes the row's TensorScale itself instead of thread 0 for the block behind a barrier: the same divisions, the
// same bytes; no block barrier a row, so warps run ahead independently (H200, 16384 x 6144: 78.0 vs 83.2 us,
// 1.08x the plain rowwise cast). 0 builds the barrier form, for A/B benchmarks.
#ifndef NVFP4_ROW_SCALED_FREE
#define NVFP4_ROW_SCALED_FREE 1
#endif
constexpr bool kRowScaledFree = NVFP4_ROW_SCALED_FREE != 0;

template <typename T, int kFos, int kPer, bool kFused>
__global__ void __launch_bounds__(kThreads) row_scaled_kernel(KParams p, float* amax_out) {
  __shared__ uint32_t red[2][kThreads / 32];
  __shared__ TensorScale ts[2];  // the row's scale, made once by thread 0 (two correctly rounded divisions)
  const int tid = threadIdx.x;
  const int64_t bpr = p.N / 16;
  const T* src = static_cast<const T*>(p.x);
  int par = 0;
  for (int64_t row = blockIdx.x; row < p.M; row += gridDim.x, par ^= 1) {
    RawBlock<T> raw[kPer];
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int64_t j = tid + u * kThreads;
      if (j < bpr) load_raw(src + row * p.N + j * 16, raw[u]);
    }
    if (kFused) {
      uint32_t m = 0;
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        if (tid + u * kThreads < bpr) {
          float x[16];
          widen_raw(raw[u], x);
          m = max(m, __float_as_uint(block_absmax16(x)));
        }
      }
      m = __reduce_max_sync(0xFFFFFFFFu, m);
      if ((tid & 31) == 0) red[par][tid / 32] = m;
      __syncthreads();
      if (tid == 0) {
        m = red[par][0];
#pragma unroll
        for (int w = 1; w < kThreads / 32; ++w) m = max(m, red[par][w]);
        m = m > 0x7F800000u ? 0x7FC00000u : m;
        amax_out[row] = __uint_as_float(m);
        ts[par] = make_tensor_scale(__uint_as_float(m), p.e4m3_max);
      }
    } else if (!kRowScaledFree && tid == 0) {
      ts[par] = make_tensor_scale(__ldg(p.amax + row), p.e4m3_max);
    }
    TensorScale t;
    if constexpr (kRowScaledFree && !kFused) {
      t = make_tensor_scale(__ldg(p.amax + row), p.e4m3_max);
    } else {
      // ts[par] is rewritten two rows on, after every thread has passed the next row's barrier.
      __syncthreads();
      t = ts[par];
    }
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int64_t j = tid + u * kThreads;
      if (j < bpr) {
        float x[16];
        widen_raw(raw[u], x);
        const int64_t g = row * bpr + j;
        uint2 q;
        uint32_t sf;
        quantize_block_1d<kFos>(x, t, false, static_cast<uint64_t>(g), 0, 0, q, sf, nullptr, nullptr);
        reinterpret_cast<uint2*>(p.data)[g] = q;
        p.scale[g] = static_cast<uint8_t>(sf);
        if (p.unit != nullptr) store_unit16(q, sf, p.unit + g * 16);
      }
    }
  }
}

// Whether row_scaled_kernel takes a row-scaled rowwise quantization (16-bit input, N <= 16384, the
// hardware-free software encode path and any 4over6 mode).
template <typename T>
bool row_scaled_fits(const KParams& kp) {
  return sizeof(T) == 2 && kp.N / 16 <= 4 * kThreads && kp.sr == 0;
}

template <typename T, int kFos, bool kFused>
void launch_row_scaled(const KParams& kp, float* amax_out, cudaStream_t stream) {
  if (kp.M == 0 || kp.N == 0) return;
  const int sms = sm_count_cached();
  const int64_t cap = static_cast<int64_t>(sms) * 16;
  const unsigned grid = static_cast<unsigned>(kp.M < cap ? kp.M : cap);
  if (kp.N / 16 <= 2 * kThreads) {
    row_scaled_kernel<T, kFos, 2, kFused><<<grid, kThreads, 0, stream>>>(kp, amax_out);
  } else {
    row_scaled_kernel<T, kFos, 4, kFused><<<grid, kThreads, 0, stream>>>(kp, amax_out);
  }
  check_launch("nvfp4 row_scaled_kernel");
}

// Grid of tile2_kernel: one thread block per tile, or per strip of kT2Strip tiles from g_tile2_strip_min_waves waves
// of tiles on (one block a tile measured fastest on an H100 at 16384x6144 BF16: row+col 154 us against 172 us for one
// persistent wave; on an H200 the persistent wave was the faster, 143 vs 154, and strips of 4 matched it: RESULTS.md
// session 35 run 3). waves > 0 (benchmarks) asks for that many waves of resident thread blocks (occupancy per
// instantiation, queried once) walking the tiles or strips instead.
template <typename T, bool k2D, bool kSR, bool kRHT, int kFos, int kStrip>
void launch_tile2_grid(const KParams& kp, cudaStream_t stream, int waves) {
  using C = Tile2Cfg<T>;
  // tiles, or strips of kStrip tiles of one tile row (T2Walk)
  const int64_t tiles = ((kp.N + 63) / 64 + kStrip - 1) / kStrip * ((kp.M + C::kRows - 1) / C::kRows);
  int64_t grid = tiles < 2147483647 ? tiles : 2147483647;  // the kernel's loop takes any grid size
  if (waves > 0) {
    // resident blocks per SM of this instantiation, queried once per device (thread-safe: relaxed
    // atomics, every thread stores the same value)
    static std::atomic<int> occupancy[64];
    const int sms = sm_count_cached();
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) dev = -1;
    int per_sm = dev >= 0 ? occupancy[dev].load(std::memory_order_relaxed) : 0;
    if (per_sm == 0) {
      int occ = 0;
      if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, tile2_kernel<T, k2D, kSR, kRHT, kFos, kStrip>, kThreads,
                                                        0) != cudaSuccess || occ < 1)
        occ = 1;
      per_sm = occ;
      if (dev >= 0) occupancy[dev].store(occ, std::memory_order_relaxed);
    }
    const int64_t want = static_cast<int64_t>(sms) * per_sm * waves;
    if (want < grid) grid = want;
  }
  tile2_kernel<T, k2D, kSR, kRHT, kFos, kStrip><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(kp);
  check_launch("nvfp4 tile2_kernel");
}

// Strips of tiles from g_tile2_strip_min_waves waves (of 4 thread blocks an SM) of tiles on.
template <typename T>
bool tile2_strips(const KParams& kp) {
  using C = Tile2Cfg<T>;
  const int64_t tiles = ((kp.N + 63) / 64) * ((kp.M + C::kRows - 1) / C::kRows);
  return tiles >= static_cast<int64_t>(g_tile2_strip_min_waves.load(std::memory_order_relaxed)) * 4 *
                      sm_count_cached();
}

template <typename T, bool k2D, bool kSR, bool kRHT, int kFos = 0>
void launch_tile2_mode(const KParams& kp, cudaStream_t stream, int waves) {
  if (tile2_strips<T>(kp)) launch_tile2_grid<T, k2D, kSR, kRHT, kFos, kT2Strip>(kp, stream, waves);
  else launch_tile2_grid<T, k2D, kSR, kRHT, kFos, 1>(kp, stream, waves);
}

template <typename T, int kFos = 0>
void launch_tile2(const KParams& kp, cudaStream_t stream, int waves = 0) {
  const bool sr = kp.sr != 0;
  if constexpr (kFos != 0) {
    require(!kp.block_2d && !sr && !kp.rht, "nvfp4 quantize: the tile2 4over6 path is 1-D, RN, without RHT");
    launch_tile2_mode<T, false, false, false, kFos>(kp, stream, waves);
    return;
  }
  if (kp.block_2d) {
    if (sr) launch_tile2_mode<T, true, true, false>(kp, stream, waves);
    else launch_tile2_mode<T, true, false, false>(kp, stream, waves);
    return;
  }
  if (kp.rht) {
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
      if (sr) launch_tile2_mode<T, false, true, true>(kp, stream, waves);
      else launch_tile2_mode<T, false, false, true>(kp, stream, waves);
      return;
    }
    require(false, "nvfp4 quantize: rht needs bfloat16 input");
  }
  if (sr) launch_tile2_mode<T, false, true, false>(kp, stream, waves);
  else launch_tile2_mode<T, false, false, false>(kp, stream, waves);
}

template <typename T, int kFos>
void launch_t(const KParams& kp, bool tiled, cudaStream_t stream) {
  if (!tiled) {
    const int64_t total = kp.M * (kp.N / 16);
    if (total == 0) return;
    if constexpr (sizeof(T) == 2 && kFos == 0) {
      if (kp.row_scaled && row_scaled_fits<T>(kp)) {
        launch_row_scaled<T, kFos, false>(kp, nullptr, stream);
        return;
      }
    }
    const int sms = sm_count_cached();
    constexpr int kPer = RowwiseCfg<kFos>::kU * kThreads;
    const int64_t want = (total + kPer - 1) / kPer;
    const int64_t grid = want < static_cast<int64_t>(sms) * 16 ? want : static_cast<int64_t>(sms) * 16;
    rowwise_kernel<T, kFos><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(kp);
    check_launch("nvfp4 rowwise_kernel");
  } else {
    if (kp.M == 0 || kp.N == 0) return;
    // 4over6 takes tile_kernel (2-D: a decision per 16x16 tile; 1-D: measured 0-7 % faster than tile2 on an
    // H100, RESULTS session 25 run 5), except a 1-D cast with the fused bias gradient, which lives in tile2.
    if (kFos == 0 || (!kp.block_2d && kp.bias_partials != nullptr)) {
      launch_tile2<T, kFos>(kp, stream);
      return;
    }
    const int64_t gx = (kp.N + kTile - 1) / kTile, gy = (kp.M + kTile - 1) / kTile;
    require(gy <= 65535, "nvfp4 quantize: M too large for the tile grid (max 65535*64 rows)");
    tile_kernel<T, kFos><<<dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), kThreads, 0,
                           stream>>>(kp);
    check_launch("nvfp4 tile_kernel");
  }
}

template <typename T>
void launch_fos(const KParams& kp, FourOverSix fos, bool tiled, cudaStream_t stream) {
  const int mode = fos_mode(fos != FourOverSix::kOff, fos == FourOverSix::kFast, kp.mse != 0);
  switch (mode) {
    case 0: launch_t<T, 0>(kp, tiled, stream); break;
    case 1: launch_t<T, 1>(kp, tiled, stream); break;
    case 2: launch_t<T, 2>(kp, tiled, stream); break;
    case 3: launch_t<T, 3>(kp, tiled, stream); break;
    case 4: launch_t<T, 4>(kp, tiled, stream); break;
  }
}

template <typename T>
bool launch_fused_row_scaled(const KParams& kp, FourOverSix fos, float* amax_out, cudaStream_t stream) {
  if (!row_scaled_fits<T>(kp)) return false;
  switch (fos_mode(fos != FourOverSix::kOff, fos == FourOverSix::kFast, kp.mse != 0)) {
    case 0: launch_row_scaled<T, 0, true>(kp, amax_out, stream); break;
    case 1: launch_row_scaled<T, 1, true>(kp, amax_out, stream); break;
    case 2: launch_row_scaled<T, 2, true>(kp, amax_out, stream); break;
    case 3: launch_row_scaled<T, 3, true>(kp, amax_out, stream); break;
    case 4: launch_row_scaled<T, 4, true>(kp, amax_out, stream); break;
  }
  return true;
}

}  // namespace

void set_software_e2m1(bool on) {
  const int v = on ? 1 : 0;
  check_cuda(cudaMemcpyToSymbol(c_e2m1_software, &v, sizeof(v)), "cudaMemcpyToSymbol(c_e2m1_software)");
}

int set_tile2_strip_min_waves(int waves) {
  require(waves >= 0, "nvfp4: tile2 strip waves must be >= 0");
  return g_tile2_strip_min_waves.exchange(waves);
}

bool software_e2m1() {
  int v = 0;
  check_cuda(cudaMemcpyFromSymbol(&v, c_e2m1_software, sizeof(v)), "cudaMemcpyFromSymbol(c_e2m1_software)");
  return v != 0;
}

void quantize(const QuantizeArgs& a, cudaStream_t stream) {
  const bool do_row = a.data != nullptr, do_col = a.data_t != nullptr;
  require(do_row || do_col, "nvfp4 quantize: neither rowwise nor columnwise output requested");
  require(!do_row || (a.N % 16 == 0 && a.scale && (a.amax || a.row_amax_out)), "nvfp4 quantize: bad rowwise arguments");
  require(!do_col || (a.M % 16 == 0 && a.scale_t && a.amax_t), "nvfp4 quantize: bad columnwise arguments");
  require(!a.rht || a.in_dtype == DType::kBFloat16, "nvfp4 quantize: rht needs bfloat16 input");
  require((a.unit == nullptr || do_row) && (a.unit_t == nullptr || do_col),
          "nvfp4 quantize: a unit operand needs its copy (rowwise for unit, columnwise for unit_t)");
  require(reinterpret_cast<std::uintptr_t>(a.unit) % 16 == 0 && reinterpret_cast<std::uintptr_t>(a.unit_t) % 16 == 0,
          "nvfp4 quantize: unit operands must be 16-byte aligned");
  require(!(a.row_scaled && (a.block_2d || a.stochastic_rounding)),
          "nvfp4 quantize: row_scaled excludes 2-D and stochastic rounding");
  require(!(a.four_over_six != FourOverSix::kOff && (a.rht || a.stochastic_rounding)),
          "nvfp4 quantize: 4over6 excludes rht and stochastic rounding");
  KParams kp{a.x,      a.M,     a.N,        a.data,          a.scale,   a.amax,
             a.row_scaled ? 1 : 0,       a.data_t,        a.scale_t, a.amax_t,
             a.rht ? 1 : 0,              a.block_2d ? 1 : 0, a.mse ? 1 : 0, a.e4m3_max,
             a.stochastic_rounding ? 1 : 0, a.seed,     a.offset,
             a.unit,   a.unit_t, a.bias_partials, a.rng_state};
  if (a.row_amax_out != nullptr) {
    // Row amax + row-scaled rowwise quantization in one pass where row_scaled_kernel fits, else the
    // row amax pass and then the quantization (the same bytes either way).
    require(a.row_scaled && do_row && !do_col && !a.block_2d && !a.stochastic_rounding && a.unit_t == nullptr,
            "nvfp4 quantize: row_amax_out needs a row-scaled rowwise-only quantization");
    kp.amax = a.row_amax_out;
    if (a.M * a.N == 0) {
      if (a.M > 0) check_cuda(cudaMemsetAsync(a.row_amax_out, 0, a.M * sizeof(float), stream), "nvfp4 row amax memset");
      return;
    }
    bool done = false;
    switch (a.in_dtype) {
      case DType::kBFloat16: done = launch_fused_row_scaled<__nv_bfloat16>(kp, a.four_over_six, a.row_amax_out, stream); break;
      case DType::kFloat16: done = launch_fused_row_scaled<__half>(kp, a.four_over_six, a.row_amax_out, stream); break;
      default: break;
    }
    if (done) return;
    row_amax(a.x, a.in_dtype, a.M, a.N, a.row_amax_out, nullptr, stream);
  }
  const bool bias = a.bias_partials != nullptr || a.bias_out != nullptr;
  require(!bias || (a.bias_partials != nullptr && a.bias_out != nullptr && do_col && !a.block_2d),
          "nvfp4 quantize: a fused bias gradient needs bias_partials and bias_out and a 1-D columnwise copy");
  // The rowwise-only 1-D case reads x directly (16-byte loads need N*sizeof % 16 == 0, true for
  // N % 16 == 0); everything else goes through the tile, as does stochastic rounding with a device rng state (only
  // tile2_kernel's SR instantiations read it; the bytes are rowwise_kernel's).
  const bool tiled = do_col || a.block_2d || (a.stochastic_rounding && a.rng_state != nullptr);
  switch (a.in_dtype) {
    case DType::kFloat32: launch_fos<float>(kp, a.four_over_six, tiled, stream); break;
    case DType::kBFloat16: launch_fos<__nv_bfloat16>(kp, a.four_over_six, tiled, stream); break;
    case DType::kFloat16: launch_fos<__half>(kp, a.four_over_six, tiled, stream); break;
    default: require(false, std::string("nvfp4 quantize: unsupported input dtype ") + dtype_name(a.in_dtype));
  }
  if (bias) launch_bias_reduce(BiasGradOut{a.bias_partials, a.bias_out, a.bias_dtype}, a.M, a.N, stream);
}

}  // namespace nvfp4
}  // namespace fp_recipes
