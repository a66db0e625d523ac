"""fp_recipes.gemm: every format pair against an FP64 reference of the dequantized operands, the RHT pairing
rule, row-scaled epilogues, the NVFP4 decode's BF16 exactness, and grouped GEMMs (zero-size groups,
more than 64 groups). Tolerances: the FP32 dot-product bound of tests/_modules_helpers.py."""

from __future__ import annotations

import pytest
import torch

from fp_recipes import gemm as G
from fp_recipes.ops import reference as R
from fp_recipes.quantizers.float8 import Float8Tensor
from fp_recipes.quantizers.nvfp4 import NVFP4Tensor

from _modules_helpers import assert_close_gemm, gemm_tol, ref_mm

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _fp8(x, fmt, scale=None):
    if scale is None:
        r = R.fp8_current_scaling_quantize(x, fmt, rowwise=True, columnwise=True)
    else:
        r = R.fp8_quantize(x, torch.tensor(scale, device=x.device), fmt, rowwise=True, columnwise=True)
    t = Float8Tensor(r.data, r.scale_inv, r.amax, fmt, x.dtype, x.shape, data_t=r.data_t)
    return t, R.fp8_dequantize(r.data, r.scale_inv, torch.float32)


def _nvfp4(x, *, row_scaled=False, e4m3_max=448, rht=False, four_over_six=False, block_2d=False):
    xin = x.to(torch.bfloat16) if rht else x
    r = R.nvfp4_quantize(xin, rowwise=True, columnwise=True, row_scaled=row_scaled,
                         e4m3_max=e4m3_max, rht=rht, four_over_six=four_over_six, block_2d=block_2d)
    t = NVFP4Tensor(r.data, r.scale, r.amax, r.data_t, r.scale_t, r.amax_t, row_scaled=row_scaled,
                    e4m3_max=e4m3_max, four_over_six=four_over_six, rht_columnwise=rht, orig_dtype=x.dtype,
                    shape=x.shape)
    row = R.nvfp4_dequantize(r.data, r.scale, r.amax, e4m3_max=e4m3_max, row_scaled=row_scaled)
    col = R.nvfp4_dequantize(r.data_t, r.scale_t, r.amax_t, e4m3_max=e4m3_max)
    return t, row, col


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fa,fb", [("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e4m3"), ("e5m2", "e5m2")])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fp8_pairs(device, fa, fb, out_dtype):
    torch.manual_seed(0)
    m, k, n = 24, 40, 20  # not multiples of 16: the native path pads K and N
    a = torch.randn(m, k, device=device) * 3
    b = torch.randn(n, k, device=device) / 5
    bias = torch.randn(n, device=device)
    qa, da = _fp8(a, fa)
    qb, db = _fp8(b, fb, scale=17.0)
    out = G.gemm(qa, qb, out_dtype=out_dtype, bias=bias)
    assert out.dtype == out_dtype and out.shape == (m, n)
    exp = ref_mm(da, db) + bias.double()
    tc = G.fp8_native_gemm_available(a.device, qa.data.dtype, qb.data.dtype)
    assert tc == (device == "cuda" and (fa, fb) != ("e5m2", "e5m2"))
    assert_close_gemm(out, exp, gemm_tol(da, db, out_dtype, fp8_tensor_cores=tc) + 2 ** -8 * bias.double().abs(),
                      f"{fa}x{fb}")
    # the transposed copies (dgrad / wgrad layouts)
    out_t = G.gemm(qa, qa, transpose_a=True, transpose_b=True, out_dtype=torch.float32)
    assert_close_gemm(out_t, ref_mm(da.t(), da.t()),
                      gemm_tol(da.t(), da.t(), torch.float32, fp8_tensor_cores=device == "cuda"), "col x col")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("e_a,e_b", [(448, 448), (256, 448), (256, 256)])
def test_nvfp4_pair_alpha_epilogue(device, e_a, e_b):
    torch.manual_seed(1)
    a = torch.randn(32, 64, device=device) * 10
    b = torch.randn(48, 64, device=device) * 1e-3
    qa, da, _ = _nvfp4(a, e4m3_max=e_a, four_over_six=e_a == 256)
    qb, db, _ = _nvfp4(b, e4m3_max=e_b, block_2d=True)
    bias = torch.randn(48, device=device)
    out = G.gemm(qa, qb, out_dtype=torch.float32, bias=bias)
    assert_close_gemm(out, ref_mm(da, db) + bias.double(), gemm_tol(da, db, torch.float32, 16) + 2 ** -23 *
                      bias.double().abs(), "nvfp4")


@pytest.mark.parametrize("device", DEVICES)
def test_nvfp4_row_scaled_epilogue(device):
    torch.manual_seed(2)
    a = torch.randn(32, 64, device=device) * torch.logspace(-3, 3, 32, device=device).unsqueeze(1)
    b = torch.randn(16, 64, device=device)
    qa, da, _ = _nvfp4(a, row_scaled=True)
    qb, db, _ = _nvfp4(b)
    assert qa.amax.shape == (32,)
    out = G.gemm(qa, qb, out_dtype=torch.float32)
    assert_close_gemm(out, ref_mm(da, db), gemm_tol(da, db, torch.float32, 16), "row-scaled A")
    out2 = G.gemm(qb, qa, out_dtype=torch.float32)  # row-scaled operand on the N side: columns scaled
    assert_close_gemm(out2, ref_mm(db, da), gemm_tol(db, da, torch.float32, 16), "row-scaled B")
    # the epilogue order of NUMERICS.md: RN(RN(acc * alpha_unit) * RN(amax_r[m] * amax_w))
    unit_a = G.decode_nvfp4_unit(qa.data, qa.scale)
    unit_b = G.decode_nvfp4_unit(qb.data, qb.scale)
    acc = unit_a.cpu().double() @ unit_b.cpu().double().t()
    one = torch.ones((), device=device)
    alpha_unit = R.nvfp4_gemm_alpha(one, one, 448, 448).cpu()
    factor = (qa.amax * qb.amax).cpu()
    scale = alpha_unit.double() * factor.double().unsqueeze(1)
    exp = acc * scale
    tol = gemm_tol(unit_a.cpu(), unit_b.cpu(), torch.float32) * scale
    assert_close_gemm(out.cpu(), exp, tol, "row-scaled epilogue")


def test_nvfp4_never_folds_global_scale():
    """Block scales stay as quantized: changing only the global amax scales the output exactly."""
    torch.manual_seed(3)
    a, b = torch.randn(16, 32), torch.randn(16, 32)
    qa, _, _ = _nvfp4(a)
    qb, _, _ = _nvfp4(b)
    out1 = G.gemm(qa, qb, out_dtype=torch.float32)
    qa.amax = qa.amax * 4  # a power of two: alpha scales exactly, so must the output
    out4 = G.gemm(qa, qb, out_dtype=torch.float32)
    assert torch.equal(out4, out1 * 4)


def test_nvfp4_unit_decode_is_exact_in_bf16():
    """Every packed byte times every finite E4M3 scale: the FP32 decode equals the per-element formula
    of formats.py, and the BF16 decode equals the FP32 one exactly."""
    from fp_recipes import formats

    e4m3 = torch.arange(256, dtype=torch.uint8)
    e4m3 = e4m3[(e4m3 & 0x7F) != 0x7F]  # finite scales only
    codes = torch.arange(256, dtype=torch.uint8).repeat(e4m3.numel(), 8)  # (254, 2048): all bytes
    sc = e4m3.unsqueeze(1).expand(-1, 2048 * 2 // 16).contiguous().view(torch.float8_e4m3fn)
    vals = G.decode_nvfp4_unit(codes, sc)
    ref = formats.e2m1_decode(formats.unpack_e2m1(codes)).float().reshape(e4m3.numel(), -1, 16) * \
        sc.float().unsqueeze(-1)
    assert torch.equal(vals, ref.reshape(vals.shape))
    assert torch.equal(G.decode_nvfp4_unit(codes, sc, torch.bfloat16).float(), vals)
    assert vals.abs().max().item() <= 448 * 6


def test_rht_operands_must_pair():
    torch.manual_seed(4)
    x = torch.randn(32, 32)
    q_rht, _, col_rht = _nvfp4(x, rht=True)
    q_plain, _, _ = _nvfp4(x)
    with pytest.raises(ValueError, match="RHT"):
        G.gemm(q_rht, q_plain, transpose_a=True, transpose_b=True)
    with pytest.raises(ValueError, match="RHT"):
        G.gemm(q_rht, torch.randn(32, 32), transpose_a=True)
    # both transformed: the orthogonal transform cancels, x^T x is recovered
    out = G.gemm(q_rht, q_rht, transpose_a=True, transpose_b=True, out_dtype=torch.float32)
    assert_close_gemm(out, ref_mm(col_rht, col_rht), gemm_tol(col_rht, col_rht, torch.float32, 16), "rht")
    exact = x.double().t() @ x.double()
    assert (out.double() - exact).norm() / exact.norm() < 0.2


def test_mixed_and_high_precision_operands():
    torch.manual_seed(5)
    a = torch.randn(8, 32)
    b = torch.randn(16, 32)
    qb, db = _fp8(b, "e4m3")
    out = G.gemm(a, qb, out_dtype=torch.float32)
    assert_close_gemm(out, ref_mm(a, db), gemm_tol(a, db, torch.float32), "hp x fp8")
    ab, bb = a.bfloat16(), b.bfloat16()
    assert torch.equal(G.gemm(ab, bb, out_dtype=torch.bfloat16), ab @ bb.t())  # torch's own matmul
    with pytest.raises(ValueError, match="contraction"):
        G.gemm(a, torch.randn(4, 16))
    with pytest.raises(TypeError, match="unsupported operand"):
        G.gemm(a, "b")


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_gemm_zero_size_and_many_groups(device):
    torch.manual_seed(6)
    num, k, n = 70, 32, 16
    rows = [(i * 5) % 7 * 16 for i in range(num)]  # zeros included
    a = [torch.randn(r, k, device=device) for r in rows]
    b = [torch.randn(n, k, device=device) for _ in range(num)]
    qa = [_fp8(x, "e4m3") for x in a]
    qb = [_fp8(x, "e4m3", scale=float(i + 1)) for i, x in enumerate(b)]
    out = G.grouped_gemm([q for q, _ in qa], [q for q, _ in qb], out_dtype=torch.bfloat16)
    exp = torch.cat([ref_mm(da, db) for (_, da), (_, db) in zip(qa, qb)])
    tol = torch.cat([gemm_tol(da, db, torch.bfloat16, fp8_tensor_cores=device == "cuda")
                     for (_, da), (_, db) in zip(qa, qb)])
    assert out.shape == (sum(rows), n)
    assert_close_gemm(out, exp, tol, "grouped fp8")
    # per-expert NVFP4 alpha
    qa4 = [_nvfp4(x * (i + 1)) for i, x in enumerate(a[:6]) if x.shape[0]]
    qb4 = [_nvfp4(x) for x in b[:len(qa4)]]
    out4 = G.grouped_gemm([q for q, _, _ in qa4], [q for q, _, _ in qb4], out_dtype=torch.float32)
    exp4 = torch.cat([ref_mm(da, db) for (_, da, _), (_, db, _) in zip(qa4, qb4)])
    tol4 = torch.cat([gemm_tol(da, db, torch.float32, 16) for (_, da, _), (_, db, _) in zip(qa4, qb4)])
    assert_close_gemm(out4, exp4, tol4, "grouped nvfp4")
    with pytest.raises(ValueError, match="operands"):
        G.grouped_gemm(qa[:2], qb[:3], out_dtype=torch.float32)
