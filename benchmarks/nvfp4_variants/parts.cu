// Variant instantiations, split over objects so that nvcc can build them in parallel: compiled once
// per part with -DPART=<n> (scripts/gpu_nvfp4_variants.sh); each part defines register_part<n>.
#include "variants.cuh"

#ifndef PART
#error "compile with -DPART=<n>"
#endif
#define VV_CAT2(a, b) a##b
#define VV_CAT(a, b) VV_CAT2(a, b)

namespace fp_recipes {
namespace nvfp4 {
namespace vv {

// All five modes of one variant; launch bounds per mode class (plain, fast, strict).
#define ALL5(name, LB_PLAIN, LB_FAST, LB_STRICT, U, PF, PACK)  \
  NVFP4_VV_ADD(out, name, 0, LB_PLAIN, U, PF, PACK);           \
  NVFP4_VV_ADD(out, name, 2, LB_FAST, U, PF, PACK);            \
  NVFP4_VV_ADD(out, name, 4, LB_FAST, U, PF, PACK);            \
  NVFP4_VV_ADD(out, name, 1, LB_STRICT, U, PF, PACK);          \
  NVFP4_VV_ADD(out, name, 3, LB_STRICT, U, PF, PACK)

void VV_CAT(register_part, PART)(std::vector<Entry>& out) {
// Launch bounds: 0 = __launch_bounds__(256) only, as the real kernel. NB: (256, 1) is NOT the same:
// ptxas then lets plain grow 63 -> 88 registers (2 blocks/SM) and fast 79 -> 127.
// Round 1 (run 1, benchmarks/results/nvfp4_variants_run1.json) is ported: base = pf_imad_lb (plain),
// u1 (fast), u1_imad (strict). Round 2 keeps the old kernel (v4) and tries the fast path's overheads.
#define FAST2(name, MINB, U, PF, PACK)       \
  NVFP4_VV_ADD(out, name, 2, MINB, U, PF, PACK); \
  NVFP4_VV_ADD(out, name, 4, MINB, U, PF, PACK)
#define R2(name, MINB, F)              \
  NVFP4_VV_ADDR2(out, name, 2, MINB, F); \
  NVFP4_VV_ADDR2(out, name, 4, MINB, F)
#if PART == 1
  ALL5("v4", 0, 0, 0, 2, 0, 0);        // the v4 kernel (before the v6 port): 2 blocks/iter, byte permutes
#elif PART == 2
  FAST2("u1_imad", 0, 1, 0, 2);        // run 1: u1 + IMAD packing (58 registers, 4 blocks/SM)
  FAST2("u1_imad_lb5", 5, 1, 0, 2);    // the same held to 5 blocks/SM (48 registers)
#elif PART == 3
  // Round 2 variants are held to 5 thread blocks per SM (48 registers, like base): unbounded they take
  // 57-63 registers (4 per SM).
  R2("r2_pt", 5, kR2Pt);               // per-tensor / row-scaled loops chosen once
  R2("r2_hmax", 5, kR2Pt | kR2Hmax);   // + BF16x2 block amax
  R2("r2_sgn", 5, kR2Pt | kR2Sgn);     // + signs from the raw words
  R2("r2_cvt", 5, kR2Pt | kR2Cvt);     // + one e4m3x2 conversion, integer div6 range test
#elif PART == 4
  R2("r2_all", 5, kR2Pt | kR2Hmax | kR2Sgn | kR2Cvt);
  R2("r2_all_u", 0, kR2Pt | kR2Hmax | kR2Sgn | kR2Cvt);  // unbounded (61-63 registers, 4 per SM)
  R2("r2_nopt", 5, kR2Hmax | kR2Sgn | kR2Cvt);           // one loop, per-block row_scaled test
#elif PART == 5
  R2("r2_all_imad", 5, kR2Pt | kR2Hmax | kR2Sgn | kR2Cvt | (2 << 8));
#else
#error "unknown PART"
#endif
}

}  // namespace vv
}  // namespace nvfp4
}  // namespace fp_recipes
