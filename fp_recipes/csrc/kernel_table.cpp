// fp_recipes._C's KernelTable (kernel_table.h): the launchers fp_recipes._torch_ops calls, as C-typed entries that
// catch every exception and return its message instead.
#include <pybind11/pybind11.h>

#include <exception>
#include <string>

#include "common.h"
#include "delayed_update.h"
#include "fp8_kernels.h"
#include "kernel_table.h"
#include "nvfp4_kernels.h"

namespace py = pybind11;

namespace fp_recipes {

bool lt_fp8_gemm(std::uintptr_t a, int64_t lda, std::uintptr_t b, int64_t ldb, std::uintptr_t scale_a,
                 std::uintptr_t scale_b, std::uintptr_t d, std::uintptr_t bias, int64_t m, int64_t n, int64_t k,
                 int a_dtype, int b_dtype, int d_dtype, int bias_dtype, bool fast_accum, std::uintptr_t workspace,
                 int64_t workspace_size, int device, std::uintptr_t stream);
bool lt_bf16_gemm(std::uintptr_t a, std::uintptr_t b, std::uintptr_t d, std::uintptr_t bias, int64_t m, int64_t n,
                  int64_t k, int d_dtype, int bias_dtype, std::uintptr_t alpha_beta, std::uintptr_t workspace,
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

// _C's own CUDA runtime keeps its own current device: select it before an NVFP4 launch, as bindings_nvfp4.cpp does
void use_device(int device) { check_cuda(cudaSetDevice(device), "cudaSetDevice"); }

const char* nv_amax(const void* x, int in_dtype, int64_t rows, int64_t cols, float* amax_out, float* rht_amax_out,
                    void* stream, int device, uint32_t* ws) {
  return guarded([&] {
    use_device(device);
    nvfp4::amax(x, code(in_dtype), rows, cols, amax_out, rht_amax_out, static_cast<cudaStream_t>(stream), ws);
  });
}

const char* nv_row_amax(const void* x, int in_dtype, int64_t rows, int64_t cols, float* row_out, float* amax_out,
                        void* stream, int device, uint32_t* ws) {
  return guarded([&] {
    use_device(device);
    nvfp4::row_amax(x, code(in_dtype), rows, cols, row_out, amax_out, static_cast<cudaStream_t>(stream), ws);
  });
}

const char* nv_quantize(const Nvfp4QuantizeCall* c) {
  return guarded([&] {
    require(c->four_over_six >= 0 && c->four_over_six <= 2, "nvfp4_quantize: four_over_six must be 0, 1 or 2");
    use_device(c->device);
    nvfp4::QuantizeArgs a;
    a.x = c->x;
    a.in_dtype = code(c->in_dtype);
    a.M = c->rows;
    a.N = c->cols;
    a.data = static_cast<uint8_t*>(c->data);
    a.scale = static_cast<uint8_t*>(c->scale);
    a.amax = c->amax;
    a.row_scaled = c->row_scaled;
    a.data_t = static_cast<uint8_t*>(c->data_t);
    a.scale_t = static_cast<uint8_t*>(c->scale_t);
    a.amax_t = c->amax_t;
    a.rht = c->rht;
    a.block_2d = c->block_2d;
    a.four_over_six = static_cast<nvfp4::FourOverSix>(c->four_over_six);
    a.mse = c->mse;
    a.e4m3_max = c->e4m3_max;
    a.stochastic_rounding = c->stochastic_rounding;
    a.seed = c->seed;
    a.offset = c->offset;
    a.row_amax_out = c->row_amax_out;
    a.bias_partials = c->bias_partials;
    a.bias_out = c->bias_out;
    if (c->bias_out != nullptr) a.bias_dtype = code(c->bias_dtype);
    a.unit = static_cast<uint16_t*>(c->unit);
    a.unit_t = static_cast<uint16_t*>(c->unit_t);
    a.rng_state = c->rng_state;
    nvfp4::quantize(a, static_cast<cudaStream_t>(c->stream));
  });
}

const char* nv_decode_units(const Nvfp4UnitJob* jobs, int num, const float* amax_a, const float* amax_b, float e_a,
                            float e_b, float* alpha_out, void* stream, int device) {
  return guarded([&] {
    require(num >= 0 && num <= nvfp4::kMaxUnitJobs, "nvfp4_decode_units: 0 to 4 copies per launch");
    use_device(device);
    nvfp4::UnitDecodeJob decode[nvfp4::kMaxUnitJobs];
    for (int i = 0; i < num; ++i) {
      decode[i].data = static_cast<const uint8_t*>(jobs[i].data);
      decode[i].scale = static_cast<const uint8_t*>(jobs[i].scale);
      decode[i].out = static_cast<uint16_t*>(jobs[i].out);
      decode[i].blocks = jobs[i].blocks;
    }
    nvfp4::GemmAlphaArgs alpha;
    alpha.amax_a = amax_a;
    alpha.amax_b = amax_b;
    alpha.e_a = e_a;
    alpha.e_b = e_b;
    alpha.out = alpha_out;
    nvfp4::decode_unit_bf16(decode, num, alpha, static_cast<cudaStream_t>(stream));
  });
}

const char* bf16_gemm(const void* a, const void* b, void* d, const void* bias, int64_t m, int64_t n, int64_t k,
                      int d_dtype, int bias_dtype, const float* alpha_beta, void* workspace, int64_t workspace_size,
                      int device, void* stream, bool* ran) {
  *ran = false;
  auto u = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p); };
  return guarded([&] {
    *ran = lt_bf16_gemm(u(a), u(b), u(d), u(bias), m, n, k, d_dtype, bias_dtype, u(alpha_beta), u(workspace),
                        workspace_size, device, u(stream));
  });
}

const char* nv_row_epilogue(const float* d, int64_t rows, int64_t cols, const float* amax_a, bool a_rows,
                            const float* amax_b, bool b_cols, const void* bias, int bias_dtype, void* out,
                            int out_dtype, void* stream, int device) {
  return guarded([&] {
    use_device(device);
    nvfp4::row_scale_epilogue(d, rows, cols, amax_a, a_rows, amax_b, b_cols, bias,
                              bias != nullptr ? code(bias_dtype) : DType::kFloat32, out, code(out_dtype),
                              static_cast<cudaStream_t>(stream));
  });
}

const char* delayed_update(const void* table, int64_t count, int64_t length, float fmt_max, int margin,
                           bool algo_max, void* stream) {
  return guarded([&] {
    require(count == 0 || table != nullptr, "delayed_update: null pointer table");
    float* const* ptrs = static_cast<float* const*>(table);
    launch_delayed_update_scales(ptrs, ptrs + count, count, length, fmt_max, margin, algo_max,
                                 static_cast<cudaStream_t>(stream));
  });
}

const char* act_cast(const void* x, int in_dtype, int64_t rows, int64_t cols, int act, const float* scale,
                     int out_dtype, bool power_2, float amax_epsilon, void* out, void* out_t, float* scale_out,
                     float* scale_inv, float* amax, float* amax_record, void* stream) {
  return guarded([&] {
    launch_fp8_act_quantize(x, code(in_dtype), rows, cols, act, scale, code(out_dtype), power_2, amax_epsilon, out,
                            out_t, scale_out, scale_inv, amax, amax_record, static_cast<cudaStream_t>(stream));
  });
}

const KernelTable g_table{kKernelTableVersion, static_cast<int>(sizeof(KernelTable)), cast_delayed, cast_current,
                          gemm, capturing, nv_amax, nv_row_amax, nv_quantize, nv_decode_units, bf16_gemm,
                          nv_row_epilogue, delayed_update, act_cast};

}  // namespace

void register_kernel_table(py::module_& m) {
  m.def("kernel_table", []() {
    return py::capsule(static_cast<const void*>(&g_table), "fp_recipes.kernel_table");
  }, "The launcher table fp_recipes._torch_ops calls (csrc/kernel_table.h).");
}

}  // namespace fp_recipes
