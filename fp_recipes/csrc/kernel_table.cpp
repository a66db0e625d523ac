// fp_recipes._C's KernelTable (kernel_table.h): the launchers fp_recipes._torch_ops calls, as C-typed entries that
// catch every exception and return its message instead.
#include <pybind11/pybind11.h>

#include <exception>
#include <string>

#include "common.h"
#include "fp8_kernels.h"
#include "kernel_table.h"

namespace py = pybind11;

namespace fp_recipes {

bool lt_fp8_gemm(std::uintptr_t a, int64_t lda, std::uintptr_t b, int64_t ldb, std::uintptr_t scale_a,
                 std::uintptr_t scale_b, std::uintptr_t d, std::uintptr_t bias, int64_t m, int64_t n, int64_t k,
                 int a_dtype, int b_dtype, int d_dtype, int bias_dtype, bool fast_accum, std::uintptr_t workspace,
                 int64_t workspace_size, int device, std::uintptr_t stream);

namespace {

thread_local std::string t_error;

template <typename F>
const char* guarded(F&& f) {
  try {
    f();
    return nullptr;
  } catch (const std::exception& e) {
    t_error = e.what();
  } catch (...) {
    t_error = "fp_recipes: unknown C++ exception";
  }
  return t_error.c_str();
}

DType code(int c) {
  require(c >= 0 && c <= static_cast<int>(DType::kUInt8), "unknown dtype code " + std::to_string(c));
  return static_cast<DType>(c);
}

const char* cast_delayed(const void* x, int in_dtype, int64_t rows, int64_t cols, const float* scale, int out_dtype,
                         void* out, void* out_t, float* scale_inv, float* amax, float* amax_record, float* partials,
                         void* db, int db_dtype, void* stream) {
  return guarded([&] {
    const BiasGradOut bias{partials, db, db_dtype >= 0 ? code(db_dtype) : DType::kFloat32};
    launch_fp8_quantize(x, code(in_dtype), rows, cols, scale, code(out_dtype), out, out_t, scale_inv, amax,
                        static_cast<cudaStream_t>(stream), amax_record, db_dtype >= 0 ? &bias : nullptr);
  });
}

const char* cast_current(const void* x, int in_dtype, int64_t rows, int64_t cols, int out_dtype, bool power_2,
                         float amax_epsilon, void* out, void* out_t, float* scale, float* scale_inv, float* amax,
                         float* partials, void* db, int db_dtype, uint32_t* amax_ws, void* stream) {
  return guarded([&] {
    const BiasGradOut bias{partials, db, db_dtype >= 0 ? code(db_dtype) : DType::kFloat32};
    launch_fp8_current_scaling_quantize(x, code(in_dtype), rows, cols, code(out_dtype), power_2, amax_epsilon, out,
                                        out_t, scale, scale_inv, amax, static_cast<cudaStream_t>(stream),
                                        db_dtype >= 0 ? &bias : nullptr, amax_ws);
  });
}

const char* gemm(const void* a, int64_t lda, const void* b, int64_t ldb, const float* scale_a, const float* scale_b,
                 void* d, const void* bias, int64_t m, int64_t n, int64_t k, int a_dtype, int b_dtype, int d_dtype,
                 int bias_dtype, bool fast_accum, void* workspace, int64_t workspace_size, int device, void* stream,
                 bool* ran) {
  *ran = false;
  auto u = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p); };
  return guarded([&] {
    *ran = lt_fp8_gemm(u(a), lda, u(b), ldb, u(scale_a), u(scale_b), u(d), u(bias), m, n, k, a_dtype, b_dtype,
                       d_dtype, bias_dtype, fast_accum, u(workspace), workspace_size, device, u(stream));
  });
}

const char* capturing(void* stream, bool* out) {
  *out = false;
  return guarded([&] {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    check_cuda(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status), "cudaStreamIsCapturing");
    *out = status != cudaStreamCaptureStatusNone;
  });
}

const KernelTable g_table{kKernelTableVersion, static_cast<int>(sizeof(KernelTable)), cast_delayed, cast_current,
                          gemm, capturing};

}  // namespace

void register_kernel_table(py::module_& m) {
  m.def("kernel_table", []() {
    return py::capsule(static_cast<const void*>(&g_table), "fp_recipes.kernel_table");
  }, "The launcher table fp_recipes._torch_ops calls (csrc/kernel_table.h).");
}

}  // namespace fp_recipes
