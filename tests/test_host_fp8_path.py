"""The FP8 Linear hot path's host-time work (issue 14): the dense FP8 GEMM through cuBLASLt's cached plan
(torch._scaled_mm as the fallback), the amax recorded into the delayed-scaling history by the cast
kernel itself, the cached one-launch scale update and its non-finite flags read without a copy.

GPU tests compare against what ran before (torch._scaled_mm, the torch-op record and update) bit for
bit; the CPU tests check the fallbacks and the Python plumbing."""

from __future__ import annotations

import pytest
import torch

import fp_recipes
from fp_recipes.gemm import cublaslt
from fp_recipes.gemm import fp8 as gemm_fp8
from fp_recipes.gemm.operands import Fp8Operand

cuda = pytest.mark.cuda


def _fp8(shape, dtype, seed, device="cuda"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(shape, generator=g) * 2).to(dtype).to(device)


def _scale(v, device="cuda"):
    return torch.tensor(v, dtype=torch.float32, device=device)


def _scaled_mm_path(monkeypatch):
    """gemm_fp8_fp8 with the cached-plan path turned off (what ran before), in C++ and in Python."""
    monkeypatch.setattr(gemm_fp8, "_FAST_GEMM", [None])
    monkeypatch.setattr(cublaslt, "fp8_gemm", lambda *a, **k: None)


# ------------------------------------------------------------------------------------------- GPU

@cuda
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias_kind", ["none", "fused", "fp32"])
@pytest.mark.parametrize("shape", [(64, 128, 256), (333, 48, 96), (7, 40, 24), (256, 4096, 512)])
@pytest.mark.parametrize("b_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_dense_gemm_through_plan_equals_scaled_mm(out_dtype, bias_kind, shape, b_dtype, monkeypatch):
    assert cublaslt.available(), cublaslt.status()
    m, n, k = shape  # (7, 40, 24): N and K padded to 16, a fused bias padded with them
    a = Fp8Operand(_fp8((m, k), torch.float8_e4m3fn, 1), _scale(0.75))
    b = Fp8Operand(_fp8((n, k), b_dtype, 2), _scale(1.5))
    bias = None
    if bias_kind == "fused":
        bias = torch.randn(n, device="cuda").to(out_dtype)
    elif bias_kind == "fp32":
        bias = torch.randn(n, device="cuda")
    calls = []
    real = cublaslt.fp8_gemm

    def counting(*args, **kw):
        out = real(*args, **kw)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(cublaslt, "fp8_gemm", counting)
    for fast in (False, True):
        got = gemm_fp8.gemm_fp8_fp8(a, b, out_dtype=out_dtype, bias=bias, use_fast_accum=fast)  # default host path
        with monkeypatch.context() as mp:
            mp.setattr(gemm_fp8, "_FAST_GEMM", [None])  # the Python host path (FP_RECIPES_TORCH_OPS=off)
            got_python = gemm_fp8.gemm_fp8_fp8(a, b, out_dtype=out_dtype, bias=bias, use_fast_accum=fast)
        with monkeypatch.context() as mp:
            _scaled_mm_path(mp)
            want = gemm_fp8.gemm_fp8_fp8(a, b, out_dtype=out_dtype, bias=bias, use_fast_accum=fast)
        assert got.shape == want.shape == (m, n) and got.dtype == want.dtype == out_dtype
        # the same library and problem: the same algorithm, the same bits (as tests/test_gemm_lt.py)
        assert torch.equal(got, want), (shape, out_dtype, bias_kind, fast)
        assert torch.equal(got_python, want), (shape, out_dtype, bias_kind, fast, "python host path")
    assert calls and all(calls)  # the Python host path's cached plan ran every time


@cuda
def test_dense_gemm_strided_rows_and_refused_cases_fall_back(monkeypatch):
    a_full = _fp8((64, 96), torch.float8_e4m3fn, 3)
    a = Fp8Operand(a_full[:, :64], _scale(1.0))  # rows of 96 bytes: a strided view read in place
    b = Fp8Operand(_fp8((32, 64), torch.float8_e4m3fn, 4), _scale(2.0))
    got = gemm_fp8.gemm_fp8_fp8(a, b, out_dtype=torch.bfloat16)
    want = torch._scaled_mm(a_full[:, :64].contiguous(), b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv,
                            out_dtype=torch.bfloat16)
    assert torch.equal(got, want)
    # an unaligned scale pointer (a scale inside a packed vector): the binding refuses it (cuBLASLt
    # would, torch._scaled_mm's too); the GEMM runs on an aligned copy of the scale
    packed = torch.tensor([0.0, 1.0, 2.0], device="cuda")
    odd = Fp8Operand(b.data, packed[1])
    assert cublaslt.fp8_gemm(a.data.contiguous(), b.data, a.scale_inv, odd.scale_inv, torch.bfloat16) is None
    out = gemm_fp8.gemm_fp8_fp8(Fp8Operand(a.data.contiguous(), a.scale_inv), odd, out_dtype=torch.bfloat16)
    assert torch.equal(out, torch._scaled_mm(a.data.contiguous(), b.data.t(), scale_a=a.scale_inv,
                                             scale_b=packed[1].clone(), out_dtype=torch.bfloat16))


@cuda
def test_linear_step_runs_no_scaled_mm(monkeypatch):
    """A Linear fwd+bwd at aligned sizes: the three GEMMs go through the cached plans."""
    def refuse(*args, **kwargs):
        raise AssertionError("torch._scaled_mm called on the hot path")

    layer = fp_recipes.Linear(128, 64, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for recipe in (fp_recipes.DelayedScaling(), fp_recipes.Float8CurrentScaling()):
        with fp_recipes.autocast(recipe=recipe):
            layer(x).sum().backward()  # first step: plans made
        monkeypatch.setattr(torch, "_scaled_mm", refuse)
        with fp_recipes.autocast(recipe=recipe):
            layer(x).sum().backward()
        monkeypatch.undo()


# ------------------------------------------------------------------------------------------- CPU

def test_fallback_pads_a_fused_bias_with_n(monkeypatch):
    """N padded to 16 with a fused bias: torch._scaled_mm (here an FP32 emulation) gets a bias of the
    padded width, and the padding columns are sliced off."""
    seen = {}

    def fake_scaled_mm(a, b, *, scale_a, scale_b, bias=None, out_dtype=None, use_fast_accum=False):
        seen["bias"] = None if bias is None else tuple(bias.shape)
        out = (a.float() @ b.float()) * (scale_a * scale_b)
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype)

    monkeypatch.setattr(gemm_fp8, "fp8_native_gemm_available", lambda *a: True)
    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    a = Fp8Operand(_fp8((5, 32), torch.float8_e4m3fn, 5, "cpu"), _scale(0.5, "cpu"))
    b = Fp8Operand(_fp8((20, 32), torch.float8_e4m3fn, 6, "cpu"), _scale(2.0, "cpu"))
    bias = torch.randn(20).to(torch.bfloat16)
    out = gemm_fp8.gemm_fp8_fp8(a, b, out_dtype=torch.bfloat16, bias=bias)
    assert seen["bias"] == (32,) and out.shape == (5, 20)
    want = ((a.data.float() @ b.data.float().t()) * 1.0 + bias.float()).to(torch.bfloat16)
    assert torch.equal(out, want)


def test_plan_path_declines_without_cublaslt():
    if cublaslt.available():
        pytest.skip("cuBLASLt is loaded here")
    a = _fp8((16, 16), torch.float8_e4m3fn, 7, "cpu")
    assert cublaslt.fp8_gemm(a, a, _scale(1.0, "cpu"), _scale(1.0, "cpu"), torch.float32) is None


# ------------------------------------------------------------------- amax recorded by the cast kernel

def _delayed_quantizer(length: int = 4, device: str = "cuda", columnwise: bool = False):
    from fp_recipes.quantizers.float8 import Float8Quantizer
    from fp_recipes.quantizers.roles import (ModuleKind, QFormat, QuantizerRole, QuantizerSpec, ScalingKind,
                                             TensorKind)

    spec = QuantizerSpec(role=QuantizerRole(ModuleKind.LINEAR, TensorKind.ACTIVATION, 0, None),
                         scaling=ScalingKind.DELAYED, fmt=QFormat.E4M3, amax_history_len=length,
                         columnwise=columnwise)
    return Float8Quantizer(spec).to(device)


@cuda
@pytest.mark.parametrize("columnwise", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cast_records_amax_into_history_like_torch_maximum(columnwise, dtype, monkeypatch):
    from fp_recipes.quantizers import float8 as f8

    assert f8._cuda_quantize() is not None and f8._RECORDING[0](), "extension without fp8_quantize_record"
    fused, twin = _delayed_quantizer(columnwise=columnwise), _delayed_quantizer(columnwise=columnwise)
    starts = [0.0, 5.0, -3.0, float("nan"), 1e-30, -0.0]
    for i, start in enumerate(starts):
        x = (torch.randn(300, 272) * (i + 1)).to(dtype).cuda()
        if i == 2:
            x[7, 9] = float("nan")  # a NaN amax replaces a finite slot
        if i == 4:
            x.zero_()  # a zero amax: max(slot, 0)
        for q in (fused, twin):
            q.amax_history.fill_(7.0)
            q.amax_history[0] = start
        a = fused.quantize(x)
        with monkeypatch.context() as mp:
            mp.setattr(f8, "_RECORDING", [lambda: False, None])  # the cast, then torch.maximum
            b = twin.quantize(x)
        torch.cuda.synchronize()
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
        if columnwise:
            assert torch.equal(a.data_t.view(torch.uint8), b.data_t.view(torch.uint8))
        assert torch.equal(a.amax.view(torch.int32), b.amax.view(torch.int32))
        assert torch.equal(fused.amax_history.view(torch.int32), twin.amax_history.view(torch.int32)), (i, start)


@cuda
def test_mapped_nonfinite_flags_warn_after_one_update_without_a_copy():
    import warnings

    from fp_recipes.modules import amax_reduction
    from fp_recipes.quantizers.float8 import NonFiniteAmaxWarning

    qs = [_delayed_quantizer(16) for _ in range(3)]
    qs[1].amax_history[0] = float("inf")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        amax_reduction.batched_update_scales(qs)
        torch.cuda.synchronize()
        amax_reduction.batched_update_scales(qs)  # the fast path: same list, same tensors
    hits = [w for w in caught if issubclass(w.category, NonFiniteAmaxWarning)]
    assert len(hits) == 1 and [getattr(q, "nonfinite_warned", False) for q in qs] == [False, True, False]
    fast = amax_reduction._FAST_PLANS[tuple(map(id, qs))]
    assert all(watch._mapped for _, _, watch, _ in fast.steps)  # read from mapped memory, no copy


@cuda
@pytest.mark.parametrize("rows", [[300, 0, 17, 64], [5] * 70])  # a member without rows; > 64 members (2 chunks)
@pytest.mark.parametrize("cols", [272, 40])  # full and partial 64-column tiles
def test_multi_cast_records_every_members_amax_like_torch_maximum(rows, cols, monkeypatch):
    """GroupedLinear's one multi-cast of delayed scaling records each expert's amax into its history slot
    in the kernel: bit for bit what the cast followed by one _foreach_maximum_ records, whatever the slot
    held (0, larger, negative, NaN, -0.0), with NaN inputs, and a member with no rows merging 0."""
    from fp_recipes.quantizers import grouped

    g = len(rows)
    fused = [_delayed_quantizer(4, columnwise=True) for _ in range(g)]
    twin = [_delayed_quantizer(4, columnwise=True) for _ in range(g)]
    starts = [0.0, 1e6, -3.0, float("nan"), -0.0, 2.5]
    parts = [(torch.randn(m, cols) * (i % 7 + 1)).to(torch.bfloat16).cuda() for i, m in enumerate(rows)]
    if rows[0] > 10:
        parts[0][3, 5] = float("nan")
    for i in range(g):
        for q in (fused[i], twin[i]):
            q.amax_history.fill_(7.0)
            q.amax_history[0] = starts[i % len(starts)]
            q.scale.fill_(0.5 + i % 3)
    a = grouped.fp8_multi_cast(fused, parts)
    with monkeypatch.context() as mp:
        mp.setattr(grouped, "_record_slots", lambda qs, device: [])  # the cast, then _foreach_maximum_
        b = grouped.fp8_multi_cast(twin, parts)
    torch.cuda.synchronize()
    assert a.addressable and b.addressable
    assert torch.equal(a.data_buf.view(torch.uint8), b.data_buf.view(torch.uint8))
    assert torch.equal(a.data_t_buf.view(torch.uint8), b.data_t_buf.view(torch.uint8))
    # f32: scale_inv of member g at [4 g] (the 3 floats after each are padding), amaxes, scales
    for part in (slice(0, 4 * g, 4), slice(4 * g, 6 * g)):
        assert torch.equal(a.f32[part].view(torch.int32), b.f32[part].view(torch.int32))
    for i in range(g):
        # a NaN amax is recorded as the amax's own NaN (0x7FC00000, as torch.maximum and the single cast
        # record it); _foreach_maximum_ on CUDA returns a NaN of another payload: NaN positions must agree
        fh, th = fused[i].amax_history, twin[i].amax_history
        assert torch.equal(fh.isnan(), th.isnan()), i
        ok = ~fh.isnan()
        assert torch.equal(fh[ok].view(torch.int32), th[ok].view(torch.int32)), i
        assert torch.equal(fh[fh.isnan()].view(torch.int32), torch.full_like(fh[fh.isnan()], float("nan")).view(
            torch.int32) & 0 | 0x7FC00000), i
