"""Native NVFP4 GEMMs on Blackwell (issue 13, target 3), checked without a Blackwell GPU.

* the swizzled (128 x 4 tile) block-scale layout cuBLAS reads, against torchao's ``to_blocked`` (when
  torchao imports) and against an element-by-element implementation of cuBLAS's index formula written
  here, over odd shapes and padding;
* the FP4 operands handed to ``torch._scaled_mm``: packing (even element in the low nibble, as
  torchao's ``pack_uint4`` and cuBLAS's E2M1x2), K/N padding, and torch's own shape/stride/scale-size
  checks run on meta tensors (the meta kernel applies the CUDA rules);
* the dispatch per compute capability (the capability query patched, never the GEMM), the first-use
  self-check and its fallback (the native GEMM replaced by test doubles at its one seam,
  ``nvfp4_native.gemm_nvfp4_native``), FP_RECIPES_NVFP4_GEMM;
* the quantize kernels' first-use E2M1 check and its fallbacks (kernel launcher and switch replaced by
  doubles).

The CUDA tests at the end run only on a GPU (the native ones only on sm_100+).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from fp_recipes import gemm as G
from fp_recipes.gemm import _common
from fp_recipes.gemm import nvfp4 as NV
from fp_recipes.gemm import nvfp4_native as NN
from fp_recipes.gemm.nvfp4_emulated import apply_global_factors, decode_nvfp4_unit, gemm_nvfp4_emulated
from fp_recipes.gemm.operands import Nvfp4Operand
from fp_recipes.gemm.scale_layout import blocked_numel, blocked_shape, to_blocked
from fp_recipes.ops import cuda_nvfp4 as CN
from fp_recipes.ops import ref_nvfp4 as R
from fp_recipes.quantizers.nvfp4 import NVFP4Tensor
from fp_recipes.recipes.env import BY_NAME, EnvVarError

cuda = pytest.mark.cuda

ROWS = [1, 2, 31, 32, 100, 127, 128, 129, 200, 256, 257, 383]
COLS = [1, 2, 3, 4, 5, 7, 8, 9, 12, 33]  # K/16: K = 16 .. 528


@pytest.fixture(autouse=True)
def _fresh_decisions():
    NV.reset()
    CN._reset_e2m1()
    yield
    NV.reset()
    CN._reset_e2m1()


# ---------------------------------------------------------------------------------------------------
# the scale swizzle
# ---------------------------------------------------------------------------------------------------


def _cublas_offset(r: int, c: int, cols: int) -> int:
    """cuBLAS "1D block scaling factors layout": 128x4 tiles, row-tile major; inside a tile the scale of
    (row, col) = (32 * g + i, j) sits at i * 16 + g * 4 + j."""
    col_tiles = -(-cols // 4)
    tile = (r // 128) * col_tiles + c // 4
    within = r % 128
    return tile * 512 + (within % 32) * 16 + (within // 32) * 4 + (c % 4)


def _formula_blocked(scale: torch.Tensor) -> torch.Tensor:
    """Element by element: every scale to its formula position, zeros elsewhere."""
    rows, cols = scale.shape
    total = (-(-rows // 128) * 128) * (-(-cols // 4) * 4)
    out = [0] * total
    values = scale.view(torch.uint8).tolist()
    for r in range(rows):
        for c in range(cols):
            out[_cublas_offset(r, c, cols)] = values[r][c]
    return torch.tensor(out, dtype=torch.uint8)


def _distinct_scales(rows: int, cols: int) -> torch.Tensor:
    """E4M3 codes 1..126 (finite, nonzero, positive), different between neighbours."""
    idx = torch.arange(rows * cols, dtype=torch.int64).reshape(rows, cols)
    return ((idx * 37) % 126 + 1).to(torch.uint8).view(torch.float8_e4m3fn)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("cols", COLS)
def test_swizzle_matches_the_cublas_formula_element_by_element(rows, cols):
    s = _distinct_scales(rows, cols)
    got = to_blocked(s)
    assert got.dtype == torch.float8_e4m3fn and got.dim() == 1 and got.is_contiguous()
    assert got.numel() == blocked_numel(rows, cols) == blocked_shape(rows, cols)[0] * blocked_shape(rows, cols)[1]
    assert torch.equal(got.view(torch.uint8), _formula_blocked(s))


def _torchao_to_blocked():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from torchao.prototype.mx_formats.utils import to_blocked as ao_to_blocked
        except Exception as exc:  # noqa: BLE001 - not installed, or its import fails on this torch
            pytest.skip(f"torchao's to_blocked does not import here ({type(exc).__name__}: {exc})")
    return ao_to_blocked


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("cols", COLS)
def test_swizzle_matches_torchao_to_blocked(rows, cols):
    ao_to_blocked = _torchao_to_blocked()
    s = _distinct_scales(rows, cols)
    want = ao_to_blocked(s)
    assert torch.equal(to_blocked(s).view(torch.uint8), want.reshape(-1).view(torch.uint8))


def test_swizzle_of_real_scales_keeps_every_byte_and_pads_with_zeros():
    x = torch.randn(200, 144, generator=torch.Generator().manual_seed(3)) * 5
    q = R.nvfp4_quantize(x)
    blocked = to_blocked(q.scale).view(torch.uint8)
    assert torch.equal(blocked.sort().values[-q.scale.numel():], q.scale.view(torch.uint8).reshape(-1).sort().values)
    assert int((blocked != 0).sum()) == int((q.scale.view(torch.uint8) != 0).sum())
    with pytest.raises(ValueError, match="2-D"):
        to_blocked(q.scale.reshape(-1))


# ---------------------------------------------------------------------------------------------------
# the operands of torch._scaled_mm
# ---------------------------------------------------------------------------------------------------


def _operand(x, **opts) -> Nvfp4Operand:
    q = R.nvfp4_quantize(x, **opts)
    return Nvfp4Operand(q.data, q.scale, q.amax, bool(opts.get("row_scaled", False)),
                        int(opts.get("e4m3_max", 448)), False)


def test_packing_is_even_element_in_the_low_nibble():
    """What torch's float4_e2m1fn_x2 / cuBLAS's E2M1x2 / torchao's pack_uint4 expect: element 2k in the
    low nibble of byte k. Codes: 6.0 -> 0x7, 0.5 -> 0x1, -1.0 -> 0xA, 3.0 -> 0x5."""
    x = torch.zeros(1, 16)
    x[0, :4] = torch.tensor([6.0, 0.5, -1.0, 3.0])
    q = R.nvfp4_quantize(x)  # amax 6: S_enc = 448, block scale 448, enc = 1: the values are the codes'
    assert q.data[0, 0].item() == (0x1 << 4) | 0x7
    assert q.data[0, 1].item() == (0x5 << 4) | 0xA
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from torchao.prototype.mx_formats.kernels import pack_uint4
        except Exception:  # noqa: BLE001
            return
    codes = torch.tensor([[0x7, 0x1, 0xA, 0x5] + [0] * 12], dtype=torch.uint8)
    assert torch.equal(pack_uint4(codes), q.data)


@pytest.mark.parametrize("m,k,n", [(1, 16, 1), (130, 80, 40), (72, 96, 48), (257, 48, 17), (64, 1024, 32),
                                   (128, 64, 16)])
def test_native_operands_pad_and_keep_bytes(m, k, n):
    g = torch.Generator().manual_seed(m + k + n)
    a = _operand(torch.randn(m, k, generator=g))
    b = _operand(torch.randn(n, k, generator=g), e4m3_max=256, four_over_six=True)
    da, sa = NN.native_operands(a)
    db, sb = NN.native_operands(b, NN.N_MULTIPLE)
    kp = -(-k // 32) * 32
    np_ = -(-n // 16) * 16
    assert da.dtype == db.dtype == torch.float4_e2m1fn_x2
    assert tuple(da.shape) == (m, kp // 2) and tuple(db.shape) == (np_, kp // 2)
    ua, ub = da.view(torch.uint8), db.view(torch.uint8)
    assert torch.equal(ua[:, :k // 2], a.data) and not ua[:, k // 2:].any()
    assert torch.equal(ub[:n, :k // 2], b.data) and not ub[n:].any() and not ub[:, k // 2:].any()
    assert torch.equal(sa.view(torch.uint8), to_blocked(a.scale).view(torch.uint8))
    assert sa.numel() == blocked_numel(m, kp // 16) and sb.numel() == blocked_numel(np_, kp // 16)


def _meta(op: Nvfp4Operand) -> Nvfp4Operand:
    return Nvfp4Operand(op.data.to("meta"), op.scale.to("meta"), op.amax.to("meta"), op.row_scaled,
                        op.e4m3_max, op.rht)


@pytest.mark.parametrize("m,k,n", [(1, 16, 1), (130, 80, 40), (72, 96, 48), (257, 48, 17), (64, 1024, 32),
                                   (3, 528, 200)])
def test_scaled_mm_accepts_the_operands_on_meta(m, k, n):
    """torch's meta kernel of _scaled_mm applies the CUDA checks (row-major A, column-major B, K/2 and N
    multiples of 16, scale numel = round_up(rows, 128) * round_up(K/16, 4), contiguous scales): the
    native call passes them for odd shapes, and gives an (M, N) FP32 accumulator."""
    g = torch.Generator().manual_seed(7)
    a = _meta(_operand(torch.randn(m, k, generator=g)))
    b = _meta(_operand(torch.randn(n, k, generator=g)))
    acc = NN.native_accumulator(a, b)
    assert acc.device.type == "meta" and acc.dtype == torch.float32 and tuple(acc.shape) == (m, n)
    # and the same call without the padding is refused by those checks (they are really applied)
    if k % 32:
        da = a.data.view(torch.float4_e2m1fn_x2)
        db = b.data.view(torch.float4_e2m1fn_x2)
        with pytest.raises(RuntimeError, match="divisible by 16"):
            torch._scaled_mm(da, db.t(), scale_a=to_blocked(a.scale), scale_b=to_blocked(b.scale),
                             out_dtype=torch.float32)


def test_native_epilogue_is_the_emulations():
    """Given the same FP32 accumulator, native and emulated apply the global factors identically (per
    tensor, row-scaled, bias, cast): the only possible difference is the accumulation order."""
    g = torch.Generator().manual_seed(11)
    for a_opts, out_dtype, bias in (({}, torch.bfloat16, None), ({"row_scaled": True}, torch.float32,
                                                                 torch.randn(24, generator=g).bfloat16())):
        a = _operand(torch.randn(40, 64, generator=g) * 3, **a_opts)
        b = _operand(torch.randn(24, 64, generator=g))
        acc = decode_nvfp4_unit(a.data, a.scale) @ decode_nvfp4_unit(b.data, b.scale).t()
        assert torch.equal(apply_global_factors(acc, a, b, out_dtype, bias), gemm_nvfp4_emulated(a, b, out_dtype, bias))


# ---------------------------------------------------------------------------------------------------
# dispatch, self-check, fallback, FP_RECIPES_NVFP4_GEMM
# ---------------------------------------------------------------------------------------------------


class _Native:
    """A test double of nvfp4_native.gemm_nvfp4_native: ``mode`` = "exact" (the emulation's bytes),
    "reordered" (the accumulator summed in float64 and rounded once: another accumulation order),
    "wrong" (off by 0.1 %), "raise"."""

    def __init__(self, mode: str = "exact"):
        self.mode = mode
        self.calls = 0

    def __call__(self, a, b, out_dtype, bias):
        self.calls += 1
        if self.mode == "raise":
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul (test double)")
        if self.mode == "reordered":
            acc = (decode_nvfp4_unit(a.data, a.scale).double() @ decode_nvfp4_unit(b.data, b.scale).double().t())
            return apply_global_factors(acc.float(), a, b, out_dtype, bias)
        out = gemm_nvfp4_emulated(a, b, out_dtype, bias)
        return out * 1.001 if self.mode == "wrong" else out


@pytest.fixture
def arch(monkeypatch):
    """Pretend every device (the CPU included) has the given capability; returns the setter."""
    def set_cap(cap):
        monkeypatch.setattr(_common, "device_capability", lambda device: cap)
        NV.reset()
    return set_cap


@pytest.fixture
def native(monkeypatch):
    def install(mode="exact"):
        double = _Native(mode)
        monkeypatch.setattr(NN, "gemm_nvfp4_native", double)
        return double
    return install


def _tensors(seed=0, m=48, k=64, n=32, **a_opts):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 2
    w = torch.randn(n, k, generator=g) / 4
    qa = R.nvfp4_quantize(x, **a_opts)
    qw = R.nvfp4_quantize(w)
    ta = NVFP4Tensor(qa.data, qa.scale, qa.amax, None, None, None, row_scaled=a_opts.get("row_scaled", False),
                     e4m3_max=448, four_over_six=False, rht_columnwise=False, orig_dtype=torch.float32,
                     shape=x.shape)
    tw = NVFP4Tensor(qw.data, qw.scale, qw.amax, None, None, None, row_scaled=False, e4m3_max=448,
                     four_over_six=False, rht_columnwise=False, orig_dtype=torch.float32, shape=w.shape)
    return ta, tw


def _emulated(ta, tw, out_dtype=torch.float32):
    from fp_recipes.gemm.operands import nvfp4_operand

    return gemm_nvfp4_emulated(nvfp4_operand(ta, False), nvfp4_operand(tw, False), out_dtype, None)


@pytest.mark.parametrize("cap", [None, (8, 0), (8, 9), (9, 0)])
def test_devices_without_fp4_tensor_cores_run_the_emulation_byte_for_byte(arch, native, cap):
    arch(cap)
    double = native("exact")
    ta, tw = _tensors()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not a word on these devices
        out = G.gemm(ta, tw, out_dtype=torch.float32)
    assert torch.equal(out, _emulated(ta, tw))
    assert double.calls == 0
    d = NV.decision(torch.device("cpu"))
    assert d.path == "emulated" and ("no FP4 tensor cores" in d.reason)
    assert not G.nvfp4_native_gemm_available(torch.device("cpu"))


@pytest.mark.parametrize("cap", [(10, 0), (10, 3), (11, 0), (12, 0), (12, 1)])
@pytest.mark.parametrize("mode", ["exact", "reordered"])
def test_blackwell_runs_native_after_a_passing_self_check(arch, native, cap, mode):
    arch(cap)
    double = native(mode)
    ta, tw = _tensors(row_scaled=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = G.gemm(ta, tw, out_dtype=torch.bfloat16)
    checks = len(NV._CASES)
    assert double.calls == checks + 1  # the self-check's GEMMs, then this one
    d = NV.decision(torch.device("cpu"))
    assert d.path == "native" and "self-check passed" in d.reason and f"sm_{cap[0]}{cap[1]}" in d.reason
    want = _emulated(ta, tw, torch.bfloat16)
    if mode == "exact":
        assert torch.equal(out, want)
    G.gemm(ta, tw, out_dtype=torch.float32)
    assert double.calls == checks + 2  # decided once
    assert G.nvfp4_native_gemm_available(torch.device("cpu"))


@pytest.mark.parametrize("mode,match", [("raise", "raised RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED"),
                                        ("wrong", "outside the FP32 accumulation-order bound")])
def test_failing_self_check_warns_once_and_falls_back_to_the_emulation(arch, native, mode, match):
    arch((10, 0))
    double = native(mode)
    ta, tw = _tensors()
    with pytest.warns(RuntimeWarning, match="failed its first-use self-check") as rec:
        out = G.gemm(ta, tw, out_dtype=torch.float32)
    assert any(match in str(w.message) for w in rec)
    assert torch.equal(out, _emulated(ta, tw))
    calls = double.calls
    assert calls == 1 if mode == "raise" else calls >= 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        again = G.gemm(ta, tw, out_dtype=torch.float32)
    assert torch.equal(again, out) and double.calls == calls  # never asked again
    d = NV.decision(torch.device("cpu"))
    assert d.path == "emulated" and "self-check failed" in d.reason


def test_native_error_after_the_check_falls_back_for_that_gemm(arch, native):
    arch((10, 0))
    double = native("exact")
    ta, tw = _tensors()
    G.gemm(ta, tw)  # decided: native
    double.mode = "raise"
    with pytest.warns(RuntimeWarning, match="native NVFP4 GEMM raised"):
        out = G.gemm(ta, tw, out_dtype=torch.float32)
    assert torch.equal(out, _emulated(ta, tw))


def test_tolerance_is_the_accumulation_order_bound():
    """tol = 2 (K - 1) 2^-24 sum|p| * |global factor| (+1 %) + an output ulp: a sum of the same products in
    another order (float64, rounded once) lies within it; an error of 2^-12 of sum|p| does not."""
    g = torch.Generator().manual_seed(5)
    k = 256
    a = _operand(torch.randn(16, k, generator=g) * 3)
    b = _operand(torch.randn(8, k, generator=g))
    want = gemm_nvfp4_emulated(a, b, torch.float32, None)
    tol = NV.tolerance(a, b, want, torch.float32)
    sum_abs = (decode_nvfp4_unit(a.data, a.scale).double().abs() @ decode_nvfp4_unit(b.data, b.scale).double().abs().t())
    scale = sum_abs * float(a.amax) * float(b.amax) / (36 * 448 * 448)
    bound = 2 * (k - 1) * 2.0 ** -24 * scale
    assert bool((tol >= bound).all()) and bool((tol <= bound * 1.01 + want.double().abs() * 2.0 ** -20).all())
    reordered = _Native("reordered")(a, b, torch.float32, None)
    assert bool(((reordered.double() - want.double()).abs() <= tol).all())
    assert bool((scale * 2.0 ** -12 > tol).all())


@pytest.mark.parametrize("raw,want", [(None, "auto"), ("", "auto"), ("  ", "auto"), ("auto", "auto"),
                                      ("Emulated", "emulated"), ("NATIVE", "native"), (" native ", "native")])
def test_env_var_parsing(monkeypatch, raw, want):
    if raw is not None:
        monkeypatch.setenv("FP_RECIPES_NVFP4_GEMM", raw)
    assert NV.requested_policy() == want


def test_env_var_bad_value_names_variable_value_and_choices(monkeypatch, arch):
    arch((10, 0))
    monkeypatch.setenv("FP_RECIPES_NVFP4_GEMM", "fast")
    with pytest.raises(EnvVarError, match=r"FP_RECIPES_NVFP4_GEMM='fast'.*auto \| native \| emulated"):
        NV.requested_policy()
    ta, tw = _tensors()
    with pytest.raises(EnvVarError):
        G.gemm(ta, tw)
    var = BY_NAME["FP_RECIPES_NVFP4_GEMM"]
    assert var.use == "backend" and var.choices == ("auto", "native", "emulated")


def test_env_emulated_never_runs_native(monkeypatch, arch, native):
    arch((10, 0))
    double = native("exact")
    monkeypatch.setenv("FP_RECIPES_NVFP4_GEMM", "emulated")
    ta, tw = _tensors()
    assert torch.equal(G.gemm(ta, tw, out_dtype=torch.float32), _emulated(ta, tw))
    assert double.calls == 0
    assert NV.decision(torch.device("cpu")).reason == "FP_RECIPES_NVFP4_GEMM=emulated"


def test_env_native_skips_the_self_check_and_raises(monkeypatch, arch, native):
    arch((10, 0))
    double = native("exact")
    monkeypatch.setenv("FP_RECIPES_NVFP4_GEMM", "native")
    ta, tw = _tensors()
    G.gemm(ta, tw)
    assert double.calls == 1  # no self-check
    assert "no self-check" in NV.decision(torch.device("cpu")).reason
    double.mode = "raise"
    with pytest.raises(RuntimeError, match="CUBLAS_STATUS_NOT_SUPPORTED"):
        G.gemm(ta, tw)


def test_env_native_on_hopper_warns_and_emulates(monkeypatch, arch, native):
    arch((9, 0))
    double = native("exact")
    monkeypatch.setenv("FP_RECIPES_NVFP4_GEMM", "native")
    ta, tw = _tensors()
    with pytest.warns(RuntimeWarning, match="FP_RECIPES_NVFP4_GEMM=native but sm_90 has no FP4 tensor cores"):
        out = G.gemm(ta, tw, out_dtype=torch.float32)
    assert torch.equal(out, _emulated(ta, tw)) and double.calls == 0


def test_changing_the_variable_takes_effect_without_a_restart(monkeypatch, arch, native):
    arch((10, 0))
    double = native("exact")
    ta, tw = _tensors()
    monkeypatch.setenv("FP_RECIPES_NVFP4_GEMM", "emulated")
    G.gemm(ta, tw)
    assert double.calls == 0
    monkeypatch.setenv("FP_RECIPES_NVFP4_GEMM", "auto")
    G.gemm(ta, tw)
    assert double.calls == len(NV._CASES) + 1


def test_doctor_reports_the_nvfp4_gemm_path_and_the_hardware_note(arch, native):
    from fp_recipes.cli import doctor

    rep = doctor._nvfp4_paths(torch.device("cpu"), kernels=False)
    assert rep["gemm"] == "emulated" and rep["policy"] == "auto"
    assert "has not run on Blackwell hardware" in rep["note"]
    arch((10, 0))
    native("exact")
    rep = doctor._nvfp4_paths(torch.device("cpu"), kernels=False)
    assert rep["gemm"] == "native" and "self-check passed" in rep["gemm_why"]


# ---------------------------------------------------------------------------------------------------
# the quantize kernels' E2M1 encoding: first-use check and fallbacks
# ---------------------------------------------------------------------------------------------------


class _Kernels:
    """Doubles of the kernel launcher and of the software-E2M1 switch. The 'hardware' encoding is
    ``hw`` ("good" | "bad" | "raise"), the software one ``sw``; bad bytes flip one code bit."""

    def __init__(self, hw="good", sw="good", has_switch=True):
        self.hw, self.sw, self.has_switch = hw, sw, has_switch
        self.software = False
        self.switches = []
        self.calls = 0

    def set_software(self, index, on):
        if not self.has_switch:
            return False
        self.switches.append((index, on))
        self.software = on
        return True

    def quantize(self, x, **opts):
        self.calls += 1
        how = self.sw if self.software else self.hw
        if how == "raise":
            raise RuntimeError("no kernel image is available for execution on the device (test double)")
        q = R.nvfp4_quantize(x, **opts)
        if how == "bad":
            data = q.data.clone()
            data.view(-1)[5] ^= 0x1
            q = q._replace(data=data)
        return q


def _decide(k: _Kernels, cap=(10, 0)):
    return CN._decide_e2m1(0, torch.device("cpu"), quantize=k.quantize, set_software=k.set_software)


@pytest.fixture
def capability(monkeypatch):
    def set_cap(cap):
        monkeypatch.setattr(CN, "_capability", lambda index: cap)
    return set_cap


def test_e2m1_check_passes_keeps_the_hardware_encoding(capability):
    capability((10, 0))
    k = _Kernels()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _decide(k) == "hardware"
    assert k.calls == len(CN._e2m1_cases()) and k.switches == []
    assert CN._E2M1[0] == "hardware"


@pytest.mark.parametrize("cap", [(8, 0), (9, 0)])
def test_e2m1_below_sm100_is_software_without_a_check(capability, cap):
    capability(cap)
    k = _Kernels(hw="bad")
    assert _decide(k) == "software" and k.calls == 0 and k.switches == []


@pytest.mark.parametrize("hw", ["bad", "raise"])
def test_e2m1_hardware_mismatch_switches_to_software(capability, hw):
    capability((10, 0))
    k = _Kernels(hw=hw)
    with pytest.warns(RuntimeWarning, match="hardware E2M1 conversion failed the first-use self-check"):
        assert _decide(k) == "software"
    assert k.switches == [(0, True)]
    assert CN._E2M1[0] == "software"


def test_e2m1_both_encodings_wrong_runs_the_reference(capability):
    capability((12, 0))
    k = _Kernels(hw="bad", sw="raise")
    with pytest.warns(RuntimeWarning, match="run the pure-torch reference"):
        assert _decide(k) == "reference"
    assert k.switches == [(0, True), (0, False)]


def test_e2m1_without_a_switch_runs_the_reference(capability):
    capability((10, 0))
    k = _Kernels(hw="bad", has_switch=False)
    with pytest.warns(RuntimeWarning, match="no software-E2M1 switch"):
        assert _decide(k) == "reference"


def test_e2m1_cases_cover_ties_and_every_rn_mode():
    cases = CN._e2m1_cases()
    names = " ".join(c[0] for c in cases)
    for what in ("ties", "2-D", "RHT", "row-scaled", "FP16"):
        assert what in names
    # the tie case really lands on E2M1 midpoints: enc = 4 exactly, so x * enc is a midpoint
    name, x, opts = cases[0]
    q = R.nvfp4_quantize(x, **opts)
    assert bool((q.scale.float() == 256).all())
    y = (x.float() * 4).abs()
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert int(torch.isin(y, mids).sum()) == 14 * 32 * 4  # 7 midpoints of each sign per block


def test_reference_route_returns_the_kernels_tuple_form():
    x = (torch.randn(32, 64, generator=torch.Generator().manual_seed(2)) * 3).bfloat16()
    res = CN._quantize_reference(x, None, True, True, False, False, False, 448, False, False, True, False,
                                 0, 0, 0, 0)
    want = R.nvfp4_quantize(x, rowwise=True, columnwise=True, rht=True)
    for got, exp in zip(res, want):
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                           exp.view(torch.uint8) if exp.dtype == torch.float8_e4m3fn else exp)
    res = CN._quantize_reference(x, None, True, False, False, False, False, 448, False, False, False, False,
                                 0, 0, 0, 0)
    assert all(t.numel() == 0 for t in res[3:])


# ---------------------------------------------------------------------------------------------------
# on a GPU
# ---------------------------------------------------------------------------------------------------


def _blackwell() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (10, 0)


@cuda
def test_cuda_path_decision_matches_the_device():
    dev = torch.device("cuda")
    d = NV.decision(dev)
    if not _blackwell():
        assert d.path == "emulated" and "no FP4 tensor cores" in d.reason
        assert CN.e2m1_encoding(dev) == "software"
    else:
        assert d.path in ("native", "emulated") and "self-check" in d.reason


@cuda
@pytest.mark.skipif(not _blackwell(), reason="native NVFP4 GEMMs need sm_100+")
@pytest.mark.parametrize("m,k,n", [(128, 128, 128), (130, 80, 40), (1000, 1024, 512), (1, 16, 1)])
@pytest.mark.parametrize("row_scaled", [False, True])
def test_cuda_native_matches_the_emulation(m, k, n, row_scaled):
    g = torch.Generator(device="cuda").manual_seed(m + k + n)
    x = torch.randn(m, k, device="cuda", generator=g) * 4
    w = torch.randn(n, k, device="cuda", generator=g) / 8
    a = _operand(x, row_scaled=row_scaled)
    b = _operand(w, e4m3_max=256, four_over_six=True)
    got = NN.gemm_nvfp4_native(a, b, torch.float32, None)
    want = gemm_nvfp4_emulated(a, b, torch.float32, None)
    assert bool(((got.double() - want.double()).abs() <= NV.tolerance(a, b, want, torch.float32)).all())


@cuda
@pytest.mark.skipif(not _blackwell(), reason="the hardware E2M1 conversion runs on sm_100+ only")
def test_cuda_e2m1_hardware_encoding_passes_its_check():
    ok, detail = CN.e2m1_self_check(torch.device("cuda"), CN._kernel_quantize)
    assert ok, detail
