"""Number formats: every code of every format, ties, saturation, subnormals, NaN/Inf, packing.

Expected values come from independent sources: hand-written tables and hex, Python's exact float
arithmetic (math.ldexp), numpy's float16, and torch's own fp8 dtypes (for in-range values only, where
torch's cast is a correct RN cast), never from the encoder under test.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp_recipes import formats as F


def _value(code: int, ebits: int, mbits: int, bias: int) -> float:
    """Value of a sign/exponent/mantissa code, by the textbook formula (no special values)."""
    s = -1.0 if code >> (ebits + mbits) else 1.0
    e = (code >> mbits) & ((1 << ebits) - 1)
    m = code & ((1 << mbits) - 1)
    if e == 0:
        return s * m * 2.0 ** (1 - bias - mbits)
    return s * (1 + m / 2 ** mbits) * 2.0 ** (e - bias)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal including NaN positions and the sign of zero."""
    a, b = a.float(), b.float()
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan]) and torch.equal(
        torch.signbit(a[~nan]), torch.signbit(b[~nan]))


# ---- E4M3 ----------------------------------------------------------------------------------------

def test_e4m3_all_256_codes_decode_and_round_trip():
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    dec = F.e4m3_decode(codes)
    expected = torch.tensor([math.nan if (c & 0x7F) == 0x7F else _value(c, 4, 3, 7) for c in range(256)])
    assert _same(dec, expected)
    assert _same(dec, codes.view(torch.float8_e4m3fn).float())  # torch agrees on every code
    back = F.e4m3_encode(dec)
    finite = ~torch.isnan(dec)
    assert torch.equal(back[finite], codes[finite])
    assert back[~finite].tolist() == [0x7F, 0x7F]  # both NaN codes -> canonical 0x7F
    assert dec[0x7E].item() == 448.0 and dec[0x01].item() == 2.0 ** -9 and dec[0x08].item() == 2.0 ** -6


def test_e4m3_saturation_and_specials():
    x = torch.tensor([448.0, 449.0, 456.0, 460.0, 464.0, 1e30, math.inf, -500.0, -math.inf, math.nan, -math.nan,
                      0.0, -0.0, 3.4e38])
    got = F.e4m3_encode(x).tolist()
    assert got == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0x7F, 0x7F, 0x00, 0x80, 0x7E]


def test_e4m3_subnormals_and_ties():
    t = 2.0 ** -10  # half the smallest subnormal
    x = torch.tensor([2.0 ** -9, t, 3 * t, 5 * t, 1.5 * t, 0.99 * t, 1e-45, -t, 2.0 ** -6 * (1 + 1 / 16)])
    # t -> tie 0|1 -> 0; 3t = 1.5 * 2^-9 -> tie 1|2 -> 2; 5t -> tie 2|3 -> 2; 1.5t -> 1; 0.99t -> 0;
    # FP32 subnormal -> 0; -t -> -0; 2^-6 * 17/16 -> tie between 0x08 and 0x09 -> 0x08
    assert F.e4m3_encode(x).tolist() == [0x01, 0x00, 0x02, 0x02, 0x01, 0x00, 0x00, 0x80, 0x08]


@pytest.mark.parametrize("fmt,ebits,mbits,bias", [("e4m3", 4, 3, 7), ("e5m2", 5, 2, 15)])
def test_fp8_every_midpoint_rounds_to_even(fmt, ebits, mbits, bias):
    maxcode = 0x7E if fmt == "e4m3" else 0x7B
    lo = torch.tensor([_value(c, ebits, mbits, bias) for c in range(maxcode)], dtype=torch.float64)
    hi = torch.tensor([_value(c + 1, ebits, mbits, bias) for c in range(maxcode)], dtype=torch.float64)
    mid = ((lo + hi) / 2).float()  # exact in FP32
    enc = F.e4m3_encode if fmt == "e4m3" else F.e5m2_encode
    want = torch.tensor([c if c % 2 == 0 else c + 1 for c in range(maxcode)])
    assert torch.equal(enc(mid).long(), want)
    assert torch.equal(enc(-mid).long(), want | 0x80)
    up = torch.nextafter(mid, torch.tensor(math.inf))
    down = torch.nextafter(mid, torch.tensor(0.0))
    assert torch.equal(enc(up).long(), torch.arange(1, maxcode + 1))
    assert torch.equal(enc(down).long(), torch.arange(maxcode))


# ---- E5M2 ----------------------------------------------------------------------------------------

def test_e5m2_all_256_codes_decode_and_round_trip():
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    dec = F.e5m2_decode(codes)
    expected = []
    for c in range(256):
        e, m = (c >> 2) & 0x1F, c & 3
        if e == 31:
            expected.append(math.nan if m else (-math.inf if c & 0x80 else math.inf))
        else:
            expected.append(_value(c, 5, 2, 15))
    assert _same(dec, torch.tensor(expected))
    assert _same(dec, codes.view(torch.float8_e5m2).float())
    back = F.e5m2_encode(dec)
    finite = torch.isfinite(dec)
    assert torch.equal(back[finite], codes[finite])
    assert back[0x7C].item() == 0x7B and back[0xFC].item() == 0xFB  # Inf saturates (SATFINITE)
    assert set(back[torch.isnan(dec)].tolist()) == {0x7F}


def test_e5m2_saturation_specials_subnormals():
    x = torch.tensor([57344.0, 61439.0, 61440.0, 1e9, math.inf, -math.inf, math.nan, 2.0 ** -16, 2.0 ** -17,
                      3 * 2.0 ** -17, -0.0])
    # 61440 is the midpoint to the (non-representable) 65536 -> saturates; 2^-17 = tie 0|1 -> 0;
    # 3 * 2^-17 = tie 1|2 -> 2
    assert F.e5m2_encode(x).tolist() == [0x7B, 0x7B, 0x7B, 0x7B, 0x7B, 0xFB, 0x7F, 0x01, 0x00, 0x02, 0x80]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=64))
def test_fp8_encode_matches_torch_cast_after_clamp(values):
    x = torch.tensor(values, dtype=torch.float32)
    for fmt, mx in (("e4m3", 448.0), ("e5m2", 57344.0)):
        got = F.fp8_encode(x, fmt).view(torch.uint8)
        ref = torch.clamp(x, -mx, mx).to(F.FP8_DTYPE[fmt]).view(torch.uint8)
        nan = torch.isnan(x)
        assert torch.equal(got[~nan], ref[~nan])
        assert bool((got[nan] == 0x7F).all())


# ---- E2M1 ----------------------------------------------------------------------------------------

def test_e2m1_all_16_codes():
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    codes = torch.arange(16, dtype=torch.uint8)
    dec = F.e2m1_decode(codes)
    assert _same(dec, torch.tensor(table + [-v for v in table]))
    assert torch.equal(F.e2m1_encode(dec), codes)


def test_e2m1_ties_saturation_sign_nan():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 1e9, math.inf, -0.1, -0.0, math.nan,
                      -math.nan, -7.0, 0.26, 4.9, 5.1])
    want = [0x0, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0x7, 0x7, 0x7, 0x8, 0x8, 0x7, 0xF, 0xF, 0x1, 0x6, 0x7]
    assert F.e2m1_encode(x).tolist() == want


def test_e2m1_pack_low_nibble_first():
    codes = torch.tensor([[0x1, 0x2, 0x3, 0x4, 0xF, 0x0]], dtype=torch.uint8)
    packed = F.pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x0F]]
    assert torch.equal(F.unpack_e2m1(packed), codes)
    with pytest.raises(ValueError, match="even"):
        F.pack_e2m1(torch.zeros(1, 3, dtype=torch.uint8))


# ---- E5M6 ----------------------------------------------------------------------------------------

def test_e5m6_all_4096_codes_decode_and_round_trip():
    codes = torch.arange(4096, dtype=torch.int64)
    dec = F.e5m6_decode(codes)
    ref = torch.from_numpy((np.arange(4096, dtype=np.uint16) << 4).view(np.float16).astype(np.float32))
    assert _same(dec, ref)
    back = F.e5m6_encode(dec).long()
    nan = torch.isnan(dec)
    assert torch.equal(back[~nan], codes[~nan])  # includes +-0, subnormals, +-Inf (0x7C0/0xFC0)
    assert set(back[nan].tolist()) == {0x7FF}
    assert dec[0x7BF].item() == 65024.0 == F.E5M6_MAX
    assert dec[0x001].item() == 2.0 ** -20


def test_e5m6_rne_in_fp16_normal_range():
    # all adjacent pairs of positive normal codes below the max: midpoint -> even code
    c = torch.arange(0x040, 0x7BF)
    lo, hi = F.e5m6_decode(c).double(), F.e5m6_decode(c + 1).double()
    mid = ((lo + hi) / 2).float()
    want = torch.where(c % 2 == 0, c, c + 1)
    assert torch.equal(F.e5m6_encode(mid).long(), want)
    assert torch.equal(F.e5m6_encode(-mid).long(), want | 0x800)
    assert torch.equal(F.e5m6_encode(torch.nextafter(mid, torch.tensor(0.0))).long(), c)
    assert torch.equal(F.e5m6_encode(torch.nextafter(mid, torch.tensor(math.inf))).long(), c + 1)


def test_e5m6_overflow_and_specials():
    x = torch.tensor([65024.0, 65279.0, 65280.0, 65535.0, 70000.0, 1e30, math.inf, -math.inf, math.nan, -0.0])
    # 65280 is the midpoint to 2^16 -> ties to the even code 0x7C0, which is Inf
    assert F.e5m6_encode(x).tolist() == [0x7BF, 0x7BF, 0x7C0, 0x7C0, 0x7C0, 0x7C0, 0x7C0, 0xFC0, 0x7FF, 0x800]


def test_e5m6_rule_below_fp16_normal_range_is_the_tilekernels_rule():
    # v = 2^-15 * (1 + 0x1FFFF * 2^-23): FP16 subnormal. RZ to FP16 gives mantissa 519 (0x207), so
    # c = 0x20; the low 17 FP32 bits are 0x1FFFF > 0x10000, so the rule rounds up to 0x21 although
    # the exact value (32.4999 * 2^-20) is nearer 0x20. This is the contract we match, not RN.
    v = torch.tensor([(1 + 0x1FFFF * 2.0 ** -23) * 2.0 ** -15], dtype=torch.float32)
    assert F.e5m6_encode(v).item() == 0x21
    # exact subnormal codes survive: 5 * 2^-20 -> 0x005
    assert F.e5m6_encode(torch.tensor([5 * 2.0 ** -20])).item() == 0x005


def test_e5m6_pack_hand_example():
    codes = torch.tensor([[0x123, 0x456, 0x789, 0xABC, 0xDEF, 0x012, 0x345, 0x678]], dtype=torch.int16)
    # the 96-bit stream 123456789ABCDEF012345678 -> words 0x12345678, 0x9ABCDEF0, 0x12345678, little-endian
    want = [0x78, 0x56, 0x34, 0x12, 0xF0, 0xDE, 0xBC, 0x9A, 0x78, 0x56, 0x34, 0x12]
    packed = F.pack_e5m6(codes)
    assert packed.dtype == torch.uint8 and packed.tolist() == [want]
    assert torch.equal(F.unpack_e5m6(packed), codes)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 4095), min_size=8, max_size=8 * 6).filter(lambda v: len(v) % 8 == 0))
def test_e5m6_pack_unpack_round_trip(vals):
    codes = torch.tensor(vals, dtype=torch.int16).reshape(1, -1)
    assert torch.equal(F.unpack_e5m6(F.pack_e5m6(codes)), codes)


def test_e5m6_pack_needs_multiple_of_8():
    with pytest.raises(ValueError, match="multiple of 8"):
        F.pack_e5m6(torch.zeros(2, 12, dtype=torch.int16))


# ---- UE8M0 ---------------------------------------------------------------------------------------

def test_ue8m0_round_trip_and_specials():
    b = torch.arange(255, dtype=torch.int64).to(torch.uint8)
    dec = F.ue8m0_decode(b)
    assert dec.tolist() == [math.ldexp(1.0, int(v) - 127) for v in range(255)]
    assert torch.equal(F.ue8m0_encode(dec), b)
    assert math.isnan(F.ue8m0_decode(torch.tensor([255], dtype=torch.uint8)).item())
    assert F.ue8m0_encode(torch.tensor([1.0, 0.125, 2.0 ** 127, math.inf, math.nan])).tolist() == [127, 124, 254,
                                                                                                    255, 255]
    for bad in (3.0, 0.0, -2.0):
        with pytest.raises(ValueError, match="powers of two"):
            F.ue8m0_encode(torch.tensor([bad]))


def test_fp32_helpers():
    x = torch.tensor([1.0, -2.0, 0.15625])
    assert F.fp32_bits(x).tolist() == [0x3F800000, 0xC0000000, 0x3E200000]
    assert torch.equal(F.fp32_from_bits(F.fp32_bits(x)), x)
    assert F.pow2(torch.tensor([-126, 0, 127])).tolist() == [2.0 ** -126, 1.0, 2.0 ** 127]
    with pytest.raises(ValueError):
        F.pow2(torch.tensor([128]))
