"""Per-token casts (fp_recipes.ops.per_token_cast / cast_back): hand-computed E5M6 and E4M3 cases,
round_sf and UE8M0, blocks, non-finite rows, the seed-000 amax-in-FP32 regression, validation.

Codes are worked out by hand from the bit layouts (E5M6 = top 12 bits of FP16); FP32 quotients come
from numpy float32 arithmetic."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp_recipes import ops
from fp_recipes.formats import unpack_e5m6

np32 = np.float32


def _hand_pack(codes):
    """Pack 8 12-bit codes by string manipulation: a 96-bit big-endian hex stream cut into 3 words."""
    stream = "".join(f"{c:03X}" for c in codes)
    words = [int(stream[i:i + 8], 16) for i in (0, 8, 16)]
    return [(w >> (8 * k)) & 0xFF for w in words for k in range(4)]


def test_e5m6_hand_no_round_sf():
    x = torch.tensor([[1.0, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0]])
    r = ops.per_token_cast(x, "e5m6")
    # a = 2; sf_inv = 65024/2 = 32512 = 2^14 * (1+63/64) -> 0x77F; -16256 -> 0xF3F; 65024 -> 0x7BF
    assert r.data.tolist() == [_hand_pack([0x77F, 0xF3F, 0, 0, 0, 0, 0, 0x7BF])]
    assert r.data.tolist() == [[0x00, 0x3F, 0xFF, 0x77, 0, 0, 0, 0, 0xBF, 0x07, 0, 0]]
    assert r.scales.shape == (1, 1) and r.scales.dtype == torch.float32
    assert r.scales.item() == float(np32(2.0) / np32(65024.0))


def test_e5m6_hand_round_sf_and_ue8m0():
    x = torch.tensor([[1.0, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0]])
    r = ops.per_token_cast(x, "e5m6", round_sf=True)
    # sf = 2/65024 = 3.08e-5 -> 2^ceil(log2) = 2^-14; sf_inv = 16384: 1 -> 2^14 -> 0x740,
    # -0.5 -> 0xF00, 2 -> 2^15 -> 0x780
    assert r.data.tolist() == [_hand_pack([0x740, 0xF00, 0, 0, 0, 0, 0, 0x780])]
    assert r.scales.item() == 2.0 ** -14
    u = ops.per_token_cast(x, "e5m6", round_sf=True, scale_format="ue8m0")
    assert u.scales.dtype == torch.uint8 and u.scales.tolist() == [[127 - 14]]
    assert torch.equal(u.data, r.data)
    back = ops.cast_back(u.data, u.scales, "e5m6", scale_format="ue8m0", out_dtype=torch.float32)
    assert torch.equal(back, x)


def test_round_sf_exact_power_of_two_is_not_bumped():
    x = torch.zeros(1, 8)
    x[0, 3] = 63.5  # 63.5 / 65024 = 2^-10 exactly -> e = -10, not -9
    r = ops.per_token_cast(x, "e5m6", round_sf=True, scale_format="ue8m0")
    assert r.scales.tolist() == [[117]]
    assert r.data.tolist() == [_hand_pack([0, 0, 0, 0x7BF, 0, 0, 0, 0])]


def test_e4m3_per_token_hand():
    x = torch.tensor([[1.0, -3.0, 0.5, 0.25]])
    r = ops.per_token_cast(x, "e4m3")
    # sf_inv = fp32(448/3) = 149.333: 149.3 -> 144 (0x71); -448 -> 0xFE; 74.7 -> 72 (0x69); 37.3 -> 36 (0x61)
    assert r.data.dtype == torch.float8_e4m3fn
    assert r.data.view(torch.uint8).tolist() == [[0x71, 0xFE, 0x69, 0x61]]
    assert r.scales.item() == float(np32(3.0) / np32(448.0))
    p = ops.per_token_cast(x, "e4m3", round_sf=True, scale_format="ue8m0")
    # sf = 3/448 = 0.0067 -> 2^-7; sf_inv = 128: 128 -> 0x70, -384 -> 0xFC, 64 -> 0x68, 32 -> 0x60
    assert p.data.view(torch.uint8).tolist() == [[0x70, 0xFC, 0x68, 0x60]]
    assert p.scales.tolist() == [[120]]
    back = ops.cast_back(r.data, r.scales, "e4m3", out_dtype=torch.float32)
    s = np32(r.scales.item())
    assert back.tolist() == [[float(np32(v) * s) for v in (144.0, -448.0, 72.0, 36.0)]]


def test_zero_row_uses_the_fp32_amax_floor():
    r = ops.per_token_cast(torch.zeros(2, 8, dtype=torch.bfloat16), "e5m6")
    assert r.data.tolist() == [[0] * 12] * 2
    assert r.scales[:, 0].tolist() == [float(np32(1e-4) / np32(65024.0))] * 2


# ---- seed 000: the amax is accumulated in FP32 ---------------------------------------------------

def test_seed000_bf16_row_true_amax_sets_the_power_of_two():
    # A wide BF16 row (7168 channels) whose max 63.75 sits in the last channel. 63.75/65024 is just
    # above 2^-10, so round_sf must pick 2^-9 (byte 118); an accumulator that loses the max (or rounds
    # it down to 63.5) picks 2^-10, one power of two too small, and the packed bytes change.
    h = 7168
    x = torch.full((2, h), 0.001, dtype=torch.bfloat16)
    x[:, -1] = 63.75
    x[1, 0] = -63.75
    r = ops.per_token_cast(x, "e5m6", round_sf=True, scale_format="ue8m0")
    assert r.scales.tolist() == [[118], [118]]
    # 63.75 * 2^9 = 32640 = 2^14 * (1 + 127/128): a tie between 63/64 and 2 -> even -> 2^15 = 0x780
    codes = unpack_e5m6(r.data)
    assert codes[0, -1].item() == 0x780 and codes[1, 0].item() == 0xF80 and codes[1, -1].item() == 0x780
    back = ops.cast_back(r.data, r.scales, "e5m6", scale_format="ue8m0")
    assert torch.isfinite(back.float()).all()


def test_seed000_fp32_amax_not_rounded_to_bf16():
    # FP32 input 63.5 * (1 + 2^-20): rounded to BF16 it would be 63.5 (sf = 2^-10 exactly, e = -10);
    # the FP32 amax gives sf slightly above 2^-10 -> e = -9, and the value encodes as 32512 -> 0x77F.
    v = float(np32(63.5) * np32(1 + 2 ** -20))
    x = torch.zeros(1, 8)
    x[0, 0] = v
    r = ops.per_token_cast(x, "e5m6", round_sf=True, scale_format="ue8m0")
    assert r.scales.tolist() == [[118]]
    assert r.data.tolist() == [_hand_pack([0x77F, 0, 0, 0, 0, 0, 0, 0])]


def test_seed000_floor_is_fp32_1e4_not_bf16():
    # rows below the floor use fp32(1e-4); a BF16 accumulator seeded with the floor holds 1.0014e-4
    x = torch.full((1, 8), 1e-6, dtype=torch.bfloat16)
    r = ops.per_token_cast(x, "e5m6")
    assert r.scales.item() == float(np32(1e-4) / np32(65024.0))
    bf16_floor = torch.tensor(1e-4, dtype=torch.bfloat16).item()
    assert r.scales.item() != float(np32(bf16_floor) / np32(65024.0))


# ---- blocks, non-finite, shapes --------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["e5m6", "e4m3"])
def test_blocks_equal_separate_casts(fmt):
    torch.manual_seed(3)
    x = torch.randn(3, 32, dtype=torch.bfloat16) * torch.tensor([1.0, 100.0, 0.01, 5.0]).repeat_interleave(8)
    r = ops.per_token_cast(x, fmt, round_sf=True, block_size=8)
    assert r.scales.shape == (3, 4)
    for b in range(4):
        one = ops.per_token_cast(x[:, 8 * b:8 * b + 8].contiguous(), fmt, round_sf=True)
        assert torch.equal(r.scales[:, b:b + 1], one.scales)
        w = 12 if fmt == "e5m6" else 8
        got = r.data.view(torch.uint8)[:, w * b:w * b + w]
        assert torch.equal(got, one.data.view(torch.uint8))
    back = ops.cast_back(r.data, r.scales, fmt, block_size=8, out_dtype=torch.float32)
    assert back.shape == (3, 32)


def test_non_finite_block_is_nan():
    x = torch.ones(2, 16)
    x[0, 2] = math.nan
    x[1, 12] = math.inf
    r = ops.per_token_cast(x, "e5m6", round_sf=True, scale_format="ue8m0", block_size=8)
    # finite blocks: a = 1 -> sf = 1/65024 = 1.54e-5 -> 2^-15 -> byte 112
    assert r.scales.tolist() == [[255, 112], [112, 255]]
    assert r.data[0, :12].tolist() == _hand_pack([0x7FF] * 8)
    assert r.data[1, 12:].tolist() == _hand_pack([0x7FF] * 8)
    back = ops.cast_back(r.data, r.scales, "e5m6", scale_format="ue8m0", block_size=8, out_dtype=torch.float32)
    assert torch.isnan(back[0, :8]).all() and torch.isnan(back[1, 8:]).all()
    assert (back[0, 8:] == 1).all() and (back[1, :8] == 1).all()
    f = ops.per_token_cast(x, "e4m3")
    assert torch.isnan(f.scales).all() and (f.data.view(torch.uint8) == 0x7F).all()


def test_one_row_and_empty():
    r = ops.per_token_cast(torch.ones(1, 8), "e5m6")
    assert r.data.shape == (1, 12)
    e = ops.per_token_cast(torch.ones(0, 16), "e4m3", block_size=8)
    assert e.data.shape == (0, 16) and e.scales.shape == (0, 2)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.booleans(), st.sampled_from(["e5m6", "e4m3"]),
       st.integers(0, 2 ** 31 - 1))
def test_round_trip_error_bound_and_row_independence(t, h8, round_sf, fmt, seed):
    gen = torch.Generator().manual_seed(seed)
    h = 8 * h8
    x = (torch.randn(t, h, generator=gen) * torch.exp2(torch.randint(-10, 10, (t, 1), generator=gen).float()))
    x = x.to(torch.bfloat16)
    r = ops.per_token_cast(x, fmt, round_sf=round_sf)
    back = ops.cast_back(r.data, r.scales, fmt, out_dtype=torch.float32)
    # RN keeps 7 significant bits for E5M6 (relative error <= 2^-7) and 4 for E4M3 (2^-4); below the
    # normal range the error is at most one subnormal step (E5M6 2^-20, E4M3 2^-9) times the scale
    # (one full step, not half, because of the TileKernels rounding rule there)
    rel, step = (2.0 ** -7, 2.0 ** -20) if fmt == "e5m6" else (2.0 ** -4, 2.0 ** -9)
    bound = rel * x.float().abs() * (1 + 2.0 ** -20) + step * r.scales
    assert bool(((back - x.float()).abs() <= bound).all())
    # each row's bytes depend only on that row
    perm = torch.randperm(t, generator=gen)
    rp = ops.per_token_cast(x[perm], fmt, round_sf=round_sf)
    assert torch.equal(rp.data.view(torch.uint8), r.data.view(torch.uint8)[perm])
    assert torch.equal(rp.scales, r.scales[perm])


def test_validation():
    x = torch.ones(2, 16)
    with pytest.raises(ValueError, match="multiple of 8"):
        ops.per_token_cast(torch.ones(2, 12), "e5m6")
    with pytest.raises(ValueError, match="round_sf"):
        ops.per_token_cast(x, "e5m6", scale_format="ue8m0")
    with pytest.raises(ValueError, match="fmt"):
        ops.per_token_cast(x, "e5m2")
    with pytest.raises(ValueError, match="divide"):
        ops.per_token_cast(x, "e4m3", block_size=5)
    with pytest.raises(ValueError, match="multiple of 8"):
        ops.per_token_cast(x, "e5m6", block_size=4)
    with pytest.raises(ValueError, match="2-D"):
        ops.per_token_cast(torch.ones(2, 2, 8), "e5m6")
    with pytest.raises(TypeError, match="dtype"):
        ops.per_token_cast(torch.ones(2, 8, dtype=torch.float64), "e5m6")
    r = ops.per_token_cast(x, "e5m6", round_sf=True)
    with pytest.raises(ValueError, match="scales must have shape"):
        ops.cast_back(r.data, r.scales, "e5m6", block_size=8)
    with pytest.raises(TypeError, match="uint8"):
        ops.cast_back(r.data, r.scales, "e5m6", scale_format="ue8m0")
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        ops.cast_back(r.data, r.scales, "e4m3")


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.booleans(), st.integers(0, 2 ** 31 - 1))
def test_e5m6_cast_vs_numpy_oracle(t, h8, round_sf, seed):
    """Independent pipeline in numpy float32/float64: amax, sf, sf_inv, v, then RN to 7 significant bits
    (valid because every |v| here is >= 2^-14, where the TileKernels rule is exactly RN)."""
    rng = np.random.default_rng(seed)
    h = 8 * h8
    mag = np.exp2(rng.uniform(-9.5, 0, size=(t, h))) * np.exp2(rng.integers(-20, 20, size=(t, 1)))
    x = torch.tensor((mag * rng.choice([-1.0, 1.0], size=(t, h))).astype(np.float32))
    r = ops.per_token_cast(x, "e5m6", round_sf=round_sf)
    xn = x.numpy()
    a = np.maximum(np.abs(xn).max(axis=1, keepdims=True), np32(1e-4)).astype(np32)
    sf = (a / np32(65024.0)).astype(np32)
    if round_sf:
        sf = np.exp2(np.ceil(np.log2(sf.astype(np.float64)))).astype(np32)
        sf_inv = (np32(1.0) / sf).astype(np32)
    else:
        sf_inv = (np32(65024.0) / a).astype(np32)
    v = (xn * sf_inv).astype(np32).astype(np.float64)
    e = np.floor(np.log2(np.abs(v)))
    q = np.exp2(e - 6)
    rounded = np.round(v / q) * q  # numpy rounds half to even
    codes = (rounded.astype(np.float16).view(np.uint16) >> 4).astype(np.int16)
    assert torch.equal(unpack_e5m6(r.data), torch.from_numpy(codes))
    assert torch.equal(r.scales, torch.from_numpy(sf))
