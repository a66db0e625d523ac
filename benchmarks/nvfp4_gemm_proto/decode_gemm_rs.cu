// v5 of the prototype: the decode spread over all three warpgroups, A from registers (issue 13; README.md).
//
// C[M, N] = RN_bf16(alpha * sum_k A[m, k] B[n, k]) for NVFP4 A (M, K) and B (N, K) as in decode_gemm.cu (v4): packed
// E2M1 codes (rows, K/2 bytes, low nibble first), E4M3 block scales (rows, K/16), FP16 unit values (exact), FP32 sums.
//
// Why: v3/v4's single producer warpgroup decodes every operand element, one warp per scheduler, and its dependent
// chains (load, shift, convert, multiply, store) set the pace at ~2.7x the MMA time per K step. Here the decode of a
// step is split evenly over the 12 warps: the two consumer warpgroups decode their own rows of A straight into the
// wgmma A-fragment registers (RS form: no shared-memory stores or reads of A), the producer warpgroup decodes B into
// shared memory. CTA tile 256 (M) x 128 (N), K step 64: 256 rows of A over 8 consumer warps and 128 rows of B over 4
// producer warps, 2048 elements a warp a step either way.
//
// The K order inside each 64-wide step is permuted, the same way for A and B, so that every thread's fragment
// values are 16 consecutive codes (one 8-byte shared load a row, one block scale): physical code p = 16 b + 4 j + i
// (b: 16-code scale block 0..3, j: 16-wide wgmma K slice 0..3, i: 0..3) sits at logical K position
// 16 j + 2 b + (i & 1) + 8 (i >> 1), which is where the m64k16 A fragment of the thread with lane % 4 == b holds it.
// A sum over K does not depend on the order its terms are named in; the tensor cores' FP32 accumulation order
// within a K slice may differ from the library path's (a GEMM tolerance, not bytes).
//
// Structure (sm_90a), 384 threads: warpgroup 0 is the producer (setmaxnreg 56): its thread 0 keeps the bulk tensor
// copy engine kAhead steps ahead of the producer's decode, copying each step's packed codes of A (256 x 32 bytes)
// and B (128 x 32) and the 16-byte scale boxes of the four steps they belong to into a staging slot (kPacked slots:
// enough that an issue never waits for a reader, see RS_COUPLED); each producer thread decodes one B
// row (64 codes) into the 128-byte swizzled K-major layout of a B stage. Warpgroups 1 and 2 (setmaxnreg 224) own
// 128 rows of A each (two m64 blocks): per step they read their packed A rows from the slot, decode the fragments
// (double-buffered in registers: the previous step's wgmmas still read theirs), wait for the B stage, and issue
// 2 x 4 wgmma m64n128k16 (A from registers). Epilogue: alpha, one rounding to BF16, direct stores.
//
// Limits: M % 256 == 0, N % 128 == 0, K % 256 == 0, 16-byte aligned codes and scales; no bias or row-scaled operands.
#include <cstdint>

#include "proto_common.cuh"
#include "proto_tma.cuh"
#include "wgmma_m64n128_rs.cuh"

namespace {

using namespace proto;

constexpr int kTM = 256, kTN = 128;                 // CTA tile (kBK = 64 from proto_common)
#ifndef RS_STAGES
#define RS_STAGES 4
#endif
// RS_COUPLED=1: session 32 run 4-5's schedule. Its TMA issue for step kt + 5 (6 slots) waited until every thread had
// read step kt - 1's slot, consumers included, so producer warp 0 could not run more than about a step ahead of the
// consumers' A decode. The default keeps the copy engine kAhead steps ahead of the producer's decode and issues after
// the producer's wait for B stage kt - kStages: the slot it refills last held step kt + kAhead - kPacked <= kt -
// kStages, whose wgmmas are done, so every thread has read it and the issue never waits.
#ifndef RS_COUPLED
#define RS_COUPLED 0
#endif
constexpr int kStages = RS_STAGES;
constexpr int kAhead = RS_COUPLED ? 5 : 3;
constexpr int kPacked = RS_COUPLED ? 6 : kAhead + kStages;
constexpr int kBStageBytes = kTN * kBK * 2;         // decoded B: 16 KB
constexpr int kAData = kTM * 32, kBData = kTN * 32;  // packed codes of a step: 8 KB, 4 KB
constexpr int kAScale = kTM * 16, kBScale = kTN * 16;  // 16-byte scale boxes: 4 KB, 2 KB
constexpr int kSlotBytes = kAData + kBData + kAScale + kBScale;  // 18 KB
constexpr int kBars = 2 * kStages + 2 * kPacked;
constexpr int kSmem = kStages * kBStageBytes + kPacked * kSlotBytes + 1024 + kBars * 8;
// setmaxnreg moves registers between the warpgroups within what the CTA got at launch (168 a thread under
// __launch_bounds__(384, 1)): a consumer's increase waits until the producer's decrease has freed enough, so asking
// for more than the pool holds hangs the kernel (the first form, 64 / 224, did).
constexpr int kLaunchRegs = 168, kProducerRegs = 56, kConsumerRegs = 224;
static_assert(kProducerRegs + 2 * kConsumerRegs <= 3 * kLaunchRegs, "setmaxnreg beyond the CTA's registers");
static_assert(kSmem <= 232448, "more shared memory than a Hopper block can have (227 KB)");
static_assert(RS_COUPLED || kAhead + kStages <= kPacked, "a TMA issue could wait on a slot a consumer still reads");

template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}

// The decode of 8 codes both operands use (RS_DECODE 0: decode8, the codes in order; 1 (default): decode8_pairs;
// 2: decode8_int, the unit values times 2^-7). Which physical codes a fragment register holds follows from it; A and
// B agree because both take it.
#ifndef RS_DECODE
#define RS_DECODE 1
#endif
// RS_ABLATE (timing experiments; the outputs are wrong): 1 leaves out B's decode (the producer stores the packed
// words), 2 leaves out A's (the consumers hand the packed words to the wgmmas), 3 leaves out the producer's proxy
// fence before it signals a B stage full (a race: the wgmmas may read stale bytes). Which one moves the time says
// which part limits a step; 4 leaves out both (the skeleton alone: copies, barriers, wgmmas, epilogue).
#ifndef RS_ABLATE
#define RS_ABLATE 0
#endif
// RS_BSPLIT 1: the producer decodes B rows 0..63 and each consumer warpgroup 32 more, for the next step, between its
// wgmmas' issue and the next A decode (the consumers 10 decodes of 8 codes a thread a step, the producer 4; the
// full barrier counts all 384 threads). Default 0: the producer decodes all of B (8 each way).
#ifndef RS_BSPLIT
#define RS_BSPLIT 0
#endif
// RS_PERSIST 1: one CTA a multiprocessor, each looping over tiles (tile = blockIdx.x + i * gridDim.x): the copies and
// the producer's B decode of the next tile overlap this tile's epilogue, and the CTA's set-up is paid once. A run of
// (K=2048, 32-step) tiles costs ~6 us a tile beyond its steps in runs 4-5 (from the K=2048 and K=8192 shapes' times),
// ~17 % at K=2048. Default 0: one CTA a tile.
#ifndef RS_PERSIST
#define RS_PERSIST 0
#endif
constexpr int kScaleMul = RS_DECODE == 2 ? 128 : 64;
constexpr float kAlphaMul = RS_DECODE == 2 ? 16384.0f : 1.0f;  // undoes the operands' 2^-7 each (exact)
__device__ __forceinline__ void decode8_rs(uint32_t w, __half2 sf2, uint32_t* out) {
#if RS_DECODE == 0
  decode8(w, sf2, out);
#elif RS_DECODE == 1
  decode8_pairs(w, sf2, out);
#else
  decode8_int(w, sf2, out);
#endif
}

__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ void ld_shared_v2(uint32_t addr, uint32_t& a, uint32_t& b) {
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(a), "=r"(b) : "r"(addr));
}
__device__ __forceinline__ void ld_shared_v4(uint32_t addr, uint32_t (&v)[4]) {
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]) : "r"(addr));
}

// One consumer thread's A fragments of one step: frag[mb][j] is the m64k16 fragment of M block mb, K slice j.
struct Frags {
  uint32_t r[2][4][4];
};

// Rows 128 c + 64 mb + 16 w + g (+ 8) of the slot's packed A, this thread's 16 codes (bytes 8 b .. 8 b + 7, b =
// lane % 4) and their block scale, decoded into the fragment registers of the four K slices.
__device__ __forceinline__ void decode_a(Frags& f, uint32_t slot, int c, int warp, int lane, int kt) {
  const int g = lane >> 2, b = lane & 3;
#pragma unroll
  for (int mb = 0; mb < 2; ++mb) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const uint32_t row = static_cast<uint32_t>(128 * c + 64 * mb + 16 * warp + g + 8 * rr);
      uint32_t w0, w1;
      ld_shared_v2(slot + row * 32u + static_cast<uint32_t>(b) * 8u, w0, w1);
      const uint32_t sw = ld_shared_u32(slot + kAData + kBData + row * 16u + static_cast<uint32_t>(kt & 3) * 4u);
      const __half2 sf2 = scale2<kScaleMul>((sw >> (8 * b)) & 0xFFu);
      uint32_t d0[4], d1[4];
#if RS_ABLATE == 2 || RS_ABLATE == 4  // timing experiment only (wrong results): A's decode left out
      d0[0] = d0[1] = d0[2] = d0[3] = w0 ^ h2_bits(sf2);
      d1[0] = d1[1] = d1[2] = d1[3] = w1;
#else
      decode8_rs(w0, sf2, d0);  // codes 16 b + 0..7: slices 0 (d0[0] lo, d0[1] hi) and 1 (d0[2], d0[3])
      decode8_rs(w1, sf2, d1);  // codes 16 b + 8..15: slices 2 and 3
#endif
      // fragment registers: 0 row g lo, 1 row g + 8 lo, 2 row g hi, 3 row g + 8 hi
      f.r[mb][0][rr] = d0[0];
      f.r[mb][0][2 + rr] = d0[1];
      f.r[mb][1][rr] = d0[2];
      f.r[mb][1][2 + rr] = d0[3];
      f.r[mb][2][rr] = d1[0];
      f.r[mb][2][2 + rr] = d1[1];
      f.r[mb][3][rr] = d1[2];
      f.r[mb][3][2 + rr] = d1[3];
    }
  }
}

// One B job: scale blocks blk0 .. blk0 + kNB - 1 of B row `row`, halves kH0 .. kH0 + kNH - 1 of the step (half h:
// each block's word h, K slices 2 h and 2 h + 1), decoded into the B stage at the permuted K positions, 128-byte
// swizzled K-major. Slice j's logical positions 0..7 hold the (i = 0, 1) pairs of blocks 0..3, positions 8..15 the
// (i = 2, 3) pairs: 16-byte chunk 2 j + h' of the row is [block 0..3's pair (j, h')], so block b's pair is the word
// at byte 4 b of its chunk. Whole rows (kNB 4, kNH 2): 2 x 16-byte loads, 8 x 16-byte stores; block pairs (kNB 2):
// one 16-byte load, 8-byte stores.
template <int kNB, int kNH, int kH0>
__device__ __forceinline__ void decode_b_job(uint32_t slot, uint32_t stage, uint32_t row, int blk0, int kt) {
  static_assert((kNB == 4 || kNB == 2) && kNH >= 1 && kH0 + kNH <= 2, "a B job is whole rows or block pairs");
  uint32_t raw[8];  // bytes 8 blk0 .. of the row: raw[2 i + h] is block blk0 + i's word h
  const uint32_t src = slot + kAData + row * 32u + static_cast<uint32_t>(blk0) * 8u;
  ld_shared_v4(src, *reinterpret_cast<uint32_t(*)[4]>(&raw[0]));
  if (kNB == 4) ld_shared_v4(src + 16u, *reinterpret_cast<uint32_t(*)[4]>(&raw[4]));
  const uint32_t sw = ld_shared_u32(slot + kAData + kBData + kAScale + row * 16u + static_cast<uint32_t>(kt & 3) * 4u);
  const uint32_t base = stage + row * 128u + static_cast<uint32_t>(blk0) * 4u, sw7 = row & 7u;
#pragma unroll
  for (int hh = 0; hh < kNH; ++hh) {
    const int half = kH0 + hh;
    uint32_t d[kNB][4];  // d[block - blk0][q]: chunk 4 half + q
#pragma unroll
    for (int i = 0; i < kNB; ++i) {
      const uint32_t code = (sw >> (8 * (blk0 + i))) & 0xFFu;
#if RS_ABLATE == 1 || RS_ABLATE == 4  // timing experiment only (wrong results): B's decode left out, the raw words stored
      d[i][0] = d[i][1] = d[i][2] = d[i][3] = raw[2 * i + half] ^ code;
#else
      decode8_rs(raw[2 * i + half], scale2<kScaleMul>(code), d[i]);
#endif
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint32_t at = base + (((static_cast<uint32_t>(4 * half + q)) ^ sw7) * 16u);
      if (kNB == 4) {
        const uint32_t v[4] = {d[0][q], d[1][q], d[2][q], d[3][q]};
        st_shared_v4(at, v);
      } else {
        asm volatile("st.shared.v2.b32 [%0], {%1, %2};" ::"r"(at), "r"(d[0][q]), "r"(d[1][q]) : "memory");
      }
    }
  }
}

// The producer's part of B step kt: every row (RS_BSPLIT 0: thread t decodes row t) or rows 0..63 (RS_BSPLIT 1:
// thread t decodes block pair t % 2 of row t / 2).
__device__ __forceinline__ void decode_b_producer(uint32_t slot, uint32_t stage, int t, int kt) {
#if RS_BSPLIT
  decode_b_job<2, 2, 0>(slot, stage, static_cast<uint32_t>(t >> 1), 2 * (t & 1), kt);
#else
  decode_b_job<4, 2, 0>(slot, stage, static_cast<uint32_t>(t), 0, kt);
#endif
}

// RS_BSPLIT 1: consumer warpgroup c's part of B: rows 64 + 32 c .. 64 + 32 c + 31, thread t block pair t % 2 of row
// (t % 64) / 2, half t / 64 (warp-uniform: warps 0-1 decode slices 0-1, warps 2-3 slices 2-3).
__device__ __forceinline__ void decode_b_consumer(uint32_t slot, uint32_t stage, int c, int t, int kt) {
  const uint32_t row = static_cast<uint32_t>(64 + 32 * c + ((t & 63) >> 1));
  if (t >= 64)
    decode_b_job<2, 1, 1>(slot, stage, row, 2 * (t & 1), kt);
  else
    decode_b_job<2, 1, 0>(slot, stage, row, 2 * (t & 1), kt);
}

__global__ void __launch_bounds__(kThreads, 1)
    decode_gemm_rs_kernel(const __grid_constant__ CUtensorMap map_a_data, const __grid_constant__ CUtensorMap map_b_data,
                          const __grid_constant__ CUtensorMap map_a_scale,
                          const __grid_constant__ CUtensorMap map_b_scale, const float* __restrict__ alpha,
                          __nv_bfloat16* __restrict__ out, int M, int N, int K) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t stages = (raw + 1023u) & ~1023u;           // decoded B stages, 1024-byte aligned
  const uint32_t slots = stages + kStages * kBStageBytes;   // staging slots (1024-aligned)
  const uint32_t bars = slots + kPacked * kSlotBytes;
  auto full = [&](int s) { return bars + 8u * s; };
  auto empty = [&](int s) { return bars + 8u * (kStages + s); };
  auto landed = [&](int p) { return bars + 8u * (2 * kStages + p); };
  auto freed = [&](int p) { return bars + 8u * (2 * kStages + kPacked + p); };
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  // Work as one stream of K steps, g = (this CTA's tile i) x steps + kt: the barriers, slots and stages follow g,
  // so under RS_PERSIST the copies and B decodes of the next tile run during this tile's epilogue. steps % 4 == 0
  // (K % 256), so a step's place in its 16-byte scale box is g & 3 and each tile starts on fragment buffer 0.
  const int steps = K / kBK, tiles_n = N / kTN;
  const int my_tiles = (RS_PERSIST ? ((M / kTM) * tiles_n - static_cast<int>(blockIdx.x) + static_cast<int>(gridDim.x) - 1) /
                                         static_cast<int>(gridDim.x)
                                   : 1);
  const int total = my_tiles * steps;
  auto tile_origin = [&](int i, int& m0, int& n0) {  // tile i of this CTA (n fastest, as a 2-D grid would run)
    const int tile = static_cast<int>(blockIdx.x) + i * static_cast<int>(gridDim.x);
    m0 = (tile / tiles_n) * kTM;
    n0 = (tile % tiles_n) * kTN;
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full(s), RS_BSPLIT ? kThreads : 128);  // every thread that writes a part of the B stage
      mbar_init(empty(s), 2);                           // both consumer warpgroups' wgmmas are done with it
    }
    for (int p = 0; p < kPacked; ++p) {
      mbar_init(landed(p), 1);
      mbar_init(freed(p), kThreads);  // every thread has read its part of the slot
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {  // producer
    setmaxnreg_dec<kProducerRegs>();
    auto issue = [&](int g) {
      const int p = g % kPacked, i = g / steps, kt = g - i * steps;
      int m0, n0;
      tile_origin(i, m0, n0);
      if (g >= kPacked) mbar_wait(freed(p), ((g / kPacked) + 1) & 1);
      const uint32_t slot = slots + p * kSlotBytes;
      mbar_arrive_expect_tx(landed(p), kSlotBytes);
      tma_load_2d(slot, &map_a_data, kt * 32, m0, landed(p));
      tma_load_2d(slot + kAData, &map_b_data, kt * 32, n0, landed(p));
      tma_load_2d(slot + kAData + kBData, &map_a_scale, (kt >> 2) * 16, m0, landed(p));
      tma_load_2d(slot + kAData + kBData + kAScale, &map_b_scale, (kt >> 2) * 16, n0, landed(p));
    };
    if (t == 0)
      for (int g = 0; g < kAhead && g < total; ++g) issue(g);
    for (int g = 0; g < total; ++g) {
      const int p = g % kPacked, s = g % kStages;
      if (RS_COUPLED && t == 0 && g + kAhead < total) issue(g + kAhead);
      if (g >= kStages) mbar_wait(empty(s), ((g / kStages) + 1) & 1);
      if (!RS_COUPLED && t == 0 && g + kAhead < total) issue(g + kAhead);
      mbar_wait(landed(p), (g / kPacked) & 1);
      decode_b_producer(slots + p * kSlotBytes, stages + s * kBStageBytes, t, g);
      mbar_arrive(freed(p));
      if (RS_ABLATE != 3) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      mbar_arrive(full(s));
    }
    return;
  }

  setmaxnreg_inc<kConsumerRegs>();
  const int c = wg - 1, warp = t / 32, lane = t % 32;
  float acc[2][64];
  Frags f[2];
  // RS_BSPLIT: this warpgroup's rows of B step g (the slot landed; the stage's previous step, g - kStages, released by
  // both consumer warpgroups; this thread arrives on slot g's freed barrier later, after its A rows of step g)
  auto b_part = [&](int g) {
    const int p = g % kPacked, s = g % kStages;
    mbar_wait(landed(p), (g / kPacked) & 1);
    if (g >= kStages) mbar_wait(empty(s), ((g / kStages) + 1) & 1);
    decode_b_consumer(slots + p * kSlotBytes, stages + s * kBStageBytes, c, t, g);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    mbar_arrive(full(s));
  };
  // one step: decode A into fr, wait for B, issue 8 wgmmas, release the tile's previous step's B stage (a tile's last
  // stage is released after its final wait), and under RS_BSPLIT decode this warpgroup's rows of the next step's B
  auto step = [&](int g, int kt, Frags& fr) {
    const int p = g % kPacked, s = g % kStages;
    mbar_wait(landed(p), (g / kPacked) & 1);
    decode_a(fr, slots + p * kSlotBytes, c, warp, lane, g);
    mbar_arrive(freed(p));
    mbar_wait(full(s), (g / kStages) & 1);
    const uint32_t sb = stages + s * kBStageBytes;
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int mb = 0; mb < 2; ++mb) wgmma_m64n128k16_f16_rs(acc[mb], fr.r[mb][j], make_desc(sb + j * 32), 1);
    }
    wgmma_commit();
    wgmma_wait<1>();  // the previous step's wgmmas are done: its B stage and fragment registers are free
    if (kt > 0 && t == 0) mbar_arrive(empty((g - 1) % kStages));
    if (RS_BSPLIT && g + 1 < total) b_part(g + 1);  // overlaps this step's wgmmas
  };
  if (RS_BSPLIT && total > 0) b_part(0);
  const float al = __ldg(alpha) * kAlphaMul;
  for (int i = 0; i < my_tiles; ++i) {
    int m0, n0;
    tile_origin(i, m0, n0);
#pragma unroll
    for (int mb = 0; mb < 2; ++mb)
#pragma unroll
      for (int e = 0; e < 64; ++e) acc[mb][e] = 0.0f;
    const int g0 = i * steps;
    for (int kt = 0; kt < steps; kt += 2) {  // steps is even (a multiple of 4)
      step(g0 + kt, kt, f[0]);
      step(g0 + kt + 1, kt + 1, f[1]);
    }
    wgmma_wait<0>();
#pragma unroll
    for (int mb = 0; mb < 2; ++mb)
#pragma unroll
      for (int e = 0; e < 64; ++e) asm volatile("" : "+f"(acc[mb][e])::"memory");
    if (t == 0) mbar_arrive(empty((g0 + steps - 1) % kStages));

    const int g = lane / 4, b = lane % 4;
#pragma unroll
    for (int mb = 0; mb < 2; ++mb) {
      const int64_t row = m0 + 128 * c + 64 * mb + 16 * warp + g;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int col = n0 + j * 8 + b * 2;
        const float* a4 = &acc[mb][4 * j];
        *reinterpret_cast<__nv_bfloat162*>(out + row * N + col) =
            __floats2bfloat162_rn(__fmul_rn(a4[0], al), __fmul_rn(a4[1], al));
        *reinterpret_cast<__nv_bfloat162*>(out + (row + 8) * N + col) =
            __floats2bfloat162_rn(__fmul_rn(a4[2], al), __fmul_rn(a4[3], al));
      }
    }
  }
}

}  // namespace

// 0 on success, else a CUDA error code (or -1: unsupported shape / alignment, -2: no tensor-map encoder, -3: a map
// could not be encoded).
extern "C" int nvfp4_decode_gemm(const void* a_data, const void* a_scale, const void* b_data, const void* b_scale,
                                 const float* alpha, void* out, int M, int N, int K, void* stream) {
  if (M <= 0 || N <= 0 || K <= 0 || M % kTM || N % kTN || K % 256) return -1;
  if (((reinterpret_cast<uintptr_t>(a_data) | reinterpret_cast<uintptr_t>(b_data) |
        reinterpret_cast<uintptr_t>(a_scale) | reinterpret_cast<uintptr_t>(b_scale)) & 15u) != 0)
    return -1;
  if (encode_fn() == nullptr) return -2;
  static bool configured = false;
  if (!configured) {
    const cudaError_t e =
        cudaFuncSetAttribute(decode_gemm_rs_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (e != cudaSuccess) return static_cast<int>(e);
    configured = true;
  }
  CUtensorMap ad, bd, as, bs;
  if (!byte_map(&ad, a_data, M, K / 2, kTM, 32) || !byte_map(&bd, b_data, N, K / 2, kTN, 32) ||
      !byte_map(&as, a_scale, M, K / 16, kTM, 16) || !byte_map(&bs, b_scale, N, K / 16, kTN, 16))
    return -3;
  int grid = (M / kTM) * (N / kTN);  // one CTA a tile, or (RS_PERSIST) one a multiprocessor looping over tiles
  if (RS_PERSIST) {
    static int sms = 0;
    if (sms == 0) {
      int dev = 0;
      cudaError_t e = cudaGetDevice(&dev);
      if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
      if (e != cudaSuccess) return static_cast<int>(e);
    }
    grid = grid < sms ? grid : sms;
  }
  decode_gemm_rs_kernel<<<grid, kThreads, kSmem, static_cast<cudaStream_t>(stream)>>>(
      ad, bd, as, bs, alpha, static_cast<__nv_bfloat16*>(out), M, N, K);
  return static_cast<int>(cudaGetLastError());
}
