// The emulated NVFP4 GEMM's unit decode (issue 13): the library kernel (fp_recipes/csrc/nvfp4_gemm_operands.cu,
// included verbatim: `lib`) against the kernel it replaced in session 34 (`prev`, kept here: one whole 16-element
// block a lane stored as two 16-byte stores 32 bytes apart, the unit values through e2m1_decode's int-to-float
// conversions and selects) and against floors measured in the same run:
//   traffic       lib's loads and stores with no decode (the stored words are the loaded ones)
//   traffic_prev  the same for prev's one-block-a-lane pattern
//   writes        cudaMemsetAsync of the unit outputs (the writes alone: 32 of every block's 41 bytes)
// What session 34 found with it (RESULTS.md): prev ran at the speed of its stores alone, whose pattern reaches
// ~1.7 TB/s on an H200 against 3.4-4.1 TB/s for lane-contiguous 16-byte stores (store_bench.cu); with lanes
// splitting the blocks the decode arithmetic showed (+20 %), and the conversion-free arithmetic took it to the
// traffic floor. lib and prev are byte-checked against each other on tails, one row, > 64 rows, empty operands,
// NaN / zero / negative scale codes. Standalone (no torch):
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -fmad=false -Ifp_recipes/csrc -gencode=arch=compute_90a,code=sm_90a \
//       benchmarks/nvfp4_variants/decode_bench.cu -o decode_bench && ./decode_bench [out.json]
#include "nvfp4_gemm_operands.cu"

#include <cstring>
#include <string>
#include <vector>

#include "bench_util.h"

namespace fp_recipes {
namespace nvfp4 {
namespace {

struct Job {
  const uint8_t* data;
  const uint8_t* scale;
  uint16_t* out;
  int64_t blocks;
};

// prev's unit value: e2m1_decode(nibble) * sf (the same bits as unit_f32_bits' top half: test_nvfp4_unit_arith.py)
__device__ __forceinline__ uint32_t prev_unit_bits(uint32_t nibble, float sf, bool sf_nan) {
  const float v = __fmul_rn(e2m1_decode(nibble), sf);
  return sf_nan ? kUnitBf16NaN : (__float_as_uint(v) >> 16);
}

__global__ void __launch_bounds__(kThreads) decode_prev(Job j) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (g >= j.blocks) return;
  const uint2 q = __ldg(reinterpret_cast<const uint2*>(j.data) + g);
  const uint32_t sf_code = __ldg(j.scale + g);
  const float sf = nvfp4_e4m3_decode(sf_code);
  const bool sf_nan = (sf_code & 0x7Fu) == 0x7Fu;
  uint32_t w[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t byte = ((i < 4 ? q.x : q.y) >> (8 * (i & 3))) & 0xFFu;
    w[i] = prev_unit_bits(byte & 0xFu, sf, sf_nan) | (prev_unit_bits(byte >> 4, sf, sf_nan) << 16);
  }
  uint4* out = reinterpret_cast<uint4*>(j.out + g * 16);
  out[0] = make_uint4(w[0], w[1], w[2], w[3]);
  out[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

// prev's loads and stores, no decode.
__global__ void __launch_bounds__(kThreads) traffic_prev(Job j) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (g >= j.blocks) return;
  const uint2 q = __ldg(reinterpret_cast<const uint2*>(j.data) + g);
  const uint32_t sf = __ldg(j.scale + g);
  uint4* out = reinterpret_cast<uint4*>(j.out + g * 16);
  out[0] = make_uint4(q.x, q.y, sf, q.x ^ sf);
  out[1] = make_uint4(q.y, q.x, sf, q.y ^ sf);
}

// lib's loads and stores (lane l: half l & 1 of blocks w + l / 2 and w + 16 + l / 2), no decode.
__global__ void __launch_bounds__(kThreads) traffic_lib(Job j) {
  const int lane = static_cast<int>(threadIdx.x & 31u), half = lane & 1;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kThreads + (threadIdx.x & ~31u);
  const uint32_t* codes = reinterpret_cast<const uint32_t*>(j.data);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t b = w + 16 * i + (lane >> 1);
    if (b >= j.blocks) continue;
    const uint32_t c = __ldg(codes + 2 * b + half), sf = __ldg(j.scale + b);
    uint16_t* o = j.out + b * 16 + half * 8;
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(o), "r"(c), "r"(sf), "r"(c ^ sf), "r"(c + 1u)
                 : "memory");
  }
}

}  // namespace
}  // namespace nvfp4
}  // namespace fp_recipes

using namespace fp_recipes::nvfp4;

namespace {

// One problem: up to two jobs (a GEMM's two operands), rows x K each.
struct Problem {
  std::string name;
  std::vector<std::pair<int64_t, int64_t>> ops;  // (rows, K)
};

struct Buffers {
  std::vector<Job> jobs;
  std::vector<void*> owned;
  int64_t bytes = 0;  // packed + scales read, units written
};

Buffers make(const Problem& p, bool specials) {
  Buffers b;
  for (auto [rows, k] : p.ops) {
    const int64_t blocks = rows * k / 16;
    std::vector<uint8_t> data(blocks * 8), scale(blocks);
    for (auto& v : data) v = static_cast<uint8_t>(bench::next_u32());
    for (int64_t i = 0; i < blocks; ++i) {
      // E4M3 scale codes over the whole range incl. zero and the two NaN codes when `specials`
      uint8_t c = static_cast<uint8_t>(bench::next_u32());
      if (!specials) c = static_cast<uint8_t>(0x20 + (c % 0x40));  // ordinary magnitudes
      scale[i] = c;
    }
    Job j{};
    uint8_t *d, *s;
    uint16_t* o;
    CK(cudaMalloc(&d, data.size() + 16));
    CK(cudaMalloc(&s, scale.size() + 16));
    CK(cudaMalloc(&o, blocks * 32 + 16));
    CK(cudaMemcpy(d, data.data(), data.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(s, scale.data(), scale.size(), cudaMemcpyHostToDevice));
    j.data = d;
    j.scale = s;
    j.out = o;
    j.blocks = blocks;
    b.jobs.push_back(j);
    b.owned.insert(b.owned.end(), {d, s, o});
    b.bytes += blocks * (8 + 1 + 32);
  }
  return b;
}

void release(Buffers& b) {
  for (void* p : b.owned) CK(cudaFree(p));
  b.owned.clear();
}

enum Variant { kLib = 0, kPrev = 1, kTraffic = 2, kTrafficPrev = 3, kWrites = 4 };
const char* kNames[] = {"lib", "prev", "traffic", "traffic_prev", "writes"};
constexpr int kVariants = 5;

void run(Variant v, const Buffers& b, cudaStream_t st) {
  if (v == kLib) {
    UnitDecodeJob jobs[kMaxUnitJobs];
    for (size_t i = 0; i < b.jobs.size(); ++i) jobs[i] = {b.jobs[i].data, b.jobs[i].scale, b.jobs[i].out, b.jobs[i].blocks};
    decode_unit_bf16(jobs, static_cast<int>(b.jobs.size()), GemmAlphaArgs{}, st);
    return;
  }
  for (const Job& j : b.jobs) {
    if (j.blocks == 0) continue;
    if (v == kWrites) {
      CK(cudaMemsetAsync(j.out, 0, j.blocks * 32, st));
      continue;
    }
    const unsigned grid = static_cast<unsigned>((j.blocks + kThreads - 1) / kThreads);
    if (v == kPrev) decode_prev<<<grid, kThreads, 0, st>>>(j);
    else if (v == kTraffic) traffic_lib<<<grid, kThreads, 0, st>>>(j);
    else traffic_prev<<<grid, kThreads, 0, st>>>(j);
  }
  CK(cudaGetLastError());
}

// lib's output bytes against prev's (each output poisoned first, so an unwritten value shows)
bool check(const Problem& p, bool specials, std::string* why) {
  Buffers b = make(p, specials);
  std::vector<std::vector<uint8_t>> ref;
  bool ok = true;
  for (int v : {kPrev, kLib}) {
    for (const Job& j : b.jobs) CK(cudaMemset(j.out, 0xA5, j.blocks * 32 + 16));
    run(static_cast<Variant>(v), b, 0);
    CK(cudaDeviceSynchronize());
    for (size_t i = 0; i < b.jobs.size(); ++i) {
      std::vector<uint8_t> h(b.jobs[i].blocks * 32 + 16);
      CK(cudaMemcpy(h.data(), b.jobs[i].out, h.size(), cudaMemcpyDeviceToHost));
      if (v == kPrev) {
        ref.push_back(h);
      } else if (h != ref[i]) {
        ok = false;
        *why += "lib differs from prev on " + p.name + (specials ? " (specials)" : "") + "; ";
      }
    }
  }
  release(b);
  return ok;
}

float time_ms(Variant v, const std::vector<Buffers>& sets, int iters, cudaStream_t st) {
  return bench::median_ms([&](int i) { run(v, sets[i % sets.size()], st); }, iters, st);
}

}  // namespace

int main(int argc, char** argv) {
  const char* json = argc > 1 ? argv[1] : nullptr;
  bench::print_device();
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  // byte checks: tails (blocks not a multiple of 32 or 16), one row, more than 64 rows, empty operands, two jobs
  const std::vector<Problem> checks = {
      {"1x16", {{1, 16}}},           {"1x32", {{1, 32}}},           {"3x48", {{3, 48}}},
      {"7x272", {{7, 272}}},          {"65x160", {{65, 160}}},       {"130x528 + 17x96", {{130, 528}, {17, 96}}},
      {"0x64 + 5x64", {{0, 64}, {5, 64}}}, {"512x4112", {{512, 4112}}}, {"4096x4096 x2", {{4096, 4096}, {4096, 4096}}}};
  std::string why;
  int n_checks = 0, n_bad = 0;
  for (const Problem& p : checks) {
    for (bool sp : {false, true}) {
      ++n_checks;
      if (!check(p, sp, &why)) ++n_bad;
    }
  }
  std::printf("byte checks: %d problems x 2 inputs, %d mismatching %s\n", n_checks / 2, n_bad, why.c_str());

  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  const double copy = bench::copy_gbps(st);
  std::printf("D2D copy: %.0f GB/s\n", copy);
  // what an NVFP4 Linear step decodes (each GEMM's two operands in one launch): 4096^3, and the model stack's
  // h4096 FC1 (4096 tokens x 4096 -> 14336) forward and h2048 QKV dgrad (8192 tokens, 2048 -> 6144)
  const std::vector<Problem> timed = {{"4096x4096 + 4096x4096", {{4096, 4096}, {4096, 4096}}},
                                      {"4096x4096 + 14336x4096", {{4096, 4096}, {14336, 4096}}},
                                      {"8192x6144 + 2048x6144", {{8192, 6144}, {2048, 6144}}}};
  FILE* js = json ? std::fopen(json, "w") : nullptr;
  if (js) std::fprintf(js, "{\"device\": \"%s\", \"copy_gbps\": %.1f, \"byte_mismatches\": %d, \"rows\": [", prop.name, copy, n_bad);
  std::printf("%-24s", "problem (us)");
  for (int v = 0; v < kVariants; ++v) std::printf(" %12s", kNames[v]);
  std::printf(" %9s %9s\n", "lib %cp", "prev %cp");
  bool first = true;
  for (const Problem& p : timed) {
    std::vector<Buffers> sets;
    int64_t bytes = 0;
    for (int i = 0; i < 3; ++i) {  // rotated so that a call reads and writes beyond the L2
      sets.push_back(make(p, false));
      bytes = sets.back().bytes;
    }
    float t[kVariants];
    for (int v = 0; v < kVariants; ++v) t[v] = time_ms(static_cast<Variant>(v), sets, 60, st);
    auto pct = [&](float ms) { return 100.0 * bytes / (ms * 1e-3) / 1e9 / copy; };
    std::printf("%-24s", p.name.c_str());
    for (int v = 0; v < kVariants; ++v) std::printf(" %12.1f", t[v] * 1e3);
    std::printf(" %8.1f%% %8.1f%%\n", pct(t[kLib]), pct(t[kPrev]));
    if (js) {
      std::fprintf(js, "%s{\"problem\": \"%s\", \"bytes\": %lld", first ? "" : ", ", p.name.c_str(),
                   static_cast<long long>(bytes));
      for (int v = 0; v < kVariants; ++v) std::fprintf(js, ", \"%s_us\": %.2f", kNames[v], t[v] * 1e3);
      std::fprintf(js, "}");
      first = false;
    }
    for (auto& s : sets) release(s);
  }
  if (js) {
    std::fprintf(js, "]}\n");
    std::fclose(js);
  }
  return n_bad == 0 ? 0 : 2;
}
