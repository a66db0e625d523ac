// TU-neutral interface of tile_kernels.cu (one object per ptxas bound) for tile_main.cu.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace tb {
enum Which { kOldTile = 0, kTile2 = 1, kRowwise = 2, kRowScaled = 3, kRowScaledFused = 4, kRowScaledFusedFast = 5 };
struct Args {
  const void* x = nullptr;
  int dtype = 2;  // 0 fp32, 2 bf16 (csrc/common.h DType)
  int64_t M = 0, N = 0;
  uint8_t* data = nullptr;
  uint8_t* scale = nullptr;
  const float* amax = nullptr;
  int row_scaled = 0;
  uint8_t* data_t = nullptr;
  uint8_t* scale_t = nullptr;
  const float* amax_t = nullptr;
  int rht = 0, block_2d = 0, sr = 0;
  uint64_t seed = 0, offset = 0;
  float* row_amax_out = nullptr;
};
void run_b0(const Args&, int which, int waves, cudaStream_t);
void run_b4(const Args&, int which, int waves, cudaStream_t);
void attrs_b0(int dtype, int which, bool d2, bool sr, bool rht, int* regs, int* local, int* occ);
void attrs_b4(int dtype, int which, bool d2, bool sr, bool rht, int* regs, int* local, int* occ);
// m0: b0 with v6's compare-and-select E2M1 binade magic and no short path (EXP_MAGIC=0, SHORT=0)
void run_m0(const Args&, int which, int waves, cudaStream_t);
void attrs_m0(int dtype, int which, bool d2, bool sr, bool rht, int* regs, int* local, int* occ);
// s0: b0 without the short (clamp-free) encode path (NVFP4_TILE2_SHORT=0)
void run_s0(const Args&, int which, int waves, cudaStream_t);
void attrs_s0(int dtype, int which, bool d2, bool sr, bool rht, int* regs, int* local, int* occ);
// f1: b0 with the stochastic-rounding encode of sessions 26-40 (NVFP4_SR_CEIL=0: encode16_sr_fma; b0 runs
// encode16_sr_ceil, session 41)
void run_f1(const Args&, int which, int waves, cudaStream_t);
void attrs_f1(int dtype, int which, bool d2, bool sr, bool rht, int* regs, int* local, int* occ);
// st4 / st1: b0 with tile2's strips of 4 tiles a thread block always / never (NVFP4_TILE2_STRIP_WAVES=0 /
// 1000000; b0 takes them from 16 waves of tiles on; session 35)
void run_st4(const Args&, int which, int waves, cudaStream_t);
void attrs_st4(int dtype, int which, bool d2, bool sr, bool rht, int* regs, int* local, int* occ);
void run_st1(const Args&, int which, int waves, cudaStream_t);
void attrs_st1(int dtype, int which, bool d2, bool sr, bool rht, int* regs, int* local, int* occ);
// rs1: b0 with NVFP4_ROW_SCALED_FREE=1 (row_scaled_kernel with a given amax: every thread makes the row's scale,
// no block barrier a row; session 35)
void run_rs1(const Args&, int which, int waves, cudaStream_t);
void attrs_rs1(int dtype, int which, bool d2, bool sr, bool rht, int* regs, int* local, int* occ);
// ru2: b0 with tile2's rowwise loop unrolled over its two blocks in the 1-D SR instantiations
// (NVFP4_TILE2_SR_ROW_UNROLL=2: two Philox chains in flight; session 41, not yet measured)
void run_ru2(const Args&, int which, int waves, cudaStream_t);
void attrs_ru2(int dtype, int which, bool d2, bool sr, bool rht, int* regs, int* local, int* occ);
}  // namespace tb
