// Bindings of the FP8 / grouped FP8 / per-token kernel family (placeholder: being written).
#include <pybind11/pybind11.h>

namespace fp_recipes {
void register_fp8(pybind11::module_& m) { (void)m; }
}  // namespace fp_recipes
