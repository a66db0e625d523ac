// NVFP4 v7 tile benchmark (issue 13, target 2), standalone (no torch): the v6 tile kernel (tile_kernel<T, 0>,
// "old") against the v7 tile2_kernel (persistent grid, cp.async double-buffered native-type tile) at two
// builds (b0 = shipped: (256, 4) for RN modes, (256, 3) with SR; b4: (256, 4) for all; m0: v6's compare/select
// E2M1 magic without the short path; s0: no short path), grid sizes (waves of resident blocks; 1000 = one
// block per tile), plus the row-scaled rowwise kernels (v6 rowwise_kernel, v7 row_scaled_kernel, and
// fused row amax + quantize). Byte checks of every variant against "old" (randn and a specials input on
// tail shapes), CUDA-event timing (median of --reps, 3 rotating inputs), D2D copy bandwidth of the same run.
// Usage: nvfp4_tile_bench [out.json] [--reps N]   (scripts/gpu_nvfp4_v7.sh)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tile_bench.h"

#include "bench_util.h"  // CK

__device__ __forceinline__ uint32_t hash32(uint32_t x) {
  x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16;
  return x;
}

// randn (Box-Muller), and with `special` every 97th element NaN / +-Inf / -0 / zero / huge in turn.
__global__ void gen(void* out, int dtype, int64_t n, uint32_t seed, int special) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const uint32_t a = hash32(static_cast<uint32_t>(i) * 2u + seed * 0x9E3779B9u);
    const uint32_t b = hash32(a ^ static_cast<uint32_t>(i >> 31) ^ 0x5bd1e995u);
    float v = sqrtf(-2.0f * logf((static_cast<float>(a >> 8) + 0.5f) * (1.0f / 16777216.0f))) *
              cospif(2.0f * static_cast<float>(b >> 8) * (1.0f / 16777216.0f));
    if (special) {
      const uint32_t h = hash32(b + 7u);
      if (h % 97u == 0) {
        switch ((h / 97u) % 6u) {
          case 0: v = __uint_as_float(0x7FC00000u); break;
          case 1: v = INFINITY; break;
          case 2: v = -INFINITY; break;
          case 3: v = -0.0f; break;
          case 4: v = 0.0f; break;
          case 5: v = v * 65536.0f; break;
        }
      }
      if ((h >> 20) % 50u == 0) v *= 1e-6f;  // small blocks: subnormal scales
    }
    if (dtype == 2) reinterpret_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(v);
    else reinterpret_cast<float*>(out)[i] = v;
  }
}

// Finite max |x| (global, for the per-tensor cases), and per-row max |x| as row_amax_kernel writes it
// (NaN propagating, canonical NaN): the row-scaled cases use it, and the fused kernel must reproduce it.
__global__ void amaxes(const void* x, int dtype, int64_t M, int64_t N, unsigned* g, float* rows) {
  for (int64_t r = blockIdx.x; r < M; r += gridDim.x) {
    float m = 0.0f;
    unsigned mb = 0;
    for (int64_t c = threadIdx.x; c < N; c += blockDim.x) {
      const float v = dtype == 2 ? __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(x)[r * N + c])
                                 : reinterpret_cast<const float*>(x)[r * N + c];
      if (isfinite(v)) m = fmaxf(m, fabsf(v));
      mb = max(mb, __float_as_uint(v) & 0x7FFFFFFFu);
    }
    for (int o = 16; o > 0; o >>= 1) {
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, o));
    }
    __shared__ float wm[32];
    __shared__ unsigned wb[32];
    if ((threadIdx.x & 31) == 0) { wm[threadIdx.x / 32] = m; wb[threadIdx.x / 32] = mb; }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < (int)blockDim.x / 32; ++w) { m = fmaxf(m, wm[w]); mb = max(mb, wb[w]); }
      rows[r] = __uint_as_float(mb > 0x7F800000u ? 0x7FC00000u : mb);
      atomicMax(g, __float_as_uint(m));
    }
    __syncthreads();
  }
}

struct Bufs {
  uint8_t *data, *scale, *data_t, *scale_t;
  float* rowam;
  size_t nd, ns;
  int64_t M;
  void alloc(int64_t M_, int64_t N) {
    M = M_;
    nd = static_cast<size_t>(M * N / 2);
    ns = static_cast<size_t>(M * ((N + 15) / 16));
    CK(cudaMalloc(&data, nd + 64)); CK(cudaMalloc(&scale, ns + 64));
    CK(cudaMalloc(&data_t, nd + 64)); CK(cudaMalloc(&scale_t, ns + 64));
    CK(cudaMalloc(&rowam, M * sizeof(float) + 64));
  }
  void release() { cudaFree(data); cudaFree(scale); cudaFree(data_t); cudaFree(scale_t); cudaFree(rowam); }
  void clear() {
    CK(cudaMemset(data, 0xA5, nd)); CK(cudaMemset(scale, 0x5A, ns));
    CK(cudaMemset(data_t, 0xA5, nd)); CK(cudaMemset(scale_t, 0x5A, ns));
    CK(cudaMemset(rowam, 0xEE, M * sizeof(float)));
  }
  std::vector<uint8_t> host(bool row, bool col, bool ram) const {
    std::vector<uint8_t> h;
    auto add = [&](const void* p, size_t n) {
      const size_t o = h.size();
      h.resize(o + n);
      CK(cudaMemcpy(h.data() + o, p, n, cudaMemcpyDeviceToHost));
    };
    if (row) { add(data, nd); add(scale, ns); }
    if (col) { add(data_t, nd); add(scale_t, ns); }
    if (ram) add(rowam, M * sizeof(float));
    return h;
  }
};

struct Case {
  const char* name;
  bool row, col, d2, sr, rht, rs;  // rs: row-scaled rowwise
};
static const Case kCases[] = {
    {"row+col", true, true, false, false, false, false},
    {"2D row+col", true, true, true, false, false, false},
    {"row + RHT col", true, true, false, false, true, false},
    {"SR row + RHT SR col", true, true, false, true, true, false},
    {"RHT col", false, true, false, false, true, false},
    {"col", false, true, false, false, false, false},
    {"2D SR row+col", true, true, true, true, false, false},
    {"row-scaled row", true, false, false, false, false, true},
};

struct Var {
  const char* name;
  int obj;  // 0: b0 (shipped), 4: b4 ((256, 4) for every mode), 1: m0 (v6 magic, no short path), 2: s0 (no short path),
            // 5: f1 (the SR encode of sessions 26-40, encode16_sr_fma), 6: st4, 7: st1 (strips of 4 tiles always / never), 8: rs1 (row-scaled without the row barrier),
            // 9: ru2 (the 1-D SR rowwise loop unrolled over its two blocks)
  int which, waves;
};

static void run(const Var& v, const tb::Args& a, cudaStream_t s) {
  if (v.obj == 0) tb::run_b0(a, v.which, v.waves, s);
  else if (v.obj == 1) tb::run_m0(a, v.which, v.waves, s);
  else if (v.obj == 2) tb::run_s0(a, v.which, v.waves, s);
  else if (v.obj == 5) tb::run_f1(a, v.which, v.waves, s);
  else if (v.obj == 6) tb::run_st4(a, v.which, v.waves, s);
  else if (v.obj == 7) tb::run_st1(a, v.which, v.waves, s);
  else if (v.obj == 8) tb::run_rs1(a, v.which, v.waves, s);
  else if (v.obj == 9) tb::run_ru2(a, v.which, v.waves, s);
  else tb::run_b4(a, v.which, v.waves, s);
}

static std::vector<Var> vars_for(const Case& c) {
  if (c.rs)
    return {{"old rowwise_kernel", 0, tb::kRowwise, 0}, {"v7 row_scaled", 0, tb::kRowScaled, 0},
            {"v7 fused amax+q", 0, tb::kRowScaledFused, 0}, {"v7 row_scaled free", 8, tb::kRowScaled, 0}};
  return {{"old tile", 0, tb::kOldTile, 0},    {"v7 w1", 0, tb::kTile2, 1}, {"v7 w2", 0, tb::kTile2, 2},
          {"v7 pertile", 0, tb::kTile2, 1000}, {"v7 b4 w1", 4, tb::kTile2, 1},
          {"v7 w1 cmpmagic", 1, tb::kTile2, 1}, {"v7 w1 noshort", 2, tb::kTile2, 1},
          {"v7 w1 srfma", 5, tb::kTile2, 1}, {"v7 strip4", 6, tb::kTile2, 0},
          {"v7 nostrip", 7, tb::kTile2, 0}, {"v7 w1 srunroll2", 9, tb::kTile2, 1}};
}

int main(int argc, char** argv) {
  std::string json = "nvfp4_tile_bench.json";
  int reps = 40;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
    else json = argv[i];
  }
  reps = std::min(reps, 500);
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  std::printf("device: %s, %d SMs\n", prop.name, sms);
  std::printf("%-22s %-22s %5s %4s %6s %4s\n", "case", "variant", "dtype", "regs", "local", "occ");
  for (int dt : {2, 0})
    for (const Case& c : kCases) {
      if (dt == 0 && (c.rht || c.rs)) continue;
      for (const Var& v : vars_for(c)) {
        int r, l, o;
        (v.obj == 0 ? tb::attrs_b0 : v.obj == 1 ? tb::attrs_m0 : v.obj == 2 ? tb::attrs_s0
                     : v.obj == 5 ? tb::attrs_f1 : v.obj == 6 ? tb::attrs_st4 : v.obj == 7 ? tb::attrs_st1 : v.obj == 8 ? tb::attrs_rs1 : v.obj == 9 ? tb::attrs_ru2 : tb::attrs_b4)(
            dt, v.which, c.d2, c.sr, c.rht, &r, &l, &o);
        std::printf("%-22s %-22s %5s %4d %6d %4d\n", c.name, v.name, dt == 2 ? "bf16" : "fp32", r, l, o);
      }
    }

  // ---- byte checks against "old" on tail shapes, randn and specials ----
  int nchecks = 0, nbad = 0;
  {
    const int64_t shapes[][2] = {{16, 16}, {96, 48}, {208, 160}, {80, 1040}, {4112, 4104}, {48, 33}, {160, 130}, {1, 16}, {17, 32}};
    for (auto& sh : shapes) {
      const int64_t M = sh[0], N = sh[1];
      for (int dt : {2, 0}) {
        void* x;
        const size_t esz = dt == 2 ? 2 : 4;
        CK(cudaMalloc(&x, M * N * esz + 64));
        unsigned* g;
        float* rows;
        CK(cudaMalloc(&g, 8));
        CK(cudaMalloc(&rows, M * sizeof(float)));
        Bufs ref, got;
        ref.alloc(M, N);
        got.alloc(M, N);
        for (int special : {0, 1}) {
          gen<<<64, 256>>>(x, dt, M * N, 77u + (uint32_t)M, special);
          CK(cudaMemset(g, 0, 8));
          amaxes<<<256, 256>>>(x, dt, M, N, g, rows);
          CK(cudaDeviceSynchronize());
          for (const Case& c : kCases) {
            if (dt == 0 && (c.rht || c.rs)) continue;
            const bool row = c.row && N % 16 == 0, col = c.col && M % 16 == 0;
            if (!row && !col) continue;
            tb::Args a;
            a.x = x; a.dtype = dt; a.M = M; a.N = N;
            a.amax = c.rs ? rows : reinterpret_cast<const float*>(g);
            a.amax_t = reinterpret_cast<const float*>(g);
            a.row_scaled = c.rs; a.rht = c.rht; a.block_2d = c.d2; a.sr = c.sr; a.seed = 99; a.offset = 3;
            std::vector<uint8_t> want;
            bool first = true;
            for (const Var& v : vars_for(c)) {
              Bufs& b = first ? ref : got;
              b.clear();
              tb::Args q = a;
              q.data = row ? b.data : nullptr; q.scale = row ? b.scale : nullptr;
              q.data_t = col ? b.data_t : nullptr; q.scale_t = col ? b.scale_t : nullptr;
              q.row_amax_out = b.rowam;
              if (c.rs && v.which == tb::kRowScaledFused) q.amax = nullptr;
              run(v, q, 0);
              CK(cudaGetLastError());
              CK(cudaDeviceSynchronize());
              std::vector<uint8_t> h = b.host(row, col, false);
              if (first) { want = h; first = false; continue; }
              ++nchecks;
              bool ok = h == want;
              if (ok && c.rs && v.which == tb::kRowScaledFused) {  // the fused row amax == row_amax_kernel's
                std::vector<float> ra(M), rr(M);
                CK(cudaMemcpy(ra.data(), b.rowam, M * 4, cudaMemcpyDeviceToHost));
                CK(cudaMemcpy(rr.data(), rows, M * 4, cudaMemcpyDeviceToHost));
                ok = std::memcmp(ra.data(), rr.data(), M * 4) == 0;
              }
              if (!ok) {
                ++nbad;
                size_t k = 0;
                while (k < h.size() && h[k] == want[k]) ++k;
                std::printf("MISMATCH %s %s %lldx%lld %s special=%d: first byte %zu of %zu got %02x want %02x\n",
                            c.name, v.name, (long long)M, (long long)N, dt == 2 ? "bf16" : "fp32", special, k, h.size(),
                            k < h.size() ? h[k] : 0, k < want.size() ? want[k] : 0);
              }
            }
          }
        }
        ref.release();
        got.release();
        cudaFree(x); cudaFree(g); cudaFree(rows);
      }
    }
  }
  std::printf("byte checks: %d, mismatches: %d\n", nchecks, nbad);

  // ---- timing ----
  FILE* jf = std::fopen(json.c_str(), "w");
  std::fprintf(jf, "{\"device\": \"%s\", \"sms\": %d, \"reps\": %d, \"mismatches\": %d, \"rows\": [\n", prop.name, sms,
               reps, nbad);
  bool first_row = true;
  std::vector<cudaEvent_t> e0(reps), e1(reps);
  for (int k = 0; k < reps; ++k) { CK(cudaEventCreate(&e0[k])); CK(cudaEventCreate(&e1[k])); }
  struct Shape { int64_t M, N; int dt; };
  const Shape shapes[] = {{16384, 6144, 2}, {4096, 4096, 2}, {4096, 4096, 0}};
  for (const Shape& sh : shapes) {
    const int64_t M = sh.M, N = sh.N, n = M * N;
    const size_t esz = sh.dt == 2 ? 2 : 4;
    const int kB = 3;
    void* xb[kB];
    unsigned* g;
    float* rows[kB];
    CK(cudaMalloc(&g, kB * 4));
    CK(cudaMemset(g, 0, kB * 4));
    for (int b = 0; b < kB; ++b) {
      CK(cudaMalloc(&xb[b], n * esz));
      CK(cudaMalloc(&rows[b], M * 4));
      gen<<<sms * 8, 256>>>(xb[b], sh.dt, n, 1000u + b, 0);
      amaxes<<<sms * 8, 256>>>(xb[b], sh.dt, M, N, g + b, rows[b]);
    }
    CK(cudaDeviceSynchronize());
    Bufs o;
    o.alloc(M, N);
    auto timeit = [&](auto&& launch) {
      for (int r = 0; r < 5 + reps; ++r) {
        if (r >= 5) CK(cudaEventRecord(e0[r - 5]));
        launch(r % kB);
        if (r >= 5) CK(cudaEventRecord(e1[r - 5]));
      }
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      std::vector<float> t(reps);
      for (int r = 0; r < reps; ++r) CK(cudaEventElapsedTime(&t[r], e0[r], e1[r]));
      std::sort(t.begin(), t.end());
      return 1000.0 * t[reps / 2];
    };
    void* cdst;
    CK(cudaMalloc(&cdst, n * esz));
    const double copy_us = timeit([&](int b) { CK(cudaMemcpyAsync(cdst, xb[b], n * esz, cudaMemcpyDeviceToDevice)); });
    CK(cudaFree(cdst));
    const double copy_gbps = 2.0 * n * esz / copy_us / 1e3;
    std::printf("\n== %lld x %lld %s: D2D copy %.1f us = %.0f GB/s (read + write)\n", (long long)M, (long long)N,
                sh.dt == 2 ? "bf16" : "fp32", copy_us, copy_gbps);
    // plain rowwise (v6 rowwise_kernel) for the x plain column
    tb::Args pa;
    pa.dtype = sh.dt; pa.M = M; pa.N = N; pa.data = o.data; pa.scale = o.scale;
    const double plain_us = timeit([&](int b) {
      tb::Args q = pa; q.x = xb[b]; q.amax = reinterpret_cast<const float*>(g) + b;
      tb::run_b0(q, tb::kRowwise, 0, 0);
    });
    const double out1 = n / 2.0 + n / 16.0;
    std::printf("%-22s %-18s %9s %7s %7s\n", "case", "variant", "us", "%copy", "xplain");
    std::printf("%-22s %-18s %9.1f %7.1f %7.2f\n", "plain rowwise", "v6 rowwise_kernel", plain_us,
                100.0 * (n * esz + out1) / plain_us / 1e3 / copy_gbps, 1.0);
    for (const Case& c : kCases) {
      if (sh.dt == 0 && (c.rht || c.rs)) continue;
      if (sh.dt == 0 && !(c.d2 || (!c.sr && c.row && c.col))) continue;  // fp32: weights (2-D) and plain row+col
      const double bytes = n * esz + out1 * (int(c.row) + int(c.col));
      for (const Var& v : vars_for(c)) {
        const double us = timeit([&](int b) {
          tb::Args q;
          q.x = xb[b]; q.dtype = sh.dt; q.M = M; q.N = N;
          q.amax = c.rs ? rows[b] : reinterpret_cast<const float*>(g) + b;
          q.amax_t = reinterpret_cast<const float*>(g) + b;
          q.row_scaled = c.rs; q.rht = c.rht; q.block_2d = c.d2; q.sr = c.sr; q.seed = 5; q.offset = 7;
          q.data = c.row ? o.data : nullptr; q.scale = c.row ? o.scale : nullptr;
          q.data_t = c.col ? o.data_t : nullptr; q.scale_t = c.col ? o.scale_t : nullptr;
          q.row_amax_out = o.rowam;
          run(v, q, 0);
        });
        const double pct = 100.0 * bytes / us / 1e3 / copy_gbps;
        std::printf("%-22s %-18s %9.1f %7.1f %7.2f\n", c.name, v.name, us, pct, us / plain_us);
        std::fprintf(jf, "%s{\"shape\": [%lld, %lld], \"dtype\": \"%s\", \"case\": \"%s\", \"variant\": \"%s\", "
                         "\"us\": %.2f, \"pct_copy\": %.2f, \"x_plain\": %.4f, \"plain_us\": %.2f, \"copy_us\": %.2f}",
                     first_row ? "" : ",\n", (long long)M, (long long)N, sh.dt == 2 ? "bf16" : "fp32", c.name, v.name, us,
                     pct, us / plain_us, plain_us, copy_us);
        first_row = false;
        std::fflush(stdout);
      }
    }
    o.release();
    for (int b = 0; b < kB; ++b) { cudaFree(xb[b]); cudaFree(rows[b]); }
    cudaFree(g);
  }
  std::fprintf(jf, "\n]}\n");
  std::fclose(jf);
  std::printf("\nwrote %s; byte mismatches: %d\n", json.c_str(), nbad);
  return nbad ? 1 : 0;
}
