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
#if PART == 1
  ALL5("copy", 0, 0, 0, 2, 0, 0);     // the real kernel's code, templated: must time like base
  ALL5("lb", 0, 4, 3, 2, 0, 0);       // launch bounds alone (fast 4, strict 3 blocks/SM)
  NVFP4_VV_ADD(out, "lb_plain5", 0, 5, 2, 0, 0);
  NVFP4_VV_ADD(out, "lb_plain6", 0, 6, 2, 0, 0);
#elif PART == 2
  ALL5("imad", 0, 0, 0, 2, 0, 2);     // IMAD packing (forced: constant-bank multipliers)
  ALL5("lea", 0, 0, 0, 2, 0, 1);      // the same sum with immediate shifts (ptxas makes LEAs)
  ALL5("imad_lb", 0, 4, 3, 2, 0, 2);  // IMAD packing + launch bounds
#elif PART == 3
  ALL5("pf", 0, 0, 0, 2, 1, 0);       // prefetch next iteration's raw words, 2 blocks/iter
  ALL5("pf_lb", 0, 3, 2, 2, 1, 0);
  ALL5("pf_imad_lb", 0, 3, 2, 2, 1, 2);
#elif PART == 5
#define FOS4(name, LB_FAST, LB_STRICT, U, PF, PACK, H)      \
  NVFP4_VV_ADDH(out, name, 2, LB_FAST, U, PF, PACK, H);    \
  NVFP4_VV_ADDH(out, name, 4, LB_FAST, U, PF, PACK, H);    \
  NVFP4_VV_ADDH(out, name, 1, LB_STRICT, U, PF, PACK, H);  \
  NVFP4_VV_ADDH(out, name, 3, LB_STRICT, U, PF, PACK, H)
  FOS4("hoist", 0, 0, 2, 0, 0, 1);     // both blocks' scale chains before the encodes
  FOS4("hoist_lb", 4, 3, 2, 0, 0, 1);
  FOS4("hoist_imad_lb", 4, 3, 2, 0, 2, 1);
#elif PART == 4
  ALL5("u1", 0, 0, 0, 1, 0, 0);       // one block per thread per iteration
  ALL5("u1pf", 0, 0, 0, 1, 1, 0);     // one block per iteration + prefetch of the next
  ALL5("u1pf_imad", 0, 0, 0, 1, 1, 2);
  ALL5("u1_lb", 6, 6, 4, 1, 0, 0);    // one block per iteration, 6 (plain, fast) / 4 (strict) blocks/SM
  ALL5("u1_imad", 0, 0, 0, 1, 0, 2);
#else
#error "unknown PART"
#endif
}

}  // namespace vv
}  // namespace nvfp4
}  // namespace fp_recipes
