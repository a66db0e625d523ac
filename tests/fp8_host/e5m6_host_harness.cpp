// Host (g++) build of the E5M6 encoders of formats.cuh -- the exact contract encoder encode_e5m6 and the
// per-token kernels' fast path e5m6_top_fast / e5m6_encode_unit -- so that CI machines without a GPU
// check the very code the kernels run (tests/test_cuda_fp8_hostmath.py). x86-64 SSE arithmetic is IEEE
// RN like the GPU's __f*_rn intrinsics; formats.cuh's host branches use plain float operations.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
static inline uint32_t __float_as_uint(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
#undef __device__
#define __device__
#undef __forceinline__
#define __forceinline__ inline
#include "formats.cuh"
using namespace fp_recipes;

// An independent statement of the contract (NUMERICS.md; ops/formats.py e5m6_encode), not the kernels'
// code: FP16 bits of RZ(v) by fields, then the rounding rule on the low 17 FP32 bits.
static uint32_t contract_e5m6(float v) {
  const uint32_t bits = __float_as_uint(v), a = bits & 0x7FFFFFFFu, sign12 = (bits >> 20) & 0x800u;
  if (a > 0x7F800000u) return 0x7FFu;
  if (a >= 0x47800000u) return sign12 | 0x7C0u;
  const uint32_t sign16 = (bits >> 16) & 0x8000u, e = (bits >> 23) & 0xFFu, m = bits & 0x7FFFFFu;
  uint32_t h;
  if (e >= 113u) {
    h = sign16 | ((e - 112u) << 10) | (m >> 13);
  } else {
    const uint64_t sig = e > 0 ? (m | (1u << 23)) : m;
    const int shift = std::min(48, std::max(0, 126 - int(std::max(e, 1u))));
    h = sign16 | uint32_t(sig >> shift);
  }
  uint32_t c = h >> 4;
  if ((c & 1u) + (bits & 0x1FFFFu) > 0x10000u) c += 1u;
  return c;
}

extern "C" {

// Mismatches over the FP32 bit patterns [lo, hi]: encode_e5m6 against the contract everywhere, and the
// fast path (code << 20) against the contract wherever e5m6_fast_key says the fast path applies (and
// |v| < 65536, which every finite block guarantees). Also counts fast-path claims outside its range.
int64_t e5m6_exhaustive(uint32_t lo, uint32_t hi, int64_t* fast_checked) {
  int64_t bad = 0, checked = 0;
  for (uint64_t b = lo; b <= hi; ++b) {
    const uint32_t bits = uint32_t(b), a = bits & 0x7FFFFFFFu;
    const float v = __uint_as_float(bits);
    const uint32_t ref = contract_e5m6(v);
    if (encode_e5m6(v) != ref) ++bad;
    const bool fast = e5m6_fast_key(v) >= kE5M6FastKeyMin;
    if (fast != (a == 0 || a >= 0x38800000u)) ++bad;  // the key is exactly the documented range test
    if (fast && a < 0x47800000u) {
      ++checked;
      if (e5m6_top_fast(v) != (ref << 20)) ++bad;
    }
  }
  *fast_checked = checked;
  return bad;
}

// The kernels' unit routine over n values (n % 8 == 0): 3 words per 8 values, finite = the block's
// scale is finite (NaN scales make every value NaN).
void e5m6_units(const float* v, int64_t n, int finite, uint32_t* words) {
  for (int64_t u = 0; u < n / 8; ++u) e5m6_encode_unit(v + 8 * u, finite != 0, words + 3 * u);
}

void e5m6_codes(const float* v, int64_t n, uint16_t* codes) {
  for (int64_t i = 0; i < n; ++i) codes[i] = uint16_t(encode_e5m6(v[i]));
}

}  // extern "C"
