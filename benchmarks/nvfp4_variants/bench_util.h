// Host helpers of the standalone kernel benchmarks here (no torch): CK (every one of them); a deterministic byte
// generator, the median of CUDA-event timings and the device-to-device copy bandwidth of the same run (the ceiling
// every "% of copy" is measured against) for decode_bench.cu and rht_amax_bench.cu.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                                          \
  do {                                                                                                 \
    cudaError_t e_ = (x);                                                                              \
    if (e_ != cudaSuccess) {                                                                           \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__, __LINE__,   \
                   cudaGetErrorString(e_));                                                            \
      std::exit(2);                                                                                    \
    }                                                                                                  \
  } while (0)

namespace bench {

inline uint32_t next_u32() {  // xorshift64, fixed seed: the same inputs in every run
  static uint64_t s = 0x9E3779B97F4A7C15ull;
  s ^= s << 13;
  s ^= s >> 7;
  s ^= s << 17;
  return static_cast<uint32_t>(s >> 11);
}

// Median milliseconds of `iters` calls of run(i), after 3 warm-up calls.
template <typename F>
float median_ms(F run, int iters, cudaStream_t st) {
  for (int i = 0; i < 3; ++i) run(i);
  cudaEvent_t a, z;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&z));
  std::vector<float> t;
  for (int i = 0; i < iters; ++i) {
    CK(cudaEventRecord(a, st));
    run(i);
    CK(cudaEventRecord(z, st));
    CK(cudaEventSynchronize(z));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, z));
    t.push_back(ms);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(z));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// GB/s of a 256 MiB device-to-device copy (bytes read + written), the median of 20.
inline double copy_gbps(cudaStream_t st) {
  const size_t n = size_t(1) << 28;
  void *src, *dst;
  CK(cudaMalloc(&src, n));
  CK(cudaMalloc(&dst, n));
  CK(cudaMemset(src, 1, n));
  const float ms = median_ms([&](int) { CK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, st)); }, 20, st);
  CK(cudaFree(src));
  CK(cudaFree(dst));
  return 2.0 * n / (ms * 1e-3) / 1e9;
}

inline void print_device() {
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, sm_%d%d, %d SMs, L2 %d MiB\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount,
              prop.l2CacheSize >> 20);
}

}  // namespace bench
