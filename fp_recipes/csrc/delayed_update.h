// Delayed-scaling scale update of many Float8Quantizers in one launch (per chunk of quantizers).
// The torch twin is the op sequence of fp_recipes/modules/amax_reduction.py: batched_update_scales.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace fp_recipes {

// For each quantizer i < count, with histories[i] an FP32 (length,) device array and scales[i] one FP32
// device value (host arrays of device pointers, all distinct):
//   every non-finite history entry (NaN, +Inf, -Inf) counts as, and is written back as, +0.0, and then
//   flags[i] = true (never cleared here);
//   amax_ref = algo_max ? max(history) : history[0];
//   s = RN(fmt_max / amax_ref); if margin != 0: s = RN(s / 2^margin); s = +Inf ? FLT_MAX : s;
//   scale = amax_ref > 0 ? s : scale (untouched);
//   history = roll(history, -1) with slot 0 zeroed.
// scales has count + 1 entries: the count scale pointers, then `flags` (a bool[count] device array, or
// null for none) -- the Python side's one host pointer table (ops/cuda_delayed.py) is
// [histories..., scales..., flags], and the binding passes table and table + count.
// One launch per kDelayedUpdateChunk quantizers (the pointers travel in the kernel parameters).
void launch_delayed_update_scales(float* const* histories, float* const* scales, int64_t count, int64_t length,
                                  float fmt_max, int margin, bool algo_max, cudaStream_t stream);

}  // namespace fp_recipes
