"""The fast emulated NVFP4 GEMM: the unit-decode kernel and the GEMM alpha it writes (bit-equal to the
torch twins ``gemm.nvfp4_emulated.decode_nvfp4_unit`` and ``ref_nvfp4.nvfp4_gemm_alpha``), the row-scaled epilogue
kernel (bit-equal to the emulation's torch epilogue on the same FP32 input), the cuBLASLt GEMM with a device
alpha against the torch emulation, and (CPU) the host-side wiring of ``gemm.nvfp4_emulated.gemm_nvfp4_emulated_cuda``.

GEMM tolerances: both paths multiply the same BF16-exact operands with FP32 accumulation, but cuBLAS
picks the summation order per call, so outputs agree to the FP32 dot-product bound of
tests/_modules_helpers.py (plus one output-dtype rounding), never bit for bit."""

from __future__ import annotations

import pytest
import torch

from fp_recipes.gemm import nvfp4_emulated as E
from fp_recipes.gemm._common import finish
from fp_recipes.gemm.operands import Nvfp4Operand
from fp_recipes.ops import ref_nvfp4 as R

from _modules_helpers import assert_close_gemm, gemm_tol

cuda = pytest.mark.cuda


def _codes(rows: int, k: int, gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed codes (every byte value) and E4M3 scales (every code but NaN)."""
    data = torch.randint(0, 256, (rows, k // 2), generator=gen, dtype=torch.uint8)
    scale = torch.randint(0, 256, (rows, k // 16), generator=gen, dtype=torch.uint8)
    scale[(scale & 0x7F) == 0x7F] = 0x3C  # NaN codes are tested on their own
    return data.to(device), scale.view(torch.float8_e4m3fn).to(device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


# ---------------------------------------------------------------------------------------------------
# CUDA: kernels against their twins
# ---------------------------------------------------------------------------------------------------


@cuda
# (block counts: tails of a 32-block warp below 16 (9, 170, 645 blocks), above 16 (7 x 272: 119 = 3 x 32 + 23) and on
# a warp boundary (1000 x 64), for a decode whose lanes split blocks as benchmarks/nvfp4_variants/decode_bench.cu's)
@pytest.mark.parametrize("rows,k", [(1, 16), (1, 32), (3, 48), (17, 160), (256, 4096), (1000, 64), (5, 16 * 129),
                                    (7, 272)])
def test_unit_decode_bit_equal_to_twin(rows, k):
    from fp_recipes.ops import cuda_nvfp4 as C

    gen = torch.Generator().manual_seed(rows * 7 + k)
    data, scale = _codes(rows, k, gen, "cuda")
    (out,), ab = C.nvfp4_unit_operands([(data, scale)], with_alpha=False)
    assert ab is None and out.dtype == torch.bfloat16 and out.shape == (rows, k)
    expect = E.decode_nvfp4_unit(data, scale, torch.bfloat16)
    assert torch.equal(_bits(out), _bits(expect)), "unit decode differs from decode_nvfp4_unit"
    assert torch.equal(_bits(out.cpu()), _bits(E.decode_nvfp4_unit(data.cpu(), scale.cpu(), torch.float32).bfloat16()))


@cuda
def test_unit_decode_specials_and_several_copies():
    """Zeros (both signs), the largest and smallest products, NaN scales (torch's canonical BF16 NaN),
    and four copies of different shapes in one launch."""
    from fp_recipes.ops import cuda_nvfp4 as C

    gen = torch.Generator().manual_seed(3)
    data, scale = _codes(4, 64, gen, "cpu")
    data[0] = 0x80  # +0 / -0 nibbles
    data[1] = 0x77  # 6 and 6
    data[2] = 0xF7  # 6 and -6
    scale[0] = torch.tensor(448.0).to(torch.float8_e4m3fn)
    scale[1] = torch.tensor(448.0).to(torch.float8_e4m3fn)  # 2688: the largest product
    scale.view(torch.uint8)[2] = 0x01  # 2^-9: the smallest scale
    scale.view(torch.uint8)[3, 0] = 0x7F  # NaN
    scale.view(torch.uint8)[3, 1] = 0xFF  # -NaN
    copies = [(data.cuda(), scale.cuda())]
    for rows, k in ((1, 16), (33, 80), (2, 2048)):
        copies.append(tuple(t for t in _codes(rows, k, gen, "cuda")))
    outs, _ = C.nvfp4_unit_operands(copies, with_alpha=False)
    for (d, s), out in zip(copies, outs):
        expect = E.decode_nvfp4_unit(d, s, torch.bfloat16)
        nan = torch.isnan(expect)
        assert torch.equal(torch.isnan(out), nan)
        assert torch.equal(_bits(out)[~nan], _bits(expect)[~nan])
        assert (_bits(out)[nan] == 0x7FC0).all()
    assert torch.equal(_bits(outs[0][0]).cpu().unique(), torch.tensor([-32768, 0], dtype=torch.int16))  # -0, +0
    assert outs[0][1].float().max().item() == 2688.0


@cuda
@pytest.mark.parametrize("e_a,e_b", [(448, 448), (256, 448), (256, 256)])
@pytest.mark.parametrize("amaxes", [(1.0, 1.0), (3.7, 0.011), (0.0, 5.0), (1e20, 1e20), (1e-30, 1e-30),
                                    (float("nan"), 1.0), (float("inf"), 2.0)])
def test_alpha_bit_equal_to_twin(e_a, e_b, amaxes):
    from fp_recipes.ops import cuda_nvfp4 as C

    a = torch.tensor(amaxes[0], dtype=torch.float32, device="cuda")
    b = torch.tensor(amaxes[1], dtype=torch.float32, device="cuda")
    data, scale = _codes(1, 16, torch.Generator().manual_seed(0), "cuda")
    _, ab = C.nvfp4_unit_operands([(data, scale)], a, b, e_a, e_b)
    expect = R.nvfp4_gemm_alpha(a.cpu(), b.cpu(), e_a, e_b)
    assert torch.equal(ab[:1].cpu().view(torch.int32), expect.reshape(1).view(torch.int32)) or \
        (torch.isnan(expect) and torch.isnan(ab[0]).item())
    assert ab[1].item() == 0.0
    _, unit = C.nvfp4_unit_operands([(data, scale)], None, None, e_a, e_b)  # the row-scaled unit alpha
    one = torch.ones((), dtype=torch.float32)
    assert torch.equal(unit[:1].cpu(), R.nvfp4_gemm_alpha(one, one, e_a, e_b).reshape(1))


def _torch_row_epilogue(d, amax_a, a_rows, amax_b, b_cols, bias, out_dtype):
    """The emulation's torch epilogue on an FP32 GEMM output (the twin of the kernel)."""
    if a_rows and b_cols:
        factor = amax_a.unsqueeze(1) * amax_b.unsqueeze(0)
    elif a_rows:
        factor = (amax_a * amax_b).unsqueeze(1)
    else:
        factor = (amax_a * amax_b).unsqueeze(0)
    return finish(d * factor, bias, out_dtype)


@cuda
# N % 4 == 0 takes the 4-column kernel: (1, 4), (3, 1028) (a second, partial column block), (70000, 8) (more
# rows than grid rows); the others the scalar kernel
@pytest.mark.parametrize("m,n", [(1, 1), (1, 37), (37, 1), (129, 259), (512, 1024), (1, 4), (3, 1028),
                                 (70000, 8)])
@pytest.mark.parametrize("rows_cols", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("out_dtype,bias_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, None),
                                                  (torch.float32, torch.float32), (torch.float16, torch.bfloat16),
                                                  (torch.bfloat16, torch.float32)])
def test_row_scale_epilogue_bit_equal(m, n, rows_cols, out_dtype, bias_dtype):
    from fp_recipes.ops import cuda_nvfp4 as C

    a_rows, b_cols = rows_cols
    g = torch.Generator(device="cuda").manual_seed(m * n)
    d = torch.randn(m, n, device="cuda", generator=g) * 1e3
    d[0, 0] = float("inf")
    if n > 1:
        d[0, 1] = float("nan")
    amax_a = torch.rand(m if a_rows else (), device="cuda", generator=g) * 50
    amax_b = torch.rand(n if b_cols else (), device="cuda", generator=g) * 3
    if a_rows:
        amax_a[-1] = 0.0
    bias = None if bias_dtype is None else (torch.randn(n, device="cuda", generator=g) * 10).to(bias_dtype)
    out = C.nvfp4_row_scale_epilogue(d, amax_a, a_rows, amax_b, b_cols, bias, out_dtype)
    expect = _torch_row_epilogue(d, amax_a, a_rows, amax_b, b_cols, bias, out_dtype)
    assert out.dtype == out_dtype
    assert torch.equal(torch.isnan(out), torch.isnan(expect))
    ok = ~torch.isnan(expect)
    assert torch.equal(out[ok], expect[ok])


@cuda
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shift", ["none", "d", "out", "rows"])
def test_row_scale_epilogue_unaligned_and_row_blocks(out_dtype, shift):
    """d or out one element off a 16-byte boundary (the scalar kernel), or out a row block of a larger
    output (the GEMM's row chunks): the same bytes as the torch epilogue."""
    from fp_recipes.ops import cuda_nvfp4 as C

    m, n = 33, 64
    g = torch.Generator(device="cuda").manual_seed(5)
    d = torch.randn(m, n, device="cuda", generator=g) * 100
    if shift == "d":
        d = torch.empty(m * n + 1, device="cuda")[1:].view(m, n).copy_(d)
    amax_a = torch.rand(m, device="cuda", generator=g) * 7
    amax_b = torch.rand((), device="cuda", generator=g)
    bias = torch.randn(n, device="cuda", generator=g).bfloat16()
    expect = _torch_row_epilogue(d, amax_a, True, amax_b, False, bias, out_dtype)
    out = None
    if shift == "out":
        out = torch.empty(m * n + 1, device="cuda", dtype=out_dtype)[1:].view(m, n)
    elif shift == "rows":
        big = torch.full((m + 5, n), 7, device="cuda", dtype=out_dtype)
        out = big[3:3 + m]
    got = C.nvfp4_row_scale_epilogue(d, amax_a, True, amax_b, False, bias, out_dtype, out=out)
    assert out is None or got.data_ptr() == out.data_ptr()
    assert torch.equal(got.view(torch.int8 if out_dtype == torch.bfloat16 else torch.int32),
                       expect.view(torch.int8 if out_dtype == torch.bfloat16 else torch.int32))
    if shift == "rows":
        assert bool((big[:3] == 7).all()) and bool((big[3 + m:] == 7).all()), "wrote outside its rows"


def _nvfp4_operand(x, **kw):
    q = R.nvfp4_quantize(x, rowwise=True, columnwise=False, **kw)
    return Nvfp4Operand(q.data, q.scale, q.amax, kw.get("row_scaled", False), kw.get("e4m3_max", 448), False)


@cuda
@pytest.mark.parametrize("m,k,n", [(16, 16, 16), (48, 96, 40), (130, 256, 72), (512, 1024, 768),
                                   (3001, 64, 56), (4100, 32, 40)])  # row-scaled: 2 and 4 row chunks
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("bias_dtype", [None, "same", torch.float32])
@pytest.mark.parametrize("row_scaled", [False, True])
def test_fast_gemm_matches_torch_emulation(m, k, n, out_dtype, bias_dtype, row_scaled):
    from fp_recipes.gemm import cublaslt

    assert cublaslt.available(), cublaslt.status()
    g = torch.Generator(device="cuda").manual_seed(m + k + n)
    x = torch.randn(m, k, device="cuda", generator=g) * 4
    w = torch.randn(n, k, device="cuda", generator=g) / 8
    a = _nvfp4_operand(x, row_scaled=row_scaled)
    b = _nvfp4_operand(w, e4m3_max=256, four_over_six=True)
    bias = None
    if bias_dtype is not None:
        bias = torch.randn(n, device="cuda", generator=g).to(out_dtype if bias_dtype == "same" else bias_dtype)
    fast = E.gemm_nvfp4_emulated_cuda(a, b, out_dtype, bias)
    assert fast is not None, "the fast path declined an operand pair it takes"
    slow = E.gemm_nvfp4_emulated(a, b, out_dtype, bias)
    assert fast.dtype == out_dtype and fast.shape == (m, n)
    ua = E.decode_nvfp4_unit(a.data, a.scale).double()
    ub = E.decode_nvfp4_unit(b.data, b.scale).double()
    scale = (a.amax.double().reshape(-1, 1) if row_scaled else a.amax.double()) * b.amax.double() / (36 * 448 * 256)
    tol = gemm_tol(ua, ub, out_dtype) * scale + slow.double().abs() * 2 ** -7
    if bias is not None:  # cuBLASLt may fuse alpha * acc + bias (one rounding instead of two)
        tol = tol + bias.double().abs() * 2 ** -7
    assert_close_gemm(fast, slow.double(), tol, f"fast vs emulated (row_scaled={row_scaled})")


@cuda
def test_fast_gemm_runs_inside_modules_and_counts_launches():
    """One Linear fwd+bwd under the NVFP4 recipe: the GEMMs take the fast path (no torch gather kernel
    of the old decode) and the step stays within a launch budget."""
    import fp_recipes
    from fp_recipes import Linear, NVFP4BlockScaling

    mod = Linear(256, 384, bias=True, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    recipe = NVFP4BlockScaling()

    def step():
        with fp_recipes.autocast(recipe=recipe):
            y = mod(x)
        y.float().sum().backward()

    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("decode_unit_kernel" in nm for nm in names), names
    assert not any("index" in nm.lower() and "gather" in nm.lower() for nm in names), names


# ---------------------------------------------------------------------------------------------------
# CPU: host-side wiring of the fast path (the CUDA pieces replaced by recorders that compute with torch)
# ---------------------------------------------------------------------------------------------------


class _Recorder:
    def __init__(self):
        self.calls = []


@pytest.fixture
def fake_cuda_pieces(monkeypatch):
    """Stand-ins for the three device pieces with the documented semantics, computed with torch on CPU,
    recording their arguments."""
    from fp_recipes.gemm import cublaslt
    from fp_recipes.ops import cuda_nvfp4 as C

    rec = _Recorder()

    def unit_operands(copies, amax_a=None, amax_b=None, e_a=448, e_b=448, *, with_alpha=True, device=None):
        rec.calls.append(("decode", len(copies), amax_a is not None, amax_b is not None, e_a, e_b))
        outs = [E.decode_nvfp4_unit(d, s, torch.bfloat16) for d, s in copies]
        one = torch.ones((), dtype=torch.float32)
        alpha = R.nvfp4_gemm_alpha(one if amax_a is None else amax_a, one if amax_b is None else amax_b, e_a, e_b)
        return outs, torch.stack([alpha.reshape(()), torch.zeros(())])

    def bf16_gemm(a, b, out, alpha_beta, *, bias=None):
        rec.calls.append(("gemm", out.dtype, None if bias is None else bias.dtype))
        acc = (a.float() @ b.float().t()) * alpha_beta[0]
        if bias is not None:
            acc = acc + bias.float()
        out.copy_(acc.to(out.dtype))
        return True

    def epilogue(d, amax_a, a_rows, amax_b, b_cols, bias, out_dtype, out=None):
        rec.calls.append(("epilogue", a_rows, b_cols))
        y = _torch_row_epilogue(d, amax_a, a_rows, amax_b, b_cols, bias, out_dtype)
        return y if out is None else out.copy_(y)

    monkeypatch.setattr(C, "unit_operands_available", lambda: True)
    monkeypatch.setattr(C, "nvfp4_unit_operands", unit_operands)
    monkeypatch.setattr(C, "nvfp4_row_scale_epilogue", epilogue)
    monkeypatch.setattr(cublaslt, "available", lambda: True)
    monkeypatch.setattr(cublaslt, "bf16_gemm_device_alpha", bf16_gemm)
    return rec


def test_cpu_wiring_per_tensor(fake_cuda_pieces):
    g = torch.Generator().manual_seed(0)
    a = _nvfp4_operand(torch.randn(32, 64, generator=g) * 3)
    b = _nvfp4_operand(torch.randn(48, 64, generator=g), e4m3_max=256, four_over_six=True)
    bias = torch.randn(48, generator=g).bfloat16()
    out = E.gemm_nvfp4_emulated_cuda(a, b, torch.bfloat16, bias)
    assert fake_cuda_pieces.calls == [("decode", 2, True, True, 448, 256), ("gemm", torch.bfloat16, torch.bfloat16)]
    assert torch.equal(out, E.gemm_nvfp4_emulated(a, b, torch.bfloat16, bias))
    # a bias of another dtype is added in FP32 after an FP32 GEMM output (the emulation's order)
    fake_cuda_pieces.calls.clear()
    out = E.gemm_nvfp4_emulated_cuda(a, b, torch.bfloat16, bias.float())
    assert fake_cuda_pieces.calls[1] == ("gemm", torch.float32, None)
    assert torch.equal(out, E.gemm_nvfp4_emulated(a, b, torch.bfloat16, bias.float()))


def test_cpu_wiring_row_scaled(fake_cuda_pieces):
    g = torch.Generator().manual_seed(1)
    a = _nvfp4_operand(torch.randn(32, 64, generator=g) * 3, row_scaled=True)
    b = _nvfp4_operand(torch.randn(16, 64, generator=g))
    out = E.gemm_nvfp4_emulated_cuda(a, b, torch.bfloat16, None)
    # unit alpha (no amax pointers), an FP32 GEMM output, then the row epilogue
    assert fake_cuda_pieces.calls == [("decode", 2, False, False, 448, 448), ("gemm", torch.float32, None),
                                      ("epilogue", True, False)]
    assert torch.equal(out, E.gemm_nvfp4_emulated(a, b, torch.bfloat16, None))


@pytest.mark.parametrize("m, chunks", [(1024, 1), (2047, 1), (2048, 2), (3001, 2), (4096, 4), (9000, 4)])
def test_cpu_wiring_row_scaled_chunks(fake_cuda_pieces, m, chunks):
    """A row-scaled product of >= 2048 rows runs in up to 4 row chunks (one GEMM into a shared FP32 scratch and
    one epilogue each, the last chunk shorter): the same output as the emulation, row for row."""
    g = torch.Generator().manual_seed(4)
    a = _nvfp4_operand(torch.randn(m, 32, generator=g) * torch.rand(m, 1, generator=g) * 8, row_scaled=True)
    b = _nvfp4_operand(torch.randn(24, 32, generator=g))
    bias = torch.randn(24, generator=g).bfloat16()
    assert E.row_chunk(m) * chunks >= m > E.row_chunk(m) * (chunks - 1)
    out = E.gemm_nvfp4_emulated_cuda(a, b, torch.bfloat16, bias)
    assert fake_cuda_pieces.calls == [("decode", 2, False, False, 448, 448)] + \
        [("gemm", torch.float32, None), ("epilogue", True, False)] * chunks
    assert torch.equal(out, E.gemm_nvfp4_emulated(a, b, torch.bfloat16, bias))


@pytest.mark.parametrize("m, n, budget, rows, chunks", [
    (4096, 24, 24 * 4 * 1024, 1024, 4),   # 1024 rows of scratch: 4 chunks
    (4000, 24, 24 * 4 * 1000, 1000, 4),   # 1000 rows -> 896 (multiple of 128): 4 chunks spread over 1000 rows
    (300, 24, 24 * 4 * 100, 150, 2),      # fewer rows than 128: chunks of 128 at least -> 2 chunks of 150
    (100, 24, 24 * 4 * 1024, 100, 1)])    # one chunk
def test_cpu_wiring_row_scratch_budget(fake_cuda_pieces, monkeypatch, m, n, budget, rows, chunks):
    """ROW_CHUNK_SCRATCH_BYTES cuts a row-scaled product by its FP32 scratch (multiples of 128 rows, at least 128,
    spread evenly): the same output as the emulation, row for row."""
    monkeypatch.setattr(E, "ROW_CHUNK_SCRATCH_BYTES", budget)
    g = torch.Generator().manual_seed(5)
    a = _nvfp4_operand(torch.randn(m, 32, generator=g) * torch.rand(m, 1, generator=g) * 8, row_scaled=True)
    b = _nvfp4_operand(torch.randn(n, 32, generator=g))
    assert E.row_chunk(m, n) == rows
    out = E.gemm_nvfp4_emulated_cuda(a, b, torch.bfloat16, None)
    assert fake_cuda_pieces.calls == [("decode", 2, False, False, 448, 448)] + \
        [("gemm", torch.float32, None), ("epilogue", True, False)] * chunks
    assert torch.equal(out, E.gemm_nvfp4_emulated(a, b, torch.bfloat16, None))


def test_row_scale_epilogue_out_checks():
    from fp_recipes.ops import cuda_nvfp4 as C

    d = torch.zeros(4, 8)
    amax = torch.ones(4)
    one = torch.ones(())
    with pytest.raises(ValueError, match="out must be a contiguous \\(4, 8\\) torch.bfloat16"):
        C.nvfp4_row_scale_epilogue(d, amax, True, one, False, None, torch.bfloat16, out=torch.empty(4, 8))
    with pytest.raises(ValueError, match="not contiguous"):
        C.nvfp4_row_scale_epilogue(d, amax, True, one, False, None, torch.bfloat16,
                                   out=torch.empty(8, 4, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match="d must be a contiguous float32"):
        C.nvfp4_row_scale_epilogue(d.bfloat16(), amax, True, one, False, None, torch.bfloat16)


def test_cpu_wiring_declines(fake_cuda_pieces, monkeypatch):
    g = torch.Generator().manual_seed(2)
    a = _nvfp4_operand(torch.randn(16, 32, generator=g))
    b = _nvfp4_operand(torch.randn(16, 32, generator=g))
    assert E.gemm_nvfp4_emulated_cuda(a, b, torch.float64, None) is None  # not an output dtype it writes
    empty = Nvfp4Operand(a.data[:0], a.scale[:0], a.amax, False, 448, False)
    assert E.gemm_nvfp4_emulated_cuda(empty, b, torch.bfloat16, None) is None  # empty: the emulation's zeros
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert E.gemm_nvfp4_emulated_cuda(a, b, torch.bfloat16, None) is None  # traced: torch ops only
    assert fake_cuda_pieces.calls == []


def test_cpu_wiring_cached_units(fake_cuda_pieces):
    """Operands with a cached BF16 unit copy (written by the quantize kernel) are not decoded again: the
    launch then decodes only the other operand, or writes only alpha; the result is the emulation's."""
    g = torch.Generator().manual_seed(3)
    a = _nvfp4_operand(torch.randn(32, 64, generator=g) * 3)
    b = _nvfp4_operand(torch.randn(48, 64, generator=g))
    want = E.gemm_nvfp4_emulated(a, b, torch.bfloat16, None)
    a.unit = E.decode_nvfp4_unit(a.data, a.scale, torch.bfloat16)
    assert torch.equal(E.gemm_nvfp4_emulated_cuda(a, b, torch.bfloat16, None), want)
    assert fake_cuda_pieces.calls[0] == ("decode", 1, True, True, 448, 448)
    b.unit = E.decode_nvfp4_unit(b.data, b.scale, torch.bfloat16)
    fake_cuda_pieces.calls.clear()
    assert torch.equal(E.gemm_nvfp4_emulated_cuda(a, b, torch.bfloat16, None), want)
    assert fake_cuda_pieces.calls == [("decode", 0, True, True, 448, 448), ("gemm", torch.bfloat16, None)]
    b.unit = b.unit.float()  # not a BF16 unit copy: ignored, decoded
    fake_cuda_pieces.calls.clear()
    assert torch.equal(E.gemm_nvfp4_emulated_cuda(a, b, torch.bfloat16, None), want)
    assert fake_cuda_pieces.calls[0] == ("decode", 1, True, True, 448, 448)
