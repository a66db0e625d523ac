// Many per-tensor-scaled FP8 GEMMs from one host call, through cuBLASLt.
//
// Why: a grouped (MoE) layer runs one GEMM per expert and per pass; from Python each
// torch._scaled_mm costs tens of microseconds of host time (argument checks, descriptor set-up and an
// algorithm heuristic query on every call), which at MoE sizes is longer than the GEMM itself. Here
// the descriptors and the chosen algorithm are cached per problem shape, so one expert's GEMM is a
// few attribute writes and one cublasLtMatmul.
//
// The library is not linked: it is opened at run time (the copy torch already loaded, by path from
// Python), so the extension still builds and imports where cuBLASLt is absent. Without <cublasLt.h>
// at build time the functions exist and report "not compiled".
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <dlfcn.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "common.h"

#if __has_include(<cublasLt.h>)
#include <cublasLt.h>
#define FPR_HAVE_CUBLASLT 1
#else
#define FPR_HAVE_CUBLASLT 0
#endif

namespace py = pybind11;

namespace fp_recipes {

#if FPR_HAVE_CUBLASLT
namespace {

struct LtApi {
  void* lib = nullptr;
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtGetVersion) get_version = nullptr;
  decltype(&cublasLtGetStatusString) status_string = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
};

LtApi g_api;
std::mutex g_mutex;

template <typename F>
void bind_symbol(F& fn, const char* name) {
  fn = reinterpret_cast<F>(dlsym(g_api.lib, name));
  if (fn == nullptr) throw std::runtime_error(std::string("fp_recipes: cuBLASLt has no symbol ") + name);
}

void check_lt(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    std::string msg = g_api.status_string ? g_api.status_string(status) : std::to_string(static_cast<int>(status));
    throw std::runtime_error(std::string("fp_recipes cuBLASLt error in ") + what + ": " + msg);
  }
}

cudaDataType_t lt_type(DType t) {
  switch (t) {
    case DType::kFloat32: return CUDA_R_32F;
    case DType::kFloat16: return CUDA_R_16F;
    case DType::kBFloat16: return CUDA_R_16BF;
    case DType::kFloat8E4M3: return CUDA_R_8F_E4M3;
    case DType::kFloat8E5M2: return CUDA_R_8F_E5M2;
    default: break;
  }
  throw std::invalid_argument(std::string("fp_recipes: cuBLASLt GEMM does not take dtype ") + dtype_name(t));
}

// One problem shape's descriptors and algorithm. Row-major D (m x n) = A (m x k) @ B^T with B (n x k),
// both K-contiguous, is cuBLASLt's column-major D^T (n x m) = op_T(B) (n x k) . A^T (k x m): its "A"
// is our B (transposed, ld k), its "B" is our A (ld k), D has ld n. That is the TN form Hopper's FP8
// GEMMs require.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t lay_a = nullptr, lay_b = nullptr, lay_d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool ok = false;  // a heuristic found an algorithm
};

// How a plan scales: FP8 per-tensor scale pointers and a host alpha of 1, or (BF16 operands) alpha and
// beta read from device memory (the emulated NVFP4 GEMM's alpha, written by the kernel before it).
enum class PlanMode : int { kFp8Scales = 0, kDeviceAlpha = 1 };

// (device, m, n, k, dtypes a/b/d, bias dtype, fast accum, workspace, alignments of cuBLASLt's A/B/D, mode,
// row strides (leading dims) of our A and B)
using PlanKey = std::tuple<int, int64_t, int64_t, int64_t, int, int, int, int, bool, size_t, uint32_t, uint32_t,
                           uint32_t, int, int64_t, int64_t>;
std::map<PlanKey, Plan> g_plans;
// Token-routed experts see a new m almost every step; the cache is bounded so that a long run cannot
// grow it without limit (dropping it costs one heuristic query per shape seen again).
constexpr size_t kMaxPlans = 4096;

void drop_plans() {
  for (auto& entry : g_plans) {
    Plan& p = entry.second;
    if (p.lay_a) g_api.layout_destroy(p.lay_a);
    if (p.lay_b) g_api.layout_destroy(p.lay_b);
    if (p.lay_d) g_api.layout_destroy(p.lay_d);
    if (p.desc) g_api.desc_destroy(p.desc);
  }
  g_plans.clear();
}
std::map<int, cublasLtHandle_t> g_handles;

cublasLtHandle_t handle_for(int device) {
  auto it = g_handles.find(device);
  if (it != g_handles.end()) return it->second;
  cublasLtHandle_t h = nullptr;
  check_lt(g_api.create(&h), "cublasLtCreate");
  g_handles[device] = h;
  return h;
}

// The largest power of two <= 256 dividing the address: the alignment cuBLASLt may assume of it. Its
// heuristic otherwise assumes 256 bytes, and an algorithm chosen for that refuses (or mis-reads) an
// operand at an odd offset inside a grouped buffer; so the alignments are part of the plan's key.
uint32_t alignment_of(std::uintptr_t ptr) {
  uint32_t a = 256;
  while (a > 1 && ptr % a != 0) a >>= 1;
  return a;
}

Plan& plan_for(int device, int64_t m, int64_t n, int64_t k, DType a_t, DType b_t, DType d_t, int bias_t,
               bool fast_accum, size_t workspace, uint32_t align_a, uint32_t align_b, uint32_t align_d,
               PlanMode mode = PlanMode::kFp8Scales, int64_t lda = 0, int64_t ldb = 0) {
  // lda / ldb: the row strides (in elements) of our A (m x k) and B (n x k); 0 = dense (k)
  if (lda <= 0) lda = k;
  if (ldb <= 0) ldb = k;
  PlanKey key{device, m, n, k, static_cast<int>(a_t), static_cast<int>(b_t), static_cast<int>(d_t), bias_t,
              fast_accum, workspace, align_a, align_b, align_d, static_cast<int>(mode), lda, ldb};
  auto it = g_plans.find(key);
  if (it != g_plans.end()) return it->second;
  if (g_plans.size() >= kMaxPlans) drop_plans();  // descriptors are only read during cublasLtMatmul
  Plan p;
  check_lt(g_api.desc_create(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
  check_lt(g_api.desc_set(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)), "TRANSA");
  check_lt(g_api.desc_set(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)), "TRANSB");
  if (mode == PlanMode::kFp8Scales) {
    int8_t fast = fast_accum ? 1 : 0;
    check_lt(g_api.desc_set(p.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)), "FAST_ACCUM");
    // Placeholder scale pointers: the heuristic must see a scaled FP8 problem; the real pointers are
    // written before every cublasLtMatmul.
    static float* const kNoScale = nullptr;
    check_lt(g_api.desc_set(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &kNoScale, sizeof(kNoScale)), "A_SCALE");
    check_lt(g_api.desc_set(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &kNoScale, sizeof(kNoScale)), "B_SCALE");
  } else {
    cublasLtPointerMode_t pm = CUBLASLT_POINTER_MODE_DEVICE;
    check_lt(g_api.desc_set(p.desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, &pm, sizeof(pm)), "POINTER_MODE");
  }
  if (bias_t >= 0) {
    cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    check_lt(g_api.desc_set(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)), "EPILOGUE");
    cudaDataType_t bt = lt_type(static_cast<DType>(bias_t));
    check_lt(g_api.desc_set(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)), "BIAS_DATA_TYPE");
  }
  check_lt(g_api.layout_create(&p.lay_a, lt_type(b_t), static_cast<uint64_t>(k), static_cast<uint64_t>(n), ldb),
           "layout A");
  check_lt(g_api.layout_create(&p.lay_b, lt_type(a_t), static_cast<uint64_t>(k), static_cast<uint64_t>(m), lda),
           "layout B");
  check_lt(g_api.layout_create(&p.lay_d, lt_type(d_t), static_cast<uint64_t>(n), static_cast<uint64_t>(m), n),
           "layout D");
  cublasLtMatmulPreference_t pref = nullptr;
  check_lt(g_api.pref_create(&pref), "cublasLtMatmulPreferenceCreate");
  uint64_t ws = workspace;
  check_lt(g_api.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)), "MAX_WORKSPACE");
  check_lt(g_api.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a)), "ALIGN_A");
  check_lt(g_api.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b)), "ALIGN_B");
  check_lt(g_api.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d, sizeof(align_d)), "ALIGN_C");
  check_lt(g_api.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d, sizeof(align_d)), "ALIGN_D");
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  cublasStatus_t st = g_api.heuristic(handle_for(device), p.desc, p.lay_a, p.lay_b, p.lay_d, p.lay_d, pref, 1,
                                      &result, &found);
  g_api.pref_destroy(pref);
  if (st == CUBLAS_STATUS_SUCCESS && found > 0) {
    p.algo = result.algo;
    p.ok = true;
  }
  return g_plans.emplace(key, p).first->second;
}

bool aligned16(std::uintptr_t ptr) { return ptr % 16 == 0; }

// One FP8 GEMM through its cached plan (caller holds g_mutex). lda / ldb: row strides of our A and B in
// elements (FP8: bytes). Returns false, having launched nothing, where cuBLASLt's FP8 kernels cannot
// take the problem (the caller's fallback then runs it).
bool run_fp8_gemm(std::uintptr_t a, int64_t lda, std::uintptr_t b, int64_t ldb, std::uintptr_t scale_a,
                  std::uintptr_t scale_b, std::uintptr_t d, std::uintptr_t bias, int64_t m, int64_t n, int64_t k,
                  DType at, DType bt, DType dt, int bias_dtype, bool fast_accum, std::uintptr_t workspace,
                  int64_t workspace_size, int device, std::uintptr_t stream) {
  const int bias_code = bias != 0 ? bias_dtype : -1;
  // cuBLASLt's FP8 kernels need K and N in multiples of 16 and 16-byte aligned operands, rows and
  // scale pointers (a scale inside a packed FP32 vector is refused as NOT_SUPPORTED); any other GEMM
  // (and K == 0, whose output is the bias or zeros) is left to the caller.
  if (k == 0 || k % 16 != 0 || n % 16 != 0 || lda < k || ldb < k || lda % 16 != 0 || ldb % 16 != 0 ||
      !aligned16(a) || !aligned16(b) || !aligned16(d) || (bias != 0 && !aligned16(bias)) || !aligned16(scale_a) ||
      !aligned16(scale_b) || scale_a == 0 || scale_b == 0)
    return false;
  // cuBLASLt's A is our B, its B our A
  Plan& p = plan_for(device, m, n, k, at, bt, dt, bias_code, fast_accum, static_cast<size_t>(workspace_size),
                     alignment_of(b), alignment_of(a), alignment_of(d), PlanMode::kFp8Scales, lda, ldb);
  if (!p.ok) return false;
  const void* sa = reinterpret_cast<const void*>(scale_b);  // cuBLASLt's A is our B
  const void* sb = reinterpret_cast<const void*>(scale_a);
  check_lt(g_api.desc_set(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)), "A_SCALE");
  check_lt(g_api.desc_set(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb)), "B_SCALE");
  if (bias != 0) {
    const void* bp = reinterpret_cast<const void*>(bias);
    check_lt(g_api.desc_set(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof(bp)), "BIAS_POINTER");
  }
  const float alpha = 1.0f, beta = 0.0f;
  void* dp = reinterpret_cast<void*>(d);
  const cublasStatus_t st =
      g_api.matmul(handle_for(device), p.desc, &alpha, reinterpret_cast<const void*>(b), p.lay_a,
                   reinterpret_cast<const void*>(a), p.lay_b, &beta, dp, p.lay_d, dp, p.lay_d, &p.algo,
                   reinterpret_cast<void*>(workspace), static_cast<size_t>(workspace_size), as_stream(stream));
  if (st == CUBLAS_STATUS_NOT_SUPPORTED) {  // refused before any launch: the caller's fallback runs it
    p.ok = false;
    return false;
  }
  check_lt(st, "cublasLtMatmul");
  return true;
}

}  // namespace
#endif  // FPR_HAVE_CUBLASLT

// One BF16 GEMM with alpha/beta read on the device (the emulated NVFP4 GEMM): D (m x n, row-major; bf16/fp16/
// fp32) = alpha * A (m x k) @ B^T (B: n x k) (+ bias), A and B contiguous BF16, FP32 accumulation. Returns false,
// having launched nothing, where cuBLASLt cannot run it (the caller's fallback then does).
bool lt_bf16_gemm(std::uintptr_t a, std::uintptr_t b, std::uintptr_t d, std::uintptr_t bias, int64_t m, int64_t n,
                  int64_t k, int d_dtype, int bias_dtype, std::uintptr_t alpha_beta, std::uintptr_t workspace,
                  int64_t workspace_size, int device, std::uintptr_t stream) {
#if FPR_HAVE_CUBLASLT
  require(m >= 0 && n >= 0 && k >= 0, "lt_bf16_gemm: negative GEMM size");
  require(workspace_size >= 0 && (workspace_size == 0 || workspace != 0),
          "lt_bf16_gemm: workspace must be a device buffer of workspace_size bytes");
  // Left to the caller: empty products, rows that are not 16-byte multiples, unaligned operands.
  if (m == 0 || n == 0 || k == 0 || k % 8 != 0 || !aligned16(a) || !aligned16(b) || !aligned16(d) ||
      alpha_beta == 0 || (bias != 0 && !aligned16(bias)))
    return false;
  std::lock_guard<std::mutex> lock(g_mutex);
  require(g_api.lib != nullptr, "lt_bf16_gemm: cuBLASLt is not loaded (call lt_load first)");
  const int bias_code = bias != 0 ? bias_dtype : -1;
  Plan& p = plan_for(device, m, n, k, DType::kBFloat16, DType::kBFloat16, static_cast<DType>(d_dtype),
                     bias_code, false, static_cast<size_t>(workspace_size), alignment_of(b), alignment_of(a),
                     alignment_of(d), PlanMode::kDeviceAlpha);
  if (!p.ok) return false;
  if (bias != 0) {
    const void* bp = reinterpret_cast<const void*>(bias);
    check_lt(g_api.desc_set(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof(bp)), "BIAS_POINTER");
  }
  const float* alpha = reinterpret_cast<const float*>(alpha_beta);
  void* dp = reinterpret_cast<void*>(d);
  const cublasStatus_t st =
      g_api.matmul(handle_for(device), p.desc, alpha, reinterpret_cast<const void*>(b), p.lay_a,
                   reinterpret_cast<const void*>(a), p.lay_b, alpha + 1, dp, p.lay_d, dp, p.lay_d, &p.algo,
                   reinterpret_cast<void*>(workspace), static_cast<size_t>(workspace_size), as_stream(stream));
  if (st == CUBLAS_STATUS_NOT_SUPPORTED) {
    p.ok = false;
    return false;
  }
  check_lt(st, "cublasLtMatmul (bf16)");
  return true;
#else
  (void)a; (void)b; (void)d; (void)bias; (void)m; (void)n; (void)k; (void)d_dtype; (void)bias_dtype;
  (void)alpha_beta; (void)workspace; (void)workspace_size; (void)device; (void)stream;
  throw std::runtime_error("fp_recipes: this build has no cuBLASLt path (<cublasLt.h> was not found)");
#endif
}

bool lt_fp8_gemm(std::uintptr_t a, int64_t lda, std::uintptr_t b, int64_t ldb, std::uintptr_t scale_a,
                 std::uintptr_t scale_b, std::uintptr_t d, std::uintptr_t bias, int64_t m, int64_t n, int64_t k,
                 int a_dtype, int b_dtype, int d_dtype, int bias_dtype, bool fast_accum, std::uintptr_t workspace,
                 int64_t workspace_size, int device, std::uintptr_t stream) {
#if FPR_HAVE_CUBLASLT
  require(m >= 0 && n >= 0 && k >= 0, "lt_fp8_gemm: negative GEMM size");
  require(workspace_size >= 0 && (workspace_size == 0 || workspace != 0),
          "lt_fp8_gemm: workspace must be a device buffer of workspace_size bytes");
  if (m == 0 || n == 0) return false;  // the caller makes the empty / bias-only output
  std::lock_guard<std::mutex> lock(g_mutex);
  require(g_api.lib != nullptr, "lt_fp8_gemm: cuBLASLt is not loaded (call lt_load first)");
  return run_fp8_gemm(a, lda, b, ldb, scale_a, scale_b, d, bias, m, n, k, static_cast<DType>(a_dtype),
                      static_cast<DType>(b_dtype), static_cast<DType>(d_dtype), bias_dtype, fast_accum, workspace,
                      workspace_size, device, stream);
#else
  (void)a; (void)lda; (void)b; (void)ldb; (void)scale_a; (void)scale_b; (void)d; (void)bias; (void)m; (void)n;
  (void)k; (void)a_dtype; (void)b_dtype; (void)d_dtype; (void)bias_dtype; (void)fast_accum; (void)workspace;
  (void)workspace_size; (void)device; (void)stream;
  throw std::runtime_error("fp_recipes: this build has no cuBLASLt path (<cublasLt.h> was not found)");
#endif
}

void register_gemm_lt(py::module_& m) {
  m.def("lt_compiled", []() { return FPR_HAVE_CUBLASLT == 1; },
        "Whether this build has the cuBLASLt grouped-GEMM path (needs <cublasLt.h> at build time).");
  m.def(
      "lt_load",
      [](const std::string& path) -> int64_t {
#if FPR_HAVE_CUBLASLT
        std::lock_guard<std::mutex> lock(g_mutex);
        if (g_api.lib != nullptr) return static_cast<int64_t>(g_api.get_version());
        void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (lib == nullptr) {
          const char* err = dlerror();
          throw std::runtime_error(std::string("fp_recipes: cannot open cuBLASLt at '") + path +
                                   "': " + (err ? err : "unknown error"));
        }
        g_api.lib = lib;
        try {
          bind_symbol(g_api.create, "cublasLtCreate");
          bind_symbol(g_api.get_version, "cublasLtGetVersion");
          bind_symbol(g_api.status_string, "cublasLtGetStatusString");
          bind_symbol(g_api.desc_create, "cublasLtMatmulDescCreate");
          bind_symbol(g_api.desc_set, "cublasLtMatmulDescSetAttribute");
          bind_symbol(g_api.desc_destroy, "cublasLtMatmulDescDestroy");
          bind_symbol(g_api.layout_create, "cublasLtMatrixLayoutCreate");
          bind_symbol(g_api.layout_destroy, "cublasLtMatrixLayoutDestroy");
          bind_symbol(g_api.pref_create, "cublasLtMatmulPreferenceCreate");
          bind_symbol(g_api.pref_set, "cublasLtMatmulPreferenceSetAttribute");
          bind_symbol(g_api.pref_destroy, "cublasLtMatmulPreferenceDestroy");
          bind_symbol(g_api.heuristic, "cublasLtMatmulAlgoGetHeuristic");
          bind_symbol(g_api.matmul, "cublasLtMatmul");
        } catch (...) {
          g_api = LtApi{};
          dlclose(lib);
          throw;
        }
        size_t version = g_api.get_version();
        if (version / 10000 != CUBLAS_VER_MAJOR) {
          g_api = LtApi{};
          dlclose(lib);
          throw std::runtime_error("fp_recipes: cuBLASLt at '" + path + "' is version " + std::to_string(version) +
                                   ", this extension was built against major version " +
                                   std::to_string(CUBLAS_VER_MAJOR));
        }
        return static_cast<int64_t>(version);
#else
        (void)path;
        throw std::runtime_error("fp_recipes: this build has no cuBLASLt path (<cublasLt.h> was not found)");
#endif
      },
      py::arg("path"), "Open cuBLASLt (path or soname); returns its version.");
  m.def(
      "lt_fp8_gemms",
      [](const std::vector<std::uintptr_t>& a, const std::vector<std::uintptr_t>& b,
         const std::vector<std::uintptr_t>& scale_a, const std::vector<std::uintptr_t>& scale_b,
         const std::vector<std::uintptr_t>& d, const std::vector<std::uintptr_t>& bias,
         const std::vector<int64_t>& ms, const std::vector<int64_t>& ns, const std::vector<int64_t>& ks, int a_dtype,
         int b_dtype, int d_dtype, int bias_dtype, bool fast_accum, std::uintptr_t workspace, int64_t workspace_size,
         int device, std::uintptr_t stream) -> std::vector<int64_t> {
#if FPR_HAVE_CUBLASLT
        const size_t num = a.size();
        require(b.size() == num && scale_a.size() == num && scale_b.size() == num && d.size() == num &&
                    ms.size() == num && ns.size() == num && ks.size() == num && (bias.empty() || bias.size() == num),
                "lt_fp8_gemms: every per-GEMM list must have the same length");
        require(workspace_size >= 0 && (workspace_size == 0 || workspace != 0),
                "lt_fp8_gemms: workspace must be a device buffer of workspace_size bytes");
        std::lock_guard<std::mutex> lock(g_mutex);
        require(g_api.lib != nullptr, "lt_fp8_gemms: cuBLASLt is not loaded (call lt_load first)");
        const DType at = static_cast<DType>(a_dtype), bt = static_cast<DType>(b_dtype),
                    dt = static_cast<DType>(d_dtype);
        std::vector<int64_t> skipped;
        for (size_t i = 0; i < num; ++i) {
          const int64_t m = ms[i], n = ns[i], k = ks[i];
          require(m >= 0 && n >= 0 && k >= 0, "lt_fp8_gemms: negative GEMM size");
          if (m == 0 || n == 0) continue;  // an empty output: nothing to write
          const std::uintptr_t bias_i = bias.empty() ? 0 : bias[i];
          if (!run_fp8_gemm(a[i], k, b[i], k, scale_a[i], scale_b[i], d[i], bias_i, m, n, k, at, bt, dt, bias_dtype,
                            fast_accum, workspace, workspace_size, device, stream))
            skipped.push_back(static_cast<int64_t>(i));
        }
        return skipped;
#else
        (void)a; (void)b; (void)scale_a; (void)scale_b; (void)d; (void)bias; (void)ms; (void)ns; (void)ks;
        (void)a_dtype; (void)b_dtype; (void)d_dtype; (void)bias_dtype; (void)fast_accum; (void)workspace;
        (void)workspace_size; (void)device; (void)stream;
        throw std::runtime_error("fp_recipes: this build has no cuBLASLt path (<cublasLt.h> was not found)");
#endif
      },
      py::arg("a"), py::arg("b"), py::arg("scale_a"), py::arg("scale_b"), py::arg("d"), py::arg("bias"),
      py::arg("ms"), py::arg("ns"), py::arg("ks"), py::arg("a_dtype"), py::arg("b_dtype"), py::arg("d_dtype"),
      py::arg("bias_dtype"), py::arg("fast_accum"), py::arg("workspace"), py::arg("workspace_size"),
      py::arg("device"), py::arg("stream"),
      "D_i (m_i x n_i, row-major) = A_i (m_i x k_i) @ B_i^T (B_i: n_i x k_i) * scale_a_i * scale_b_i (+ bias_i), "
      "each operand contiguous, FP8 per-tensor scales as device FP32 pointers. Returns the indices of the "
      "GEMMs it did not run (shapes or alignment cuBLASLt's FP8 kernels cannot take, K == 0), for the caller's "
      "fallback.");
  m.def(
      "lt_fp8_gemm",
      [](std::uintptr_t a, int64_t lda, std::uintptr_t b, int64_t ldb, std::uintptr_t scale_a, std::uintptr_t scale_b,
         std::uintptr_t d, std::uintptr_t bias, int64_t m, int64_t n, int64_t k, int a_dtype, int b_dtype, int d_dtype,
         int bias_dtype, bool fast_accum, std::uintptr_t workspace, int64_t workspace_size, int device,
         std::uintptr_t stream) -> bool {
        return lt_fp8_gemm(a, lda, b, ldb, scale_a, scale_b, d, bias, m, n, k, a_dtype, b_dtype, d_dtype, bias_dtype,
                           fast_accum, workspace, workspace_size, device, stream);
      },
      py::arg("a"), py::arg("lda"), py::arg("b"), py::arg("ldb"), py::arg("scale_a"), py::arg("scale_b"), py::arg("d"),
      py::arg("bias"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("a_dtype"), py::arg("b_dtype"),
      py::arg("d_dtype"), py::arg("bias_dtype"), py::arg("fast_accum"), py::arg("workspace"),
      py::arg("workspace_size"), py::arg("device"), py::arg("stream"),
      "One dense FP8 GEMM through the cached plan of its shape: D (m x n, row-major, dense) = A (m x k, row "
      "stride lda) @ B^T (B: n x k, row stride ldb) * scale_a * scale_b (+ bias). Returns False without "
      "launching where cuBLASLt's FP8 kernels cannot take it (the caller's fallback then runs it).");
  m.def(
      "lt_bf16_gemm",
      &lt_bf16_gemm,
      py::arg("a"), py::arg("b"), py::arg("d"), py::arg("bias"), py::arg("m"), py::arg("n"), py::arg("k"),
      py::arg("d_dtype"), py::arg("bias_dtype"), py::arg("alpha_beta"), py::arg("workspace"),
      py::arg("workspace_size"), py::arg("device"), py::arg("stream"),
      "D (m x n, row-major; bf16/fp16/fp32) = alpha * A (m x k) @ B^T (B: n x k) (+ bias), A and B contiguous "
      "BF16, FP32 accumulation; alpha_beta = device FP32 {alpha, beta = 0} (no host synchronisation). Returns "
      "False without launching when cuBLASLt cannot run it here (the caller's fallback then does).");
}

}  // namespace fp_recipes
