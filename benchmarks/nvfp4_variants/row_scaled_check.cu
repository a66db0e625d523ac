// Byte check of row_scaled_kernel (a given row amax, the library's launch_row_scaled<T, 0, false>) against
// rowwise_kernel<T, 0> with row_scaled set (the v6 kernel the GPU tests compare with the torch twin), for the build
// this TU is compiled with: -DNVFP4_ROW_SCALED_FREE=1 checks the barrier-free form (every thread makes the row's
// TensorScale). Standalone (no torch), so that compute-sanitizer memcheck / racecheck can run it without the package:
//
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -fmad=false -Ifp_recipes/csrc -gencode=arch=compute_90a,code=sm_90a \
//       -DNVFP4_ROW_SCALED_FREE=1 benchmarks/nvfp4_variants/row_scaled_check.cu -o row_scaled_check
//   compute-sanitizer --tool memcheck ./row_scaled_check; compute-sanitizer --tool racecheck ./row_scaled_check
//
// Shapes: one row, tails of rows, N from one block to 16384 (both kPer forms, 2 and 4 blocks a thread), more rows
// than the grid (the row loop); inputs randn-like with NaN, +-Inf, huge, tiny and zero elements; row amaxes the true
// ones, and 0, NaN, Inf, a tiny and a huge value on some rows. Exits 1 on any mismatching byte.
#include "nvfp4_quantize.cu"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#define CKR(x)                                                                                         \
  do {                                                                                                 \
    cudaError_t e_ = (x);                                                                              \
    if (e_ != cudaSuccess) {                                                                           \
      std::fprintf(stderr, "CUDA error %s at %s:%d\n", cudaGetErrorName(e_), __FILE__, __LINE__);      \
      std::exit(2);                                                                                    \
    }                                                                                                  \
  } while (0)

namespace {

uint64_t g_state = 0x2545F4914F6CDD1Dull;
uint32_t next_u32() {
  g_state ^= g_state << 13;
  g_state ^= g_state >> 7;
  g_state ^= g_state << 17;
  return static_cast<uint32_t>(g_state >> 11);
}
float uniform() { return (next_u32() & 0xFFFFFF) / 16777216.0f; }

float sample(int kind) {
  const float u = uniform() * 2.0f - 1.0f;
  switch (kind) {
    case 0: return u * 3.0f;
    default: {  // specials
      const uint32_t r = next_u32() % 64;
      if (r == 0) return NAN;
      if (r == 1) return INFINITY;
      if (r == 2) return -INFINITY;
      if (r == 3) return 0.0f;
      if (r == 4) return -0.0f;
      if (r == 5) return u * 60000.0f;
      if (r == 6) return u * 1e-6f;
      return u;
    }
  }
}

uint16_t to_bits(float v, bool bf16) {
  if (bf16) {
    const __nv_bfloat16 b = __float2bfloat16(v);
    uint16_t o;
    std::memcpy(&o, &b, 2);
    return o;
  }
  const __half h = __float2half(v);
  uint16_t o;
  std::memcpy(&o, &h, 2);
  return o;
}

float from_bits(uint16_t b, bool bf16) {
  if (bf16) {
    __nv_bfloat16 v;
    std::memcpy(&v, &b, 2);
    return __bfloat162float(v);
  }
  __half v;
  std::memcpy(&v, &b, 2);
  return __half2float(v);
}

template <typename T>
int check(int64_t M, int64_t N, int kind, bool special_amax, cudaStream_t st) {
  using namespace fp_recipes::nvfp4;
  const bool bf16 = sizeof(T) == 2 && std::is_same<T, __nv_bfloat16>::value;
  std::vector<uint16_t> hx(M * N);
  std::vector<float> ha(M);
  for (int64_t r = 0; r < M; ++r) {
    float m = 0.0f;
    bool nan = false;
    for (int64_t c = 0; c < N; ++c) {
      hx[r * N + c] = to_bits(sample(kind), bf16);
      const float v = from_bits(hx[r * N + c], bf16);
      if (std::isnan(v)) nan = true;
      else m = std::fmax(m, std::fabs(v));
    }
    ha[r] = nan ? NAN : m;
    if (special_amax) {
      const int s = static_cast<int>(r % 7);
      if (s == 1) ha[r] = 0.0f;
      if (s == 2) ha[r] = NAN;
      if (s == 3) ha[r] = INFINITY;
      if (s == 4) ha[r] = 1e-30f;
      if (s == 5) ha[r] = 3e38f;
    }
  }
  void* x;
  float* amax;
  uint8_t *d0, *s0, *d1, *s1;
  const int64_t blocks = M * (N / 16);
  CKR(cudaMalloc(&x, M * N * 2 + 16));
  CKR(cudaMalloc(&amax, M * sizeof(float)));
  CKR(cudaMalloc(&d0, blocks * 8 + 16));
  CKR(cudaMalloc(&d1, blocks * 8 + 16));
  CKR(cudaMalloc(&s0, blocks + 16));
  CKR(cudaMalloc(&s1, blocks + 16));
  CKR(cudaMemcpy(x, hx.data(), M * N * 2, cudaMemcpyHostToDevice));
  CKR(cudaMemcpy(amax, ha.data(), M * sizeof(float), cudaMemcpyHostToDevice));
  CKR(cudaMemset(d0, 0xAB, blocks * 8 + 16));
  CKR(cudaMemset(d1, 0xCD, blocks * 8 + 16));
  CKR(cudaMemset(s0, 0xAB, blocks + 16));
  CKR(cudaMemset(s1, 0xCD, blocks + 16));
  KParams k{};
  k.x = x;
  k.M = M;
  k.N = N;
  k.amax = amax;
  k.row_scaled = 1;
  k.e4m3_max = 448.0f;
  // the reference: rowwise_kernel<T, 0> (row_scaled: the row's scale made per block)
  k.data = d0;
  k.scale = s0;
  {
    int dev = 0, sms = 132;
    CKR(cudaGetDevice(&dev));
    CKR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    constexpr int kPer = RowwiseCfg<0>::kU * kThreads;
    const int64_t want = (blocks + kPer - 1) / kPer, cap = static_cast<int64_t>(sms) * 16;
    rowwise_kernel<T, 0><<<static_cast<unsigned>(want < cap ? want : cap), kThreads, 0, st>>>(k);
    CKR(cudaGetLastError());
  }
  // the checked kernel, as the library launches it
  k.data = d1;
  k.scale = s1;
  launch_row_scaled<T, 0, false>(k, nullptr, st);
  CKR(cudaStreamSynchronize(st));
  std::vector<uint8_t> a(blocks * 8 + 16), b(blocks * 8 + 16), sa(blocks + 16), sb(blocks + 16);
  CKR(cudaMemcpy(a.data(), d0, blocks * 8, cudaMemcpyDeviceToHost));
  CKR(cudaMemcpy(b.data(), d1, blocks * 8, cudaMemcpyDeviceToHost));
  CKR(cudaMemcpy(sa.data(), s0, blocks, cudaMemcpyDeviceToHost));
  CKR(cudaMemcpy(sb.data(), s1, blocks, cudaMemcpyDeviceToHost));
  int bad = std::memcmp(a.data(), b.data(), blocks * 8) != 0 || std::memcmp(sa.data(), sb.data(), blocks) != 0;
  if (bad) std::printf("MISMATCH %s M=%lld N=%lld kind=%d special_amax=%d\n", bf16 ? "bf16" : "fp16",
                       static_cast<long long>(M), static_cast<long long>(N), kind, special_amax ? 1 : 0);
  CKR(cudaFree(x));
  CKR(cudaFree(amax));
  CKR(cudaFree(d0));
  CKR(cudaFree(d1));
  CKR(cudaFree(s0));
  CKR(cudaFree(s1));
  return bad;
}

}  // namespace

int main() {
  cudaStream_t st;
  CKR(cudaStreamCreate(&st));
  const int64_t shapes[][2] = {{1, 16},    {3, 48},     {17, 32},   {130, 80},  {1000, 96}, {64, 4096},
                               {5, 16384}, {33, 8192},  {7, 8208},  {257, 1040}, {2500, 256}, {3000, 6144}};
  int checks = 0, bad = 0;
  for (const auto& s : shapes)
    for (int kind = 0; kind < 2; ++kind)
      for (int sa = 0; sa < 2; ++sa) {
        bad += check<__nv_bfloat16>(s[0], s[1], kind, sa != 0, st);
        bad += check<__half>(s[0], s[1], kind, sa != 0, st);
        checks += 2;
      }
  std::printf("row_scaled_check (NVFP4_ROW_SCALED_FREE=%d): %d checks, %d mismatching\n", NVFP4_ROW_SCALED_FREE,
              checks, bad);
  return bad ? 1 : 0;
}
