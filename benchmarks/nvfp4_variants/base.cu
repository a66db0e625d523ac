// The real rowwise kernel (fp_recipes/csrc/nvfp4_quantize.cu, included verbatim) as the "base" entries
// of the variant benchmark: a VParams -> KParams adapter around rowwise_kernel<__nv_bfloat16, kFos>.
#include "nvfp4_quantize.cu"
#include "variants.cuh"

namespace fp_recipes {
namespace nvfp4 {
namespace vv {

template <int kFos>
static void launch_base(const VParams& v, unsigned grid, cudaStream_t s) {
  KParams k{};
  k.x = v.x;
  k.M = v.M;
  k.N = v.N;
  k.data = v.data;
  k.scale = v.scale;
  k.amax = v.amax;
  k.row_scaled = v.row_scaled;
  k.e4m3_max = v.e4m3_max;
  k.sr = v.sr;
  k.seed = v.seed;
  k.offset = v.offset;
  rowwise_kernel<__nv_bfloat16, kFos><<<grid, kThreads, 0, s>>>(k);
}

void register_base(std::vector<Entry>& out) {
#define BASE(F) \
  out.push_back(Entry{"base", F, RowwiseCfg<F>::kU, reinterpret_cast<const void*>(&rowwise_kernel<__nv_bfloat16, F>), &launch_base<F>})
  BASE(0);
  BASE(2);
  BASE(4);
  BASE(1);
  BASE(3);
#undef BASE
}

}  // namespace vv
}  // namespace nvfp4
}  // namespace fp_recipes
