// Can cuBLASLt apply a row-scaled NVFP4 product's per-token factor in its own epilogue on sm_90?
//
// Today the row-scaled GEMM writes an FP32 product and a second kernel scales its rows and casts (8 bytes an
// element more than a BF16 output: ~1.5 ms a step at h2048, NOTES_nvfp4.md session 35). cuBLASLt's alpha vector
// (CUBLASLT_POINTER_MODE_ALPHA_DEVICE_VECTOR_BETA_ZERO) scales the rows of D; our output rows are tokens only when
// D is row-major (CUBLASLT_ORDER_ROW), m = tokens. This probe asks the heuristic for such a BF16 GEMM, checks
// its values against the FP32 product scaled on the host side of the comparison, and times it beside
//   lib:  the library's form (column-major D^T, FP32 output, device scalar alpha) + a row-scale epilogue kernel,
//   bf16: a plain BF16-output GEMM (the floor),
// so that one nvcc-only device call says whether the fusion exists and what it would save.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a lt_row_alpha_probe.cu -lcublasLt -o probe && ./probe
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) {                                                         \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

static const char* st(cublasStatus_t s) { return cublasLtGetStatusString(s); }

__global__ void fill_bf16(__nv_bfloat16* p, size_t n, unsigned seed, float scale) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i >= n) return;
  unsigned h = (unsigned)i * 2654435761u ^ seed;
  h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
  // small integers times a power of two: products and sums stay exact in FP32 for the K used here
  int v = (int)(h % 15u) - 7;
  p[i] = __float2bfloat16(v * scale);
}

__global__ void row_epilogue(const float* d, const float* f, __nv_bfloat16* out, int m, int n) {
  size_t i = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) * 4;
  size_t total = (size_t)m * n;
  if (i >= total) return;
  float4 v = *reinterpret_cast<const float4*>(d + i);
  float s = f[i / n];
  __nv_bfloat162 lo = __floats2bfloat162_rn(v.x * s, v.y * s), hi = __floats2bfloat162_rn(v.z * s, v.w * s);
  *reinterpret_cast<__nv_bfloat162*>(out + i) = lo;
  *reinterpret_cast<__nv_bfloat162*>(out + i + 2) = hi;
}

struct Gemm {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo;
  bool ok = false;
};

static cublasLtHandle_t g_lt;
static void* g_ws;
static const size_t kWs = 32u << 20;

static cublasLtMatrixLayout_t layout(cudaDataType_t t, uint64_t rows, uint64_t cols, int64_t ld, bool row_order) {
  cublasLtMatrixLayout_t l;
  cublasLtMatrixLayoutCreate(&l, t, rows, cols, ld);
  if (row_order) {
    cublasLtOrder_t o = CUBLASLT_ORDER_ROW;
    cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_ORDER, &o, sizeof(o));
  }
  return l;
}

// The library's form: D^T (N x M column-major = our M x N row-major) = W (N x K row-major = K x N col, op T) x X^T.
static Gemm make_lib(int M, int N, int K, cudaDataType_t out, cublasLtPointerMode_t pm) {
  Gemm g;
  cublasLtMatmulDescCreate(&g.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  cublasOperation_t tA = CUBLAS_OP_T, tB = CUBLAS_OP_N;
  cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_TRANSA, &tA, sizeof(tA));
  cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tB, sizeof(tB));
  cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, &pm, sizeof(pm));
  g.a = layout(CUDA_R_16BF, K, N, K, false);
  g.b = layout(CUDA_R_16BF, K, M, K, false);
  g.d = layout(out, N, M, N, false);
  return g;
}

// The fused form: D (M x N, row order) = X (M x K, variant: row order op N, or K x M col op T) x W^T (K x N col).
static Gemm make_row(int M, int N, int K, int variant) {
  Gemm g;
  cublasLtMatmulDescCreate(&g.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  cublasOperation_t tA = variant == 0 ? CUBLAS_OP_N : CUBLAS_OP_T, tB = CUBLAS_OP_N;
  cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_TRANSA, &tA, sizeof(tA));
  cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tB, sizeof(tB));
  cublasLtPointerMode_t pm = CUBLASLT_POINTER_MODE_ALPHA_DEVICE_VECTOR_BETA_ZERO;
  cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, &pm, sizeof(pm));
  g.a = variant == 0 ? layout(CUDA_R_16BF, M, K, K, true) : layout(CUDA_R_16BF, K, M, K, false);
  g.b = layout(CUDA_R_16BF, K, N, K, false);
  g.d = layout(CUDA_R_16BF, M, N, N, true);
  return g;
}

static bool pick(Gemm& g, const char* name) {
  cublasLtMatmulPreference_t pref;
  cublasLtMatmulPreferenceCreate(&pref);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kWs, sizeof(kWs));
  cublasLtMatmulHeuristicResult_t res[8];
  int n = 0;
  cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(g_lt, g.desc, g.a, g.b, g.d, g.d, pref, 8, res, &n);
  cublasLtMatmulPreferenceDestroy(pref);
  std::printf("  %-28s heuristic: %s, %d algos\n", name, st(s), n);
  if (s != CUBLAS_STATUS_SUCCESS || n == 0) return false;
  g.algo = res[0].algo;
  g.ok = true;
  return true;
}

static float* g_zero;  // beta on the device: the device pointer modes read alpha and beta there

static cublasStatus_t run(const Gemm& g, const void* alpha, const void* A, const void* B, void* D) {
  return cublasLtMatmul(g_lt, g.desc, alpha, A, g.a, B, g.b, g_zero, D, g.d, D, g.d, &g.algo, g_ws, kWs, 0);
}

template <typename F>
static float time_us(F f, int iters = 30) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < 5; ++i) f();
  cudaEventRecord(a);
  for (int i = 0; i < iters; ++i) f();
  cudaEventRecord(b);
  CK(cudaEventSynchronize(b));
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  return ms * 1000.f / iters;
}

int main() {
  cublasLtCreate(&g_lt);
  CK(cudaMalloc(&g_ws, kWs));
  CK(cudaMalloc(&g_zero, 4));
  CK(cudaMemset(g_zero, 0, 4));
  std::printf("cuBLASLt %zu\n", cublasLtGetVersion());
  const int shapes[][3] = {{8192, 6144, 2048}, {8192, 8192, 2048}, {8192, 2048, 8192},
                           {4096, 12288, 4096}, {4096, 4096, 4096}, {4096, 14336, 4096}};
  std::printf("%-20s %10s %10s %10s %10s %10s  %s\n", "M x N x K", "bf16 us", "lib gemm", "lib+epi", "row N", "row T",
              "row check (vs FP32 x f, BF16)");
  for (auto& s : shapes) {
    const int M = s[0], N = s[1], K = s[2];
    std::printf("== %d x %d x %d\n", M, N, K);
    __nv_bfloat16 *X, *W, *Y, *Y2;
    float *D32, *f, *alpha1;
    CK(cudaMalloc(&X, (size_t)M * K * 2));
    CK(cudaMalloc(&W, (size_t)N * K * 2));
    CK(cudaMalloc(&Y, (size_t)M * N * 2));
    CK(cudaMalloc(&Y2, (size_t)M * N * 2));
    CK(cudaMalloc(&D32, (size_t)M * N * 4));
    CK(cudaMalloc(&f, (size_t)M * 4));
    CK(cudaMalloc(&alpha1, 4));
    fill_bf16<<<(unsigned)(((size_t)M * K + 255) / 256), 256>>>(X, (size_t)M * K, 1u, 1.f / 64);
    fill_bf16<<<(unsigned)(((size_t)N * K + 255) / 256), 256>>>(W, (size_t)N * K, 7u, 1.f / 64);
    std::vector<float> hf(M);
    for (int m = 0; m < M; ++m) hf[m] = std::ldexp(1.0f + (m % 97) / 97.0f, (m % 11) - 5);
    CK(cudaMemcpy(f, hf.data(), M * 4, cudaMemcpyHostToDevice));
    float one = 1.f;
    CK(cudaMemcpy(alpha1, &one, 4, cudaMemcpyHostToDevice));

    Gemm bf = make_lib(M, N, K, CUDA_R_16BF, CUBLASLT_POINTER_MODE_DEVICE);
    Gemm lib = make_lib(M, N, K, CUDA_R_32F, CUBLASLT_POINTER_MODE_DEVICE);
    Gemm rowN = make_row(M, N, K, 0), rowT = make_row(M, N, K, 1);
    pick(bf, "bf16 out (col D^T)");
    pick(lib, "fp32 out (col D^T)");
    pick(rowN, "row D, alpha vec, A row");
    pick(rowT, "row D, alpha vec, A col^T");
    float t_bf = bf.ok ? time_us([&] { run(bf, alpha1, W, X, Y); }) : -1;
    float t_lib = lib.ok ? time_us([&] { run(lib, alpha1, W, X, D32); }) : -1;
    unsigned eb = (unsigned)(((size_t)M * N / 4 + 255) / 256);
    float t_libe = lib.ok ? time_us([&] {
      run(lib, alpha1, W, X, D32);
      row_epilogue<<<eb, 256>>>(D32, f, Y, M, N);
    }) : -1;
    float t_rn = -1, t_rt = -1;
    char check[160] = "no fused form";
    for (int v = 0; v < 2; ++v) {
      Gemm& g = v == 0 ? rowN : rowT;
      if (!g.ok) continue;
      cublasStatus_t rs = run(g, f, X, W, Y2);
      CK(cudaDeviceSynchronize());
      if (rs != CUBLAS_STATUS_SUCCESS) {
        std::printf("  row variant %d matmul: %s\n", v, st(rs));
        continue;
      }
      float t = time_us([&] { run(g, f, X, W, Y2); });
      (v == 0 ? t_rn : t_rt) = t;
      // values: the library's FP32 product (exact here: small integers x 2^-12) scaled per row, rounded to BF16
      run(lib, alpha1, W, X, D32);
      row_epilogue<<<eb, 256>>>(D32, f, Y, M, N);
      run(g, f, X, W, Y2);
      CK(cudaDeviceSynchronize());
      std::vector<uint16_t> a((size_t)M * N), b((size_t)M * N);
      CK(cudaMemcpy(a.data(), Y, a.size() * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(b.data(), Y2, b.size() * 2, cudaMemcpyDeviceToHost));
      size_t bad = 0, first = (size_t)-1;
      for (size_t i = 0; i < a.size(); ++i)
        if (a[i] != b[i]) {
          if (first == (size_t)-1) first = i;
          ++bad;
        }
      std::snprintf(check, sizeof(check), "variant %d: %zu of %zu BF16 outputs differ%s", v, bad, a.size(),
                    bad ? " (first at row/col shown below)" : "");
      if (bad) std::printf("  first differing: row %zu col %zu\n", first / N, first % N);
    }
    std::printf("%-20s %10.1f %10.1f %10.1f %10.1f %10.1f  %s\n", "", t_bf, t_lib, t_libe, t_rn, t_rt, check);
    cudaFree(X); cudaFree(W); cudaFree(Y); cudaFree(Y2); cudaFree(D32); cudaFree(f); cudaFree(alpha1);
  }
  std::printf("done\n");
  return 0;
}
