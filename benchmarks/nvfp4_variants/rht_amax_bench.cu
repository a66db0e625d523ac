// The post-RHT amax of the emulated NVFP4 step (issue 13: x's and dy's columnwise copies take the Hadamard
// transform, and their global amax is a pass of its own): fp_recipes/csrc/nvfp4_amax.cu included verbatim, its
// rht_amax_kernel run with 8, 4 (the library's choice since session 34: 2-5 % faster than 8 on an H200) and 2
// adjacent columns a thread. 8 columns hold 128 floats a thread (128 registers, 2 blocks a multiprocessor); fewer
// columns trade load width for occupancy. Every form must
// give the same two amaxes bit for bit (checked on odd shapes, NaN, Inf, zeros, huge values); then each is timed
// on the model's shapes against the read bandwidth of a device-to-device copy in the same run.
// Standalone (no torch). Build and run: `bash scripts/gpu_nvfp4_step_kernels.sh` (log and JSON in $OUT).
#include "nvfp4_amax.cu"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "bench_util.h"

using namespace fp_recipes::nvfp4;

namespace {

struct Shape {
  int64_t M, N;
};

// Both amaxes {plain, post-RHT} of x with kVec columns a thread (outputs zeroed first: no workspace).
template <int kVec>
void launch(const __nv_bfloat16* x, int64_t M, int64_t N, uint32_t* out, cudaStream_t st) {
  rht_amax_kernel<kVec><<<grid_for((M / 16) * ((N + kVec - 1) / kVec)), kThreads, 0, st>>>(x, M, N, out + 1, out,
                                                                                           nullptr);
}

void run(int vec, const __nv_bfloat16* x, int64_t M, int64_t N, uint32_t* out, cudaStream_t st) {
  CK(cudaMemsetAsync(out, 0, 2 * sizeof(uint32_t), st));
  switch (vec) {
    case 8: launch<8>(x, M, N, out, st); break;
    case 4: launch<4>(x, M, N, out, st); break;
    case 2: launch<2>(x, M, N, out, st); break;
    default: launch<1>(x, M, N, out, st); break;
  }
  CK(cudaGetLastError());
}

uint16_t bf16_bits(float f) {  // round to nearest even (finite inputs here)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

std::vector<uint16_t> make_input(const Shape& s, int kind) {
  std::vector<uint16_t> h(s.M * s.N);
  for (auto& v : h) {
    const float r = (static_cast<float>(bench::next_u32() % 2000001u) - 1000000.0f) * 1e-6f;  // [-1, 1]
    v = bf16_bits(r * 3.0f);
  }
  if (kind >= 1 && !h.empty()) {  // specials at random places: zeros, huge finite, the largest BF16
    for (int i = 0; i < 64; ++i) h[bench::next_u32() % h.size()] = 0x0000u;
    h[bench::next_u32() % h.size()] = 0x7F7Fu;  // 3.39e38
    h[bench::next_u32() % h.size()] = 0xFF70u;  // -3.19e38
  }
  if (kind == 2 && !h.empty()) h[bench::next_u32() % h.size()] = 0x7FC0u;  // NaN
  if (kind == 3 && !h.empty()) h[bench::next_u32() % h.size()] = 0xFF80u;  // -Inf
  return h;
}

}  // namespace

int main(int argc, char** argv) {
  const char* json = argc > 1 ? argv[1] : nullptr;
  bench::print_device();
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  uint32_t* out;
  CK(cudaMalloc(&out, 8 * sizeof(uint32_t)));

  // Bit checks: every form against kVec = 8 (N a multiple of 8: the library's vector path; the others also run
  // where N % 8 != 0 for 4 and 2 when N allows).
  const std::vector<Shape> checks = {{16, 8}, {16, 16}, {32, 24}, {48, 40}, {16, 4104}, {1040, 72}, {4096, 4096}};
  int n_checks = 0, n_bad = 0;
  for (const Shape& s : checks) {
    for (int kind = 0; kind < 4; ++kind) {
      std::vector<uint16_t> h = make_input(s, kind);
      __nv_bfloat16* x;
      CK(cudaMalloc(&x, h.size() * 2 + 16));
      CK(cudaMemcpy(x, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
      uint32_t ref[2], got[2];
      run(8, x, s.M, s.N, out, st);
      CK(cudaMemcpy(ref, out, 8, cudaMemcpyDeviceToHost));
      for (int vec : {4, 2, 1}) {
        run(vec, x, s.M, s.N, out, st);
        CK(cudaMemcpy(got, out, 8, cudaMemcpyDeviceToHost));
        ++n_checks;
        if (got[0] != ref[0] || got[1] != ref[1]) {
          ++n_bad;
          std::printf("MISMATCH %lldx%lld kind %d vec %d: plain %08x vs %08x, rht %08x vs %08x\n",
                      static_cast<long long>(s.M), static_cast<long long>(s.N), kind, vec, got[0], ref[0], got[1],
                      ref[1]);
        }
      }
      CK(cudaFree(x));
    }
  }
  std::printf("bit checks: %d (form, shape, input) cases against 8 columns a thread, %d mismatching\n", n_checks, n_bad);

  const double copy = bench::copy_gbps(st);
  std::printf("D2D copy: %.0f GB/s (read + write)\n", copy);
  // x and dy of the model benchmark's Linear layers, and issue 13's quantization shape
  const std::vector<Shape> timed = {{4096, 4096}, {4096, 14336}, {8192, 6144}, {16384, 6144}};
  FILE* js = json ? std::fopen(json, "w") : nullptr;
  if (js) std::fprintf(js, "{\"copy_gbps\": %.1f, \"bit_mismatches\": %d, \"rows\": [", copy, n_bad);
  std::printf("%-14s %9s %9s %9s %9s %11s\n", "M x N", "8 us", "4 us", "2 us", "1 us", "8: % copy");
  bool first = true;
  for (const Shape& s : timed) {
    const int64_t bytes = s.M * s.N * 2;
    const int sets = static_cast<int>(std::max<int64_t>(2, (3 * (int64_t(64) << 20)) / bytes + 1));
    std::vector<__nv_bfloat16*> xs(sets);
    std::vector<uint16_t> h = make_input(s, 0);
    for (auto& x : xs) {
      CK(cudaMalloc(&x, bytes));
      CK(cudaMemcpy(x, h.data(), bytes, cudaMemcpyHostToDevice));
    }
    float t[4];
    const int vecs[4] = {8, 4, 2, 1};
    for (int i = 0; i < 4; ++i)
      t[i] = bench::median_ms([&](int k) { run(vecs[i], xs[k % sets], s.M, s.N, out, st); }, 40, st);
    // a read-only pass against the copy's bandwidth (which counts read + written bytes)
    const double pct = 100.0 * bytes / (t[0] * 1e-3) / 1e9 / copy;
    std::printf("%6lldx%-7lld %9.1f %9.1f %9.1f %9.1f %10.1f%%\n", static_cast<long long>(s.M),
                static_cast<long long>(s.N), t[0] * 1e3, t[1] * 1e3, t[2] * 1e3, t[3] * 1e3, pct);
    if (js) {
      std::fprintf(js, "%s{\"M\": %lld, \"N\": %lld, \"us\": {\"8\": %.2f, \"4\": %.2f, \"2\": %.2f, \"1\": %.2f}}",
                   first ? "" : ", ", static_cast<long long>(s.M), static_cast<long long>(s.N), t[0] * 1e3,
                   t[1] * 1e3, t[2] * 1e3, t[3] * 1e3);
      first = false;
    }
    for (auto& x : xs) CK(cudaFree(x));
  }
  if (js) {
    std::fprintf(js, "]}\n");
    std::fclose(js);
  }
  return n_bad == 0 ? 0 : 2;
}
