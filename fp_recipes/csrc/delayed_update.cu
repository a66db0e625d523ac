// Delayed-scaling scale update in one launch. After every forward (outermost autocast exit) and every
// backward, each Float8Quantizer's scale is recomputed from its amax history and the history rolls.
// The torch version (amax_reduction.py: batched_update_scales) is ~11 kernels per batch; a grouped MoE
// step is host-bound, so every launch is host time. Here: one warp per quantizer, the history and scale
// pointers of a chunk of quantizers passed by value in the kernel parameters (< 4 KB), one launch per
// chunk. Bit for bit the torch rule (same correctly rounded FP32 divisions; the build uses -fmad=false).
// Non-finite history entries (NaN, +-Inf) count as +0.0 and are written back as +0.0; the quantizer's flag
// is set (never cleared), so the host can warn without a sync (quantizers/float8.py: NonfiniteWatch).
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <string>

#include "common.h"
#include "delayed_update.h"

namespace fp_recipes {
namespace {

constexpr int kDelayedUpdateChunk = 224;
constexpr int kWarpsPerBlock = 4;
constexpr unsigned kFullMask = 0xffffffffu;

struct DelayedUpdateChunk {
  float* history[kDelayedUpdateChunk];
  float* scale[kDelayedUpdateChunk];
  bool* flags;  // this chunk's first flag, or null
  int64_t length;
  int count;
  float fmt_max;
  float margin_div;  // 2^margin in FP32 (as torch.full((), 2.0 ** margin) rounds it)
  bool use_margin;
  bool algo_max;
};
static_assert(sizeof(DelayedUpdateChunk) < 4000, "kernel parameters must stay under 4 KB");

__device__ __forceinline__ float finite_or_zero(float v) { return isfinite(v) ? v : 0.f; }

__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    delayed_update_kernel(const __grid_constant__ DelayedUpdateChunk c) {
  const int q = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (q >= c.count) return;  // the whole warp leaves together
  float* h = c.history[q];
  const int64_t L = c.length;
  const float h0 = finite_or_zero(h[0]);

  // 1. amax_ref, from the whole history before anything is written (the shuffles order it). Every slot
  // is read (also for most_recent) to find non-finite entries.
  float m = -INFINITY;
  bool bad = false;
  for (int64_t j = lane; j < L; j += 32) {
    const float v = h[j];
    const bool finite = isfinite(v);
    bad |= !finite;
    m = fmaxf(m, finite ? v : 0.f);  // the sign of a zero max does not matter: a zero amax keeps the old scale
  }
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(kFullMask, m, off));
  bad = __any_sync(kFullMask, bad);
  const float amax_ref = c.algo_max ? m : h0;

  // 2. the scale (lane 0): same FP32 ops and order as the torch twin.
  if (lane == 0) {
    float s = __fdiv_rn(c.fmt_max, amax_ref);
    if (c.use_margin) s = __fdiv_rn(s, c.margin_div);
    s = s > FLT_MAX ? FLT_MAX : s;  // clamp_max: +Inf (amax_ref 0 or subnormal) -> FLT_MAX
    if (amax_ref > 0.f) *c.scale[q] = s;  // amax_ref is finite: non-finite entries counted as 0
    if (bad && c.flags != nullptr) c.flags[q] = true;
  }

  // 3. roll by -1 and zero slot 0, in place: out[j] = h[j + 1] (1 <= j < L-1), out[L-1] = h0, out[0] = 0.
  // Each 32-slot window reads h[j + 1] before any lane writes it (__syncwarp); later windows read only
  // slots above the ones written so far.
  for (int64_t base = 0; base < L; base += 32) {
    const int64_t j = base + lane;
    float v = 0.f;
    if (j > 0 && j < L) v = j == L - 1 ? h0 : finite_or_zero(h[j + 1]);
    __syncwarp();
    if (j < L) h[j] = v;
  }
}

}  // namespace

void launch_delayed_update_scales(float* const* histories, float* const* scales, int64_t count, int64_t length,
                                  float fmt_max, int margin, bool algo_max, cudaStream_t stream) {
  require(count >= 0, "delayed_update_scales: count must be >= 0, got " + std::to_string(count));
  require(length >= 1, "delayed_update_scales: history length must be >= 1, got " + std::to_string(length));
  DelayedUpdateChunk c;
  c.length = length;
  c.fmt_max = fmt_max;
  c.margin_div = std::ldexp(1.0f, margin);  // exact power of two, Inf past FP32 range, as torch rounds it
  c.use_margin = margin != 0;
  c.algo_max = algo_max;
  // the flags pointer follows the count scales in the table (null: no flags)
  bool* const flags = count > 0 ? reinterpret_cast<bool*>(scales[count]) : nullptr;
  for (int64_t first = 0; first < count; first += kDelayedUpdateChunk) {
    c.flags = flags != nullptr ? flags + first : nullptr;
    c.count = static_cast<int>(std::min<int64_t>(kDelayedUpdateChunk, count - first));
    for (int i = 0; i < c.count; ++i) {
      c.history[i] = histories[first + i];
      c.scale[i] = scales[first + i];
      require(c.history[i] != nullptr && c.scale[i] != nullptr, "delayed_update_scales: null pointer");
    }
    const int blocks = (c.count + kWarpsPerBlock - 1) / kWarpsPerBlock;
    delayed_update_kernel<<<blocks, kWarpsPerBlock * 32, 0, stream>>>(c);
    check_launch("delayed_update_kernel");
  }
}

}  // namespace fp_recipes
