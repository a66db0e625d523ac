// Bindings of the FP8 / grouped FP8 / per-token kernel family. Raw device pointers (ints), element
// counts, dtype codes (common.h DType) and the CUDA stream as an int; fp_recipes/ops/cuda_fp8.py
// validates tensors and calls these. Errors surface as Python ValueError/RuntimeError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <utility>
#include <vector>

#include "common.h"
#include "delayed_update.h"
#include "fp8_kernels.h"

namespace py = pybind11;

namespace fp_recipes {

int64_t per_token_max_hidden(bool unit8);

namespace {
DType dt(int code) {
  require(code >= 0 && code <= static_cast<int>(DType::kUInt8), "unknown dtype code " + std::to_string(code));
  return static_cast<DType>(code);
}
PerTokenFmt pt_fmt(int code) {
  require(code == 0 || code == 1, "per-token fmt code must be 0 (e5m6) or 1 (e4m3), got " + std::to_string(code));
  return static_cast<PerTokenFmt>(code);
}
template <typename T = void>
T* p(std::uintptr_t v) {
  return reinterpret_cast<T*>(v);
}

// Member descriptors of the multi-tensor casts from per-member lists (x, rows, and out / out_t /
// scale / ld_t, each either one entry per member or empty = null (ld_t: 0, dense) for every member).
std::vector<Fp8MultiMember> multi_members(const char* what, const std::vector<std::uintptr_t>& x,
                                          const std::vector<int64_t>& rows, const std::vector<std::uintptr_t>& out,
                                          const std::vector<std::uintptr_t>& out_t,
                                          const std::vector<std::uintptr_t>& scale,
                                          const std::vector<int64_t>& ld_t) {
  const size_t g = x.size();
  const std::string w(what);
  require(rows.size() == g, w + ": " + std::to_string(g) + " inputs but " + std::to_string(rows.size()) + " row counts");
  require(out.empty() || out.size() == g, w + ": out must have one pointer per member or none, got " +
                                              std::to_string(out.size()) + " for " + std::to_string(g) + " members");
  require(out_t.empty() || out_t.size() == g, w + ": out_t must have one pointer per member or none, got " +
                                                  std::to_string(out_t.size()) + " for " + std::to_string(g) + " members");
  require(scale.empty() || scale.size() == g, w + ": scales must have one pointer per member or none, got " +
                                                  std::to_string(scale.size()) + " for " + std::to_string(g) + " members");
  require(ld_t.empty() || ld_t.size() == g, w + ": ld_t must have one row stride per member or none, got " +
                                                std::to_string(ld_t.size()) + " for " + std::to_string(g) + " members");
  std::vector<Fp8MultiMember> m(g);
  for (size_t i = 0; i < g; ++i) {
    m[i].x = p(x[i]);
    m[i].rows = rows[i];
    m[i].out = out.empty() ? nullptr : p(out[i]);
    m[i].out_t = out_t.empty() ? nullptr : p(out_t[i]);
    m[i].scale = scale.empty() ? nullptr : p<const float>(scale[i]);
    m[i].ld_t = ld_t.empty() ? 0 : ld_t[i];
  }
  return m;
}
}  // namespace

void register_fp8(py::module_& m) {
  m.def("fp8_amax",
        [](std::uintptr_t x, int in_dtype, int64_t n, std::uintptr_t amax, std::uintptr_t stream) {
          launch_fp8_amax(p(x), dt(in_dtype), n, p<float>(amax), as_stream(stream));
        },
        py::arg("x"), py::arg("in_dtype"), py::arg("n"), py::arg("amax"), py::arg("stream"));
  m.def("fp8_quantize",
        [](std::uintptr_t x, int in_dtype, int64_t rows, int64_t cols, std::uintptr_t scale, int out_dtype,
           std::uintptr_t out, std::uintptr_t out_t, std::uintptr_t scale_inv, std::uintptr_t amax,
           std::uintptr_t stream) {
          launch_fp8_quantize(p(x), dt(in_dtype), rows, cols, p<const float>(scale), dt(out_dtype), p(out), p(out_t),
                              p<float>(scale_inv), p<float>(amax), as_stream(stream));
        },
        py::arg("x"), py::arg("in_dtype"), py::arg("rows"), py::arg("cols"), py::arg("scale"),
        py::arg("out_dtype"), py::arg("out"), py::arg("out_t"), py::arg("scale_inv"), py::arg("amax"),
        py::arg("stream"));
  // fp8_quantize that also max-merges the amax into amax_record (a delayed-scaling amax_history[0]) in
  // the kernel: one launch instead of the cast plus a torch.maximum (fp8_kernels.h).
  m.def("fp8_quantize_record",
        [](std::uintptr_t x, int in_dtype, int64_t rows, int64_t cols, std::uintptr_t scale, int out_dtype,
           std::uintptr_t out, std::uintptr_t out_t, std::uintptr_t scale_inv, std::uintptr_t amax,
           std::uintptr_t amax_record, std::uintptr_t stream) {
          require(amax_record != 0, "fp8_quantize_record: null amax_record");
          launch_fp8_quantize(p(x), dt(in_dtype), rows, cols, p<const float>(scale), dt(out_dtype), p(out), p(out_t),
                              p<float>(scale_inv), p<float>(amax), as_stream(stream), p<float>(amax_record));
        },
        py::arg("x"), py::arg("in_dtype"), py::arg("rows"), py::arg("cols"), py::arg("scale"),
        py::arg("out_dtype"), py::arg("out"), py::arg("out_t"), py::arg("scale_inv"), py::arg("amax"),
        py::arg("amax_record"), py::arg("stream"));
  // The casts with a fused bias gradient of the input (the grad_output of a Linear with a bias): the tile
  // sums in the cast's pass, then one reduction into db (fp8_kernels.h, BiasGradOut). amax_record may be 0.
  m.def("fp8_quantize_dbias",
        [](std::uintptr_t x, int in_dtype, int64_t rows, int64_t cols, std::uintptr_t scale, int out_dtype,
           std::uintptr_t out, std::uintptr_t out_t, std::uintptr_t scale_inv, std::uintptr_t amax,
           std::uintptr_t amax_record, std::uintptr_t partials, std::uintptr_t db, int db_dtype,
           std::uintptr_t stream) {
          const BiasGradOut bias{p<float>(partials), p(db), dt(db_dtype)};
          launch_fp8_quantize(p(x), dt(in_dtype), rows, cols, p<const float>(scale), dt(out_dtype), p(out), p(out_t),
                              p<float>(scale_inv), p<float>(amax), as_stream(stream), p<float>(amax_record), &bias);
        },
        py::arg("x"), py::arg("in_dtype"), py::arg("rows"), py::arg("cols"), py::arg("scale"),
        py::arg("out_dtype"), py::arg("out"), py::arg("out_t"), py::arg("scale_inv"), py::arg("amax"),
        py::arg("amax_record"), py::arg("partials"), py::arg("db"), py::arg("db_dtype"), py::arg("stream"));
  m.def("fp8_current_scaling_quantize_dbias",
        [](std::uintptr_t x, int in_dtype, int64_t rows, int64_t cols, int out_dtype, bool power_2,
           float amax_epsilon, std::uintptr_t out, std::uintptr_t out_t, std::uintptr_t scale,
           std::uintptr_t scale_inv, std::uintptr_t amax, std::uintptr_t partials, std::uintptr_t db, int db_dtype,
           std::uintptr_t stream, std::uintptr_t amax_ws) {
          const BiasGradOut bias{p<float>(partials), p(db), dt(db_dtype)};
          launch_fp8_current_scaling_quantize(p(x), dt(in_dtype), rows, cols, dt(out_dtype), power_2, amax_epsilon,
                                              p(out), p(out_t), p<float>(scale), p<float>(scale_inv),
                                              p<float>(amax), as_stream(stream), &bias, p<uint32_t>(amax_ws));
        },
        py::arg("x"), py::arg("in_dtype"), py::arg("rows"), py::arg("cols"), py::arg("out_dtype"),
        py::arg("power_2"), py::arg("amax_epsilon"), py::arg("out"), py::arg("out_t"), py::arg("scale"),
        py::arg("scale_inv"), py::arg("amax"), py::arg("partials"), py::arg("db"), py::arg("db_dtype"),
        py::arg("stream"), py::arg("amax_ws") = 0);
  m.def("bias_grad",
        [](std::uintptr_t x, int in_dtype, int64_t rows, int64_t cols, std::uintptr_t partials, std::uintptr_t db,
           int db_dtype, std::uintptr_t stream) {
          launch_bias_grad(p(x), dt(in_dtype), rows, cols, BiasGradOut{p<float>(partials), p(db), dt(db_dtype)},
                           as_stream(stream));
        },
        py::arg("x"), py::arg("in_dtype"), py::arg("rows"), py::arg("cols"), py::arg("partials"), py::arg("db"),
        py::arg("db_dtype"), py::arg("stream"));
  m.def("fp8_current_scaling_quantize",
        [](std::uintptr_t x, int in_dtype, int64_t rows, int64_t cols, int out_dtype, bool power_2,
           float amax_epsilon, std::uintptr_t out, std::uintptr_t out_t, std::uintptr_t scale,
           std::uintptr_t scale_inv, std::uintptr_t amax, std::uintptr_t stream, std::uintptr_t amax_ws) {
          launch_fp8_current_scaling_quantize(p(x), dt(in_dtype), rows, cols, dt(out_dtype), power_2, amax_epsilon,
                                              p(out), p(out_t), p<float>(scale), p<float>(scale_inv),
                                              p<float>(amax), as_stream(stream), nullptr, p<uint32_t>(amax_ws));
        },
        py::arg("x"), py::arg("in_dtype"), py::arg("rows"), py::arg("cols"), py::arg("out_dtype"),
        py::arg("power_2"), py::arg("amax_epsilon"), py::arg("out"), py::arg("out_t"), py::arg("scale"),
        py::arg("scale_inv"), py::arg("amax"), py::arg("stream"), py::arg("amax_ws") = 0);
  // The current-scaling casts take amax_ws (a per-stream zeroed workspace: no amax memset; fp8_kernels.h)
  m.attr("fp8_amax_workspace") = true;
  // Current scaling's cast from a given amax (fp8_kernels.h, launch_fp8_cast_from_amax); db_dtype < 0: no bias
  // gradient (else partials/db as in fp8_current_scaling_quantize_dbias; partials may be 0 for an empty x)
  m.def("fp8_cast_from_amax",
        [](std::uintptr_t x, int in_dtype, int64_t rows, int64_t cols, int out_dtype, bool power_2,
           float amax_epsilon, std::uintptr_t out, std::uintptr_t out_t, std::uintptr_t scale,
           std::uintptr_t scale_inv, std::uintptr_t amax, std::uintptr_t stream, std::uintptr_t partials,
           std::uintptr_t db, int db_dtype) {
          const bool with_bias = db_dtype >= 0;
          const BiasGradOut bias{p<float>(partials), p(db), with_bias ? dt(db_dtype) : DType::kFloat32};
          launch_fp8_cast_from_amax(p(x), dt(in_dtype), rows, cols, dt(out_dtype), power_2, amax_epsilon, p(out),
                                    p(out_t), p<float>(scale), p<float>(scale_inv), p<const float>(amax),
                                    as_stream(stream), with_bias ? &bias : nullptr);
        },
        py::arg("x"), py::arg("in_dtype"), py::arg("rows"), py::arg("cols"), py::arg("out_dtype"),
        py::arg("power_2"), py::arg("amax_epsilon"), py::arg("out"), py::arg("out_t"), py::arg("scale"),
        py::arg("scale_inv"), py::arg("amax"), py::arg("stream"), py::arg("partials") = 0, py::arg("db") = 0,
        py::arg("db_dtype") = -1);
  // The cast of an activation of x without the activation in memory (fp8_kernels.h, launch_fp8_act_quantize):
  // scale 0 -> current scaling (scale_out written), else delayed (amax_record merged). act 1: GELU, tanh.
  m.def("fp8_act_quantize",
        [](std::uintptr_t x, int in_dtype, int64_t rows, int64_t cols, int act, std::uintptr_t scale, int out_dtype,
           bool power_2, float amax_epsilon, std::uintptr_t out, std::uintptr_t out_t, std::uintptr_t scale_out,
           std::uintptr_t scale_inv, std::uintptr_t amax, std::uintptr_t amax_record, std::uintptr_t stream) {
          launch_fp8_act_quantize(p(x), dt(in_dtype), rows, cols, act, p<const float>(scale), dt(out_dtype), power_2,
                                  amax_epsilon, p(out), p(out_t), p<float>(scale_out), p<float>(scale_inv),
                                  p<float>(amax), p<float>(amax_record), as_stream(stream));
        },
        py::arg("x"), py::arg("in_dtype"), py::arg("rows"), py::arg("cols"), py::arg("act"), py::arg("scale"),
        py::arg("out_dtype"), py::arg("power_2"), py::arg("amax_epsilon"), py::arg("out"), py::arg("out_t"),
        py::arg("scale_out"), py::arg("scale_inv"), py::arg("amax"), py::arg("amax_record"), py::arg("stream"));
  m.attr("fp8_act_gelu_tanh") = kActGeluTanh;
  m.def("fp8_dequantize",
        [](std::uintptr_t data, int fp8_dtype, int64_t n, std::uintptr_t scale_inv, std::uintptr_t out,
           int out_dtype, std::uintptr_t stream) {
          launch_fp8_dequantize(p(data), dt(fp8_dtype), n, p<const float>(scale_inv), p(out), dt(out_dtype),
                                as_stream(stream));
        },
        py::arg("data"), py::arg("fp8_dtype"), py::arg("n"), py::arg("scale_inv"), py::arg("out"),
        py::arg("out_dtype"), py::arg("stream"));
  m.def("fp8_grouped_quantize",
        [](std::uintptr_t x, int in_dtype, int64_t n, std::uintptr_t offsets, int64_t num_groups,
           std::uintptr_t scales, int out_dtype, std::uintptr_t out, std::uintptr_t scale_inv, std::uintptr_t amax,
           std::uintptr_t stream) {
          launch_fp8_grouped_quantize(p(x), dt(in_dtype), n, p<const int64_t>(offsets), num_groups,
                                      p<const float>(scales), dt(out_dtype), p(out), p<float>(scale_inv),
                                      p<float>(amax), as_stream(stream));
        },
        py::arg("x"), py::arg("in_dtype"), py::arg("n"), py::arg("offsets"), py::arg("num_groups"),
        py::arg("scales"), py::arg("out_dtype"), py::arg("out"), py::arg("scale_inv"), py::arg("amax"),
        py::arg("stream"));
  m.def("fp8_grouped_amax",
        [](std::uintptr_t x, int in_dtype, int64_t n, std::uintptr_t offsets, int64_t num_groups,
           std::uintptr_t amax, std::uintptr_t stream) {
          launch_fp8_grouped_amax(p(x), dt(in_dtype), n, p<const int64_t>(offsets), num_groups, p<float>(amax),
                                  as_stream(stream));
        },
        py::arg("x"), py::arg("in_dtype"), py::arg("n"), py::arg("offsets"), py::arg("num_groups"),
        py::arg("amax"), py::arg("stream"));
  m.def("fp8_grouped_dequantize",
        [](std::uintptr_t data, int fp8_dtype, int64_t n, std::uintptr_t offsets, int64_t num_groups,
           std::uintptr_t scale_inv, std::uintptr_t out, int out_dtype, std::uintptr_t stream) {
          launch_fp8_grouped_dequantize(p(data), dt(fp8_dtype), n, p<const int64_t>(offsets), num_groups,
                                        p<const float>(scale_inv), p(out), dt(out_dtype), as_stream(stream));
        },
        py::arg("data"), py::arg("fp8_dtype"), py::arg("n"), py::arg("offsets"), py::arg("num_groups"),
        py::arg("scale_inv"), py::arg("out"), py::arg("out_dtype"), py::arg("stream"));
  m.def("fp8_multi_quantize",
        [](const std::vector<std::uintptr_t>& x, const std::vector<int64_t>& rows, int64_t cols, int in_dtype,
           const std::vector<std::uintptr_t>& out, const std::vector<std::uintptr_t>& out_t,
           const std::vector<std::uintptr_t>& scales, int out_dtype, std::uintptr_t scale_out,
           std::uintptr_t scale_inv, std::uintptr_t amax, std::uintptr_t stream, int64_t scale_inv_stride,
           const std::vector<std::uintptr_t>& records, const std::vector<int64_t>& ld_t) {
          auto m = multi_members("fp8_multi_quantize", x, rows, out, out_t, scales, ld_t);
          require(records.empty() || records.size() == m.size(),
                  "fp8_multi_quantize: records must have one pointer per member or none, got " +
                      std::to_string(records.size()) + " for " + std::to_string(m.size()) + " members");
          for (size_t i = 0; i < records.size(); ++i) m[i].record = p<float>(records[i]);
          launch_fp8_multi_quantize(m.data(), int64_t(m.size()), cols, dt(in_dtype), dt(out_dtype), p<float>(scale_out),
                                    p<float>(scale_inv), scale_inv_stride, p<float>(amax), as_stream(stream));
        },
        py::arg("x"), py::arg("rows"), py::arg("cols"), py::arg("in_dtype"), py::arg("out"), py::arg("out_t"),
        py::arg("scales"), py::arg("out_dtype"), py::arg("scale_out"), py::arg("scale_inv"), py::arg("amax"),
        py::arg("stream"), py::arg("scale_inv_stride") = 1, py::arg("records") = std::vector<std::uintptr_t>{},
        py::arg("ld_t") = std::vector<int64_t>{},
        "Delayed-scaling FP8 cast of many (rows[g], cols) tensors in one launch; out / out_t / scales / records: "
        "one pointer per member or an empty list (none). records: FP32 amax_history[0] slots the members' "
        "amaxes are max-merged into (torch.maximum's rule). ld_t: the row stride of each member's (cols, ld_t) "
        "out_t, its columns [rows, ld_t) written as zeros (empty: dense, ld_t = rows).");
  m.def("fp8_multi_current_scaling_quantize",
        [](const std::vector<std::uintptr_t>& x, const std::vector<int64_t>& rows, int64_t cols, int in_dtype,
           const std::vector<std::uintptr_t>& out, const std::vector<std::uintptr_t>& out_t, int out_dtype,
           bool power_2, float amax_epsilon, std::uintptr_t scale, std::uintptr_t scale_inv, std::uintptr_t amax,
           std::uintptr_t stream, int64_t scale_inv_stride, const std::vector<int64_t>& ld_t) {
          const auto m = multi_members("fp8_multi_current_scaling_quantize", x, rows, out, out_t, {}, ld_t);
          launch_fp8_multi_current_scaling_quantize(m.data(), int64_t(m.size()), cols, dt(in_dtype), dt(out_dtype),
                                                    power_2, amax_epsilon, p<float>(scale), p<float>(scale_inv),
                                                    scale_inv_stride, p<float>(amax), as_stream(stream));
        },
        py::arg("x"), py::arg("rows"), py::arg("cols"), py::arg("in_dtype"), py::arg("out"), py::arg("out_t"),
        py::arg("out_dtype"), py::arg("power_2"), py::arg("amax_epsilon"), py::arg("scale"), py::arg("scale_inv"),
        py::arg("amax"), py::arg("stream"), py::arg("scale_inv_stride") = 1, py::arg("ld_t") = std::vector<int64_t>{},
        "Current-scaling FP8 cast of many (rows[g], cols) tensors: one amax launch, one cast launch; ld_t as "
        "for fp8_multi_quantize.");
  m.def("per_token_cast",
        [](std::uintptr_t x, int in_dtype, int64_t tokens, int64_t hidden, int fmt, bool round_sf, bool ue8m0,
           int64_t block_size, std::uintptr_t data, std::uintptr_t scales, std::uintptr_t stream) {
          launch_per_token_cast(p(x), dt(in_dtype), tokens, hidden, pt_fmt(fmt), round_sf, ue8m0, block_size,
                                p(data), p(scales), as_stream(stream));
        },
        py::arg("x"), py::arg("in_dtype"), py::arg("tokens"), py::arg("hidden"), py::arg("fmt"),
        py::arg("round_sf"), py::arg("ue8m0"), py::arg("block_size"), py::arg("data"), py::arg("scales"),
        py::arg("stream"));
  m.def("per_token_cast_back",
        [](std::uintptr_t data, std::uintptr_t scales, int fmt, bool ue8m0, int64_t tokens, int64_t hidden,
           int64_t block_size, std::uintptr_t out, int out_dtype, std::uintptr_t stream) {
          launch_per_token_cast_back(p(data), p(scales), pt_fmt(fmt), ue8m0, tokens, hidden, block_size, p(out),
                                     dt(out_dtype), as_stream(stream));
        },
        py::arg("data"), py::arg("scales"), py::arg("fmt"), py::arg("ue8m0"), py::arg("tokens"), py::arg("hidden"),
        py::arg("block_size"), py::arg("out"), py::arg("out_dtype"), py::arg("stream"));
  m.def("per_token_max_hidden", &per_token_max_hidden, py::arg("unit8"),
        "Largest hidden size the per-token cast kernel takes (unit8: hidden and block_size multiples of 8).");
  // Page-locked host memory mapped into the device address space (zeroed), for flags a kernel sets and
  // the host reads without a copy (quantizers/float8.py: NonfiniteWatch). Returns (host, device)
  // addresses; never freed (the caller keeps slabs for the life of the process).
  m.def("mapped_host_alloc",
        [](int64_t bytes) -> std::pair<std::uintptr_t, std::uintptr_t> {
          require(bytes > 0, "mapped_host_alloc: bytes must be > 0");
          void* host = nullptr;
          check_cuda(cudaHostAlloc(&host, size_t(bytes), cudaHostAllocMapped | cudaHostAllocPortable),
                     "cudaHostAlloc(mapped)");
          std::memset(host, 0, size_t(bytes));
          void* dev = nullptr;
          const cudaError_t err = cudaHostGetDevicePointer(&dev, host, 0);
          if (err != cudaSuccess) {
            cudaFreeHost(host);
            check_cuda(err, "cudaHostGetDevicePointer");
          }
          return {reinterpret_cast<std::uintptr_t>(host), reinterpret_cast<std::uintptr_t>(dev)};
        },
        py::arg("bytes"));
  // ptrs: a HOST int64 array of 2 * count device pointers (the histories, then the scales), cached by
  // the caller so that a step converts no Python lists.
  m.def("delayed_update_scales",
        [](std::uintptr_t ptrs, int64_t count, int64_t length, float fmt_max, int margin, bool algo_max,
           std::uintptr_t stream) {
          require(count == 0 || ptrs != 0, "delayed_update_scales: null pointer table");
          float* const* table = p<float* const>(ptrs);
          launch_delayed_update_scales(table, table + count, count, length, fmt_max, margin, algo_max,
                                       as_stream(stream));
        },
        py::arg("ptrs"), py::arg("count"), py::arg("length"), py::arg("fmt_max"), py::arg("margin"),
        py::arg("algo_max"), py::arg("stream"));
}

}  // namespace fp_recipes
