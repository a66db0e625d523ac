// fp_recipes._torch_ops: the host calls of a training step's eager casts, GEMMs and scale updates as one C++ call
// each (issues 13, 14): FP8 casts and GEMMs, NVFP4 quantize launches and emulated NVFP4 GEMMs, delayed-scaling updates.
//
// Why: through Python, one cast costs ~5 us of host time around its launch on a GPU host (three torch.empty at
// 4-6 us each there, pointer and stream look-ups) and one GEMM ~4 us more; a Linear step makes three of each.
// Here the outputs come from at::empty (the same caching allocator, no Python frames), the current stream from
// c10's device-guard interface, and the launch from fp_recipes._C's KernelTable (csrc/kernel_table.h): the kernels
// and the cuBLASLt plan cache stay in _C, one copy per process. Linked against libtorch (libc10, libtorch_cpu,
// libtorch_python) only: built where torch is importable at build time (pip's --no-build-isolation), loaded by
// fp_recipes/_extension.py (fast_ops), FP_RECIPES_TORCH_OPS=off turns it off. Every function returns None where
// the Python path must run instead (it then makes the same launches with the same arguments: the bytes are
// equal, tests/test_cuda_fast_ops.py).
#include <torch/csrc/autograd/variable.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../kernel_table.h"

namespace {

using fp_recipes::KernelTable;

const KernelTable* g_table = nullptr;

constexpr int64_t kBiasTileRows = 64;  // ops/ref_fp8.py BIAS_GRAD_TILE_ROWS: one row of partial sums per 64 rows

void check(const char* err) {
  if (err != nullptr) throw std::runtime_error(err);
}

const KernelTable& table() {
  if (g_table == nullptr) throw std::runtime_error("fp_recipes._torch_ops: init() was not called");
  return *g_table;
}

// dtype codes of csrc/common.h (DType); -1: not a code
int code_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kHalf: return 1;
    case at::kBFloat16: return 2;
    case at::kFloat8_e4m3fn: return 3;
    case at::kFloat8_e5m2: return 4;
    case at::kByte: return 5;
    default: return -1;
  }
}

bool is_float_input(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

// The current CUDA device and the handle of a device's current stream, through the device-guard interface that
// c10's CUDA library registers when torch loads (no link against libc10_cuda).
const c10::impl::DeviceGuardImplInterface& cuda_impl() {
  static const c10::impl::DeviceGuardImplInterface* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return *impl;
}

// x on the current CUDA device (the Python path declines another device: rare, left to it)
bool on_current_device(const at::Tensor& x) {
  return x.is_cuda() && x.device().index() == cuda_impl().getDevice().index();
}

void* current_stream(const at::Device& device) { return cuda_impl().getStream(device).native_handle(); }

// Per (device, stream) buffers, never freed (as the Python dicts keep theirs; no destructor runs at exit, when
// CUDA may already be gone). Launches on one stream run in order, so they can share one.
struct StreamBuffers {
  std::mutex mutex;
  std::unordered_map<uint64_t, at::Tensor*> amax_ws;  // the zeroed int32 (4,) amax workspace (ops/workspace.py)
  std::unordered_map<uint64_t, at::Tensor*> gemm_ws;  // cuBLASLt's workspace (gemm/cublaslt.py)
};
StreamBuffers g_buffers;

uint64_t key_of(const at::Device& device, void* stream) {
  return (reinterpret_cast<uint64_t>(stream) << 8) ^ static_cast<uint64_t>(device.index());
}

// A zeroed buffer kept for the process's life, made on a short-lived helper thread with the caller's device and
// current stream (ops/workspace.py persistent_cuda_tensor): torch routes a CUDA-graph pool's allocations by thread
// (torch.compile's mode="reduce-overhead" warms its graphs up so), and refuses to replay when a tensor it did not
// return stays alive in the pool. Not while the stream is being captured: callers check first.
at::Tensor* persistent_buffer(const at::Device& device, at::ScalarType dtype, int64_t numel, bool zeroed) {
  const c10::Stream stream = cuda_impl().getStream(device);
  at::Tensor* out = nullptr;
  std::exception_ptr error;
  std::thread helper([&] {
    try {
      const c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
      const c10::Device previous_device = impl.exchangeDevice(device);
      const c10::Stream previous_stream = impl.exchangeStream(stream);
      const auto options = at::TensorOptions().dtype(dtype).device(device);
      out = new at::Tensor(zeroed ? at::zeros({numel}, options) : at::empty({numel}, options));
      impl.exchangeStream(previous_stream);
      impl.setDevice(previous_device);
    } catch (...) {
      error = std::current_exception();
    }
  });
  {
    // the helper may need the GIL (the allocator's history recording takes Python stacks): not held while waiting
    std::optional<py::gil_scoped_release> release;
    if (PyGILState_Check()) release.emplace();
    helper.join();
  }
  if (error) std::rethrow_exception(error);
  return out;
}

uint32_t* amax_workspace(const at::Device& device, void* stream) {
  bool capturing = false;
  check(table().stream_capturing(stream, &capturing));
  if (capturing) return nullptr;  // a replay would share the capture stream's buffer: the launcher memsets
  std::lock_guard<std::mutex> lock(g_buffers.mutex);
  at::Tensor*& ws = g_buffers.amax_ws[key_of(device, stream)];
  if (ws == nullptr) ws = persistent_buffer(device, at::kInt, 4, true);
  return reinterpret_cast<uint32_t*>(ws->data_ptr<int32_t>());
}

void* gemm_workspace(const at::Device& device, void* stream, int64_t nbytes) {
  if (nbytes == 0) return nullptr;
  bool capturing = false;
  check(table().stream_capturing(stream, &capturing));
  std::lock_guard<std::mutex> lock(g_buffers.mutex);
  at::Tensor*& ws = g_buffers.gemm_ws[key_of(device, stream)];
  if (ws == nullptr || ws->numel() < nbytes)  // an older, smaller one stays alive: launches may still read it
    ws = capturing ? new at::Tensor(at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).device(device)))
                   : persistent_buffer(device, at::kByte, nbytes, false);  // (captured: the graph's pool holds it)
  return ws->data_ptr();
}

// The emulated NVFP4 GEMM's FP32 {alpha, 0} per (device, stream) of this thread: a decode launch writes it and the BF16
// GEMM right after it on the stream reads it (launches on one stream run in order). Per thread, as
// ops/cuda_nvfp4.py _alpha_ws: two threads' launches on one stream may interleave (decode A, decode B, GEMM A).
// Never freed: the map holds raw pointers, so a thread's exit frees nothing (16 bytes per thread and stream).
thread_local std::unordered_map<uint64_t, at::Tensor*> t_alpha_ws;
std::atomic<int64_t> g_alpha_ws_count{0};

// The stream's alpha workspace; a fresh one while capturing (the graph's pool holds it).
at::Tensor alpha_workspace(const at::Device& device, void* stream) {
  bool capturing = false;
  check(table().stream_capturing(stream, &capturing));
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  if (capturing) return at::empty({4}, f32);
  at::Tensor*& ws = t_alpha_ws[key_of(device, stream)];
  if (ws == nullptr) {
    ws = persistent_buffer(device, at::kFloat, 4, true);
    ++g_alpha_ws_count;
  }
  return *ws;
}

void init(py::capsule table_capsule) {
  if (std::string(table_capsule.name()) != "fp_recipes.kernel_table")
    throw std::invalid_argument("fp_recipes._torch_ops.init: expected fp_recipes._C.kernel_table()");
  auto* t = static_cast<const KernelTable*>(table_capsule.get_pointer());
  if (t->version < fp_recipes::kKernelTableVersion || t->size < static_cast<int>(sizeof(KernelTable)))
    throw std::runtime_error("fp_recipes._torch_ops: fp_recipes._C is older than this module (kernel table version " +
                             std::to_string(t->version) + ", need " +
                             std::to_string(fp_recipes::kKernelTableVersion) + "): rebuild the package");
  g_table = t;
}

// The outputs of one FP8 cast (defined: made), or ok false where the Python path must run instead.
struct Fp8CastOut {
  bool ok = false;
  at::Tensor data, data_t, scale_inv, amax, scale, db;
};

// An FP8 quantizer's cast of a contiguous 2-D x: the launches of ops/cuda_fp8.py's planned and traced casts.
// separate: each FP32 value its own allocation (a custom op's outputs must not alias one another); else views of one
// allocation ([scale_inv, amax, scale] for current scaling, [scale_inv, amax] for delayed).
// act: 0, or the activation applied to x in the cast (ops/cuda_fp8_act.py ACT_CODES; no bias gradient then).
Fp8CastOut cast_fp8(const at::Tensor& x, int out_code, bool rowwise, bool columnwise, bool current, bool pow2,
                    double eps, const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& record,
                    c10::optional<at::ScalarType> bias_dtype, bool separate, int act = 0) {
  Fp8CastOut o;
  if (x.dim() != 2 || !is_float_input(x.scalar_type()) || x.numel() == 0 || !x.is_contiguous() ||
      !on_current_device(x) || (bias_dtype.has_value() && !is_float_input(*bias_dtype)) ||
      (!current && (!scale.has_value() || !record.has_value())) || (act != 0 && bias_dtype.has_value()))
    return o;
  if (out_code != 3 && out_code != 4)
    throw std::invalid_argument("fp_recipes._torch_ops.fp8_cast: out_code must be 3 (e4m3) or 4 (e5m2), got " +
                                std::to_string(out_code));
  const KernelTable& t = table();
  const int64_t m = x.size(0), n = x.size(1);
  const at::ScalarType fp8 = out_code == 3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
  const auto opts = x.options();
  if (rowwise) o.data = at::empty({m, n}, opts.dtype(fp8));
  if (columnwise) o.data_t = at::empty({n, m}, opts.dtype(fp8));
  void* stream = current_stream(x.device());
  at::Tensor partials;
  int db_code = -1;
  if (bias_dtype.has_value()) {
    partials = at::empty({(m + kBiasTileRows - 1) / kBiasTileRows, n}, opts.dtype(at::kFloat));
    o.db = at::empty({n}, opts.dtype(*bias_dtype));
    db_code = code_of(*bias_dtype);
  }
  float* partials_ptr = partials.defined() ? partials.data_ptr<float>() : nullptr;
  void* db_ptr = o.db.defined() ? o.db.data_ptr() : nullptr;
  void* data_ptr = o.data.defined() ? o.data.data_ptr() : nullptr;
  void* data_t_ptr = o.data_t.defined() ? o.data_t.data_ptr() : nullptr;
  const int in_code = code_of(x.scalar_type());
  const auto f32 = opts.dtype(at::kFloat);
  if (separate) {
    o.scale_inv = at::empty({}, f32);
    o.amax = at::empty({}, f32);
    o.scale = current ? at::empty({}, f32) : *scale;
  } else {
    at::Tensor buf = at::empty({current ? 3 : 2}, f32);
    o.scale_inv = buf.select(0, 0);
    o.amax = buf.select(0, 1);
    o.scale = current ? buf.select(0, 2) : *scale;
  }
  float* scale_inv_ptr = o.scale_inv.data_ptr<float>();
  float* amax_ptr = o.amax.data_ptr<float>();
  if (act != 0) {
    check(t.fp8_act_cast(x.data_ptr(), in_code, m, n, act, current ? nullptr : scale->data_ptr<float>(), out_code,
                         pow2, static_cast<float>(eps), data_ptr, data_t_ptr,
                         current ? o.scale.data_ptr<float>() : nullptr, scale_inv_ptr, amax_ptr,
                         current ? nullptr : record->data_ptr<float>(), stream));
  } else if (current) {
    check(t.fp8_cast_current(x.data_ptr(), in_code, m, n, out_code, pow2, static_cast<float>(eps), data_ptr,
                             data_t_ptr, o.scale.data_ptr<float>(), scale_inv_ptr, amax_ptr, partials_ptr, db_ptr,
                             db_code, amax_workspace(x.device(), stream), stream));
  } else {
    check(t.fp8_cast_delayed(x.data_ptr(), in_code, m, n, scale->data_ptr<float>(), out_code, data_ptr, data_t_ptr,
                             scale_inv_ptr, amax_ptr, record->data_ptr<float>(), partials_ptr, db_ptr, db_code,
                             stream));
  }
  o.ok = true;
  return o;
}

// An FP8 quantizer's planned eager cast (ops/cuda_fp8.py fp8_cast_planned): (data, data_t, scale_inv, amax, scale
// [, db]), an unwanted copy None, the FP32 values as views of one allocation; None where the Python path runs.
py::object fp8_cast(const at::Tensor& x, int out_code, bool rowwise, bool columnwise, bool current, bool pow2,
                    double eps, const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& record,
                    c10::optional<at::ScalarType> bias_dtype, int act) {
  const Fp8CastOut o =
      cast_fp8(x, out_code, rowwise, columnwise, current, pow2, eps, scale, record, bias_dtype, false, act);
  if (!o.ok) return py::none();
  py::object none = py::none();
  auto opt = [&](const at::Tensor& v) -> py::object { return v.defined() ? py::cast(v) : none; };
  if (o.db.defined()) return py::make_tuple(opt(o.data), opt(o.data_t), o.scale_inv, o.amax, o.scale, o.db);
  return py::make_tuple(opt(o.data), opt(o.data_t), o.scale_inv, o.amax, o.scale);
}

// A copy the cast made, or the empty (0,) tensor of the FP8 dtype a custom op returns for an unwanted one.
at::Tensor copy_or_placeholder(const at::Tensor& t, const at::Tensor& x, int code) {
  return t.defined() ? t : at::empty({0}, x.options().dtype(code == 3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2));
}

// The same cast in the form of ops/cuda_fp8.py's traced-cast ops (what a torch.compile graph calls): (data, data_t,
// scale_inv, amax, scale, db), an unwanted copy an empty (0,) tensor of the FP8 dtype, each FP32 value its own
// allocation, db None without a bias gradient; None where the op's Python implementation runs.
py::object fp8_cast_op(const at::Tensor& x, int out_code, bool rowwise, bool columnwise, bool current, bool pow2,
                       double eps, const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& record,
                       c10::optional<at::ScalarType> bias_dtype) {
  const Fp8CastOut o = cast_fp8(x, out_code, rowwise, columnwise, current, pow2, eps, scale, record, bias_dtype, true);
  if (!o.ok) return py::none();
  return py::make_tuple(copy_or_placeholder(o.data, x, out_code), copy_or_placeholder(o.data_t, x, out_code),
                        o.scale_inv, o.amax, o.scale, o.db.defined() ? py::cast(o.db) : py::none());
}

// An operand cuBLASLt reads in place (gemm/_common.py gemm_ready): row-major, rows and start 16-byte aligned.
bool gemm_ready(const at::Tensor& t) {
  const int64_t s0 = t.stride(0), s1 = t.stride(1);
  return s1 == 1 && s0 >= std::max<int64_t>(1, t.size(1)) && (s0 * t.element_size()) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// The CUDA branch of gemm/fp8.py gemm_fp8_fp8 in one call: the operands' readiness (a contiguous copy where
// cuBLASLt cannot read one in place), a scale that is not 16-byte aligned copied (as _fp8_mm does), the bias
// fused into the epilogue, the cached plan. None, having launched nothing, wherever the Python branch does
// something else: an empty product, K or N to pad to 16, a bias it adds in FP32 (another dtype than the output),
// E5M2 x E5M2, contraction dims that differ (it raises), or a problem the plan refuses: an undefined tensor then.
at::Tensor linear_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a, const at::Tensor& scale_b,
                       at::ScalarType out_dtype, const c10::optional<at::Tensor>& bias, bool fast_accum,
                       int64_t workspace_bytes) {
  const at::Tensor declined;
  if (a.dim() != 2 || b.dim() != 2 || !on_current_device(a) || b.device() != a.device()) return declined;
  const int64_t m = a.size(0), k = a.size(1), n = b.size(0);
  const int ac = code_of(a.scalar_type()), bc = code_of(b.scalar_type()), oc = code_of(out_dtype);
  if (k != b.size(1) || m == 0 || n == 0 || k == 0 || k % 16 || n % 16 || ac < 3 || ac > 4 || bc < 3 || bc > 4 ||
      (ac == 4 && bc == 4) || oc < 0 || oc > 2)
    return declined;
  const bool with_bias = bias.has_value() && bias->defined();
  if (with_bias && (bias->scalar_type() != out_dtype || oc == 0 || !bias->is_contiguous() || bias->dim() != 1 ||
                    bias->size(0) != n))
    return declined;
  const at::Tensor aa = gemm_ready(a) ? a : a.contiguous();
  const at::Tensor bb = gemm_ready(b) ? b : b.contiguous();
  const at::Tensor sa = reinterpret_cast<uintptr_t>(scale_a.data_ptr()) % 16 ? scale_a.clone() : scale_a;
  const at::Tensor sb = reinterpret_cast<uintptr_t>(scale_b.data_ptr()) % 16 ? scale_b.clone() : scale_b;
  void* stream = current_stream(a.device());
  void* ws = gemm_workspace(a.device(), stream, workspace_bytes);
  at::Tensor out = at::empty({m, n}, a.options().dtype(out_dtype));
  bool ran = false;
  check(table().lt_fp8_gemm(aa.data_ptr(), aa.stride(0), bb.data_ptr(), bb.stride(0), sa.data_ptr<float>(),
                            sb.data_ptr<float>(), out.data_ptr(), with_bias ? bias->data_ptr() : nullptr, m, n, k, ac,
                            bc, oc, with_bias ? oc : -1, fast_accum, ws, workspace_bytes,
                            static_cast<int>(a.device().index()), stream, &ran));
  return ran ? out : declined;
}

py::object fp8_linear_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                           const at::Tensor& scale_b, at::ScalarType out_dtype, const c10::optional<at::Tensor>& bias,
                           bool fast_accum, int64_t workspace_bytes) {
  const at::Tensor out = linear_gemm(a, b, scale_a, scale_b, out_dtype, bias, fast_accum, workspace_bytes);
  return out.defined() ? py::cast(out) : py::none();
}

// ---- the traced ops' CUDA kernels -------------------------------------------------------------------------------
// A torch.compile graph calls the FP8 casts and GEMM as torch.ops.fp_recipes ops, which ops/cuda_fp8.py and
// gemm/fp8.py define with a Python implementation for every backend (CompositeExplicitAutograd). The kernels here
// are registered for the CUDA key, which the dispatcher takes before that one: a graph's cast or GEMM then enters no
// Python (each op costs a compiled step host time). Where the C++ call declines (another device current, a
// non-contiguous input, an argument the Python implementation raises on), the Python implementation runs, called
// back under the GIL, as before.

using Tensors4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using Tensors5 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

std::mutex g_ops_mutex;
torch::Library* g_ops_lib = nullptr;                                // never freed (see StreamBuffers)
std::unordered_map<std::string, py::object*>* g_python_impls = nullptr;
int64_t g_ops_gemm_workspace = 0;

std::atomic<bool> g_ops_enabled{true};  // false: every call takes the Python implementation (A/B rows, tests)

template <typename Out, typename... Args>
Out python_impl(const char* op, const Args&... args) {
  py::gil_scoped_acquire gil;
  return (*g_python_impls->at(op))(args...).template cast<Out>();
}

int fmt_code(c10::string_view fmt) { return fmt == "e4m3" ? 3 : fmt == "e5m2" ? 4 : -1; }

// ops/cuda_fp8_act.py ACT_CODES; -1: not one the kernel applies (the Python implementation runs)
int act_code(c10::string_view activation) { return activation == "gelu" ? 1 : -1; }

// The Python implementations' plain-argument case (ops/cuda_fp8.py _delayed_cast and _cast_input, cuda_fp8_act.py's
// ops with act > 0): else they run.
Fp8CastOut op_delayed(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& history, int code, bool rowwise,
                      bool columnwise, c10::optional<at::ScalarType> bias_dtype, int act = 0) {
  if (!g_ops_enabled || code < 0 || act < 0 || !(rowwise || columnwise) || scale.scalar_type() != at::kFloat ||
      scale.dim() != 0 || scale.device() != x.device() || history.scalar_type() != at::kFloat ||
      history.device() != x.device() || !history.is_contiguous() || history.numel() == 0)
    return {};
  return cast_fp8(x, code, rowwise, columnwise, false, false, 0.0, scale, history, bias_dtype, true, act);
}

Fp8CastOut op_current(const at::Tensor& x, int code, bool pow2, double eps, bool rowwise, bool columnwise,
                      c10::optional<at::ScalarType> bias_dtype, int act = 0) {
  if (!g_ops_enabled || code < 0 || act < 0 || !(rowwise || columnwise) || !(eps >= 0.0)) return {};
  return cast_fp8(x, code, rowwise, columnwise, true, pow2, eps, c10::nullopt, c10::nullopt, bias_dtype, true, act);
}

Tensors4 op_fp8_delayed_cast(const at::Tensor& x, const at::Tensor& scale, at::Tensor& history, c10::string_view fmt,
                             bool rowwise, bool columnwise) {
  const int code = fmt_code(fmt);
  const Fp8CastOut o = op_delayed(x, scale, history, code, rowwise, columnwise, c10::nullopt);
  if (!o.ok) return python_impl<Tensors4>("fp8_delayed_cast", x, scale, history, std::string(fmt), rowwise, columnwise);
  return {copy_or_placeholder(o.data, x, code), copy_or_placeholder(o.data_t, x, code), o.scale_inv, o.amax};
}

Tensors5 op_fp8_delayed_cast_dbias(const at::Tensor& x, const at::Tensor& scale, at::Tensor& history,
                                   c10::string_view fmt, bool rowwise, bool columnwise, at::ScalarType bias_dtype) {
  const int code = fmt_code(fmt);
  const Fp8CastOut o = op_delayed(x, scale, history, code, rowwise, columnwise, bias_dtype);
  if (!o.ok)
    return python_impl<Tensors5>("fp8_delayed_cast_dbias", x, scale, history, std::string(fmt), rowwise, columnwise,
                                 bias_dtype);
  return {copy_or_placeholder(o.data, x, code), copy_or_placeholder(o.data_t, x, code), o.scale_inv, o.amax, o.db};
}

Tensors4 op_fp8_delayed_rowwise_cast(const at::Tensor& x, const at::Tensor& scale, at::Tensor& history,
                                     c10::string_view fmt) {
  const Fp8CastOut o = op_delayed(x, scale, history, fmt_code(fmt), true, false, c10::nullopt);
  if (!o.ok) return python_impl<Tensors4>("fp8_delayed_rowwise_cast", x, scale, history, std::string(fmt));
  return {o.data, o.scale_inv, o.amax, scale.clone()};
}

Tensors5 op_fp8_current_scaling_quantize(const at::Tensor& x, c10::string_view fmt, bool pow2, double eps, bool rowwise,
                                         bool columnwise) {
  const int code = fmt_code(fmt);
  const Fp8CastOut o = op_current(x, code, pow2, eps, rowwise, columnwise, c10::nullopt);
  if (!o.ok)
    return python_impl<Tensors5>("fp8_current_scaling_quantize", x, std::string(fmt), pow2, eps, rowwise, columnwise);
  return {copy_or_placeholder(o.data, x, code), copy_or_placeholder(o.data_t, x, code), o.scale_inv, o.amax, o.scale};
}

Tensors5 op_fp8_current_cast_dbias(const at::Tensor& x, c10::string_view fmt, bool pow2, double eps, bool rowwise,
                                   bool columnwise, at::ScalarType bias_dtype) {
  const int code = fmt_code(fmt);
  const Fp8CastOut o = op_current(x, code, pow2, eps, rowwise, columnwise, bias_dtype);
  if (!o.ok)
    return python_impl<Tensors5>("fp8_current_cast_dbias", x, std::string(fmt), pow2, eps, rowwise, columnwise,
                                 bias_dtype);
  return {copy_or_placeholder(o.data, x, code), copy_or_placeholder(o.data_t, x, code), o.scale_inv, o.amax, o.db};
}

Tensors4 op_fp8_delayed_act_cast(const at::Tensor& x, const at::Tensor& scale, at::Tensor& history,
                                 c10::string_view fmt, bool rowwise, bool columnwise, c10::string_view activation) {
  const int code = fmt_code(fmt);
  const Fp8CastOut o = op_delayed(x, scale, history, code, rowwise, columnwise, c10::nullopt, act_code(activation));
  if (!o.ok)
    return python_impl<Tensors4>("fp8_delayed_act_cast", x, scale, history, std::string(fmt), rowwise, columnwise,
                                 std::string(activation));
  return {copy_or_placeholder(o.data, x, code), copy_or_placeholder(o.data_t, x, code), o.scale_inv, o.amax};
}

Tensors5 op_fp8_current_act_cast(const at::Tensor& x, c10::string_view fmt, bool pow2, double eps, bool rowwise,
                                 bool columnwise, c10::string_view activation) {
  const int code = fmt_code(fmt);
  const Fp8CastOut o = op_current(x, code, pow2, eps, rowwise, columnwise, c10::nullopt, act_code(activation));
  if (!o.ok)
    return python_impl<Tensors5>("fp8_current_act_cast", x, std::string(fmt), pow2, eps, rowwise, columnwise,
                                 std::string(activation));
  return {copy_or_placeholder(o.data, x, code), copy_or_placeholder(o.data_t, x, code), o.scale_inv, o.amax, o.scale};
}

at::Tensor op_fp8_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a, const at::Tensor& scale_b,
                     at::ScalarType out_dtype, const c10::optional<at::Tensor>& bias, bool use_fast_accum) {
  if (g_ops_enabled) {
    at::Tensor out = linear_gemm(a, b, scale_a, scale_b, out_dtype, bias, use_fast_accum, g_ops_gemm_workspace);
    if (out.defined()) return out;
  }
  return python_impl<at::Tensor>("fp8_mm", a, b, scale_a, scale_b, out_dtype, bias, use_fast_accum);
}

// Registers the CUDA kernels of the ops named in python_impls (name -> the op's Python implementation, the fallback),
// once per process; returns the names registered (none on a second call).
std::vector<std::string> register_traced_ops(const py::dict& python_impls, int64_t gemm_workspace_bytes) {
  std::lock_guard<std::mutex> lock(g_ops_mutex);
  std::vector<std::string> done;
  if (g_ops_lib != nullptr) return done;
  auto* impls = new std::unordered_map<std::string, py::object*>();
  for (const auto& item : python_impls)
    (*impls)[item.first.cast<std::string>()] = new py::object(py::reinterpret_borrow<py::object>(item.second));
  g_python_impls = impls;
  g_ops_gemm_workspace = gemm_workspace_bytes;
  g_ops_lib = new torch::Library(torch::Library::IMPL, "fp_recipes", c10::DispatchKey::CUDA, __FILE__, __LINE__);
  auto reg = [&](const char* name, auto fn) {
    if (impls->count(name) == 0) return;
    g_ops_lib->impl(name, fn);
    done.emplace_back(name);
  };
  reg("fp8_delayed_cast", TORCH_FN(op_fp8_delayed_cast));
  reg("fp8_delayed_cast_dbias", TORCH_FN(op_fp8_delayed_cast_dbias));
  reg("fp8_delayed_rowwise_cast", TORCH_FN(op_fp8_delayed_rowwise_cast));
  reg("fp8_current_scaling_quantize", TORCH_FN(op_fp8_current_scaling_quantize));
  reg("fp8_current_cast_dbias", TORCH_FN(op_fp8_current_cast_dbias));
  reg("fp8_mm", TORCH_FN(op_fp8_mm));
  reg("fp8_delayed_act_cast", TORCH_FN(op_fp8_delayed_act_cast));
  reg("fp8_current_act_cast", TORCH_FN(op_fp8_current_act_cast));
  return done;
}

// One NVFP4 operand of the emulated GEMM (gemm/operands.py Nvfp4Operand): packed codes, E4M3 block scales, the
// global amax (per row when row_scaled), its E4M3 range, and the BF16 unit copy the quantize kernel may have written.
struct UnitSource {
  const at::Tensor& data;
  const at::Tensor& scale;
  const at::Tensor& amax;
  const c10::optional<at::Tensor>& unit;
  bool row_scaled;
};

// The operand's cached unit copy where the GEMM can read it as is (nvfp4_emulated.py cached_unit), else undefined.
at::Tensor cached_unit(const UnitSource& op, const at::Device& dev) {
  if (!op.unit.has_value() || !op.unit->defined()) return at::Tensor();
  const at::Tensor& u = *op.unit;
  if (u.scalar_type() != at::kBFloat16 || u.dim() != 2 || u.size(0) != op.data.size(0) ||
      u.size(1) != op.data.size(1) * 2 || u.device() != dev || !u.is_contiguous() ||
      reinterpret_cast<uintptr_t>(u.data_ptr()) % 16)
    return at::Tensor();
  return u;
}

// A copy the decode kernel can read (cuda_nvfp4.py nvfp4_unit_operands' checks; the Python path raises there, so
// the caller declines and lets it).
bool decodable(const UnitSource& op, const at::Device& dev) {
  const at::Tensor &d = op.data, &s = op.scale;
  return d.scalar_type() == at::kByte && s.dim() == 2 && s.size(0) == d.size(0) && s.size(1) == d.size(1) / 8 &&
         d.device() == dev && s.device() == dev && d.is_contiguous() && s.is_contiguous() &&
         reinterpret_cast<uintptr_t>(d.data_ptr()) % 8 == 0;
}

bool amax_ok(const at::Tensor& t, const at::Device& dev) {
  return t.scalar_type() == at::kFloat && t.device() == dev && t.is_contiguous();
}

// gemm/nvfp4_emulated.py emulated_cuda_eager as one call: the decode launch of the operands without a cached unit
// copy (it also writes the GEMM's device alpha), the cuBLASLt BF16 GEMM reading that alpha (the bias fused where it
// has the output's dtype), and for a row-scaled product the GEMM + epilogue per row chunk. None, having launched
// nothing, wherever the Python path does something else (an output dtype or operand it declines, a check it raises
// on); the same launches with the same arguments otherwise, so the bytes are equal (tests/test_cuda_fast_ops.py).
py::object nvfp4_emulated_gemm(const at::Tensor& a_data, const at::Tensor& a_scale, const at::Tensor& a_amax,
                               const c10::optional<at::Tensor>& a_unit, bool a_rows, double e_a,
                               const at::Tensor& b_data, const at::Tensor& b_scale, const at::Tensor& b_amax,
                               const c10::optional<at::Tensor>& b_unit, bool b_rows, double e_b,
                               at::ScalarType out_dtype, const c10::optional<at::Tensor>& bias,
                               int64_t workspace_bytes, int64_t chunk_min_rows, int64_t chunk_max) {
  const int oc = code_of(out_dtype);
  if (oc < 0 || oc > 2 || a_data.dim() != 2 || b_data.dim() != 2 || !on_current_device(a_data)) return py::none();
  const at::Device dev = a_data.device();
  if (b_data.device() != dev) return py::none();
  const int64_t m = a_data.size(0), n = b_data.size(0), k = a_data.size(1) * 2;
  if (m == 0 || n == 0 || k == 0 || b_data.size(1) * 2 != k) return py::none();
  const bool row = a_rows || b_rows;
  if (!amax_ok(a_amax, dev) || !amax_ok(b_amax, dev)) return py::none();
  // per tensor the decode reads element 0 of each amax; row-scaled, the epilogue reads m (n) of a per-row one, one
  // of the other (the Python epilogue raises on any other length)
  if (row && (a_amax.numel() != (a_rows ? m : 1) || b_amax.numel() != (b_rows ? n : 1))) return py::none();
  const bool with_bias = bias.has_value() && bias->defined();
  if (with_bias && (bias->device() != dev || !is_float_input(bias->scalar_type()) || !bias->is_contiguous() ||
                    bias->dim() != 1 || bias->size(0) != n))
    return py::none();
  const UnitSource a{a_data, a_scale, a_amax, a_unit, a_rows}, b{b_data, b_scale, b_amax, b_unit, b_rows};
  at::Tensor ua = cached_unit(a, dev), ub = cached_unit(b, dev);
  const bool decode_a = !ua.defined(), decode_b = !ub.defined();
  // (neither cached: both decoded in one launch; else only the one without)
  if ((decode_a && !decodable(a, dev)) || (decode_b && !decodable(b, dev))) return py::none();
  const KernelTable& t = table();
  void* stream = current_stream(dev);
  const int index = static_cast<int>(dev.index());
  const auto bf16 = a_data.options().dtype(at::kBFloat16);
  fp_recipes::Nvfp4UnitJob jobs[2];
  int num = 0;
  for (const UnitSource* op : {&a, &b}) {
    at::Tensor& u = op == &a ? ua : ub;
    if (u.defined()) continue;
    u = at::empty({op->data.size(0), op->data.size(1) * 2}, bf16);
    jobs[num++] = {op->data.data_ptr(), op->scale.numel() ? op->scale.data_ptr() : nullptr, u.data_ptr(),
                   op->data.size(0) * op->data.size(1) / 8};
  }
  at::Tensor alpha = alpha_workspace(dev, stream);
  const float* amax_a_ptr = row || a_amax.numel() == 0 ? nullptr : a_amax.data_ptr<float>();
  const float* amax_b_ptr = row || b_amax.numel() == 0 ? nullptr : b_amax.data_ptr<float>();
  check(t.nvfp4_decode_units(jobs, num, amax_a_ptr, amax_b_ptr, static_cast<float>(e_a), static_cast<float>(e_b),
                             alpha.data_ptr<float>(), stream, index));
  void* ws = gemm_workspace(dev, stream, workspace_bytes);
  // cuBLASLt's BF16 GEMM into d, or (a problem its plan refuses) torch's FP32-accumulating mm times alpha
  auto product = [&](const at::Tensor& lhs, at::Tensor d, const at::Tensor* fused_bias) -> at::Tensor {
    bool ran = false;
    check(t.lt_bf16_gemm(lhs.data_ptr(), ub.data_ptr(), d.data_ptr(),
                         fused_bias != nullptr ? fused_bias->data_ptr() : nullptr, lhs.size(0), n, k,
                         code_of(d.scalar_type()), fused_bias != nullptr ? code_of(fused_bias->scalar_type()) : -1,
                         alpha.data_ptr<float>(), ws, workspace_bytes, index, stream, &ran));
    if (ran) return d;
    return at::mm(lhs, ub.t(), at::kFloat) * alpha.select(0, 0);
  };
  if (!row) {
    const bool fuse_bias = !with_bias || bias->scalar_type() == out_dtype;
    at::Tensor out = at::empty({m, n}, a_data.options().dtype(fuse_bias ? out_dtype : at::kFloat));
    at::Tensor d = product(ua, out, fuse_bias && with_bias ? &*bias : nullptr);
    if (d.is_same(out) && fuse_bias) return py::cast(out);
    if (with_bias) d = d + bias->to(at::kFloat);  // gemm/_common.py finish: the bias in FP32, then one cast
    return py::cast(out_dtype == at::kFloat ? d : d.to(out_dtype));
  }
  // Row-scaled: up to chunk_max chunks of >= chunk_min_rows rows (nvfp4_emulated.py row_chunk), one GEMM into a
  // shared FP32 scratch and one epilogue launch each.
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(chunk_max, m / chunk_min_rows));
  const int64_t rows = (m + chunks - 1) / chunks;
  at::Tensor out = at::empty({m, n}, a_data.options().dtype(out_dtype));
  at::Tensor scratch = at::empty({std::min(rows, m), n}, a_data.options().dtype(at::kFloat));
  for (int64_t r0 = 0; r0 < m; r0 += rows) {
    const int64_t r1 = std::min(m, r0 + rows);
    at::Tensor d = product(ua.narrow(0, r0, r1 - r0), scratch.narrow(0, 0, r1 - r0), nullptr);
    const float* sa = a_rows ? a_amax.data_ptr<float>() + r0 : a_amax.data_ptr<float>();
    check(t.nvfp4_row_epilogue(d.data_ptr<float>(), r1 - r0, n, sa, a_rows, b_amax.data_ptr<float>(), b_rows,
                               with_bias ? bias->data_ptr() : nullptr,
                               with_bias ? code_of(bias->scalar_type()) : -1, out.narrow(0, r0, r1 - r0).data_ptr(),
                               oc, stream, index));
  }
  return py::cast(out);
}

// The delayed-scaling scale update of one list of quantizers (modules/amax_reduction.py _FastUpdate): per batch one
// launch through the kernel table (the pointer tables are host memory the Python DelayedUpdate objects own), the
// scales' version counters bumped as the torch ops' in-place writes would (a cached quantized weight is keyed by its
// scale's version), and the non-finite flags the kernels set in mapped host memory read (NonfiniteWatch).
struct DelayedBatch {
  uintptr_t table;
  int64_t count, length;
  double fmt_max;
  int margin;
  bool algo_max;
  uintptr_t flags_host;  // the mapped flags' host address (0: the flags live on the device)
  int64_t flags_bytes;
};

struct DelayedUpdates {
  int device;  // -1: the current device
  std::vector<DelayedBatch> batches;
  std::vector<at::Tensor> scales;

  // True: launched, and the flags are all clear (nothing to report); False: launched, the caller reports (a flag is
  // set, the flags are on the device, or the stream is being captured); None: nothing launched (another device is
  // current: the caller's Python path runs).
  py::object run() const {
    const c10::Device current = cuda_impl().getDevice();
    if (device >= 0 && current.index() != device) return py::none();
    void* stream = current_stream(current);
    const KernelTable& t = table();
    for (const DelayedBatch& b : batches)
      check(t.delayed_update(reinterpret_cast<const void*>(b.table), b.count, b.length, static_cast<float>(b.fmt_max),
                             b.margin, b.algo_max, stream));
    for (const at::Tensor& s : scales)  // (as torch.autograd.graph.increment_version: an inference tensor has none)
      if (!s.is_inference()) torch::autograd::impl::bump_version(s);
    bool capturing = false;
    check(t.stream_capturing(stream, &capturing));
    if (capturing) return py::bool_(false);
    for (const DelayedBatch& b : batches) {
      if (b.flags_host == 0) return py::bool_(false);
      const volatile uint8_t* flags = reinterpret_cast<const volatile uint8_t*>(b.flags_host);
      for (int64_t i = 0; i < b.flags_bytes; ++i)
        if (flags[i] != 0) return py::bool_(false);
    }
    return py::bool_(true);
  }
};

// One NVFP4 quantizer plan's quantization of one input shape and dtype (ops/cuda_nvfp4.py _Launch): the same
// amax launches, outputs and quantize launch as _Launch.run, resolved once; run() allocates with at::empty.
enum class AmaxMode : int { kPlain = 0, kBoth = 1, kRow = 2, kFusedRow = 3 };  // _Launch.mode

struct Nvfp4Launch {
  int64_t m, n;
  int code;
  AmaxMode mode;
  bool rowwise, columnwise, row_scaled, block_2d, rht, need_g;
  int fos;
  bool mse;
  double e4m3_max;
  bool sr;

  // (data, scale, rowwise amax, data_t, scale_t, amax_t, unit, unit_t), or None (nothing launched) where the
  // Python path must run: x not 16-byte aligned or contiguous, not on the current CUDA device, another shape.
  // unit_row / unit_col: also the BF16 unit GEMM operand of the rowwise / columnwise copy (where it is made).
  // rng_state: the quantizer's device (seed, offset) pair, read by the kernel instead of seed/offset.
  py::object run(const at::Tensor& x, uint64_t seed, uint64_t offset, const c10::optional<at::Tensor>& partials,
                 const c10::optional<at::Tensor>& db, bool unit_row, bool unit_col,
                 const c10::optional<at::Tensor>& rng_state) const {
    if (!x.is_contiguous() || !on_current_device(x) || x.dim() != 2 || x.size(0) != m || x.size(1) != n ||
        code_of(x.scalar_type()) != code || reinterpret_cast<uintptr_t>(x.data_ptr()) % 16)
      return py::none();
    if (rng_state.has_value() && (rng_state->device() != x.device() || rng_state->scalar_type() != at::kLong ||
                                  rng_state->numel() != 2 || !rng_state->is_contiguous()))
      return py::none();  // (the Python path raises the error)
    const KernelTable& t = table();
    const auto opts = x.options();
    const auto f32 = opts.dtype(at::kFloat);
    void* stream = current_stream(x.device());
    const int dev = static_cast<int>(x.device().index());
    uint32_t* ws = amax_workspace(x.device(), stream);
    const void* xp = x.data_ptr();
    at::Tensor g_am, t_am, row_am;
    float* g_ptr = nullptr;
    float* t_ptr = nullptr;
    float* row_amax_out = nullptr;
    if (mode == AmaxMode::kBoth) {  // both amaxes in one 8-byte buffer: x's, then the post-RHT one
      at::Tensor both = at::empty({2}, f32);
      g_am = both.select(0, 0);
      t_am = both.select(0, 1);
      g_ptr = both.data_ptr<float>();
      t_ptr = g_ptr + 1;
      check(t.nvfp4_amax(xp, code, m, n, g_ptr, t_ptr, stream, dev, ws));
    } else if (mode == AmaxMode::kPlain) {
      if (need_g) {
        g_am = at::empty({}, f32);
        g_ptr = g_am.data_ptr<float>();
      }
      if (rht) {
        t_am = at::empty({}, f32);
        t_ptr = t_am.data_ptr<float>();
      }
      check(t.nvfp4_amax(xp, code, m, n, g_ptr, t_ptr, stream, dev, ws));
      if (columnwise && !rht) {
        t_am = g_am;
        t_ptr = g_ptr;
      }
    } else {
      row_am = at::empty({m}, f32);
      g_ptr = row_am.data_ptr<float>();  // the rowwise amax: the per-row one
      if (mode == AmaxMode::kFusedRow) {
        row_amax_out = g_ptr;
      } else {
        if (columnwise) {
          t_am = at::empty({}, f32);
          t_ptr = t_am.data_ptr<float>();
        }
        check(t.nvfp4_row_amax(xp, code, m, n, g_ptr, t_ptr, stream, dev, ws));
      }
    }
    at::Tensor data, scale, data_t, scale_t;
    if (rowwise) {
      data = at::empty({m, n / 2}, opts.dtype(at::kByte));
      scale = at::empty({m, n / 16}, opts.dtype(at::kFloat8_e4m3fn));
    }
    if (columnwise) {
      data_t = at::empty({n, m / 2}, opts.dtype(at::kByte));
      scale_t = at::empty({n, m / 16}, opts.dtype(at::kFloat8_e4m3fn));
    }
    at::Tensor unit, unit_t;
    if (unit_row && rowwise) unit = at::empty({m, n}, opts.dtype(at::kBFloat16));
    if (unit_col && columnwise) unit_t = at::empty({n, m}, opts.dtype(at::kBFloat16));
    const bool with_bias = partials.has_value() && db.has_value();
    fp_recipes::Nvfp4QuantizeCall c{};
    c.x = xp;
    c.in_dtype = code;
    c.rows = m;
    c.cols = n;
    c.data = rowwise ? data.data_ptr() : nullptr;
    c.scale = rowwise ? scale.data_ptr() : nullptr;
    c.amax = (rowwise || block_2d) ? g_ptr : nullptr;
    c.row_scaled = row_scaled;
    c.data_t = columnwise ? data_t.data_ptr() : nullptr;
    c.scale_t = columnwise ? scale_t.data_ptr() : nullptr;
    c.amax_t = t_ptr;
    c.rht = rht;
    c.block_2d = block_2d;
    c.four_over_six = fos;
    c.mse = mse;
    c.e4m3_max = static_cast<float>(e4m3_max);
    c.stochastic_rounding = sr;
    c.seed = seed;
    c.offset = offset;
    c.row_amax_out = row_amax_out;
    c.bias_partials = with_bias ? partials->data_ptr<float>() : nullptr;
    c.bias_out = with_bias ? db->data_ptr() : nullptr;
    c.bias_dtype = with_bias ? code_of(db->scalar_type()) : -1;
    c.stream = stream;
    c.device = dev;
    c.unit = unit.defined() ? unit.data_ptr() : nullptr;
    c.unit_t = unit_t.defined() ? unit_t.data_ptr() : nullptr;
    c.rng_state = rng_state.has_value() ? static_cast<const uint64_t*>(rng_state->data_ptr()) : nullptr;
    check(t.nvfp4_quantize(&c));
    py::object none = py::none();
    auto opt = [&](const at::Tensor& v) -> py::object { return v.defined() ? py::cast(v) : none; };
    at::Tensor rowwise_amax = rowwise ? (row_am.defined() ? row_am : g_am) : at::Tensor();
    return py::make_tuple(opt(data), opt(scale), opt(rowwise_amax), opt(data_t), opt(scale_t), opt(t_am), opt(unit),
                          opt(unit_t));
  }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fp_recipes' torch-linked host fast path of the eager FP8 casts and GEMMs (use fp_recipes.ops)";
  m.def("init", &init, py::arg("table"), "Take fp_recipes._C.kernel_table(); call once before the others.");
  m.attr("fp8_cast_acts") = true;  // fp8_cast takes act, and register_traced_ops the activation casts' ops
  m.attr("nvfp4_launch_units") = true;  // Nvfp4Launch.run takes unit_row / unit_col
  m.def("fp8_cast", &fp8_cast, py::arg("x"), py::arg("out_code"), py::arg("rowwise"), py::arg("columnwise"),
        py::arg("current"), py::arg("pow2"), py::arg("eps"), py::arg("scale"), py::arg("record"),
        py::arg("bias_dtype"), py::arg("act") = 0,
        "(data, data_t, scale_inv, amax, scale[, db]) of an FP8 quantizer's cast of a contiguous 2-D CUDA x (of act(x) "
        "for act > 0: ops/cuda_fp8_act.py ACT_CODES, no bias gradient), or None.");
  m.def("fp8_cast_op", &fp8_cast_op, py::arg("x"), py::arg("out_code"), py::arg("rowwise"), py::arg("columnwise"),
        py::arg("current"), py::arg("pow2"), py::arg("eps"), py::arg("scale"), py::arg("record"),
        py::arg("bias_dtype"),
        "fp8_cast for the traced-cast ops: (data, data_t, scale_inv, amax, scale, db or None), placeholders for "
        "unwanted copies, separate FP32 values; or None.");
  m.def("register_traced_ops", &register_traced_ops, py::arg("python_impls"), py::arg("gemm_workspace_bytes"),
        "Register the CUDA kernels of the named traced ops (name -> Python implementation, run where C++ declines); "
        "once per process. Returns the names registered.");
  m.def("traced_ops_enabled", [](bool enabled) { return g_ops_enabled.exchange(enabled); }, py::arg("enabled"),
        "Whether the registered op kernels take their C++ calls (False: each runs its Python implementation); "
        "returns the previous setting.");
  m.def("fp8_linear_gemm", &fp8_linear_gemm, py::arg("a"), py::arg("b"), py::arg("scale_a"), py::arg("scale_b"),
        py::arg("out_dtype"), py::arg("bias"), py::arg("fast_accum"), py::arg("workspace_bytes"),
        "gemm/fp8.py gemm_fp8_fp8's CUDA branch (operand readiness, fused bias, the cached plan), or None.");
  m.def("nvfp4_emulated_gemm", &nvfp4_emulated_gemm, py::arg("a_data"), py::arg("a_scale"), py::arg("a_amax"),
        py::arg("a_unit"), py::arg("a_row_scaled"), py::arg("a_e4m3_max"), py::arg("b_data"), py::arg("b_scale"),
        py::arg("b_amax"), py::arg("b_unit"), py::arg("b_row_scaled"), py::arg("b_e4m3_max"), py::arg("out_dtype"),
        py::arg("bias"), py::arg("workspace_bytes"), py::arg("chunk_min_rows"), py::arg("chunk_max"),
        "gemm/nvfp4_emulated.py emulated_cuda_eager (decode + alpha, BF16 GEMM, row epilogue), or None.");
  py::class_<DelayedUpdates>(m, "DelayedUpdates", "amax_reduction.py _FastUpdate's launches, one C++ call per update")
      .def(py::init([](int device, const std::vector<py::tuple>& batches, std::vector<at::Tensor> scales) {
             DelayedUpdates u{device, {}, std::move(scales)};
             for (const py::tuple& b : batches) {
               if (b.size() != 8) throw std::invalid_argument("DelayedUpdates: each batch is an 8-tuple");
               u.batches.push_back({b[0].cast<uintptr_t>(), b[1].cast<int64_t>(), b[2].cast<int64_t>(),
                                    b[3].cast<double>(), b[4].cast<int>(), b[5].cast<bool>(), b[6].cast<uintptr_t>(),
                                    b[7].cast<int64_t>()});
             }
             return u;
           }),
           py::arg("device"), py::arg("batches"), py::arg("scales"),
           "batches: (table address, count, length, fmt_max, margin, algo_max, mapped flags host address or 0, "
           "flag bytes) per launch")
      .def("run", &DelayedUpdates::run);
  py::class_<Nvfp4Launch>(m, "Nvfp4Launch", "ops/cuda_nvfp4.py _Launch's quantization, one C++ call per run")
      .def(py::init([](int64_t m, int64_t n, int code, int mode, bool rowwise, bool columnwise, bool row_scaled,
                       bool block_2d, bool rht, bool need_g, int fos, bool mse, double e4m3_max, bool sr) {
             if (mode < 0 || mode > 3) throw std::invalid_argument("Nvfp4Launch: mode must be 0..3");
             if (fos < 0 || fos > 2) throw std::invalid_argument("Nvfp4Launch: four_over_six must be 0, 1 or 2");
             return Nvfp4Launch{m, n, code, static_cast<AmaxMode>(mode), rowwise, columnwise, row_scaled, block_2d,
                                rht, need_g, fos, mse, e4m3_max, sr};
           }),
           py::arg("m"), py::arg("n"), py::arg("code"), py::arg("mode"), py::arg("rowwise"), py::arg("columnwise"),
           py::arg("row_scaled"), py::arg("block_2d"), py::arg("rht"), py::arg("need_g"), py::arg("four_over_six"),
           py::arg("mse"), py::arg("e4m3_max"), py::arg("stochastic_rounding"))
      .def("run", &Nvfp4Launch::run, py::arg("x"), py::arg("seed"), py::arg("offset"), py::arg("partials"),
           py::arg("db"), py::arg("unit_row") = false, py::arg("unit_col") = false,
           py::arg("rng_state") = py::none());
  m.def("buffers", []() {
    std::lock_guard<std::mutex> lock(g_buffers.mutex);
    return py::make_tuple(g_buffers.amax_ws.size(), g_buffers.gemm_ws.size(), g_alpha_ws_count.load());
  }, "(amax workspaces, GEMM workspaces, NVFP4 alpha workspaces) held: one per device and stream used (alpha: and "
     "thread).");
}
