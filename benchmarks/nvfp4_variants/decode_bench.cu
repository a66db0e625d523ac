// The emulated NVFP4 GEMM's unit decode (issue 13): the library kernel (fp_recipes/csrc/nvfp4_gemm_operands.cu,
// included verbatim: `lib`, one whole 16-element block a lane, stored as two 16-byte stores 32 bytes apart, so each
// warp store half-fills 32 sectors) against bench-only forms in which a warp's lanes split each block, so that every
// warp store writes 512 contiguous bytes. Byte-checked against lib, then timed against a device-to-device copy in
// the same run:
//   split   lane l takes half (l & 1) of blocks w + l / 2 and w + 16 + l / 2 (the same grid and values a lane)
//   split2  the same over two consecutive warp steps (64 blocks a warp, half the CTAs, four loads in flight a lane)
// lib takes ~95 us per Linear 4096^3 step on an H100 and an H200 alike (RESULTS.md session 33, run 5), which a
// bandwidth-bound kernel would not: the half-filled sectors are the suspect. If split wins, it replaces the
// library's kernel body. Standalone (no torch). Build and run: `bash scripts/gpu_nvfp4_step_kernels.sh`.
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

// 8 unit values of half a block (codes: 4 bytes, low nibble first; sf_code: the block's E4M3 scale) to
// out[0..7]: one 16-byte store. Inline PTX: NVVM split the plain vector assignment of a conditional store into
// four 4-byte stores.
__device__ __forceinline__ void store_half_block(uint32_t codes, uint32_t sf_code, uint16_t* out) {
  uint32_t w[4];
  unit8_words(codes, nvfp4_e4m3_decode(sf_code), (sf_code & 0x7Fu) == 0x7Fu, w);
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(out), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3])
               : "memory");
}

// kSteps consecutive warp steps of 32 blocks a warp (kThreads * kSteps blocks a CTA); in step i, lane l takes half
// (l & 1) of blocks w_i + l / 2 and w_i + 16 + l / 2. All loads first, then the stores.
template <int kSteps>
__global__ void __launch_bounds__(kThreads) decode_split(Job j) {
  const int lane = static_cast<int>(threadIdx.x & 31u), half = lane & 1;
  const int64_t w = (static_cast<int64_t>(blockIdx.x) * kThreads + (threadIdx.x & ~31u)) * kSteps;
  const uint32_t* codes = reinterpret_cast<const uint32_t*>(j.data);
  uint32_t c[2 * kSteps], s[2 * kSteps];
  int64_t b[2 * kSteps];
#pragma unroll
  for (int i = 0; i < 2 * kSteps; ++i) {
    b[i] = w + 16 * i + (lane >> 1);
    const bool in = b[i] < j.blocks;
    c[i] = in ? __ldg(codes + 2 * b[i] + half) : 0u;
    s[i] = in ? __ldg(j.scale + b[i]) : 0u;
  }
#pragma unroll
  for (int i = 0; i < 2 * kSteps; ++i) {
    if (b[i] < j.blocks) store_half_block(c[i], s[i], j.out + b[i] * 16 + half * 8);
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

enum Variant { kLib = 0, kSplit = 1, kSplit2 = 2 };
const char* kNames[] = {"lib", "split", "split2"};

void run(Variant v, const Buffers& b, cudaStream_t st) {
  if (v == kLib) {
    UnitDecodeJob jobs[kMaxUnitJobs];
    for (size_t i = 0; i < b.jobs.size(); ++i) jobs[i] = {b.jobs[i].data, b.jobs[i].scale, b.jobs[i].out, b.jobs[i].blocks};
    decode_unit_bf16(jobs, static_cast<int>(b.jobs.size()), GemmAlphaArgs{}, st);
    return;
  }
  for (const Job& j : b.jobs) {
    if (j.blocks == 0) continue;
    const int64_t per = v == kSplit ? kThreads : 2 * kThreads;
    const unsigned grid = static_cast<unsigned>((j.blocks + per - 1) / per);
    if (v == kSplit) decode_split<1><<<grid, kThreads, 0, st>>>(j);
    else decode_split<2><<<grid, kThreads, 0, st>>>(j);
  }
  CK(cudaGetLastError());
}

// every variant's output bytes against lib's (poisoned first, so an unwritten value shows)
bool check(const Problem& p, bool specials, std::string* why) {
  Buffers b = make(p, specials);
  std::vector<std::vector<uint8_t>> ref;
  bool ok = true;
  for (int v : {kLib, kSplit, kSplit2}) {
    for (const Job& j : b.jobs) CK(cudaMemset(j.out, 0xA5, j.blocks * 32 + 16));
    run(static_cast<Variant>(v), b, 0);
    CK(cudaDeviceSynchronize());
    for (size_t i = 0; i < b.jobs.size(); ++i) {
      std::vector<uint8_t> h(b.jobs[i].blocks * 32 + 16);
      CK(cudaMemcpy(h.data(), b.jobs[i].out, h.size(), cudaMemcpyDeviceToHost));
      if (v == kLib) {
        ref.push_back(h);
      } else if (h != ref[i]) {
        ok = false;
        *why += std::string(kNames[v]) + " differs from lib on " + p.name + (specials ? " (specials)" : "") + "; ";
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
  std::printf("%-26s %10s %10s %10s %8s %8s\n", "problem", "lib us", "split us", "split2 us", "lib %cp", "split %cp");
  bool first = true;
  for (const Problem& p : timed) {
    std::vector<Buffers> sets;
    int64_t bytes = 0;
    for (int i = 0; i < 3; ++i) {  // rotated so that a call reads and writes beyond the L2
      sets.push_back(make(p, false));
      bytes = sets.back().bytes;
    }
    float t[3];
    for (int v : {kLib, kSplit, kSplit2}) t[v] = time_ms(static_cast<Variant>(v), sets, 60, st);
    auto pct = [&](float ms) { return 100.0 * bytes / (ms * 1e-3) / 1e9 / copy; };
    std::printf("%-26s %10.1f %10.1f %10.1f %7.1f%% %7.1f%%\n", p.name.c_str(), t[kLib] * 1e3, t[kSplit] * 1e3,
                t[kSplit2] * 1e3, pct(t[kLib]), pct(t[kSplit]));
    if (js) {
      std::fprintf(js, "%s{\"problem\": \"%s\", \"bytes\": %lld, \"lib_us\": %.2f, \"split_us\": %.2f, \"split2_us\": %.2f}",
                   first ? "" : ", ", p.name.c_str(), static_cast<long long>(bytes), t[kLib] * 1e3, t[kSplit] * 1e3,
                   t[kSplit2] * 1e3);
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
