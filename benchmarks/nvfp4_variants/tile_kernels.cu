// The tile kernels of fp_recipes/csrc/nvfp4_quantize.cu (included verbatim) behind a TU-neutral entry point
// for tile_main.cu (the v7 tile benchmark). Compiled once per ptxas bound: -DNVFP4_TILE2_MINB=<b>
// -DTB_TAG=<name>; the library's external functions are renamed per object so that they link together.
#ifndef TB_TAG
#error "compile with -DTB_TAG=<tag>"
#endif
#define TB_CAT2(a, b) a##b
#define TB_CAT(a, b) TB_CAT2(a, b)
#define quantize TB_CAT(quantize_, TB_TAG)
#define set_software_e2m1 TB_CAT(set_software_e2m1_, TB_TAG)
#define software_e2m1 TB_CAT(software_e2m1_, TB_TAG)
#define set_tile2_strip_min_waves TB_CAT(set_tile2_strip_min_waves_, TB_TAG)
#include "nvfp4_quantize.cu"
#include "tile_bench.h"

namespace fp_recipes {
namespace nvfp4 {
namespace {

KParams to_k(const tb::Args& a) {
  KParams k{};
  k.x = a.x;
  k.M = a.M;
  k.N = a.N;
  k.data = a.data;
  k.scale = a.scale;
  k.amax = a.amax;
  k.row_scaled = a.row_scaled;
  k.data_t = a.data_t;
  k.scale_t = a.scale_t;
  k.amax_t = a.amax_t;
  k.rht = a.rht;
  k.block_2d = a.block_2d;
  k.e4m3_max = 448.0f;
  k.sr = a.sr;
  k.seed = a.seed;
  k.offset = a.offset;
  return k;
}

template <typename T>
void run_t(const tb::Args& a, int which, int waves, cudaStream_t s) {
  const KParams k = to_k(a);
  switch (which) {
    case tb::kOldTile: {  // v6 tile kernel, its own 64x64 grid
      const int64_t gx = (k.N + kTile - 1) / kTile, gy = (k.M + kTile - 1) / kTile;
      tile_kernel<T, 0><<<dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), kThreads, 0, s>>>(k);
      break;
    }
    case tb::kTile2: launch_tile2<T>(k, s, waves); break;
    case tb::kRowwise: {  // rowwise_kernel as the library launches it (row_scaled as given)
      const int64_t total = k.M * (k.N / 16);
      int dev = 0, sms = 132;
      cudaGetDevice(&dev);
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
      constexpr int kPer = RowwiseCfg<0>::kU * kThreads;
      const int64_t want = (total + kPer - 1) / kPer, cap = static_cast<int64_t>(sms) * 16;
      rowwise_kernel<T, 0><<<static_cast<unsigned>(want < cap ? want : cap), kThreads, 0, s>>>(k);
      break;
    }
    case tb::kRowScaled:
      if constexpr (sizeof(T) == 2) launch_row_scaled<T, 0, false>(k, nullptr, s);
      break;
    case tb::kRowScaledFused:
      if constexpr (sizeof(T) == 2) launch_row_scaled<T, 0, true>(k, a.row_amax_out, s);
      break;
    case tb::kRowScaledFusedFast:
      if constexpr (sizeof(T) == 2) launch_row_scaled<T, 2, true>(k, a.row_amax_out, s);
      break;
  }
}

}  // namespace
}  // namespace nvfp4
}  // namespace fp_recipes

namespace tb {
void TB_CAT(run_, TB_TAG)(const Args& a, int which, int waves, cudaStream_t s) {
  using namespace fp_recipes::nvfp4;
  switch (a.dtype) {
    case 0: run_t<float>(a, which, waves, s); break;
    case 2: run_t<__nv_bfloat16>(a, which, waves, s); break;
    default: break;
  }
}
// Registers / local bytes / occupancy of the kernel that `which` launches for (dtype, 2-D, SR, RHT).
void TB_CAT(attrs_, TB_TAG)(int dtype, int which, bool d2, bool sr, bool rht, int* regs, int* local, int* occ) {
  using namespace fp_recipes::nvfp4;
  const void* f = nullptr;
  if (dtype == 2) {
    using T = __nv_bfloat16;
    if (which == kOldTile) f = reinterpret_cast<const void*>(&tile_kernel<T, 0>);
    else if (which == kRowwise) f = reinterpret_cast<const void*>(&rowwise_kernel<T, 0>);
    else if (which == kRowScaled) f = reinterpret_cast<const void*>(&row_scaled_kernel<T, 0, 2, false>);
    else if (which == kRowScaledFused) f = reinterpret_cast<const void*>(&row_scaled_kernel<T, 0, 2, true>);
    else if (which == kRowScaledFusedFast) f = reinterpret_cast<const void*>(&row_scaled_kernel<T, 2, 2, true>);
    else if (d2) f = sr ? reinterpret_cast<const void*>(&tile2_kernel<T, true, true, false>)
                        : reinterpret_cast<const void*>(&tile2_kernel<T, true, false, false>);
    else if (rht) f = sr ? reinterpret_cast<const void*>(&tile2_kernel<T, false, true, true>)
                         : reinterpret_cast<const void*>(&tile2_kernel<T, false, false, true>);
    else f = sr ? reinterpret_cast<const void*>(&tile2_kernel<T, false, true, false>)
                : reinterpret_cast<const void*>(&tile2_kernel<T, false, false, false>);
  } else {
    using T = float;
    if (which == kOldTile) f = reinterpret_cast<const void*>(&tile_kernel<T, 0>);
    else if (which == kRowwise) f = reinterpret_cast<const void*>(&rowwise_kernel<T, 0>);
    else if (d2) f = sr ? reinterpret_cast<const void*>(&tile2_kernel<T, true, true, false>)
                        : reinterpret_cast<const void*>(&tile2_kernel<T, true, false, false>);
    else f = sr ? reinterpret_cast<const void*>(&tile2_kernel<T, false, true, false>)
                : reinterpret_cast<const void*>(&tile2_kernel<T, false, false, false>);
  }
  *regs = *local = *occ = -1;
  if (f == nullptr) return;
  cudaFuncAttributes fa;
  if (cudaFuncGetAttributes(&fa, f) != cudaSuccess) return;
  *regs = fa.numRegs;
  *local = static_cast<int>(fa.localSizeBytes);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(occ, f, 256, 0);
}
}  // namespace tb
