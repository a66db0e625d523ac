// v3 of the prototype (runs since session 32; slower than v4, see README.md): the
// packed tiles through the bulk tensor copy engine into a staging ring. Kept for the next attempt.
// Prototype (issue 13): the emulated NVFP4 GEMM with the E2M1 x E4M3 decode inside the GEMM's mainloop, so that no
// 16-bit operand is ever written to device memory. C[M, N] = RN_bf16(alpha * sum_k A[m, k] B[n, k]) for NVFP4 A
// (M, K) and B (N, K), each as packed E2M1 codes (rows, K/2 bytes, low nibble first) and E4M3 block scales
// (rows, K/16), alpha an FP32 device value (the product of the global factors, gemm/nvfp4_emulated.py).
//
// Why FP16 operands: code x scale has at most 6 significant bits and lies in [2^-10, 2688] (nvfp4_device.cuh), so it
// is exact in FP16 as in BF16, and an FP16 wgmma runs at the BF16 rate. The decode then uses the hardware
// E4M3 -> FP16 conversion: an E2M1 code s e1 e0 m placed as the E4M3 byte s 0 e1 e0 m 0 0 is the code's value
// times 2^-6 (subnormals included), and the block scale enters as E4M3 -> FP16 times 2^6; the FP16 product of the
// two is exact. The sum is FP32 (wgmma), then alpha and one rounding to BF16, as cuBLASLt does in the unit path.
//
// Structure (sm_90a): a CTA computes a 128 x 256 tile of C with three warpgroups. Warpgroup 0 is the producer.
// Its thread 0 keeps the bulk tensor copy engine (TMA) kPacked - 1 K steps ahead: per 64-wide K step one 2-D copy
// each of the packed codes (128 rows of A x 32 bytes, 256 rows of B) and of the scales (16-byte boxes, of which a
// step uses 4 bytes a row) into a ring of kPacked staging slots, completing on the slot's mbarrier. Per step the
// warpgroup reads its slot (6 x 16 bytes and 6 x 2 bytes a thread, conflict-free), decodes to FP16 and stores to
// shared memory in the 128-byte swizzled K-major layout wgmma reads, then signals the stage full (mbarrier).
// Warpgroups 1 and 2 each issue four wgmma m64n256k16 per stage on their 64 rows, keep one stage's wgmmas in
// flight, and signal the stage before it empty. 3 decoded stages of 48 KB, 4 staging slots of 18 KB.
// (v0, decode_gemm_cvt.cu, loaded the packed bytes with plain loads one step ahead: 366-415 TFLOP/s on an H200;
// Nsight Compute: L1TEX 82 % busy, two thirds of the stalls on those loads, 16 cache lines per warp load.)
//
// Limits of the prototype: M % 128 == 0, N % 256 == 0, K % 64 == 0, 16-byte aligned data; no bias, no row-scaled
// operands (the library's path keeps them).
#include <cstdint>

#include "proto_common.cuh"
#include "proto_tma.cuh"

namespace {

using namespace proto;

constexpr int kStages = 3, kPacked = 4;
constexpr int kDataBytes = (kBM + kBN) * kBK / 2;  // one step's packed codes: 12 KB (A rows first)
constexpr int kScaleBytes = (kBM + kBN) * 16;      // one step's scale boxes: 16 bytes a row, 6 KB
constexpr int kSlotBytes = kDataBytes + kScaleBytes;
constexpr int kSmem = kStages * kStageBytes + kPacked * kSlotBytes + 1024 + 2 * (kStages + kPacked) * 8;

__device__ __forceinline__ void producer_sync() { asm volatile("bar.sync 1, 128;" ::: "memory"); }

// The four maps, encoded on the host and passed as separate __grid_constant__ kernel parameters.
struct Maps {
  CUtensorMap a_data, a_scale, b_data, b_scale;
};

struct Prefetch {
  uint4 q[kJobs];
  uint32_t s[kJobs];
};

// This thread's packed codes and scales of one step from its staging slot (A rows, then B rows; 32 bytes of codes
// and a 16-byte scale box row each).
__device__ __forceinline__ void read_slot(Prefetch& p, uint32_t slot, int t, int k) {
#pragma unroll
  for (int j = 0; j < kJobs; ++j) {
    bool is_a;
    int row, half;
    job_of(j, t, is_a, row, half);
    const uint32_t r = static_cast<uint32_t>(is_a ? row : kBM + row);
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(p.q[j].x), "=r"(p.q[j].y), "=r"(p.q[j].z), "=r"(p.q[j].w)
                 : "r"(slot + r * 32u + static_cast<uint32_t>(half) * 16u));
    uint16_t sc;
    asm volatile("ld.shared.u16 %0, [%1];" : "=h"(sc) : "r"(slot + kDataBytes + r * 16u + static_cast<uint32_t>(k & 3) * 4u + static_cast<uint32_t>(half) * 2u));
    p.s[j] = sc;
  }
}

__device__ __forceinline__ void store_step(const Prefetch& p, uint32_t stage, int t) {
#pragma unroll
  for (int j = 0; j < kJobs; ++j) {
    bool is_a;
    int row, half;
    job_of(j, t, is_a, row, half);
    const uint32_t base = stage + (is_a ? 0u : static_cast<uint32_t>(kABytes)) + static_cast<uint32_t>(row) * 128u;
    const uint32_t words[4] = {p.q[j].x, p.q[j].y, p.q[j].z, p.q[j].w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const __half2 sf2 = scale2(q < 2 ? (p.s[j] & 0xFFu) : (p.s[j] >> 8));
      uint32_t v[4];
      decode8(words[q], sf2, v);
      const uint32_t chunk = static_cast<uint32_t>(half * 4 + q) ^ static_cast<uint32_t>(row & 7);
      st_shared_v4(base + chunk * 16u, v);
    }
  }
}

__global__ void __launch_bounds__(kThreads, 1)
    decode_gemm_kernel(const __grid_constant__ CUtensorMap map_a_data, const __grid_constant__ CUtensorMap map_b_data,
                       const __grid_constant__ CUtensorMap map_a_scale, const __grid_constant__ CUtensorMap map_b_scale,
                       const float* __restrict__ alpha, __nv_bfloat16* __restrict__ out, int M, int N, int K) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t tiles = (raw + 1023u) & ~1023u;  // 1024-byte aligned stages
  const uint32_t slots = tiles + kStages * kStageBytes;  // (1024-aligned: kStageBytes is a multiple of 1024)
  const uint32_t bars = slots + kPacked * kSlotBytes;
  auto full = [&](int s) { return bars + 8u * s; };
  auto empty = [&](int s) { return bars + 8u * (kStages + s); };
  auto landed = [&](int p) { return bars + 8u * (2 * kStages + p); };
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  const int m0 = blockIdx.y * kBM, n0 = blockIdx.x * kBN;
  const int steps = K / kBK;
  if (threadIdx.x == 0) {
    init_stage_barriers<kStages>(full, empty);
    for (int p = 0; p < kPacked; ++p) mbar_init(landed(p), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {  // producer
    // thread 0: the copies of step k into slot k % kPacked (the slot's previous step was read by every producer
    // thread before the producer_sync that preceded this call)
    auto issue = [&](int k) {
      const int p = k % kPacked;
      const uint32_t slot = slots + p * kSlotBytes;
      mbar_arrive_expect_tx(landed(p), kSlotBytes);
      tma_load_2d(slot, &map_a_data, k * 32, m0, landed(p));
      tma_load_2d(slot + kBM * 32, &map_b_data, k * 32, n0, landed(p));
      // (a box's first byte must be 16-byte aligned: the 16-byte scale box of the four steps k belongs to)
      tma_load_2d(slot + kDataBytes, &map_a_scale, (k >> 2) * 16, m0, landed(p));
      tma_load_2d(slot + kDataBytes + kBM * 16, &map_b_scale, (k >> 2) * 16, n0, landed(p));
    };
    if (t == 0) {
      for (int k = 0; k < kPacked - 1 && k < steps; ++k) issue(k);
    }
    Prefetch cur;
    for (int kt = 0; kt < steps; ++kt) {
      if (t == 0 && kt + kPacked - 1 < steps) issue(kt + kPacked - 1);
      const int p = kt % kPacked;
      mbar_wait(landed(p), (kt / kPacked) & 1);
      read_slot(cur, slots + p * kSlotBytes, t, kt);
      producer_sync();  // every producer thread has read slot p: it may be refilled
      const int s = kt % kStages;
      if (kt >= kStages) mbar_wait(empty(s), ((kt / kStages) + 1) & 1);
      store_step(cur, tiles + s * kStageBytes, t);
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      mbar_arrive(full(s));
    }
    return;
  }

  proto::consume<kStages>(tiles, full, empty, wg - 1, t, m0, n0, N, steps, alpha, out);
}

}  // namespace

// 0 on success, else a CUDA error code (or -1: unsupported shape / alignment, -2: no tensor-map encoder).
extern "C" int nvfp4_decode_gemm(const void* a_data, const void* a_scale, const void* b_data, const void* b_scale,
                                 const float* alpha, void* out, int M, int N, int K, void* stream) {
  if (!proto::supported(M, N, K, a_data, a_scale, b_data, b_scale)) return -1;
  if (encode_fn() == nullptr) return -2;
  static bool configured = false;
  if (!configured) {
    const cudaError_t e = cudaFuncSetAttribute(decode_gemm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (e != cudaSuccess) return static_cast<int>(e);
    configured = true;
  }
  Maps host_maps;
  if (!byte_map(&host_maps.a_data, a_data, M, K / 2, kBM, 32) ||
      !byte_map(&host_maps.b_data, b_data, N, K / 2, kBN, 32) ||
      !byte_map(&host_maps.a_scale, a_scale, M, K / 16, kBM, 16) ||
      !byte_map(&host_maps.b_scale, b_scale, N, K / 16, kBN, 16))
    return -3;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  decode_gemm_kernel<<<dim3(N / kBN, M / kBM), kThreads, kSmem, st>>>(
      host_maps.a_data, host_maps.b_data, host_maps.a_scale, host_maps.b_scale, alpha, static_cast<__nv_bfloat16*>(out),
      M, N, K);
  return static_cast<int>(cudaGetLastError());
}
