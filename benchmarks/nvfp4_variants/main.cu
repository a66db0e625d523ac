// NVFP4 rowwise quantize variant benchmark (issue 6), standalone (no torch): the real kernel ("base",
// fp_recipes/csrc/nvfp4_quantize.cu) and templated bench-only variants (variants.cuh, parts.cu) in all
// five modes (plain, 4over6 fast/strict x MAE/MSE), BF16, on (16384, 6144) and (16384, 8192) randn
// inputs (3 rotating buffers, so L2 does not help), CUDA-event timing (median of --reps after warm-up),
// a D2D copy baseline, and a byte check of every variant's data + scales against base on the randn
// input and on a specials input (zeros, -0, huge, Inf, NaN of both signs, denormals, clamped scales)
// under several amax / E settings, per-tensor and row-scaled, at two grid sizes.
// Usage: nvfp4_variants [out.json] [--reps N] [--only SUBSTR]   (scripts/gpu_nvfp4_variants.sh)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "variants.cuh"

namespace fp_recipes {
namespace nvfp4 {
namespace vv {
void register_part1(std::vector<Entry>&);
void register_part2(std::vector<Entry>&);
void register_part3(std::vector<Entry>&);
void register_part4(std::vector<Entry>&);
void register_part5(std::vector<Entry>&);
}  // namespace vv
}  // namespace nvfp4
}  // namespace fp_recipes

using fp_recipes::nvfp4::vv::Entry;
using fp_recipes::nvfp4::vv::VParams;

#include "bench_util.h"  // CK

static const char* mode_name(int fos) {
  switch (fos) {
    case 0: return "plain";
    case 1: return "strict MAE";
    case 2: return "fast MAE";
    case 3: return "strict MSE";
    case 4: return "fast MSE";
  }
  return "?";
}

__device__ __forceinline__ uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

__global__ void gen_randn(__nv_bfloat16* out, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const uint32_t a = hash32(static_cast<uint32_t>(i) * 2u + seed * 0x9E3779B9u);
    const uint32_t b = hash32(a ^ static_cast<uint32_t>(i >> 31) ^ 0x5bd1e995u);
    const float u1 = (static_cast<float>(a >> 8) + 0.5f) * (1.0f / 16777216.0f);
    const float u2 = static_cast<float>(b >> 8) * (1.0f / 16777216.0f);
    out[i] = __float2bfloat16_rn(sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2));
  }
}

__global__ void amax_bf16(const __nv_bfloat16* x, int64_t n, unsigned* out) {
  float m = 0.0f;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    m = fmaxf(m, fabsf(__bfloat162float(x[i])));
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) atomicMax(out, __float_as_uint(m));
}

struct Out {
  uint8_t* data = nullptr;
  uint8_t* scale = nullptr;
  size_t nd = 0, ns = 0;
  void alloc(int64_t M, int64_t N) {
    nd = static_cast<size_t>(M * N / 2);
    ns = static_cast<size_t>(M * N / 16);
    CK(cudaMalloc(&data, nd));
    CK(cudaMalloc(&scale, ns));
  }
  void release() {
    cudaFree(data);
    cudaFree(scale);
  }
  void clear() {
    CK(cudaMemset(data, 0xA5, nd));
    CK(cudaMemset(scale, 0x5A, ns));
  }
  std::vector<uint8_t> host() const {
    std::vector<uint8_t> h(nd + ns);
    CK(cudaMemcpy(h.data(), data, nd, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h.data() + nd, scale, ns, cudaMemcpyDeviceToHost));
    return h;
  }
};

static unsigned grid_for(const Entry& e, int64_t M, int64_t N, int sms, int cap) {
  const int64_t total = M * (N / 16);
  const int64_t per = static_cast<int64_t>(e.per_thread) * 256;
  int64_t g = (total + per - 1) / per;
  if (cap > 0) g = std::min<int64_t>(g, static_cast<int64_t>(sms) * cap);
  return static_cast<unsigned>(std::max<int64_t>(g, 1));
}

static uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
static float bf16_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

int main(int argc, char** argv) {
  std::string json = "nvfp4_variants.json", only;
  int reps = 60;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
    else json = argv[i];
  }
  std::vector<Entry> all, es;
  fp_recipes::nvfp4::vv::register_base(all);
  fp_recipes::nvfp4::vv::register_part1(all);
  fp_recipes::nvfp4::vv::register_part2(all);
  fp_recipes::nvfp4::vv::register_part3(all);
  fp_recipes::nvfp4::vv::register_part4(all);
  fp_recipes::nvfp4::vv::register_part5(all);
  for (auto& e : all)
    if (e.variant == "base" || only.empty() || e.variant.find(only) != std::string::npos) es.push_back(e);
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  std::printf("device: %s, %d SMs\n", prop.name, sms);

  struct Attr {
    int regs, local, occ, smem;
  };
  std::vector<Attr> attrs;
  std::printf("%-16s %-11s %4s %6s %6s %3s\n", "variant", "mode", "regs", "local", "smem", "occ");
  for (auto& e : es) {
    cudaFuncAttributes fa;
    CK(cudaFuncGetAttributes(&fa, e.func));
    int occ = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, e.func, 256, 0));
    attrs.push_back({fa.numRegs, static_cast<int>(fa.localSizeBytes), occ, static_cast<int>(fa.sharedSizeBytes)});
    std::printf("%-16s %-11s %4d %6d %6d %3d\n", e.variant.c_str(), mode_name(e.fos), fa.numRegs,
                static_cast<int>(fa.localSizeBytes), static_cast<int>(fa.sharedSizeBytes), occ);
  }
  auto base_of = [&](int fos) -> const Entry& {
    for (auto& e : es)
      if (e.variant == "base" && e.fos == fos) return e;
    std::fprintf(stderr, "no base\n");
    std::exit(2);
  };

  // ---- specials byte check ----
  std::vector<bool> sp_ok(es.size(), true);
  {
    const int64_t M = 96, N = 6144;
    std::vector<uint16_t> h(static_cast<size_t>(M * N));
    uint64_t st = 12345;
    auto urand = [&]() {
      st = st * 6364136223846793005ULL + 1442695040888963407ULL;
      return (static_cast<double>(st >> 11) + 0.5) / 9007199254740992.0;
    };
    for (int64_t r = 0; r < M; ++r) {
      const double sc = std::ldexp(1.0, static_cast<int>((r % 16) * 4) - 30);
      for (int64_t c = 0; c < N; ++c) {
        const double g = std::sqrt(-2.0 * std::log(urand())) * std::cos(6.283185307179586 * urand());
        h[r * N + c] = bf16_bits(static_cast<float>(g * sc));
      }
      uint16_t* row = &h[r * N];
      const int k = static_cast<int>(r % 12);
      for (int j = 0; j < 16; ++j) {
        row[16 * 0 + j] = 0x0000;                                   // zeros
        row[16 * 1 + j] = 0x8000;                                   // -0
        row[16 * 7 + j] = static_cast<uint16_t>(0x0001 + j);        // denormals
        row[16 * 8 + j] = bf16_bits(static_cast<float>(j) * 0.25f);  // grid points and midpoints
        row[16 * 9 + j] = bf16_bits(-static_cast<float>(j) * 0.375f);
      }
      row[16 * 2 + k] = 0x7F7F;   // huge (bf16 max)
      row[16 * 3 + k] = 0x7F80;   // +Inf
      row[16 * 4 + k] = 0xFF80;   // -Inf
      row[16 * 5 + k] = 0x7FC0;   // NaN
      row[16 * 6 + k] = 0xFFC0;   // negative NaN
      row[16 * 10 + k] = bf16_bits(static_cast<float>(sc * 40.0));  // block amax >> rest: clamped scales
    }
    // Finite maxima: global and per row.
    std::vector<float> rowmax(static_cast<size_t>(M), 0.0f);
    float gmax = 0.0f;
    for (int64_t r = 0; r < M; ++r)
      for (int64_t c = 0; c < N; ++c) {
        const float v = std::fabs(bf16_float(h[r * N + c]));
        if (std::isfinite(v)) rowmax[r] = std::max(rowmax[r], v);
      }
    for (float v : rowmax) gmax = std::max(gmax, v);
    __nv_bfloat16* dx;
    CK(cudaMalloc(&dx, h.size() * 2));
    CK(cudaMemcpy(dx, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    float* damax;
    CK(cudaMalloc(&damax, M * sizeof(float)));
    struct Cfg {
      const char* name;
      float amax, e;
      bool row;
    };
    const float inf = INFINITY, nan = NAN;
    const Cfg cfgs[] = {{"amax=max E=448", gmax, 448.0f, false}, {"amax=max E=256", gmax, 256.0f, false},
                        {"amax=1 E=448", 1.0f, 448.0f, false},   {"amax=0 E=448", 0.0f, 448.0f, false},
                        {"amax=1e-30 E=448", 1e-30f, 448.0f, false}, {"amax=3e38 E=448", 3e38f, 448.0f, false},
                        {"amax=inf E=448", inf, 448.0f, false},  {"amax=nan E=448", nan, 448.0f, false},
                        {"row E=448", 0.0f, 448.0f, true},       {"row E=256", 0.0f, 256.0f, true}};
    Out ob, ov;
    ob.alloc(M, N);
    ov.alloc(M, N);
    int nchecks = 0, nbad = 0;
    for (const Cfg& c : cfgs) {
      if (c.row) {
        CK(cudaMemcpy(damax, rowmax.data(), M * sizeof(float), cudaMemcpyHostToDevice));
      } else {
        CK(cudaMemcpy(damax, &c.amax, sizeof(float), cudaMemcpyHostToDevice));
      }
      VParams p{dx, M, N, nullptr, nullptr, damax, c.row ? 1 : 0, c.e, 0, 0, 0};
      for (int fos : {0, 1, 2, 3, 4}) {
        const Entry& b = base_of(fos);
        p.data = ob.data;
        p.scale = ob.scale;
        ob.clear();
        b.launch(p, grid_for(b, M, N, sms, 16), 0);
        CK(cudaGetLastError());
        const std::vector<uint8_t> ref = ob.host();
        for (size_t i = 0; i < es.size(); ++i) {
          const Entry& e = es[i];
          if (e.fos != fos) continue;
          for (unsigned grid : {grid_for(e, M, N, sms, 16), 7u}) {
            p.data = ov.data;
            p.scale = ov.scale;
            ov.clear();
            e.launch(p, grid, 0);
            CK(cudaGetLastError());
            const std::vector<uint8_t> got = ov.host();
            ++nchecks;
            if (got != ref) {
              ++nbad;
              sp_ok[i] = false;
              size_t k = 0;
              while (got[k] == ref[k]) ++k;
              std::printf("MISMATCH specials [%s] %s %s grid %u: first byte %zu (%s) got %02x want %02x\n", c.name,
                          e.variant.c_str(), mode_name(fos), grid, k, k < ob.nd ? "data" : "scale", got[k], ref[k]);
            }
          }
        }
      }
    }
    std::printf("specials: %d checks, %d mismatches\n", nchecks, nbad);
    ob.release();
    ov.release();
    cudaFree(dx);
    cudaFree(damax);
  }

  // ---- timing + randn byte check ----
  const int64_t shapes[2][2] = {{16384, 6144}, {16384, 8192}};
  const char* wide_caps_variants[] = {"base", "v4", "r2_all"};
  FILE* jf = std::fopen(json.c_str(), "w");
  std::fprintf(jf, "{\"device\": \"%s\", \"sms\": %d, \"reps\": %d, \"rows\": [\n", prop.name, sms, reps);
  bool first_row = true;
  cudaEvent_t ev[2][512];
  reps = std::min(reps, 500);
  for (int k = 0; k < 512; ++k) {
    CK(cudaEventCreate(&ev[0][k]));
    CK(cudaEventCreate(&ev[1][k]));
  }
  for (auto& sh : shapes) {
    const int64_t M = sh[0], N = sh[1], n = M * N;
    const int kBufs = 3;
    __nv_bfloat16* xb[kBufs];
    unsigned* amx;
    CK(cudaMalloc(&amx, kBufs * sizeof(unsigned)));
    CK(cudaMemset(amx, 0, kBufs * sizeof(unsigned)));
    for (int b = 0; b < kBufs; ++b) {
      CK(cudaMalloc(&xb[b], n * 2));
      gen_randn<<<sms * 8, 256>>>(xb[b], n, 1000u + b);
      amax_bf16<<<sms * 8, 256>>>(xb[b], n, amx + b);
    }
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    unsigned hamx[kBufs];
    CK(cudaMemcpy(hamx, amx, sizeof(hamx), cudaMemcpyDeviceToHost));
    const float* famx = reinterpret_cast<const float*>(amx);
    Out o, ref;
    o.alloc(M, N);
    ref.alloc(M, N);
    auto timeit = [&](auto&& launch) {
      const int warm = 5;
      for (int r = 0; r < warm + reps; ++r) {
        if (r >= warm) CK(cudaEventRecord(ev[0][r - warm]));
        launch(r % kBufs);
        if (r >= warm) CK(cudaEventRecord(ev[1][r - warm]));
      }
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      std::vector<float> t(reps);
      for (int r = 0; r < reps; ++r) CK(cudaEventElapsedTime(&t[r], ev[0][r], ev[1][r]));
      std::sort(t.begin(), t.end());
      return 1000.0 * t[reps / 2];
    };
    // D2D copy of x.
    __nv_bfloat16* cdst;
    CK(cudaMalloc(&cdst, n * 2));
    const double copy_us = timeit([&](int b) { CK(cudaMemcpyAsync(cdst, xb[b], n * 2, cudaMemcpyDeviceToDevice)); });
    CK(cudaFree(cdst));
    const double bytes = n * 2.0 + n / 2.0 + n / 16.0;
    std::printf("\n== %lld x %lld bf16: D2D copy %.1f us (%.0f GB/s r+w); quantize bytes at copy BW: %.1f us\n",
                (long long)M, (long long)N, copy_us, 4.0 * n / copy_us / 1e3, bytes / (4.0 * n / copy_us));
    std::printf("   amax of the 3 buffers: %g %g %g\n", (double)reinterpret_cast<float*>(hamx)[0],
                (double)reinterpret_cast<float*>(hamx)[1], (double)reinterpret_cast<float*>(hamx)[2]);
    std::printf("%-16s %-11s %4s %6s %4s %3s %9s %8s %8s %5s\n", "variant", "mode", "cap", "grid", "regs", "occ", "us",
                "xplainB", "xmodeB", "equal");
    double base_us[5] = {0, 0, 0, 0, 0};
    std::vector<std::vector<uint8_t>> refs(5);
    // Base first (reference bytes and reference times).
    std::vector<size_t> order;
    for (size_t i = 0; i < es.size(); ++i)
      if (es[i].variant == "base") order.push_back(i);
    for (size_t i = 0; i < es.size(); ++i)
      if (es[i].variant != "base") order.push_back(i);
    for (size_t i : order) {
      const Entry& e = es[i];
      VParams p{nullptr, M, N, o.data, o.scale, nullptr, 0, 448.0f, 0, 0, 0};
      // Byte check on buffer 0 at cap 16.
      p.x = xb[0];
      p.amax = famx + 0;
      o.clear();
      e.launch(p, grid_for(e, M, N, sms, 16), 0);
      CK(cudaGetLastError());
      std::vector<uint8_t> got = o.host();
      bool eq = true;
      if (e.variant == "base") {
        refs[e.fos] = std::move(got);
      } else {
        eq = got == refs[e.fos];
      }
      eq = eq && sp_ok[i];
      std::vector<int> caps = {16};
      for (const char* w : wide_caps_variants)
        if (e.variant == w) caps = {16, 8, 32, 64};
      for (int cap : caps) {
        const unsigned grid = grid_for(e, M, N, sms, cap);
        const double us = timeit([&](int b) {
          VParams q = p;
          q.x = xb[b];
          q.amax = famx + b;
          e.launch(q, grid, 0);
        });
        if (e.variant == "base" && cap == 16) base_us[e.fos] = us;
        const double xp = us / base_us[0], xm = us / base_us[e.fos];
        std::printf("%-16s %-11s %4d %6u %4d %3d %9.1f %8.3f %8.3f %5s\n", e.variant.c_str(), mode_name(e.fos), cap, grid,
                    attrs[i].regs, attrs[i].occ, us, xp, xm, eq ? "yes" : "NO");
        std::fprintf(jf,
                     "%s{\"shape\": [%lld, %lld], \"variant\": \"%s\", \"mode\": \"%s\", \"fos\": %d, \"cap_per_sm\": %d, "
                     "\"grid\": %u, \"regs\": %d, \"local_bytes\": %d, \"occupancy\": %d, \"us\": %.2f, "
                     "\"x_plain_base\": %.4f, \"x_mode_base\": %.4f, \"bytes_equal\": %s, \"copy_us\": %.2f}",
                     first_row ? "" : ",\n", (long long)M, (long long)N, e.variant.c_str(), mode_name(e.fos), e.fos, cap,
                     grid, attrs[i].regs, attrs[i].local, attrs[i].occ, us, xp, xm, eq ? "true" : "false", copy_us);
        first_row = false;
        std::fflush(stdout);
      }
    }
    o.release();
    ref.release();
    for (int b = 0; b < kBufs; ++b) cudaFree(xb[b]);
    cudaFree(amx);
  }
  std::fprintf(jf, "\n]}\n");
  std::fclose(jf);
  std::printf("\nwrote %s\n", json.c_str());
  return 0;
}
