"""Number formats, bit-exact, in plain torch: the one Python source of truth (``csrc/formats.cuh`` is its
CUDA twin and must produce the same codes).

Every encoder takes FP32 values (other float dtypes are converted first, which is exact for FP16/BF16)
and rounds to nearest, ties to even (RN), working on the IEEE bit patterns with integer arithmetic so the
result never depends on how a library rounds a cast. Decoders are exact table lookups / bit moves.

Summary of special values (each encoder's docstring has the detail):

=======  ======  =========================  ==========================  =====================
format   max     finite overflow / +-Inf    NaN                         codes
=======  ======  =========================  ==========================  =====================
E4M3     448     saturate to +-448          0x7F (sign dropped)         torch.float8_e4m3fn
E5M2     57344   saturate to +-57344        0x7F (sign dropped)         torch.float8_e5m2
E2M1     6       saturate to +-6            0x7 | sign (= +-6)          4-bit, 2 per byte
E5M6     65024   +-Inf (0x7C0 | sign)       0x7FF (sign dropped)        12-bit, 8 per 12 bytes
UE8M0    2^127   (exponent byte e + 127)    0xFF                        uint8
=======  ======  =========================  ==========================  =====================

The FP8 NaN code is what the CUDA conversion ``cvt.rn.satfinite`` (``__nv_cvt_float_to_fp8`` with
``__NV_SATFINITE``) produces: the canonical NaN 0x7F whatever the input's sign. Torch's own
``.to(torch.float8_e4m3fn)`` does not saturate (448 < |x| becomes NaN) and keeps the sign of a NaN; never
use it where bytes matter.

RN arithmetic notes (how the references get IEEE results from torch): a single torch elementwise op on
FP32 tensors (``a * b``, ``a / b``, ``a + b``) is one IEEE operation rounded to nearest even, on CPU
and on CUDA (torch is not built with fast-math, and one op leaves nothing to fuse into an FMA). So the
references write each contract step as its own op, in the contract's order, on FP32 tensors; they
never use fused helpers (``addcmul``, ``lerp``, ``baddbmm``) or Python floats in mixed expressions where
the order matters. FP32 -> BF16/FP16 ``.to()`` is one RN cast. Widening BF16/FP16 -> FP32 is exact.
Powers of two are built from exponent bits (:func:`pow2`), never with ``exp2``/``pow``.
"""

from __future__ import annotations

import math

import torch

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
E2M1_MAX = 6.0
E5M6_MAX = 65024.0
FP32_MAX = float(torch.finfo(torch.float32).max)

E4M3_NAN = 0x7F
E5M2_NAN = 0x7F
E5M6_NAN = 0x7FF
E5M6_INF = 0x7C0
UE8M0_NAN = 0xFF

FP8_MAX = {"e4m3": E4M3_MAX, "e5m2": E5M2_MAX}
FP8_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code & 0x7 -> magnitude


# ---- FP32 bit helpers ----------------------------------------------------------------------------

def fp32_bits(x: torch.Tensor) -> torch.Tensor:
    """The IEEE bit patterns of ``x`` as FP32, as int64 in [0, 2^32) (no sign-extension surprises)."""
    return x.to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def fp32_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`fp32_bits`: integer bit patterns (any int dtype, low 32 bits used) -> FP32."""
    b = bits.to(torch.int64) & 0xFFFFFFFF
    b = torch.where(b >= 2**31, b - 2**32, b)  # to signed 32-bit range, same bits
    return b.to(torch.int32).view(torch.float32)


def fp32_exponent(x: torch.Tensor) -> torch.Tensor:
    """Unbiased exponent floor(log2|x|) of normal FP32 values, read from the bits (int64)."""
    return ((fp32_bits(x) >> 23) & 0xFF) - 127


def pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact 2^e as FP32 for integer e in [-126, 127] (built from the exponent bits, no rounding)."""
    e = e.to(torch.int64)
    if bool(((e < -126) | (e > 127)).any()):
        raise ValueError("pow2: exponent outside the FP32 normal range [-126, 127]")
    return fp32_from_bits((e + 127) << 23)


# ---- generic RN rounding of a non-negative FP32 magnitude to a small float format ------------------

def _round_magnitude(a: torch.Tensor, *, mbits: int, bias: int) -> torch.Tensor:
    """Code (without sign) of the finite, non-negative FP32 ``a`` in a format with ``mbits`` mantissa
    bits and exponent ``bias``, rounded to nearest even. The caller clamps ``a`` to the format's max
    first, so the result never overflows. A carry out of the mantissa bumps the exponent, which is the
    correct next code. Works on the bits exactly like the CUDA software conversion does.
    """
    bits = fp32_bits(a)
    exp32 = bits >> 23
    mant32 = bits & 0x7FFFFF
    emin = 1 - bias  # smallest normal exponent of the target
    # normal target: keep the top mbits of the FP32 mantissa, round the dropped bits
    shift_n = 23 - mbits
    code_n = ((exp32 - 127 + bias) << mbits) | (mant32 >> shift_n)
    rem_n = mant32 & ((1 << shift_n) - 1)
    half_n = 1 << (shift_n - 1)
    up_n = (rem_n > half_n) | ((rem_n == half_n) & ((code_n & 1) == 1))
    code_n = code_n + up_n.to(torch.int64)
    # subnormal target (also FP32 subnormals): significand * 2^(e-23) in units of 2^(emin-mbits)
    sig = torch.where(exp32 > 0, mant32 | (1 << 23), mant32)
    e = torch.clamp(exp32, min=1) - 127
    shift_s = torch.clamp(23 + emin - mbits - e, min=1, max=48)
    code_s = sig >> shift_s
    rem_s = sig & ((torch.ones_like(shift_s) << shift_s) - 1)
    half_s = torch.ones_like(shift_s) << (shift_s - 1)
    up_s = (rem_s > half_s) | ((rem_s == half_s) & ((code_s & 1) == 1))
    code_s = code_s + up_s.to(torch.int64)
    return torch.where(exp32 - 127 >= emin, code_n, code_s)


_DECODE_TABLES: dict = {}


def _decode_table(ebits: int, mbits: int, bias: int, kind: str) -> tuple:
    """Value of every code of a sign+ebits+mbits format, as Python floats (exact). The tables the
    decoders use are built at import (a plain dict, which torch.compile reads as constants; it would
    trace through an lru_cache wrapper, with a warning)."""
    key = (ebits, mbits, bias, kind)
    table = _DECODE_TABLES.get(key)
    if table is None:
        table = _DECODE_TABLES[key] = _build_decode_table(ebits, mbits, bias, kind)
    return table


def _build_decode_table(ebits: int, mbits: int, bias: int, kind: str) -> tuple:
    n = 1 << (1 + ebits + mbits)
    emax_field = (1 << ebits) - 1
    out = []
    for code in range(n):
        sign = -1.0 if code >> (ebits + mbits) else 1.0
        ef = (code >> mbits) & emax_field
        m = code & ((1 << mbits) - 1)
        if kind == "e4m3fn" and ef == emax_field and m == (1 << mbits) - 1:
            out.append(math.nan)
            continue
        if kind == "ieee" and ef == emax_field:
            out.append(sign * math.inf if m == 0 else math.nan)
            continue
        if ef == 0:
            out.append(sign * math.ldexp(m, 1 - bias - mbits))
        else:
            out.append(sign * math.ldexp((1 << mbits) + m, ef - bias - mbits))
    return tuple(out)


for _args in ((4, 3, 7, "e4m3fn"), (5, 2, 15, "ieee"), (2, 1, 1, "finite")):
    _decode_table(*_args)


def _lookup(codes: torch.Tensor, table: tuple) -> torch.Tensor:
    t = torch.tensor(table, dtype=torch.float32, device=codes.device)
    return t[codes.to(torch.int64)]


def _sign_bit(x: torch.Tensor) -> torch.Tensor:
    return (fp32_bits(x) >> 31) & 1


# ---- FP8 -----------------------------------------------------------------------------------------

def _fp8_encode(x: torch.Tensor, fmt_max: float, mbits: int, bias: int, nan_code: int) -> torch.Tensor:
    x = x.to(torch.float32)
    sign = _sign_bit(x)
    mag = torch.clamp(x.abs(), max=fmt_max)  # saturate finite overflow and +-Inf; NaN stays NaN
    mag = torch.where(torch.isnan(mag), torch.zeros_like(mag), mag)
    code = _round_magnitude(mag, mbits=mbits, bias=bias) | (sign << 7)
    code = torch.where(torch.isnan(x), torch.full_like(code, nan_code), code)
    return code.to(torch.uint8)


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """FP32 -> E4M3 (e4m3fn) codes as uint8, RN, saturating.

    |x| > 448 (including a value that would round up to the NaN slot, e.g. 460) and +-Inf -> +-448
    (0x7E / 0xFE); NaN -> 0x7F (sign dropped, like CUDA); -0 -> 0x80; RN ties to even also in the
    subnormal range (min subnormal 2^-9; |x| <= 2^-10 -> signed zero).
    """
    return _fp8_encode(x, E4M3_MAX, 3, 7, E4M3_NAN)


def e5m2_encode(x: torch.Tensor) -> torch.Tensor:
    """FP32 -> E5M2 codes as uint8, RN, *saturating*: finite overflow and +-Inf -> +-57344 (0x7B/0xFB),
    never the Inf code (this is CUDA's ``__NV_SATFINITE``, which every fp_recipes cast uses). NaN -> 0x7F
    (sign dropped). Min subnormal 2^-16."""
    return _fp8_encode(x, E5M2_MAX, 2, 15, E5M2_NAN)


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """E4M3 codes (uint8 or float8_e4m3fn) -> FP32, exact. 0x7F/0xFF -> NaN."""
    return _lookup(_as_uint8(codes), _decode_table(4, 3, 7, "e4m3fn"))


def e5m2_decode(codes: torch.Tensor) -> torch.Tensor:
    """E5M2 codes (uint8 or float8_e5m2) -> FP32, exact. 0x7C -> Inf, 0x7D..0x7F -> NaN (and signed)."""
    return _lookup(_as_uint8(codes), _decode_table(5, 2, 15, "ieee"))


def _as_uint8(codes: torch.Tensor) -> torch.Tensor:
    if codes.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return codes.view(torch.uint8)
    if codes.dtype != torch.uint8:
        raise TypeError(f"expected uint8 or float8 codes, got {codes.dtype}")
    return codes


def fp8_encode(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """FP32 -> fp8 tensor of the torch dtype of ``fmt`` ("e4m3" | "e5m2"), saturate_RN."""
    enc = {"e4m3": e4m3_encode, "e5m2": e5m2_encode}.get(fmt)
    if enc is None:
        raise ValueError(f"fp8 format must be 'e4m3' or 'e5m2', got {fmt!r}")
    return enc(x).view(FP8_DTYPE[fmt])


def fp8_decode(data: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn / float8_e5m2 tensor -> FP32, exact (by code table, independent of torch casts)."""
    if data.dtype == torch.float8_e4m3fn:
        return e4m3_decode(data)
    if data.dtype == torch.float8_e5m2:
        return e5m2_decode(data)
    raise TypeError(f"fp8_decode: expected float8_e4m3fn or float8_e5m2 data, got {data.dtype}")


# ---- E2M1 (FP4) ----------------------------------------------------------------------------------

def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """FP32 -> E2M1 4-bit codes (uint8 in [0, 15]): code = sign<<3 | index into E2M1_VALUES.

    RN ties to even (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4); |x| > 6 and +-Inf -> +-6;
    the sign bit is always kept (-0.1 -> 0x8, -0 -> 0x8); NaN -> 0x7 | sign (the max, like satfinite).
    """
    x = x.to(torch.float32)
    sign = _sign_bit(x)
    mag = torch.clamp(x.abs(), max=E2M1_MAX)
    mag = torch.where(torch.isnan(mag), torch.full_like(mag, E2M1_MAX), mag)
    code = _round_magnitude(mag, mbits=1, bias=1) | (sign << 3)
    return code.to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, low 4 bits used; values 0..15) -> FP32, exact."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"e2m1_decode: expected uint8 codes, got {codes.dtype}")
    return _lookup(codes & 0xF, _decode_table(2, 1, 1, "finite"))


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """(..., N) 4-bit codes -> (..., N/2) uint8; element 2k in the LOW nibble, 2k+1 in the high."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_e2m1: expected uint8 codes, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: last dim must be even, got shape {tuple(codes.shape)}")
    c = codes & 0xF
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """(..., N/2) uint8 -> (..., N) 4-bit codes (inverse of :func:`pack_e2m1`)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_e2m1: expected uint8, got {packed.dtype}")
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ---- E5M6 (12-bit: the top 12 bits of an IEEE FP16) -----------------------------------------------

def _fp16_bits_rz(x: torch.Tensor) -> torch.Tensor:
    """FP16 bit pattern (int64) of FP32 ``x`` rounded toward zero (what ``__float2half_rz`` gives for
    |x| < 65536; the caller handles larger magnitudes, NaN and Inf)."""
    bits = fp32_bits(x)
    sign16 = (bits >> 16) & 0x8000
    exp32 = (bits >> 23) & 0xFF
    mant32 = bits & 0x7FFFFF
    normal = ((exp32 - 112) << 10) | (mant32 >> 13)  # exp32 in [113, 142]: fp16 normal
    sig = torch.where(exp32 > 0, mant32 | (1 << 23), mant32)
    shift = torch.clamp(126 - torch.clamp(exp32, min=1), min=0, max=48)
    sub = sig >> shift  # |x| < 2^-14: floor(|x| * 2^24)
    return sign16 | torch.where(exp32 >= 113, normal, sub)


def e5m6_encode(v: torch.Tensor) -> torch.Tensor:
    """FP32 -> 12-bit E5M6 codes (int16 in [0, 4095]), TileKernels' rule (NUMERICS.md):

    ``h = fp16_bits(round_toward_zero(v)); c = h >> 4; r = bits(v) & 0x1FFFF;
    if (c & 1) + r > 0x10000: c += 1``.

    In the FP16-normal range (2^-14 <= |v|) this is exactly RN ties-to-even on the 17 dropped FP32
    mantissa bits, and a carry past 65024 gives Inf (|v| >= 65280 -> Inf, as IEEE RN would).
    Below 2^-14 (FP16 subnormals, FP32 subnormals) the rule is *not* RN: it truncates and then
    rounds up by the low 17 FP32 bits, which are not the dropped bits there; we reproduce it exactly
    because it is the contract of the kernels we match. Defined by us for inputs the per-token cast
    never produces: finite |v| >= 65536 -> +-Inf (0x7C0 | sign), +-Inf -> +-Inf, NaN -> 0x7FF.
    """
    v = v.to(torch.float32)
    bits = fp32_bits(v)
    sign12 = (bits >> 20) & 0x800
    h = _fp16_bits_rz(v)
    c = h >> 4
    r = bits & 0x1FFFF
    c = c + (((c & 1) + r) > 0x10000).to(torch.int64)
    big = v.abs() >= 65536.0  # includes +-Inf
    c = torch.where(big, sign12 | E5M6_INF, c)
    c = torch.where(torch.isnan(v), torch.full_like(c, E5M6_NAN), c)
    return c.to(torch.int16)


def e5m6_decode(codes: torch.Tensor) -> torch.Tensor:
    """12-bit E5M6 codes (any int dtype, values 0..4095) -> FP32, exact: FP16 bits = code << 4."""
    c = codes.to(torch.int32) & 0xFFF
    h = (c << 4).to(torch.int32)
    h = torch.where(h >= 2**15, h - 2**16, h).to(torch.int16)
    return h.view(torch.float16).to(torch.float32)


def pack_e5m6(codes: torch.Tensor) -> torch.Tensor:
    """(..., H) 12-bit codes -> (..., H*3/2) uint8. Each group of 8 codes h0..h7 is one big-endian 96-bit
    stream stored as three little-endian uint32 words:
    w0 = h0<<20 | h1<<8 | h2>>4;  w1 = (h2&0xF)<<28 | h3<<16 | h4<<4 | h5>>8;  w2 = (h5&0xFF)<<24 | h6<<12 | h7.
    Needs H % 8 == 0."""
    if codes.shape[-1] % 8:
        raise ValueError(f"pack_e5m6: last dim must be a multiple of 8, got shape {tuple(codes.shape)}")
    lead = codes.shape[:-1]
    h = (codes.to(torch.int64) & 0xFFF).reshape(*lead, codes.shape[-1] // 8, 8)
    h0, h1, h2, h3, h4, h5, h6, h7 = h.unbind(-1)
    w0 = (h0 << 20) | (h1 << 8) | (h2 >> 4)
    w1 = ((h2 & 0xF) << 28) | (h3 << 16) | (h4 << 4) | (h5 >> 8)
    w2 = ((h5 & 0xFF) << 24) | (h6 << 12) | h7
    words = torch.stack((w0, w1, w2), dim=-1)  # (..., H/8, 3)
    by = torch.stack([(words >> (8 * k)) & 0xFF for k in range(4)], dim=-1)  # little-endian bytes
    return by.to(torch.uint8).reshape(*lead, codes.shape[-1] * 3 // 2)


def unpack_e5m6(packed: torch.Tensor) -> torch.Tensor:
    """(..., H*3/2) uint8 -> (..., H) 12-bit codes as int16 (inverse of :func:`pack_e5m6`)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_e5m6: expected uint8, got {packed.dtype}")
    if packed.shape[-1] % 12:
        raise ValueError(f"unpack_e5m6: last dim must be a multiple of 12, got {tuple(packed.shape)}")
    lead = packed.shape[:-1]
    by = packed.to(torch.int64).reshape(*lead, packed.shape[-1] // 12, 3, 4)
    words = by[..., 0] | (by[..., 1] << 8) | (by[..., 2] << 16) | (by[..., 3] << 24)
    w0, w1, w2 = words.unbind(-1)
    h = torch.stack((
        w0 >> 20,
        (w0 >> 8) & 0xFFF,
        ((w0 & 0xFF) << 4) | (w1 >> 28),
        (w1 >> 16) & 0xFFF,
        (w1 >> 4) & 0xFFF,
        ((w1 & 0xF) << 8) | (w2 >> 24),
        (w2 >> 12) & 0xFFF,
        w2 & 0xFFF,
    ), dim=-1)
    return h.reshape(*lead, packed.shape[-1] * 2 // 3).to(torch.int16)


# ---- UE8M0 (power-of-two scale as a biased exponent byte) ----------------------------------------

def ue8m0_from_exponent(e: torch.Tensor) -> torch.Tensor:
    """Exponent e (int) -> byte e + 127 (uint8). e must lie in [-127, 127]; 255 is reserved for NaN."""
    e = e.to(torch.int64)
    if bool(((e < -127) | (e > 127)).any()):
        raise ValueError("ue8m0_from_exponent: exponent outside [-127, 127]")
    return (e + 127).to(torch.uint8)


def ue8m0_encode(x: torch.Tensor) -> torch.Tensor:
    """Positive power-of-two FP32 scales -> UE8M0 bytes (the FP32 exponent field). +Inf and NaN -> 0xFF
    (UE8M0 NaN); 2^-127 (an FP32 subnormal) -> 0. Anything else (zero, negative, not a power of two) is
    not representable and raises ValueError rather than silently rounding."""
    x = x.to(torch.float32)
    bits = fp32_bits(x)
    special = ~torch.isfinite(x) & ~(x == -math.inf)
    exp_field = (bits >> 23) & 0xFF
    normal_pow2 = (x > 0) & ((bits & 0x7FFFFF) == 0) & (exp_field > 0)
    tiny = bits == 0x00400000  # 2^-127
    ok = special | normal_pow2 | tiny
    if not bool(ok.all()):
        bad = x[~ok].flatten()[:4].tolist()
        raise ValueError(f"ue8m0_encode: values must be positive powers of two (or Inf/NaN), got e.g. {bad}")
    byte = torch.where(tiny, torch.zeros_like(exp_field), exp_field)
    byte = torch.where(special, torch.full_like(byte, UE8M0_NAN), byte)
    return byte.to(torch.uint8)


def ue8m0_decode(b: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes -> FP32 2^(b-127), exact; 0 -> 2^-127 (FP32 subnormal); 0xFF -> NaN."""
    if b.dtype != torch.uint8:
        raise TypeError(f"ue8m0_decode: expected uint8, got {b.dtype}")
    bi = b.to(torch.int64)
    bits = torch.where(bi == 0, torch.full_like(bi, 0x00400000), bi << 23)
    bits = torch.where(bi == 255, torch.full_like(bi, 0x7FC00000), bits)
    return fp32_from_bits(bits)


__all__ = [
    "E2M1_MAX", "E2M1_VALUES", "E4M3_MAX", "E4M3_NAN", "E5M2_MAX", "E5M2_NAN", "E5M6_INF", "E5M6_MAX",
    "E5M6_NAN", "FP32_MAX", "FP8_DTYPE", "FP8_MAX", "UE8M0_NAN",
    "e2m1_decode", "e2m1_encode", "e4m3_decode", "e4m3_encode", "e5m2_decode", "e5m2_encode",
    "e5m6_decode", "e5m6_encode", "fp32_bits", "fp32_exponent", "fp32_from_bits", "fp8_decode",
    "fp8_encode", "pack_e2m1", "pack_e5m6", "pow2", "ue8m0_decode", "ue8m0_encode",
    "ue8m0_from_exponent", "unpack_e2m1", "unpack_e5m6",
]
