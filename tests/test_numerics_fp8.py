"""FP8 per-tensor reference ops (fp_recipes.ops.fp8_*): hand-computed cases, current-scaling rules,
grouped semantics (1, 63, 64, 65, 1000 members, empty members) and input validation.

Expected codes below are worked out by hand from the E4M3/E5M2 bit layouts; FP32 quotients are
computed with numpy's float32 arithmetic (an independent IEEE implementation)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp_recipes import ops

u8 = lambda t: t.view(torch.uint8)  # noqa: E731
f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731


# ---- fp8_quantize / fp8_dequantize --------------------------------------------------------------

def test_fp8_quantize_hand_e4m3():
    x = torch.tensor([[1.0, -2.5, 300.0, 0.0]])
    r = ops.fp8_quantize(x, f32(2.0), "e4m3")
    # x*2 = 2 -> 0x40; -5 = -1.25*2^2 -> 0xCA; 600 -> saturates to 448 = 0x7E; 0 -> 0x00
    assert u8(r.data).tolist() == [[0x40, 0xCA, 0x7E, 0x00]]
    assert r.data.dtype == torch.float8_e4m3fn and r.data_t is None
    assert r.scale_inv.item() == 0.5 and r.amax.item() == 300.0 and r.scale.item() == 2.0
    assert r.scale_inv.dim() == 0 and r.amax.dim() == 0 and r.amax.dtype == torch.float32


def test_fp8_quantize_hand_e5m2():
    x = torch.tensor([[1.0, -2.5, 300.0, 0.0, 1e6]])
    r = ops.fp8_quantize(x, f32(2.0), "e5m2")
    # 2 -> 0x40; -5 -> 0xC5; 600 = 1.171875*2^9 -> nearest 1.25*2^9 = 640 -> 0x61; 2e6 -> 57344 = 0x7B
    assert u8(r.data).tolist() == [[0x40, 0xC5, 0x61, 0x00, 0x7B]]
    assert r.data.dtype == torch.float8_e5m2


def test_fp8_quantize_specials_and_columnwise():
    x = torch.tensor([[math.inf, -math.inf, math.nan], [1.0, -0.0, 2.0 ** -12]])
    r = ops.fp8_quantize(x, f32(1.0), "e4m3", rowwise=True, columnwise=True)
    # +-Inf saturate, NaN -> 0x7F, -0 keeps its sign, 2^-12 underflows (below half of 2^-9) to 0
    assert u8(r.data).tolist() == [[0x7E, 0xFE, 0x7F], [0x38, 0x80, 0x00]]
    assert math.isnan(r.amax.item())  # NaN anywhere -> NaN amax
    assert r.data_t.shape == (3, 2) and r.data_t.is_contiguous()
    assert torch.equal(u8(r.data_t), u8(r.data).t())
    only_col = ops.fp8_quantize(x, f32(1.0), "e4m3", rowwise=False, columnwise=True)
    assert only_col.data is None and torch.equal(u8(only_col.data_t), u8(r.data_t))


def test_fp8_columnwise_equals_quantizing_the_transpose():
    torch.manual_seed(0)
    x = torch.randn(7, 13, dtype=torch.bfloat16) * 10
    r = ops.fp8_quantize(x, f32(3.0), "e4m3", columnwise=True)
    rt = ops.fp8_quantize(x.t().contiguous(), f32(3.0), "e4m3")
    assert torch.equal(u8(r.data_t), u8(rt.data))


def test_fp8_input_dtypes_give_the_same_bytes():
    torch.manual_seed(1)
    xb = torch.randn(5, 9, dtype=torch.bfloat16)
    ref = ops.fp8_quantize(xb.float(), f32(7.0), "e4m3")
    for dt in (torch.bfloat16, torch.float16):
        got = ops.fp8_quantize(xb.to(dt), f32(7.0), "e4m3")
        assert torch.equal(u8(got.data), u8(ref.data)) and torch.equal(got.amax, ref.amax)


def test_fp8_one_row_zero_rows_zeros():
    r = ops.fp8_quantize(torch.zeros(1, 5), f32(4.0), "e4m3")
    assert u8(r.data).tolist() == [[0] * 5] and r.amax.item() == 0.0
    r = ops.fp8_quantize(torch.zeros(0, 5), f32(4.0), "e5m2", columnwise=True)
    assert r.data.shape == (0, 5) and r.data_t.shape == (5, 0) and r.amax.item() == 0.0


def test_fp8_dequantize_hand():
    data = torch.tensor([[0x40, 0xCA, 0x7E, 0x7F]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    out = ops.fp8_dequantize(data, f32(0.5), torch.float32)
    assert out[0, :3].tolist() == [1.0, -2.5, 224.0] and math.isnan(out[0, 3].item())
    # BF16 output: the FP32 product RN(1.125 * fp32(1/3)) then one RN cast to BF16
    d = torch.tensor([0x39], dtype=torch.uint8).view(torch.float8_e4m3fn)  # 1.125
    s = f32(np.float32(1) / np.float32(3))  # 0.3333333432674408
    got = ops.fp8_dequantize(d, s, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert got.item() == torch.tensor(float(np.float32(1.125) * np.float32(s.item()))).to(torch.bfloat16).item()


def test_fp8_amax():
    assert ops.fp8_amax(torch.tensor([[-3.0, 2.0]], dtype=torch.bfloat16)).item() == 3.0
    assert ops.fp8_amax(torch.zeros(0, 3)).item() == 0.0
    assert math.isinf(ops.fp8_amax(torch.tensor([[1.0, -math.inf]])).item())
    assert math.isnan(ops.fp8_amax(torch.tensor([[math.inf, math.nan, 1.0]])).item())
    assert ops.fp8_amax(torch.ones(2, 2)).dtype == torch.float32


# ---- current scaling ----------------------------------------------------------------------------

def test_current_scaling_hand():
    x = torch.tensor([[3.0, -1.5]])
    r = ops.fp8_current_scaling_quantize(x, "e4m3")
    s = np.float32(448.0) / np.float32(3.0)
    assert r.scale.item() == float(s) and r.amax.item() == 3.0
    assert r.scale_inv.item() == float(np.float32(1.0) / s)
    assert u8(r.data).tolist()[0][0] == 0x7E  # 3 * s rounds to 448
    p2 = ops.fp8_current_scaling_quantize(x, "e4m3", use_power_2_scales=True)
    # 2^floor(log2 149.33) = 128: 3*128 = 384 = 1.5*2^8 -> 0x7C; -192 = -1.5*2^7 -> 0xF4
    assert p2.scale.item() == 128.0 and p2.scale_inv.item() == 1 / 128
    assert u8(p2.data).tolist() == [[0x7C, 0xF4]]
    e5 = ops.fp8_current_scaling_quantize(x, "e5m2", use_power_2_scales=True)
    assert e5.scale.item() == 16384.0  # 57344/3 = 19114.67 -> 2^14


def test_current_scaling_edge_rules():
    z = ops.fp8_current_scaling_quantize(torch.zeros(2, 3), "e4m3")
    assert z.scale.item() == 1.0 and z.scale_inv.item() == 1.0 and z.amax.item() == 0.0
    inf = ops.fp8_current_scaling_quantize(torch.tensor([[1.0, math.inf]]), "e4m3")
    assert inf.scale.item() == 1.0 and u8(inf.data).tolist() == [[0x38, 0x7E]] and math.isinf(inf.amax.item())
    nan = ops.fp8_current_scaling_quantize(torch.tensor([[1.0, math.nan]]), "e4m3")
    assert nan.scale.item() == 1.0 and u8(nan.data).tolist() == [[0x38, 0x7F]] and math.isnan(nan.amax.item())
    eps = ops.fp8_current_scaling_quantize(torch.full((1, 2), 1e-8), "e4m3", amax_epsilon=1.0)
    assert eps.scale.item() == 448.0 and eps.amax.item() == float(np.float32(1e-8))  # raw amax reported
    tiny = ops.fp8_current_scaling_quantize(torch.tensor([[1e-40]]), "e4m3")  # 448 / 1e-40 overflows
    assert tiny.scale.item() == float(np.finfo(np.float32).max)
    tiny2 = ops.fp8_current_scaling_quantize(torch.tensor([[1e-40]]), "e4m3", use_power_2_scales=True)
    assert tiny2.scale.item() == 2.0 ** 127
    exact = ops.fp8_current_scaling_quantize(torch.tensor([[7.0]]), "e4m3", use_power_2_scales=True)
    assert exact.scale.item() == 64.0  # 448/7 = 64 exactly: stays 64


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-1e4, 1e4, width=32), min_size=1, max_size=40), st.booleans(),
       st.sampled_from(["e4m3", "e5m2"]))
def test_current_scaling_equals_quantize_with_its_scale(vals, pow2, fmt):
    x = torch.tensor([vals], dtype=torch.float32)
    cur = ops.fp8_current_scaling_quantize(x, fmt, use_power_2_scales=pow2)
    ref = ops.fp8_quantize(x, cur.scale, fmt)
    assert torch.equal(u8(cur.data), u8(ref.data))
    mx = 448.0 if fmt == "e4m3" else 57344.0
    if cur.amax.item() > 0:
        assert cur.scale.item() * cur.amax.item() <= mx * (1 + 2 ** -20)
        if pow2:
            m, _ = math.frexp(cur.scale.item())
            assert m == 0.5


# ---- validation -----------------------------------------------------------------------------------

def test_fp8_input_validation():
    x = torch.ones(2, 3)
    with pytest.raises(TypeError, match="int32"):
        ops.fp8_quantize(torch.ones(2, 3, dtype=torch.int32), f32(1.0), "e4m3")
    with pytest.raises(ValueError, match="2-D"):
        ops.fp8_quantize(torch.ones(2, 3, 4), f32(1.0), "e4m3")
    with pytest.raises(ValueError, match="fmt"):
        ops.fp8_quantize(x, f32(1.0), "e3m4")
    with pytest.raises(TypeError, match="float32"):
        ops.fp8_quantize(x, torch.tensor(1.0, dtype=torch.float64), "e4m3")
    with pytest.raises(ValueError, match="shape"):
        ops.fp8_quantize(x, torch.ones(1), "e4m3")
    with pytest.raises(ValueError, match="same device"):
        ops.fp8_quantize(x, torch.ones((), device="meta"), "e4m3")
    with pytest.raises(ValueError, match="both False"):
        ops.fp8_quantize(x, f32(1.0), "e4m3", rowwise=False)
    with pytest.raises(TypeError, match="float8"):
        ops.fp8_dequantize(x, f32(1.0))
    with pytest.raises(TypeError, match="out_dtype"):
        ops.fp8_dequantize(ops.fp8_quantize(x, f32(1.0), "e4m3").data, f32(1.0), torch.int8)
    with pytest.raises(ValueError, match="amax_epsilon"):
        ops.fp8_current_scaling_quantize(x, "e4m3", amax_epsilon=-1.0)


# ---- grouped --------------------------------------------------------------------------------------

def _random_group(g: int, seed: int, max_numel: int, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, max_numel + 1, (g,), generator=gen)
    sizes[torch.randint(0, g, (max(1, g // 5),), generator=gen)] = 0  # plenty of empty members
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(sizes, 0)])
    x = (torch.randn(int(offsets[-1]), generator=gen) * torch.exp2(torch.randint(-8, 8, (int(offsets[-1]),),
                                                                                  generator=gen).float())).to(dtype)
    scales = torch.exp2(torch.randint(-4, 6, (g,), generator=gen).float()) * 1.37
    return x, offsets, scales


@pytest.mark.parametrize("g", [1, 63, 64, 65, 1000])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_grouped_equals_single_tensor_op_per_member(g, fmt):
    x, offsets, scales = _random_group(g, seed=g, max_numel=40 if g < 1000 else 12)
    r = ops.fp8_grouped_quantize(x, offsets, scales, fmt)
    assert r.data.shape == x.shape and r.scale_inv.shape == (g,) and r.amax.shape == (g,)
    deq = ops.fp8_grouped_dequantize(r.data, offsets, r.scale_inv, torch.float32)
    for i in range(g):
        a, b = int(offsets[i]), int(offsets[i + 1])
        one = ops.fp8_quantize(x[a:b].reshape(1, -1), scales[i], fmt)
        assert torch.equal(u8(r.data[a:b]), u8(one.data).reshape(-1)), f"member {i}"
        assert torch.equal(r.amax[i], one.amax) and torch.equal(r.scale_inv[i], one.scale_inv)
        assert torch.equal(deq[a:b], ops.fp8_dequantize(one.data, one.scale_inv).reshape(-1))
        if a == b:
            assert r.amax[i].item() == 0.0
    amax = ops.fp8_grouped_amax(x, offsets)
    assert torch.equal(amax, r.amax)


def test_grouped_2d_buffer_nan_and_zero_members():
    x = torch.tensor([[1.0, 2.0, math.nan], [4.0, -8.0, 0.5]])
    offsets = torch.tensor([0, 2, 2, 4, 6])  # members: [1,2] | empty | [nan,4] | [-8,0.5]
    r = ops.fp8_grouped_quantize(x, offsets, torch.tensor([1.0, 3.0, 2.0, 0.5]), "e4m3")
    assert r.data.shape == (2, 3)
    assert r.amax[0].item() == 2.0 and r.amax[1].item() == 0.0 and math.isnan(r.amax[2].item())
    assert r.amax[3].item() == 8.0
    # 1 -> 0x38, 2 -> 0x40, NaN -> 0x7F, 4*2 = 8 -> 0x50, -8*0.5 = -4 -> 0xC8, 0.5*0.5 = 0.25 -> 0x28
    assert u8(r.data).tolist() == [[0x38, 0x40, 0x7F], [0x50, 0xC8, 0x28]]
    assert r.scale_inv.tolist() == [1.0, float(np.float32(1) / np.float32(3)), 0.5, 2.0]


def test_grouped_zero_members():
    r = ops.fp8_grouped_quantize(torch.zeros(0), torch.zeros(1, dtype=torch.int64), torch.zeros(0), "e4m3")
    assert r.data.numel() == 0 and r.amax.shape == (0,) and r.scale_inv.shape == (0,)


def test_grouped_validation():
    x = torch.ones(6)
    s = torch.ones(2)
    with pytest.raises(TypeError, match="int64"):
        ops.fp8_grouped_quantize(x, torch.tensor([0, 3, 6], dtype=torch.int32), s, "e4m3")
    with pytest.raises(ValueError, match=r"offsets\[0\]"):
        ops.fp8_grouped_quantize(x, torch.tensor([1, 3, 6]), s, "e4m3")
    with pytest.raises(ValueError, match="non-decreasing"):
        ops.fp8_grouped_quantize(x, torch.tensor([0, 4, 3, 6]), torch.ones(3), "e4m3")
    with pytest.raises(ValueError, match="number of elements"):
        ops.fp8_grouped_quantize(x, torch.tensor([0, 3, 5]), s, "e4m3")
    with pytest.raises(ValueError, match="shape"):
        ops.fp8_grouped_quantize(x, torch.tensor([0, 3, 6]), torch.ones(3), "e4m3")
    with pytest.raises(ValueError, match="contiguous"):
        ops.fp8_grouped_quantize(torch.ones(4, 3).t(), torch.tensor([0, 6, 12]), s, "e4m3")
    with pytest.raises(ValueError, match="1-D or 2-D"):
        ops.fp8_grouped_quantize(torch.ones(1, 2, 3), torch.tensor([0, 3, 6]), s, "e4m3")


# ---- random odd shapes against an independent oracle ------------------------------------------------

def _oracle_fp8(x: torch.Tensor, scale: float, fmt: str) -> torch.Tensor:
    """Independent FP8 cast: FP32 product, clamp to +-max, torch's RN cast; NaN -> 0x7F."""
    mx = 448.0 if fmt == "e4m3" else 57344.0
    y = x.float() * torch.tensor(scale, dtype=torch.float32)
    codes = torch.clamp(y, -mx, mx).to(torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2)
    codes = codes.view(torch.uint8).clone()
    codes[torch.isnan(y)] = 0x7F
    return codes


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 9), st.integers(1, 9), st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       st.sampled_from(["e4m3", "e5m2"]), st.floats(2.0 ** -20, 2.0 ** 20), st.integers(0, 2 ** 31 - 1))
def test_fp8_quantize_odd_shapes_vs_oracle(m, n, dtype, fmt, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, n, generator=gen) * torch.exp2(torch.randint(-12, 12, (m, n), generator=gen).float())
    x.view(-1)[torch.randint(0, m * n, (1,), generator=gen)] = float(torch.tensor([math.inf, -math.inf, math.nan,
                                                                                   6e4, 0.0])[seed % 5])
    x = x.to(dtype)
    s = torch.tensor(scale, dtype=torch.float32)
    r = ops.fp8_quantize(x, s, fmt, columnwise=True)
    want = _oracle_fp8(x, s.item(), fmt)
    assert torch.equal(u8(r.data), want) and torch.equal(u8(r.data_t), want.t())
    finite_amax = x.float().abs().max()
    assert torch.equal(r.amax, finite_amax) or (math.isnan(r.amax.item()) and torch.isnan(x).any())
