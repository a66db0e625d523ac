// Host launchers of the FP8 kernel family: per-tensor FP8 casts with fused amax, grouped FP8
// per-tensor casts, multi-tensor FP8 casts (many tensors, one launch), and per-token E5M6 / E4M3
// casts. Framework-agnostic: raw device pointers, element counts, dtype codes and a stream. Every launcher validates its arguments (throws
// std::invalid_argument with a clear message) and checks every launch (std::runtime_error).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "common.h"

namespace fp_recipes {

// A bias gradient computed with a cast (or alone, launch_bias_grad): out[c] = the sum over the rows of
// column c of the (rows, cols) input, in the order of the reference (ops/ref_fp8.py, bias_grad): FP32
// sums of 16-row segments, four segments per 64-row tile, tiles added in order; rounded once to
// out_dtype (float32/float16/bfloat16). partials: a (ceil(rows / 64), cols) FP32 device workspace.
struct BiasGradOut {
  float* partials;
  void* out;        // (cols,) of out_dtype
  DType out_dtype;
};

// The second half of a bias gradient: db from the (ceil(rows / 64), cols) tile sums a cast wrote into
// bias.partials (the NVFP4 tile kernel's fused bias gradient uses it too).
void launch_bias_reduce(const BiasGradOut& bias, int64_t rows, int64_t cols, cudaStream_t stream);

// The bias gradient alone (two launches: tile sums, then the reduction over tiles).
void launch_bias_grad(const void* x, DType in_dtype, int64_t rows, int64_t cols, const BiasGradOut& bias,
                      cudaStream_t stream);

// amax_out[0] = max |x| over n elements, FP32, NaN-propagating.
void launch_fp8_amax(const void* x, DType in_dtype, int64_t n, float* amax_out, cudaStream_t stream);

// Delayed scaling: data = satRN(RN(x * scale[0])) as out_dtype (FP8 E4M3/E5M2) over the (rows, cols)
// row-major input; out (rows, cols) and/or out_t (cols, rows) may be null (not wanted);
// scale_inv[0] = RN(1 / scale[0]); amax[0] = max |x| of this input (computed in the same pass).
// amax_record (null: none): an FP32 device value (a delayed-scaling amax_history[0]) updated in the same
// pass as torch.maximum(*amax_record, amax[0]) would (NaN propagates; merged per block with a CAS), so the
// quantizer needs no launch of its own to record the amax.
void launch_fp8_quantize(const void* x, DType in_dtype, int64_t rows, int64_t cols, const float* scale,
                         DType out_dtype, void* out, void* out_t, float* scale_inv, float* amax,
                         cudaStream_t stream, float* amax_record = nullptr, const BiasGradOut* bias = nullptr);

// amax_ws (null: none): a zeroed 16-byte per-stream workspace (the one nvfp4::amax uses) in which the amax
// kernel's blocks reduce the amax, the last block writing amax[0] and zeroing it again: no memset launch.
// Kernels on one stream run in order, so they never share it concurrently; null zeroes amax with a memset
// first. (Delayed scaling's casts above compute the amax in the cast kernel, where the last-block handshake's
// __threadfence waits for each block's stores: measured slower than the memset, so they keep it.)
//
// Current scaling, two launches: amax, then the cast with the scale computed on the device from it
// (see fp8_current_scale in fp8_cast.cu). Writes amax[0], scale[0], scale_inv[0].
// bias (null: none): the bias gradient of x computed in the cast's pass (tiled kernel), plus one
// reduction launch; the same in launch_fp8_quantize.
void launch_fp8_current_scaling_quantize(const void* x, DType in_dtype, int64_t rows, int64_t cols,
                                         DType out_dtype, bool power_2_scale, float amax_epsilon,
                                         void* out, void* out_t, float* scale, float* scale_inv,
                                         float* amax, cudaStream_t stream, const BiasGradOut* bias = nullptr,
                                         uint32_t* amax_ws = nullptr);

// Current scaling's second launch alone: the cast with the scale computed on the device from a given amax
// (amax_in[0], an FP32 device value: max |x| computed elsewhere, e.g. fused by torch.compile into the kernel
// that produced x). The same scale rule and bytes as launch_fp8_current_scaling_quantize for that amax;
// writes scale[0], scale_inv[0] (and bias, as there), never amax_in.
void launch_fp8_cast_from_amax(const void* x, DType in_dtype, int64_t rows, int64_t cols, DType out_dtype,
                               bool power_2_scale, float amax_epsilon, void* out, void* out_t, float* scale,
                               float* scale_inv, const float* amax_in, cudaStream_t stream,
                               const BiasGradOut* bias = nullptr);

// The cast of act(x) without act(x) in memory: each element of x goes through the activation `act` and is rounded to
// x's dtype (the tensor torch's activation kernel writes), then cast as launch_fp8_quantize (scale given: delayed
// scaling, the amax of act(x) written to amax[0] and max-merged into amax_record[0]) or as
// launch_fp8_current_scaling_quantize (scale null: the amax pass and the scale over act(x), written to amax[0],
// scale_out[0], scale_inv[0]) would cast that tensor. One tiled pass for the copies (either may be null), plus the
// amax pass for current scaling; no bias gradient. act: kActGeluTanh (F.gelu(x, approximate="tanh")).
constexpr int kActGeluTanh = 1;
void launch_fp8_act_quantize(const void* x, DType in_dtype, int64_t rows, int64_t cols, int act, const float* scale,
                             DType out_dtype, bool power_2_scale, float amax_epsilon, void* out, void* out_t,
                             float* scale_out, float* scale_inv, float* amax, float* amax_record, cudaStream_t stream);

// out = cast(RN(fp32(data) * scale_inv[0])) to out_dtype (fp32/fp16/bf16) over n elements.
void launch_fp8_dequantize(const void* data, DType fp8_dtype, int64_t n, const float* scale_inv,
                           void* out, DType out_dtype, cudaStream_t stream);

// Grouped: num_groups tensors in one flat buffer of n elements; member g spans
// [offsets[g], offsets[g+1]) (int64, device, validated by the caller: 0, non-decreasing, n).
// scales/scale_inv/amax are (num_groups,) FP32 device arrays. One launch (plus a memset of amax).
void launch_fp8_grouped_quantize(const void* x, DType in_dtype, int64_t n, const int64_t* offsets,
                                 int64_t num_groups, const float* scales, DType out_dtype, void* out,
                                 float* scale_inv, float* amax, cudaStream_t stream);

// Per-member amax (num_groups,) of a grouped buffer (first pass of grouped current scaling).
void launch_fp8_grouped_amax(const void* x, DType in_dtype, int64_t n, const int64_t* offsets, int64_t num_groups,
                             float* amax, cudaStream_t stream);

void launch_fp8_grouped_dequantize(const void* data, DType fp8_dtype, int64_t n, const int64_t* offsets,
                                   int64_t num_groups, const float* scale_inv, void* out,
                                   DType out_dtype, cudaStream_t stream);

// Multi-tensor casts: G separate row-major (rows_g, cols) inputs, all of in_dtype, quantized in one
// launch per chunk of members (G = 8: one launch for delayed, two for current scaling, plus one memset
// of amax). Member g's bytes equal those of launch_fp8_quantize / launch_fp8_current_scaling_quantize
// on member g alone (a padded out_t: in its first rows columns, zeros after them). scale_out /
// scale_inv / amax are contiguous (G,) FP32 device arrays indexed by member; any G >= 0, rows_g >= 0
// (an empty member still gets scale_inv, amax 0 and the scale rule).
struct Fp8MultiMember {
  const void* x;       // (rows, cols) row-major contiguous; may be null when rows * cols == 0
  int64_t rows;        // >= 0
  void* out;           // (rows, cols) FP8, or null (not wanted)
  void* out_t;         // (cols, ld_t) FP8, or null (not wanted)
  const float* scale;  // delayed scaling: this member's FP32 scale (device scalar); unused by current
  float* record;       // delayed scaling: an FP32 device value (the member's amax_history[0]) updated as
                       // torch.maximum(*record, amax_g) in the same pass (null: none); unused by current
  int64_t ld_t;        // out_t's row stride: 0 = rows (dense (cols, rows)); else rows <= ld_t <= rows
                       // rounded up to 64, out_t is (cols, ld_t) and its columns [rows, ld_t) are written
                       // as zeros (the grouped layer pads to a multiple of 16: K of its wgrad GEMMs)
};

// Delayed: data = satRN(RN(x * scale_g)), scale_inv[g * scale_inv_stride] = RN(1 / scale_g),
// amax[g] = max |x_g| (same pass); scale_out[g] = scale_g (the scales gathered; scale_out may be null);
// a member's record (if not null) max-merged with amax_g, a member without elements merging 0.
// scale_inv_stride (1..64 floats): 4 puts every scale_inv at a 16-byte aligned address, which cuBLASLt
// requires of a GEMM's scale pointer.
void launch_fp8_multi_quantize(const Fp8MultiMember* members, int64_t num_members, int64_t cols, DType in_dtype,
                               DType out_dtype, float* scale_out, float* scale_inv, int64_t scale_inv_stride,
                               float* amax, cudaStream_t stream);

// Current: an amax pass over all members, then the cast with scale[g] computed on the device from
// amax[g] (fp8_current_scale: power_2, amax_epsilon). Writes amax, scale, scale_inv.
void launch_fp8_multi_current_scaling_quantize(const Fp8MultiMember* members, int64_t num_members, int64_t cols,
                                               DType in_dtype, DType out_dtype, bool power_2_scale,
                                               float amax_epsilon, float* scale, float* scale_inv,
                                               int64_t scale_inv_stride, float* amax, cudaStream_t stream);

// Per-token casts. fmt: 0 = E5M6 (packed 8 codes in 12 bytes), 1 = E4M3. block_size divides hidden
// (== hidden for one scale per token). scales: FP32 (tokens, hidden/block_size) holding the dequant
// scale sf, or UE8M0 bytes when ue8m0_scales (requires round_sf).
enum class PerTokenFmt : int { kE5M6 = 0, kE4M3 = 1 };

void launch_per_token_cast(const void* x, DType in_dtype, int64_t tokens, int64_t hidden,
                           PerTokenFmt fmt, bool round_sf, bool ue8m0_scales, int64_t block_size,
                           void* data, void* scales, cudaStream_t stream);

void launch_per_token_cast_back(const void* data, const void* scales, PerTokenFmt fmt, bool ue8m0_scales,
                                int64_t tokens, int64_t hidden, int64_t block_size, void* out,
                                DType out_dtype, cudaStream_t stream);

}  // namespace fp_recipes
