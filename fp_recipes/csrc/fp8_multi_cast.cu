// Multi-tensor FP8 per-tensor casts: G separate tensors (each with its own scale, amax, scale_inv and
// its own output buffers) quantized in one launch (delayed scaling) or two (current scaling: an amax
// pass, then the cast). GroupedLinear quantizes every expert's activation / weight / grad_output this
// way: one launch per operand for all experts instead of one (or two) per expert.
//
// Every member's bytes (data, data_t, scale_inv, amax, scale) are those of launch_fp8_quantize /
// launch_fp8_current_scaling_quantize on that member alone (a padded data_t: its first rows columns,
// then zeros): the tiles run the same device code (fp8_device.cuh: cast_transpose_tile, cast_tile,
// amax_tile, flush_amax, fp8_current_scale), and the amax is an order-independent max over the
// member's elements.
//
// Layout of a launch: the member descriptors of a bounded chunk (kMultiChunk members) travel by
// value in the kernel parameters (a __grid_constant__ struct, < 4 KB), with the prefix of the
// members' tile counts; a block finds the member of its tile by binary search over that prefix. Any
// number of members: one launch per chunk (G = 8 is one chunk), the amax of all G zeroed by one
// memset first. Members with no rows have no tiles; block 0 of each launch writes the scale_inv (and
// scale) of every member of its chunk, so those still get scale_inv, amax 0 and the scale rule.
//   * a transposed copy wanted (any member of the chunk): one 64x64 tile per block, as
//     cast_transpose_kernel does (same tile order within a member: column tiles fastest); a member's
//     transposed copy may have a row stride past its rows (Fp8MultiMember::ld_t), the padding written
//     as zeros by its last row tile (the grouped layer's wgrad GEMMs contract over the padded depth);
//   * rowwise only: a persistent grid over flat tiles of kThreads x kUnroll 16-byte vectors per
//     member, as cast_kernel does; the amax pass of current scaling uses the same tiling and grid,
//     and the cast then walks each block's range backwards (the last tiles read are still in L2).
#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

#include "common.h"
#include "formats.cuh"
#include "fp8_device.cuh"
#include "fp8_kernels.h"

namespace fp_recipes {
namespace {

constexpr int kMultiChunk = 64;  // members per launch (descriptor arrays of the kernel parameters)

// Per-member flags (host-computed).
constexpr uint8_t kFlatVec = 1;  // x 16-byte aligned and out (if any) aligned for V-byte stores
constexpr uint8_t kTileVec = 2;  // kFlatVec and cols % V == 0: the vector path of cast_transpose_tile
constexpr uint8_t kTVec = 4;     // ld_t % 16 == 0 and out_t 16-byte aligned: vector stores of data_t
constexpr uint8_t kXVec = 8;     // x 16-byte aligned (the amax pass)

struct MultiParams {
  const void* x[kMultiChunk];
  uint8_t* out[kMultiChunk];
  uint8_t* out_t[kMultiChunk];
  const float* scale[kMultiChunk];      // delayed: each member's scale (device scalar)
  float* record[kMultiChunk];           // delayed: each member's amax_history[0] or null (see Fp8MultiMember)
  int64_t rows[kMultiChunk];
  int32_t tile_start[kMultiChunk + 1];  // prefix of this launch's per-member tile counts
  uint8_t flags[kMultiChunk];
  uint8_t t_pad[kMultiChunk];           // out_t's row stride past rows (ld_t - rows, < kTR): zeros
  int32_t count;                        // members in this chunk
  int32_t col_tiles;                    // ceil(cols / kTC) (transposed tiling)
  int64_t cols;
  // The chunk's slices of the (G,) arrays.
  uint32_t* amax_bits;     // written (atomicMax on the FP32 bits; zeroed before)
  const float* amax_in;    // current: the amax pass's result (the same array)
  float* scale_out;        // written (delayed: the gathered scales; may be null)
  float* scale_inv;        // written, member g at scale_inv[g * scale_inv_stride]
  int32_t scale_inv_stride;
  float fmt_max;
  float amax_epsilon;
  int32_t power_2;
};
static_assert(sizeof(MultiParams) <= 4096, "the kernel parameters must stay under 4 KB");

// The member whose tiles include `tile`: the last g with tile_start[g] <= tile (members without tiles
// have tile_start[g] == tile_start[g + 1] and are skipped). tile < tile_start[count].
__device__ __forceinline__ int member_of(const MultiParams& p, int tile) {
  int lo = 0, hi = p.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (p.tile_start[mid] <= tile) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <bool kCurrent>
__device__ __forceinline__ float member_scale(const MultiParams& p, int g) {
  return kCurrent ? fp8_current_scale(p.amax_in[g], p.fmt_max, p.amax_epsilon, p.power_2) : *p.scale[g];
}

// Block 0: scale (current: computed; delayed: gathered) and scale_inv = RN(1 / scale) of every member;
// delayed: a member without tiles (no elements) records its amax of 0 (no other block visits it).
template <bool kCurrent>
__device__ __forceinline__ void write_scales(const MultiParams& p) {
  if (blockIdx.x != 0) return;
  for (int g = threadIdx.x; g < p.count; g += kThreads) {
    const float s = member_scale<kCurrent>(p, g);
    if (p.scale_out != nullptr) p.scale_out[g] = s;
    p.scale_inv[int64_t(g) * p.scale_inv_stride] = __fdiv_rn(1.0f, s);
    if (!kCurrent && p.record[g] != nullptr && p.tile_start[g] == p.tile_start[g + 1]) record_max(p.record[g], 0u);
  }
}

// Transposed (and/or rowwise) copies: one 64x64 tile per block. kCurrent: the scale comes from the
// amax pass and no amax is taken here; delayed: the amax is fused.
template <typename T, Fp8Fmt F, bool kCurrent>
__global__ void __launch_bounds__(kThreads) multi_cast_transpose_kernel(const __grid_constant__ MultiParams p) {
  constexpr bool kAmax = !kCurrent;
  write_scales<kCurrent>(p);
  const int tile = int(blockIdx.x);
  if (tile >= p.tile_start[p.count]) return;  // the lone block of a launch without tiles
  const int g = member_of(p, tile);
  const int lt = tile - p.tile_start[g];
  const int ty = lt / p.col_tiles, tx = lt - ty * p.col_tiles;
  const float s = member_scale<kCurrent>(p, g);
  const uint8_t fl = p.flags[g];
  uint32_t key = 0;
  cast_transpose_tile<T, F, kAmax, false, true>(static_cast<const T*>(p.x[g]), p.rows[g], p.cols,
                                                int64_t(ty) * kTR, int64_t(tx) * kTC, s, (fl & kTileVec) != 0,
                                                (fl & kTVec) != 0, p.out[g], p.out_t[g], key, nullptr,
                                                p.rows[g] + p.t_pad[g]);
  if (kAmax) flush_amax_record(key, p.amax_bits + g, p.record[g]);
}

// Flat tiles over each member's rows * cols elements, a persistent grid (contiguous tile range per
// block). kMode: 0 = amax only (the first pass of current scaling), 1 = delayed cast with the amax
// fused (a member without a rowwise output only contributes its amax), 2 = current-scaling cast.
template <typename T, Fp8Fmt F, int kMode>
__global__ void __launch_bounds__(kThreads) multi_flat_kernel(const __grid_constant__ MultiParams p, bool reverse) {
  constexpr bool kCurrent = kMode == 2;
  constexpr bool kAmax = kMode != 2;
  constexpr int64_t kTile = int64_t(kThreads) * kUnroll * Vec16<T>::kElems;
  if constexpr (kMode != 0) write_scales<kCurrent>(p);
  int64_t t0, t1;
  block_tile_range(p.tile_start[p.count], t0, t1);
  int cur = -1, lo = 0, hi = 0;  // the current member and its tile range [lo, hi)
  const T* x = nullptr;
  uint8_t* out = nullptr;
  int64_t n = 0;
  bool vec = false;
  float s = 0.0f;
  uint32_t key = 0;
  const int block_tiles = int(t1 - t0);
  for (int i = 0; i < block_tiles; ++i) {
    const int t = int(reverse ? t1 - 1 - i : t0 + i);
    if (t < lo || t >= hi) {  // block-uniform: a new member
      if (kAmax && cur >= 0) flush_amax_record(key, p.amax_bits + cur, kMode == 1 ? p.record[cur] : nullptr);
      key = 0;
      cur = member_of(p, t);
      lo = p.tile_start[cur];
      hi = p.tile_start[cur + 1];
      x = static_cast<const T*>(p.x[cur]);
      out = kMode == 0 ? nullptr : p.out[cur];
      n = p.rows[cur] * p.cols;
      const uint8_t fl = p.flags[cur];
      vec = (fl & (out != nullptr ? kFlatVec : kXVec)) != 0;
      if constexpr (kMode != 0) s = member_scale<kCurrent>(p, cur);
    }
    const int64_t ts = int64_t(t - lo) * kTile, te = min(n, ts + kTile);
    if (out == nullptr) {
      if constexpr (kAmax) {
        if (vec) amax_tile<T, true>(x, ts, te, key); else amax_tile<T, false>(x, ts, te, key);
      }
    } else if (vec) {
      cast_tile<T, F, kAmax, true>(x, out, ts, te, s, key);
    } else {
      cast_tile<T, F, kAmax, false>(x, out, ts, te, s, key);
    }
  }
  if (kAmax && cur >= 0) flush_amax_record(key, p.amax_bits + cur, kMode == 1 ? p.record[cur] : nullptr);
}

// ---------------------------------------------------------------------------------------------
// Host side

bool aligned_to(const void* p, std::uintptr_t a) { return (reinterpret_cast<std::uintptr_t>(p) & (a - 1)) == 0; }

int vec_elems(DType t) { return t == DType::kFloat32 ? 4 : 8; }

// Checks the descriptors (all of them, before anything is launched).
void check_members(const char* what, const Fp8MultiMember* members, int64_t num_members, int64_t cols,
                   bool delayed) {
  const std::string w(what);
  require(num_members >= 0, w + ": negative member count " + std::to_string(num_members));
  require(num_members == 0 || members != nullptr, w + ": null member array");
  require(cols >= 0, w + ": cols must be non-negative, got " + std::to_string(cols));
  for (int64_t g = 0; g < num_members; ++g) {
    const Fp8MultiMember& m = members[g];
    const std::string at = w + ": member " + std::to_string(g);
    require(m.rows >= 0, at + " has negative rows " + std::to_string(m.rows));
    if (m.rows > 0 && cols > 0) {
      require(m.x != nullptr, at + ": null input pointer for a non-empty member");
    }
    require(!delayed || m.scale != nullptr, at + ": null scale pointer (delayed scaling needs one per member)");
    const int64_t ld_max = (m.rows + kTR - 1) / kTR * kTR;
    require(m.ld_t == 0 || (m.ld_t >= m.rows && m.ld_t <= ld_max),
            at + ": ld_t " + std::to_string(m.ld_t) + " must be 0 (dense) or in [rows, rows rounded up to " +
                std::to_string(kTR) + "] = [" + std::to_string(m.rows) + ", " + std::to_string(ld_max) + "]");
  }
}

// Fills the chunk [first, first + count) of params; tiles_of(member) gives each member's tile count.
template <typename TilesOf>
void fill_chunk(MultiParams& p, const Fp8MultiMember* members, int64_t first, int count, int64_t cols,
                DType in_dtype, TilesOf&& tiles_of) {
  const int V = vec_elems(in_dtype);
  p.count = count;
  p.cols = cols;
  p.col_tiles = int32_t(std::max<int64_t>(1, (cols + kTC - 1) / kTC));
  int64_t acc = 0;
  for (int i = 0; i < count; ++i) {
    const Fp8MultiMember& m = members[first + i];
    p.x[i] = m.x;
    p.out[i] = static_cast<uint8_t*>(m.out);
    p.out_t[i] = static_cast<uint8_t*>(m.out_t);
    p.scale[i] = m.scale;
    p.record[i] = m.record;
    p.rows[i] = m.rows;
    const bool x16 = aligned16(m.x);
    const bool out_ok = m.out == nullptr || aligned_to(m.out, std::uintptr_t(V));
    uint8_t fl = 0;
    if (x16) fl |= kXVec;
    if (x16 && out_ok) fl |= kFlatVec;
    if (x16 && out_ok && cols % V == 0) fl |= kTileVec;
    const int64_t ld_t = m.ld_t > 0 ? m.ld_t : m.rows;
    if (ld_t % 16 == 0 && aligned16(m.out_t)) fl |= kTVec;
    p.flags[i] = fl;
    p.t_pad[i] = uint8_t(ld_t - m.rows);
    p.tile_start[i] = int32_t(acc);
    acc += tiles_of(m);
    require(acc <= INT32_MAX, "fp8 multi cast: more than 2^31 - 1 tiles in one launch of " + std::to_string(count) +
                                  " members; split the call");
  }
  p.tile_start[count] = int32_t(acc);
}

int64_t flat_tiles(int64_t rows, int64_t cols, DType in_dtype) {
  const int64_t kTile = int64_t(kThreads) * kUnroll * (16 / (in_dtype == DType::kFloat32 ? 4 : 2));
  return (rows * cols + kTile - 1) / kTile;
}

int64_t tt_tiles(int64_t rows, int64_t cols) { return ((rows + kTR - 1) / kTR) * ((cols + kTC - 1) / kTC); }

bool has_data(const Fp8MultiMember& m, int64_t cols) { return m.rows > 0 && cols > 0; }

bool chunk_wants_transpose(const Fp8MultiMember* members, int64_t first, int count, int64_t cols) {
  for (int i = 0; i < count; ++i) {
    if (members[first + i].out_t != nullptr && has_data(members[first + i], cols)) return true;
  }
  return false;
}

template <int kMode>
void launch_flat(const MultiParams& p, DType in_dtype, Fp8Fmt fmt, bool reverse, int64_t grid_blocks,
                 cudaStream_t stream) {
  dispatch_input(in_dtype, [&](auto tag) {
    using T = decltype(tag);
    dispatch_fmt(fmt, [&](auto ftag) {
      constexpr Fp8Fmt F = kMode == 0 ? Fp8Fmt::kE4M3 : decltype(ftag)::value;  // the amax pass casts nothing
      auto kernel = multi_flat_kernel<T, F, kMode>;
      const int64_t grid = grid_blocks > 0 ? grid_blocks : persistent_grid(kernel, p.tile_start[p.count]);
      kernel<<<unsigned(grid), kThreads, 0, stream>>>(p, reverse);
      check_launch("fp8 multi_flat_kernel");
    });
  });
}

int64_t flat_grid(const MultiParams& p, DType in_dtype, Fp8Fmt fmt, int mode) {
  int64_t grid = 1;
  dispatch_input(in_dtype, [&](auto tag) {
    using T = decltype(tag);
    dispatch_fmt(fmt, [&](auto ftag) {
      constexpr Fp8Fmt F = decltype(ftag)::value;
      grid = mode == 2 ? persistent_grid(multi_flat_kernel<T, F, 2>, p.tile_start[p.count])
                       : persistent_grid(multi_flat_kernel<T, F, 1>, p.tile_start[p.count]);
    });
  });
  return grid;
}

template <bool kCurrent>
void launch_transpose(const MultiParams& p, DType in_dtype, Fp8Fmt fmt, cudaStream_t stream) {
  const int64_t grid = std::max<int32_t>(1, p.tile_start[p.count]);
  dispatch_input(in_dtype, [&](auto tag) {
    using T = decltype(tag);
    dispatch_fmt(fmt, [&](auto ftag) {
      multi_cast_transpose_kernel<T, decltype(ftag)::value, kCurrent><<<unsigned(grid), kThreads, 0, stream>>>(p);
      check_launch("fp8 multi_cast_transpose_kernel");
    });
  });
}

}  // namespace

void launch_fp8_multi_quantize(const Fp8MultiMember* members, int64_t num_members, int64_t cols, DType in_dtype,
                               DType out_dtype, float* scale_out, float* scale_inv, int64_t scale_inv_stride,
                               float* amax, cudaStream_t stream) {
  const char* what = "fp8_multi_quantize";
  require(scale_inv_stride >= 1 && scale_inv_stride <= 64, "fp8_multi_quantize: scale_inv_stride must be in [1, 64]");
  require_input_dtype(in_dtype, "fp8_multi_quantize input");
  const Fp8Fmt fmt = fp8_fmt_of(out_dtype, "fp8_multi_quantize output dtype");
  check_members(what, members, num_members, cols, true);
  if (num_members == 0) return;
  require(scale_inv != nullptr && amax != nullptr, "fp8_multi_quantize: null scale_inv/amax array");
  zero_amax(amax, num_members, stream);
  MultiParams p;
  p.fmt_max = 0.0f;
  p.amax_epsilon = 0.0f;
  p.power_2 = 0;
  for (int64_t first = 0; first < num_members; first += kMultiChunk) {
    const int count = int(std::min<int64_t>(kMultiChunk, num_members - first));
    p.amax_bits = reinterpret_cast<uint32_t*>(amax + first);
    p.amax_in = nullptr;
    p.scale_out = scale_out != nullptr ? scale_out + first : nullptr;
    p.scale_inv = scale_inv + first * scale_inv_stride;
    p.scale_inv_stride = int32_t(scale_inv_stride);
    if (chunk_wants_transpose(members, first, count, cols)) {
      fill_chunk(p, members, first, count, cols, in_dtype,
                 [&](const Fp8MultiMember& m) { return has_data(m, cols) ? tt_tiles(m.rows, cols) : 0; });
      launch_transpose<false>(p, in_dtype, fmt, stream);
    } else {
      fill_chunk(p, members, first, count, cols, in_dtype,
                 [&](const Fp8MultiMember& m) { return flat_tiles(m.rows, cols, in_dtype); });
      launch_flat<1>(p, in_dtype, fmt, false, 0, stream);
    }
  }
}

void launch_fp8_multi_current_scaling_quantize(const Fp8MultiMember* members, int64_t num_members, int64_t cols,
                                               DType in_dtype, DType out_dtype, bool power_2_scale,
                                               float amax_epsilon, float* scale, float* scale_inv,
                                               int64_t scale_inv_stride, float* amax, cudaStream_t stream) {
  const char* what = "fp8_multi_current_scaling_quantize";
  require(scale_inv_stride >= 1 && scale_inv_stride <= 64,
          "fp8_multi_current_scaling_quantize: scale_inv_stride must be in [1, 64]");
  require_input_dtype(in_dtype, "fp8_multi_current_scaling_quantize input");
  const Fp8Fmt fmt = fp8_fmt_of(out_dtype, "fp8_multi_current_scaling_quantize output dtype");
  check_members(what, members, num_members, cols, false);
  if (num_members == 0) return;
  require(scale != nullptr && scale_inv != nullptr && amax != nullptr,
          "fp8_multi_current_scaling_quantize: null scale/scale_inv/amax array");
  zero_amax(amax, num_members, stream);
  MultiParams p;
  p.fmt_max = fmt == Fp8Fmt::kE4M3 ? kE4M3Max : kE5M2Max;
  p.amax_epsilon = amax_epsilon;
  p.power_2 = power_2_scale ? 1 : 0;
  for (int64_t first = 0; first < num_members; first += kMultiChunk) {
    const int count = int(std::min<int64_t>(kMultiChunk, num_members - first));
    p.amax_bits = reinterpret_cast<uint32_t*>(amax + first);
    p.amax_in = amax + first;
    p.scale_out = scale + first;
    p.scale_inv = scale_inv + first * scale_inv_stride;
    p.scale_inv_stride = int32_t(scale_inv_stride);
    const bool transpose = chunk_wants_transpose(members, first, count, cols);
    // Pass 1: the amax of every member (flat tiles), on the grid the rowwise cast will use.
    fill_chunk(p, members, first, count, cols, in_dtype,
               [&](const Fp8MultiMember& m) { return flat_tiles(m.rows, cols, in_dtype); });
    const bool flat_same_tiles = [&] {
      for (int i = 0; i < count; ++i) {
        if (members[first + i].out == nullptr && has_data(members[first + i], cols)) return false;
      }
      return true;
    }();
    int64_t grid = 0;
    if (!transpose && flat_same_tiles) grid = flat_grid(p, in_dtype, fmt, 2);
    if (p.tile_start[count] > 0) launch_flat<0>(p, in_dtype, fmt, false, grid, stream);
    // Pass 2: the cast, each member's scale computed on the device from its amax.
    if (transpose) {
      fill_chunk(p, members, first, count, cols, in_dtype, [&](const Fp8MultiMember& m) {
        return has_data(m, cols) && (m.out != nullptr || m.out_t != nullptr) ? tt_tiles(m.rows, cols) : 0;
      });
      launch_transpose<true>(p, in_dtype, fmt, stream);
    } else {
      if (!flat_same_tiles) {
        fill_chunk(p, members, first, count, cols, in_dtype, [&](const Fp8MultiMember& m) {
          return m.out != nullptr ? flat_tiles(m.rows, cols, in_dtype) : 0;
        });
      }
      launch_flat<2>(p, in_dtype, fmt, /*reverse=*/grid > 0, grid, stream);
    }
  }
}

}  // namespace fp_recipes
