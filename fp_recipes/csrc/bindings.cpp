// The pybind11 module fp_recipes._C. Each kernel family registers its own functions
// (bindings_<family>.cpp); this file only assembles them and answers build questions.
#include <pybind11/pybind11.h>

#include <cuda_runtime.h>

#include "common.h"

namespace py = pybind11;

namespace fp_recipes {
void register_fp8(py::module_& m);
void register_nvfp4(py::module_& m);
void register_gemm_lt(py::module_& m);
void register_kernel_table(py::module_& m);
}  // namespace fp_recipes

#ifndef FP_RECIPES_ARCHS
#define FP_RECIPES_ARCHS ""
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "fp_recipes CUDA kernels (raw-pointer bindings; use fp_recipes.ops, not this module)";
  m.def("built_archs", []() { return std::string(FP_RECIPES_ARCHS); },
        "The CUDA archs this extension was compiled for, ';'-separated.");
  m.def("device_count", []() {
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
      cudaGetLastError();  // clear the sticky 'no device' error
      return 0;
    }
    return n;
  }, "Number of CUDA devices visible to the extension's runtime (0 when none).");
  fp_recipes::register_fp8(m);
  fp_recipes::register_nvfp4(m);
  fp_recipes::register_gemm_lt(m);
  fp_recipes::register_kernel_table(m);
}
