// Bindings of the NVFP4 kernel family (placeholder: being written).
#include <pybind11/pybind11.h>

namespace fp_recipes {
void register_nvfp4(pybind11::module_& m) { (void)m; }
}  // namespace fp_recipes
