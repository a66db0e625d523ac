// Host launchers of the NVFP4 kernel family (nvfp4_*.cu). Framework-agnostic: raw device
// pointers, sizes and a stream; fp_recipes/ops/cuda_nvfp4.py validates and allocates.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "common.h"

namespace fp_recipes {
namespace nvfp4 {

// 4over6 mode of a quantization: off, strict error path, fast-math error path.
enum class FourOverSix : int { kOff = 0, kStrict = 1, kFast = 2 };

struct QuantizeArgs {
  const void* x = nullptr;  // (M, N) row-major, dtype `in_dtype`
  DType in_dtype = DType::kBFloat16;
  int64_t M = 0, N = 0;
  // Rowwise copy: data (M, N/2) uint8, scale (M, N/16) e4m3. amax: FP32 scalar, or (M,) when
  // row_scaled.
  uint8_t* data = nullptr;
  uint8_t* scale = nullptr;
  const float* amax = nullptr;
  bool row_scaled = false;
  // Columnwise copy (quantization of x^T): data_t (N, M/2), scale_t (N, M/16); amax_t FP32 scalar
  // (post-RHT when rht).
  uint8_t* data_t = nullptr;
  uint8_t* scale_t = nullptr;
  const float* amax_t = nullptr;
  bool rht = false;  // columnwise copy of RHT(x) (bf16 input only)
  bool block_2d = false;
  FourOverSix four_over_six = FourOverSix::kOff;
  bool mse = false;  // 4over6 error: MSE (else MAE)
  float e4m3_max = 448.0f;
  bool stochastic_rounding = false;
  uint64_t seed = 0, offset = 0;
  // Optional device (seed, offset) pair (2 x uint64, 8-byte aligned), read by the kernels when they run instead
  // of seed/offset: a captured launch then draws with the counter of each replay (the caller advances it).
  const uint64_t* rng_state = nullptr;
  // Optional BF16 "unit" GEMM operands (E2M1 x E4M3, no global factor; bit-equal to what
  // decode_unit_bf16 writes from the packed copy): unit (M, N) of the rowwise copy, unit_t (N, M) of
  // the columnwise copy, 16-byte aligned. The emulated GEMM reads them without a decode pass.
  uint16_t* unit = nullptr;
  uint16_t* unit_t = nullptr;
  // Optional (row-scaled rowwise-only quantizations): compute the per-row amax in the same launch, write
  // it here (M floats, exactly what row_amax writes) and quantize with it; `amax` is then ignored. One
  // read of x where the fused kernel fits (16-bit input, N <= 16384), else row_amax + quantize.
  float* row_amax_out = nullptr;
  // Optional bias gradient of a grad_output x, fused into a columnwise 1-D quantization (the tile kernel
  // reads every column anyway): the FP32 partial sums of ops.bias_grad's fixed order (16-row segments,
  // four per 64-row tile) into bias_partials ((M + 63) / 64, N), then db (N,) of bias_dtype into bias_out
  // (a second, small launch): the bytes of launch_bias_grad without its read of x.
  float* bias_partials = nullptr;
  void* bias_out = nullptr;
  DType bias_dtype = DType::kFloat32;
};

// Quantize per args (rowwise if data != nullptr, columnwise if data_t != nullptr).
void quantize(const QuantizeArgs& args, cudaStream_t stream);

// The quantize kernels' E2M1 encoding on the CURRENT device: the sm_100-family hardware conversion
// (cvt.rn.satfinite.e2m1x2, compiled into the 100a/120a cubins) unless switched to the software
// encoding (the one every other arch runs; the same bytes by contract). Host-synchronous; set it
// before launching quantizations that should use it (fp_recipes/ops/cuda_nvfp4.py does, on first use).
void set_software_e2m1(bool on);
bool software_e2m1();
// tile2_kernel takes strips of 4 tiles a thread block from this many waves (4 blocks an SM) of 128 x 64 tiles on
// (default 16; 0: always). Returns the previous value. Host-side, every device.
int set_tile2_strip_min_waves(int waves);

// amax = max |x| over numel elements (FP32, NaN propagates as the canonical NaN 0x7FC00000).
// Also (when rht_amax != nullptr) the amax of RHT(x) over 16-row groups of the (M, N) bf16 tensor.
// Either output may be nullptr. Outputs are fully written (no caller memset needed).
// ws: optional amax workspace (kAmaxWorkspaceWords uint32, zero before the first use, owned by one
// stream): with it the launch needs no memset (the last block writes the outputs and re-zeroes ws).
constexpr int kAmaxWorkspaceWords = 4;
void amax(const void* x, DType in_dtype, int64_t M, int64_t N, float* amax_out, float* rht_amax_out,
          cudaStream_t stream, uint32_t* ws = nullptr);

// row_amax[m] = max_n |x[m, n]|; optionally also the global max into amax_out.
void row_amax(const void* x, DType in_dtype, int64_t M, int64_t N, float* row_amax_out,
              float* amax_out, cudaStream_t stream, uint32_t* ws = nullptr);

// x ~= q * RN(RN(fp32(sf) * amax) * RN(1/(6E))), cast to out_dtype (float32/bfloat16/float16).
// data (M, N/2), scale (M, N/16), amax scalar or (M,) when row_scaled.
void dequantize(const uint8_t* data, const uint8_t* scale, const float* amax, bool row_scaled,
                int64_t M, int64_t N, float e4m3_max, void* out, DType out_dtype,
                cudaStream_t stream);

// ---- the emulated GEMM's operands (nvfp4_gemm_operands.cu) ----

// One NVFP4 copy to decode into BF16 "unit" values (E2M1 x E4M3, no global factor), row-major (rows, K).
struct UnitDecodeJob {
  const uint8_t* data = nullptr;   // (rows, K/2) packed E2M1, 8-byte aligned
  const uint8_t* scale = nullptr;  // (rows, K/16) E4M3
  uint16_t* out = nullptr;         // (rows, K) BF16 bits, 16-byte aligned
  int64_t blocks = 0;              // rows * K / 16
};
constexpr int kMaxUnitJobs = 4;

// The GEMM's FP32 alpha = RN(RN(amax_a * amax_b) * RN(1/(36 E_a E_b))), written to out[0], and a zero
// beta to out[1] (cuBLASLt's device pointer mode reads both). A null amax counts as 1 (the unit alpha
// of a row-scaled GEMM). out == nullptr: no alpha.
struct GemmAlphaArgs {
  const float* amax_a = nullptr;
  const float* amax_b = nullptr;
  float e_a = 448.0f, e_b = 448.0f;
  float* out = nullptr;
};

// Decode up to kMaxUnitJobs copies and write alpha, in one launch.
void decode_unit_bf16(const UnitDecodeJob* jobs, int num_jobs, const GemmAlphaArgs& alpha, cudaStream_t stream);

// out[m, n] = cast(RN(RN(d[m, n] * RN(sa * sb)) + bias[n])), sa = amax_a[m] if a_rows else amax_a[0],
// sb = amax_b[n] if b_cols else amax_b[0]; bias optional (float32/bfloat16/float16).
void row_scale_epilogue(const float* d, int64_t M, int64_t N, const float* amax_a, bool a_rows, const float* amax_b,
                        bool b_cols, const void* bias, DType bias_dtype, void* out, DType out_dtype,
                        cudaStream_t stream);

}  // namespace nvfp4
}  // namespace fp_recipes
