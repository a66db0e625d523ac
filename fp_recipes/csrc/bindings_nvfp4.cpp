// Bindings of the NVFP4 kernel family: raw device pointers (0 = absent), sizes, dtype codes, a
// stream handle and the device index. fp_recipes/ops/cuda_nvfp4.py validates before calling.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <vector>

#include "common.h"
#include "nvfp4_kernels.h"

namespace py = pybind11;

namespace fp_recipes {
namespace {

// The extension links its own (static) CUDA runtime, whose current device is separate from
// torch's: select the tensor's device before every launch.
void use_device(int device) { check_cuda(cudaSetDevice(device), "cudaSetDevice"); }

void nvfp4_quantize(std::uintptr_t x, int in_dtype, int64_t M, int64_t N, std::uintptr_t data,
                    std::uintptr_t scale, std::uintptr_t amax, bool row_scaled, std::uintptr_t data_t,
                    std::uintptr_t scale_t, std::uintptr_t amax_t, bool rht, bool block_2d,
                    int four_over_six, bool mse, double e4m3_max, bool stochastic_rounding,
                    uint64_t seed, uint64_t offset, std::uintptr_t stream, int device, std::uintptr_t unit,
                    std::uintptr_t unit_t, std::uintptr_t row_amax_out, std::uintptr_t bias_partials,
                    std::uintptr_t bias_out, int bias_dtype, std::uintptr_t rng_state) {
  use_device(device);
  require(four_over_six >= 0 && four_over_six <= 2, "nvfp4_quantize: four_over_six must be 0, 1 or 2");
  nvfp4::QuantizeArgs a;
  a.x = as_ptr<const void>(x);
  a.in_dtype = static_cast<DType>(in_dtype);
  a.M = M;
  a.N = N;
  a.data = as_ptr<uint8_t>(data);
  a.scale = as_ptr<uint8_t>(scale);
  a.amax = as_ptr<const float>(amax);
  a.row_scaled = row_scaled;
  a.data_t = as_ptr<uint8_t>(data_t);
  a.scale_t = as_ptr<uint8_t>(scale_t);
  a.amax_t = as_ptr<const float>(amax_t);
  a.rht = rht;
  a.block_2d = block_2d;
  a.four_over_six = static_cast<nvfp4::FourOverSix>(four_over_six);
  a.mse = mse;
  a.e4m3_max = static_cast<float>(e4m3_max);
  a.stochastic_rounding = stochastic_rounding;
  a.seed = seed;
  a.offset = offset;
  a.rng_state = as_ptr<const uint64_t>(rng_state);
  a.unit = as_ptr<uint16_t>(unit);
  a.unit_t = as_ptr<uint16_t>(unit_t);
  a.row_amax_out = as_ptr<float>(row_amax_out);
  a.bias_partials = as_ptr<float>(bias_partials);
  a.bias_out = as_ptr<void>(bias_out);
  if (bias_out != 0) a.bias_dtype = static_cast<DType>(bias_dtype);
  nvfp4::quantize(a, as_stream(stream));
}

}  // namespace

void register_nvfp4(py::module_& m) {
  m.def(
      "nvfp4_set_software_e2m1",
      [](bool on, int device) {
        use_device(device);
        nvfp4::set_software_e2m1(on);
      },
      "Make the quantize kernels on `device` use the software E2M1 encoding even where the sm_100-family "
      "hardware conversion is compiled (True), or the hardware one again (False)",
      py::arg("on"), py::arg("device"));
  m.def("nvfp4_set_tile2_strip_min_waves", &nvfp4::set_tile2_strip_min_waves,
        "From how many waves of tiles (4 thread blocks an SM) on the row+col quantize kernel takes strips of 4 "
        "tiles a thread block (0: always); returns the previous value (tests, benchmarks)",
        py::arg("waves"));
  m.def(
      "nvfp4_software_e2m1",
      [](int device) {
        use_device(device);
        return nvfp4::software_e2m1();
      },
      "Whether the software E2M1 encoding is forced on `device`", py::arg("device"));
  m.def("nvfp4_quantize", &nvfp4_quantize, "NVFP4 quantize (raw pointers; see nvfp4_kernels.h)",
        py::arg("x"), py::arg("in_dtype"), py::arg("M"), py::arg("N"), py::arg("data"),
        py::arg("scale"), py::arg("amax"), py::arg("row_scaled"), py::arg("data_t"),
        py::arg("scale_t"), py::arg("amax_t"), py::arg("rht"), py::arg("block_2d"),
        py::arg("four_over_six"), py::arg("mse"), py::arg("e4m3_max"),
        py::arg("stochastic_rounding"), py::arg("seed"), py::arg("offset"), py::arg("stream"),
        py::arg("device"), py::arg("unit") = 0, py::arg("unit_t") = 0, py::arg("row_amax_out") = 0,
        py::arg("bias_partials") = 0, py::arg("bias_out") = 0, py::arg("bias_dtype") = -1,
        py::arg("rng_state") = 0);
  // Feature flags for fp_recipes/ops/cuda_nvfp4.py: nvfp4_quantize takes row_amax_out (row amax computed in
  // the quantize launch, v7) and bias_partials/bias_out/bias_dtype (the bias gradient fused into a
  // columnwise quantization).
  m.attr("nvfp4_fused_row_amax") = true;
  m.attr("nvfp4_fused_bias_grad") = true;
  // ... and rng_state (the stochastic-rounding seed and offset read from device memory when the kernel runs)
  m.attr("nvfp4_device_rng_state") = true;
  m.def(
      "nvfp4_amax",
      [](std::uintptr_t x, int in_dtype, int64_t M, int64_t N, std::uintptr_t amax_out,
         std::uintptr_t rht_amax_out, std::uintptr_t stream, int device, std::uintptr_t ws) {
        use_device(device);
        nvfp4::amax(as_ptr<const void>(x), static_cast<DType>(in_dtype), M, N, as_ptr<float>(amax_out),
                    as_ptr<float>(rht_amax_out), as_stream(stream), as_ptr<uint32_t>(ws));
      },
      "amax of x and/or of RHT(x) (raw pointers; 0 = not wanted)", py::arg("x"), py::arg("in_dtype"),
      py::arg("M"), py::arg("N"), py::arg("amax_out"), py::arg("rht_amax_out"), py::arg("stream"),
      py::arg("device"), py::arg("ws") = 0);
  m.def(
      "nvfp4_row_amax",
      [](std::uintptr_t x, int in_dtype, int64_t M, int64_t N, std::uintptr_t row_out,
         std::uintptr_t amax_out, std::uintptr_t stream, int device, std::uintptr_t ws) {
        use_device(device);
        nvfp4::row_amax(as_ptr<const void>(x), static_cast<DType>(in_dtype), M, N, as_ptr<float>(row_out),
                        as_ptr<float>(amax_out), as_stream(stream), as_ptr<uint32_t>(ws));
      },
      "per-row amax (and optionally the global amax)", py::arg("x"), py::arg("in_dtype"), py::arg("M"),
      py::arg("N"), py::arg("row_out"), py::arg("amax_out"), py::arg("stream"), py::arg("device"),
      py::arg("ws") = 0);
  m.def(
      "nvfp4_dequantize",
      [](std::uintptr_t data, std::uintptr_t scale, std::uintptr_t amax, bool row_scaled, int64_t M,
         int64_t N, double e4m3_max, std::uintptr_t out, int out_dtype, std::uintptr_t stream,
         int device) {
        use_device(device);
        nvfp4::dequantize(as_ptr<const uint8_t>(data), as_ptr<const uint8_t>(scale), as_ptr<const float>(amax),
                          row_scaled, M, N, static_cast<float>(e4m3_max), as_ptr<void>(out),
                          static_cast<DType>(out_dtype), as_stream(stream));
      },
      "NVFP4 dequantize", py::arg("data"), py::arg("scale"), py::arg("amax"), py::arg("row_scaled"),
      py::arg("M"), py::arg("N"), py::arg("e4m3_max"), py::arg("out"), py::arg("out_dtype"),
      py::arg("stream"), py::arg("device"));
  m.def(
      "nvfp4_decode_unit_bf16",
      [](const std::vector<std::uintptr_t>& data, const std::vector<std::uintptr_t>& scale,
         const std::vector<std::uintptr_t>& out, const std::vector<int64_t>& blocks, std::uintptr_t amax_a,
         std::uintptr_t amax_b, double e_a, double e_b, std::uintptr_t alpha_out, std::uintptr_t stream, int device) {
        const size_t num = data.size();
        require(scale.size() == num && out.size() == num && blocks.size() == num,
                "nvfp4_decode_unit_bf16: data, scale, out and blocks must have the same length");
        require(num <= static_cast<size_t>(nvfp4::kMaxUnitJobs), "nvfp4_decode_unit_bf16: at most 4 copies per call");
        use_device(device);
        nvfp4::UnitDecodeJob jobs[nvfp4::kMaxUnitJobs];
        for (size_t i = 0; i < num; ++i) {
          jobs[i].data = as_ptr<const uint8_t>(data[i]);
          jobs[i].scale = as_ptr<const uint8_t>(scale[i]);
          jobs[i].out = as_ptr<uint16_t>(out[i]);
          jobs[i].blocks = blocks[i];
        }
        nvfp4::GemmAlphaArgs alpha;
        alpha.amax_a = as_ptr<const float>(amax_a);
        alpha.amax_b = as_ptr<const float>(amax_b);
        alpha.e_a = static_cast<float>(e_a);
        alpha.e_b = static_cast<float>(e_b);
        alpha.out = as_ptr<float>(alpha_out);
        nvfp4::decode_unit_bf16(jobs, static_cast<int>(num), alpha, as_stream(stream));
      },
      "BF16 unit values (E2M1 x E4M3, no global factor) of up to 4 NVFP4 copies, and optionally the GEMM's "
      "{alpha, 0} (amax pointers 0 = 1), in one launch",
      py::arg("data"), py::arg("scale"), py::arg("out"), py::arg("blocks"), py::arg("amax_a"), py::arg("amax_b"),
      py::arg("e_a"), py::arg("e_b"), py::arg("alpha_out"), py::arg("stream"), py::arg("device"));
  m.def(
      "nvfp4_row_scale_epilogue",
      [](std::uintptr_t d, int64_t M, int64_t N, std::uintptr_t amax_a, bool a_rows, std::uintptr_t amax_b,
         bool b_cols, std::uintptr_t bias, int bias_dtype, std::uintptr_t out, int out_dtype, std::uintptr_t stream,
         int device) {
        use_device(device);
        nvfp4::row_scale_epilogue(as_ptr<const float>(d), M, N, as_ptr<const float>(amax_a), a_rows,
                                  as_ptr<const float>(amax_b), b_cols, as_ptr<const void>(bias),
                                  static_cast<DType>(bias_dtype), as_ptr<void>(out), static_cast<DType>(out_dtype),
                                  as_stream(stream));
      },
      "row-scaled GEMM epilogue: out = cast(RN(RN(d * RN(sa * sb)) + bias))", py::arg("d"), py::arg("M"), py::arg("N"),
      py::arg("amax_a"), py::arg("a_rows"), py::arg("amax_b"), py::arg("b_cols"), py::arg("bias"),
      py::arg("bias_dtype"), py::arg("out"), py::arg("out_dtype"), py::arg("stream"), py::arg("device"));
}

}  // namespace fp_recipes
