// Store-only patterns at the unit decode's output sizes (issue 13): which way of writing BF16 unit operands reaches
// the write bandwidth cudaMemsetAsync shows (decode_bench.cu, session 34: the library's decode runs at the speed of
// its stores alone, which take ~1.7x memset's time). Each kernel writes `bytes` of non-zero data:
//   lib_grid   one lane per 32 bytes (two 16-byte stores 32 bytes apart), one CTA per 8 KB: the library's pattern
//   lane_grid  one CTA per 8 KB, a warp's 16-byte stores contiguous (512 bytes an instruction)
//   lane_cs    lane_grid with st.global.cs (streaming: evict first)
//   stride     a persistent grid (8 CTAs an SM), lane-contiguous 16-byte stores, grid-stride, 4 stores in a row
//   stride_cs  stride with st.global.cs
//   memset     cudaMemsetAsync (zeros)
// Then tile2_kernel's four output stores alone (tile2_stores) against the same bytes written lane-contiguously.
// Standalone (no torch): nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a store_bench.cu -o store_bench
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

// tile2_kernel's output stores (BF16 input: 128 x 64 tiles, one CTA a tile, 256 threads), values not computed: the
// rowwise codes (4 lanes write a row's 32 bytes, 8 rows a warp store), their scale bytes (4 a row: 4-byte runs), the
// columnwise codes (8 lanes write a column's 64 bytes, 4 columns a warp store) and their scale bytes (8 a column).
// kMask picks them (1 row codes, 2 row scales, 4 col codes, 8 col scales; 16: the row scales as one 4-byte store a
// row, 32: the column scales as one 8-byte store a column, as a kernel staging them in shared memory would write
// them: fewer store instructions, the same sectors). Against the same bytes written
// lane-contiguously: is the tile kernels' store pattern (not their loads or arithmetic) what keeps them at ~40-60 %
// of copy bandwidth, and are the scale bytes' short runs (partial sectors) the expensive part?
template <int kMask>
__global__ void __launch_bounds__(kThreads) tile2_stores(uint8_t* data, uint8_t* scale, uint8_t* data_t,
                                                         uint8_t* scale_t, int64_t M, int64_t N) {
  const int tid = threadIdx.x;
  const int64_t gx = N / 64, ty = blockIdx.x / gx, tx = blockIdx.x % gx, r0 = ty * 128, c0 = tx * 64;
  const uint32_t v = static_cast<uint32_t>(blockIdx.x) | 1u;
  const int cb = tid % 4;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t row = r0 + tid / 4 + 64 * i, b = row * (N / 16) + c0 / 16 + cb;
    if (kMask & 1) reinterpret_cast<uint2*>(data)[b] = make_uint2(v, static_cast<uint32_t>(b));
    if (kMask & 2) scale[b] = static_cast<uint8_t>(v);
  }
  if ((kMask & 16) && tid < 128) {  // one lane a row: the row's 4 scale bytes of this tile
    const int64_t row = r0 + tid;
    reinterpret_cast<uint32_t*>(scale + row * (N / 16) + c0 / 16)[0] = v;
  }
  if ((kMask & 32) && tid < 64) {  // one lane a column: the column's 8 scale bytes of this tile
    const int64_t col = c0 + tid;
    reinterpret_cast<uint2*>(scale_t + col * (M / 16) + r0 / 16)[0] = make_uint2(v, static_cast<uint32_t>(col));
  }
  const int crb = tid % 8, cu = tid / 8;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int64_t col = c0 + cu * 2 + j, row16 = r0 + crb * 16;
    if (kMask & 4)
      reinterpret_cast<uint2*>(data_t + col * (M / 2) + row16 / 2)[0] = make_uint2(v, static_cast<uint32_t>(col));
    if (kMask & 8) scale_t[col * (M / 16) + row16 / 16] = static_cast<uint8_t>(v);
  }
}

}  // namespace

int tile_patterns(FILE* js, cudaStream_t st) {
  // NVFP4's reference shape (issue 13): 16384 x 6144 BF16; rowwise and columnwise copies 1/2 byte an element of
  // codes plus 1/16 of scales each
  const int64_t M = 16384, N = 6144, codes = M * N / 2, scales = M * N / 16;
  uint8_t *d, *s, *dt, *stt;
  CK(cudaMalloc(&d, codes));
  CK(cudaMalloc(&s, scales));
  CK(cudaMalloc(&dt, codes));
  CK(cudaMalloc(&stt, scales));
  const unsigned tiles = static_cast<unsigned>((M / 128) * (N / 64));
  constexpr int kRows = 11;
  const char* names[kRows] = {"row codes", "row scales", "row both", "col codes", "col scales", "col both",
                              "all four", "all, contiguous", "row scales, 4 B a lane", "col scales, 8 B a lane",
                              "all four, scales packed"};
  const double cs = double(codes + scales);
  const double bytes[kRows] = {double(codes), double(scales), cs, double(codes), double(scales), cs, 2 * cs, 2 * cs,
                               double(scales), double(scales), 2 * cs};
  float t[kRows];
  const int64_t per_cta = 2 * kThreads;
  auto contiguous = [&](uint8_t* p, int64_t nbytes) {
    lane_grid<false><<<static_cast<unsigned>((nbytes / 16 + per_cta - 1) / per_cta), kThreads, 0, st>>>(
        reinterpret_cast<uint4*>(p), nbytes / 16);
  };
  for (int v = 0; v < kRows; ++v) {
    t[v] = bench::median_ms([&](int) {
      switch (v) {
        case 0: tile2_stores<1><<<tiles, kThreads, 0, st>>>(d, s, dt, stt, M, N); break;
        case 1: tile2_stores<2><<<tiles, kThreads, 0, st>>>(d, s, dt, stt, M, N); break;
        case 2: tile2_stores<3><<<tiles, kThreads, 0, st>>>(d, s, dt, stt, M, N); break;
        case 3: tile2_stores<4><<<tiles, kThreads, 0, st>>>(d, s, dt, stt, M, N); break;
        case 4: tile2_stores<8><<<tiles, kThreads, 0, st>>>(d, s, dt, stt, M, N); break;
        case 5: tile2_stores<12><<<tiles, kThreads, 0, st>>>(d, s, dt, stt, M, N); break;
        case 6: tile2_stores<15><<<tiles, kThreads, 0, st>>>(d, s, dt, stt, M, N); break;
        case 8: tile2_stores<16><<<tiles, kThreads, 0, st>>>(d, s, dt, stt, M, N); break;
        case 9: tile2_stores<32><<<tiles, kThreads, 0, st>>>(d, s, dt, stt, M, N); break;
        case 10: tile2_stores<1 | 4 | 16 | 32><<<tiles, kThreads, 0, st>>>(d, s, dt, stt, M, N); break;
        default:
          contiguous(d, codes);
          contiguous(dt, codes);
          contiguous(s, scales);
          contiguous(stt, scales);
      }
    }, 60, st);
    CK(cudaGetLastError());
  }
  std::printf("\ntile2 output stores alone, 16384 x 6144 BF16:  %10s %8s\n", "us", "GB/s");
  for (int v = 0; v < kRows; ++v)
    std::printf("  %-44s %10.1f %8.0f\n", names[v], t[v] * 1e3, bytes[v] / (t[v] * 1e-3) / 1e9);
  if (js) {
    std::fprintf(js, ", \"tile2_stores_16384x6144\": {");
    for (int v = 0; v < kRows; ++v) std::fprintf(js, "%s\"%s_us\": %.2f", v ? ", " : "", names[v], t[v] * 1e3);
    std::fprintf(js, "}");
  }
  for (uint8_t* p : {d, s, dt, stt}) CK(cudaFree(p));
  return 0;
}

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
  if (js) std::fprintf(js, "]");
  tile_patterns(js, st);
  if (js) {
    std::fprintf(js, "}\n");
    std::fclose(js);
  }
  return 0;
}
