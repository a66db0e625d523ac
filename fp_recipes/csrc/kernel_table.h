// The table of host launchers that fp_recipes._C hands to fp_recipes._torch_ops (a PyCapsule named
// "fp_recipes.kernel_table"): the torch-linked module allocates outputs and reads the current stream in C++,
// then calls these. _C keeps every kernel and the cuBLASLt plan cache, so there is one copy of each in the
// process, and _C itself stays framework-agnostic.
//
// Plain function pointers with C types only; an entry returns nullptr on success, else the error message (valid
// until the calling thread's next call): exceptions do not cross the module boundary. A new entry goes at the end
// with kKernelTableVersion raised; the reader checks `version` and `size`.
#pragma once

#include <cstdint>

namespace fp_recipes {

constexpr int kKernelTableVersion = 5;  // 2: the emulated NVFP4 GEMM's three launchers, the delayed update;
                                        // 3: the FP8 cast of an activation of x;
                                        // 4: Nvfp4QuantizeCall's unit operands;
                                        // 5: Nvfp4QuantizeCall's device rng_state

// One NVFP4 quantize launch (nvfp4_kernels.h QuantizeArgs, C types; null pointers: absent).
struct Nvfp4QuantizeCall {
  const void* x;
  int in_dtype;
  int64_t rows, cols;
  void* data;
  void* scale;
  const float* amax;
  bool row_scaled;
  void* data_t;
  void* scale_t;
  const float* amax_t;
  bool rht, block_2d;
  int four_over_six;  // 0 off, 1 strict, 2 fast
  bool mse;
  float e4m3_max;
  bool stochastic_rounding;
  uint64_t seed, offset;
  float* row_amax_out;
  float* bias_partials;
  void* bias_out;
  int bias_dtype;  // -1: none
  void* stream;
  int device;
  void* unit;    // BF16 (rows, cols) unit operand of the rowwise copy, or null (QuantizeArgs::unit)
  void* unit_t;  // BF16 (cols, rows) unit operand of the columnwise copy, or null
  const uint64_t* rng_state;  // device (seed, offset) read instead of seed/offset, or null (QuantizeArgs::rng_state)
};

// One copy to decode into BF16 unit values (nvfp4_kernels.h UnitDecodeJob): `blocks` 16-element blocks.
struct Nvfp4UnitJob {
  const void* data;   // packed E2M1, 8-byte aligned
  const void* scale;  // E4M3, one per block
  void* out;          // BF16, 16 values per block
  int64_t blocks;
};

struct KernelTable {
  int version;
  int size;  // sizeof(KernelTable) of the writer

  // Delayed scaling (launch_fp8_quantize): a given scale; amax_record, partials/db may be null (db_dtype -1: none).
  const char* (*fp8_cast_delayed)(const void* x, int in_dtype, int64_t rows, int64_t cols, const float* scale,
                                  int out_dtype, void* out, void* out_t, float* scale_inv, float* amax,
                                  float* amax_record, float* partials, void* db, int db_dtype, void* stream);
  // Current scaling (launch_fp8_current_scaling_quantize); amax_ws: the stream's zeroed workspace or null (memset).
  const char* (*fp8_cast_current)(const void* x, int in_dtype, int64_t rows, int64_t cols, int out_dtype,
                                  bool power_2, float amax_epsilon, void* out, void* out_t, float* scale,
                                  float* scale_inv, float* amax, float* partials, void* db, int db_dtype,
                                  uint32_t* amax_ws, void* stream);
  // One dense FP8 GEMM through the cached cuBLASLt plan (the binding lt_fp8_gemm); *ran false: not launched.
  const char* (*lt_fp8_gemm)(const void* a, int64_t lda, const void* b, int64_t ldb, const float* scale_a,
                             const float* scale_b, void* d, const void* bias, int64_t m, int64_t n, int64_t k,
                             int a_dtype, int b_dtype, int d_dtype, int bias_dtype, bool fast_accum, void* workspace,
                             int64_t workspace_size, int device, void* stream, bool* ran);
  // Whether `stream` is being captured into a CUDA graph (casts then take no amax workspace: ops/workspace.py).
  const char* (*stream_capturing)(void* stream, bool* capturing);
  // NVFP4 (nvfp4_kernels.h): the amax of x and/or of RHT(x), the per-row amax, one quantize launch.
  const char* (*nvfp4_amax)(const void* x, int in_dtype, int64_t rows, int64_t cols, float* amax_out,
                            float* rht_amax_out, void* stream, int device, uint32_t* amax_ws);
  const char* (*nvfp4_row_amax)(const void* x, int in_dtype, int64_t rows, int64_t cols, float* row_out,
                                float* amax_out, void* stream, int device, uint32_t* amax_ws);
  const char* (*nvfp4_quantize)(const Nvfp4QuantizeCall* call);

  // Version 2: the emulated NVFP4 GEMM (gemm/nvfp4_emulated.py). Up to 4 unit decodes and the GEMM's device
  // {alpha, 0} in one launch (alpha_out null: none; a null amax counts as 1).
  const char* (*nvfp4_decode_units)(const Nvfp4UnitJob* jobs, int num_jobs, const float* amax_a, const float* amax_b,
                                    float e_a, float e_b, float* alpha_out, void* stream, int device);
  // One BF16 GEMM with device alpha/beta through the cached cuBLASLt plan (the binding lt_bf16_gemm); *ran false:
  // not launched.
  const char* (*lt_bf16_gemm)(const void* a, const void* b, void* d, const void* bias, int64_t m, int64_t n,
                              int64_t k, int d_dtype, int bias_dtype, const float* alpha_beta, void* workspace,
                              int64_t workspace_size, int device, void* stream, bool* ran);
  // The row-scaled GEMM's epilogue (nvfp4_kernels.h row_scale_epilogue); bias_dtype -1: no bias.
  const char* (*nvfp4_row_epilogue)(const float* d, int64_t rows, int64_t cols, const float* amax_a, bool a_rows,
                                    const float* amax_b, bool b_cols, const void* bias, int bias_dtype, void* out,
                                    int out_dtype, void* stream, int device);
  // The delayed-scaling update of `count` quantizers (delayed_update.h): `table` is host memory holding the count
  // history pointers, the count scale pointers, then the flags pointer (null: none).
  const char* (*delayed_update)(const void* table, int64_t count, int64_t length, float fmt_max, int margin,
                                bool algo_max, void* stream);

  // Version 3: the FP8 cast of act(x) (launch_fp8_act_quantize): scale null -> current scaling (scale_out written),
  // else delayed scaling (amax_record max-merged); act: fp8_kernels.h kActGeluTanh.
  const char* (*fp8_act_cast)(const void* x, int in_dtype, int64_t rows, int64_t cols, int act, const float* scale,
                              int out_dtype, bool power_2, float amax_epsilon, void* out, void* out_t,
                              float* scale_out, float* scale_inv, float* amax, float* amax_record, void* stream);
};

}  // namespace fp_recipes
