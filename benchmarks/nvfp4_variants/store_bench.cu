// Store-only patterns at the unit decode's output sizes (issue 13): which way of writing BF16 unit operands reaches
// the write bandwidth cudaMemsetAsync shows (decode_bench.cu, session 34: the library's decode runs at the speed of
// its stores alone, which take ~1.7x memset's time). Each kernel writes `bytes` of non-zero data:
//   lib_grid   one lane per 32 bytes (two 16-byte stores 32 bytes apart), one CTA per 8 KB: the library's pattern
//   lane_grid  one CTA per 8 KB, a warp's 16-byte stores contiguous (512 bytes an instruction)
//   lane_cs    lane_grid with st.global.cs (streaming: evict first)
//   stride     a persistent grid (8 CTAs an SM), lane-contiguous 16-byte stores, grid-stride, 4 stores in a row
//   stride_cs  stride with st.global.cs
//   memset     cudaMemsetAsync (zeros)
// Standalone (no torch).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "bench_util.h"

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ void st16(void* p, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
__device__ __forceinline__ void st16_cs(void* p, uint4 v) {
  asm volatile("st.global.cs.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

__global__ void __launch_bounds__(kThreads) lib_grid(uint4* out, int64_t n16) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (2 * g + 1 >= n16 + 1) return;
  const uint32_t v = static_cast<uint32_t>(g) | 1u;
  st16(out + 2 * g, make_uint4(v, v, v, v));
  if (2 * g + 1 < n16) st16(out + 2 * g + 1, make_uint4(v, 3u, v, 5u));
}

template <bool kCs>
__global__ void __launch_bounds__(kThreads) lane_grid(uint4* out, int64_t n16) {
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads * 2;
  const uint32_t v = static_cast<uint32_t>(base) | 1u;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t k = base + i * kThreads + threadIdx.x;
    if (k < n16) {
      if (kCs) st16_cs(out + k, make_uint4(v, 3u, v, 5u));
      else st16(out + k, make_uint4(v, 3u, v, 5u));
    }
  }
}

template <bool kCs>
__global__ void __launch_bounds__(kThreads) stride(uint4* out, int64_t n16) {
  const int64_t s = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; k < n16; k += 4 * s) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t kk = k + i * s;
      if (kk < n16) {
        const uint32_t v = static_cast<uint32_t>(kk) | 1u;
        if (kCs) st16_cs(out + kk, make_uint4(v, 3u, v, 5u));
        else st16(out + kk, make_uint4(v, 3u, v, 5u));
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  bench::print_device();
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  const double copy = bench::copy_gbps(st);
  std::printf("D2D copy: %.0f GB/s\n", copy);
  // the unit outputs of decode_bench's three problems (2 bytes an element)
  const int64_t sizes[] = {2ll * 4096 * 4096 * 2, (4096ll * 4096 + 14336ll * 4096) * 2, (8192ll * 6144 + 2048ll * 6144) * 2};
  const char* names[] = {"lib_grid", "lane_grid", "lane_cs", "stride", "stride_cs", "memset"};
  FILE* js = argc > 1 ? std::fopen(argv[1], "w") : nullptr;
  if (js) std::fprintf(js, "{\"copy_gbps\": %.1f, \"rows\": [", copy);
  std::printf("%12s", "MB written");
  for (const char* n : names) std::printf(" %10s", n);
  std::printf("   (us; GB/s below)\n");
  for (int si = 0; si < 3; ++si) {
    const int64_t bytes = sizes[si], n16 = bytes / 16;
    uint4* bufs[3];
    for (auto& b : bufs) CK(cudaMalloc(&b, bytes));  // rotated: beyond the L2
    float t[6];
    for (int v = 0; v < 6; ++v) {
      t[v] = bench::median_ms([&](int i) {
        uint4* o = bufs[i % 3];
        const int64_t per_cta = 2 * kThreads;
        const unsigned one_shot = static_cast<unsigned>((n16 + per_cta - 1) / per_cta);
        const unsigned persistent = static_cast<unsigned>(sms * 8);
        switch (v) {
          case 0: lib_grid<<<one_shot, kThreads, 0, st>>>(o, n16); break;
          case 1: lane_grid<false><<<one_shot, kThreads, 0, st>>>(o, n16); break;
          case 2: lane_grid<true><<<one_shot, kThreads, 0, st>>>(o, n16); break;
          case 3: stride<false><<<persistent, kThreads, 0, st>>>(o, n16); break;
          case 4: stride<true><<<persistent, kThreads, 0, st>>>(o, n16); break;
          default: CK(cudaMemsetAsync(o, 0, bytes, st));
        }
      }, 60, st);
      CK(cudaGetLastError());
    }
    std::printf("%12.1f", bytes / 1e6);
    for (float x : t) std::printf(" %10.1f", x * 1e3);
    std::printf("\n%12s", "");
    for (float x : t) std::printf(" %10.0f", bytes / (x * 1e-3) / 1e9);
    std::printf("\n");
    if (js) {
      std::fprintf(js, "%s{\"bytes\": %lld", si ? ", " : "", static_cast<long long>(bytes));
      for (int v = 0; v < 6; ++v) std::fprintf(js, ", \"%s_us\": %.2f", names[v], t[v] * 1e3);
      std::fprintf(js, "}");
    }
    for (auto& b : bufs) CK(cudaFree(b));
  }
  if (js) {
    std::fprintf(js, "]}\n");
    std::fclose(js);
  }
  return 0;
}
