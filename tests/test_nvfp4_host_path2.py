"""NVFP4 host path, part 2 (issue 13): the per-shape resolved launch of the quantizer's eager CUDA path
(``cuda_nvfp4._Launch``, cached on the ``QuantizePlan``), the emulated GEMM's per-stream alpha workspace
(``nvfp4_unit_operands(alpha_workspace=True)``) and the allocations they leave per call.

CPU: a recording do-nothing extension stands in for ``fp_recipes._C`` (as in test_nvfp4_host_path.py), so
the cached launch and the general wrapper ``cuda_nvfp4.nvfp4_quantize`` can be compared call for call;
errors for bad input stay the general path's. CUDA: the bytes, against the reference twin and the general
path, on repeated calls (cache hits), unaligned inputs, a device forced to the reference twin, back-to-back
GEMMs sharing the alpha workspace, and CUDA-graph capture with and without a workspace."""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp_recipes import _extension, ops
from fp_recipes.ops import cuda_nvfp4 as C
from fp_recipes.ops import ref_nvfp4 as R

cuda = pytest.mark.cuda

FIELDS = ("data", "scale", "amax", "data_t", "scale_t", "amax_t")

# (name, options): every amax layout of _Launch ("both", "plain" with g and/or t, "row", "fused_row")
COMBOS = [
    ("rowwise", {}),
    ("row+col", {"columnwise": True}),
    ("col", {"rowwise": False, "columnwise": True}),
    ("2d", {"columnwise": True, "block_2d": True}),
    ("2d-col", {"rowwise": False, "columnwise": True, "block_2d": True}),
    ("2d-sr", {"columnwise": True, "block_2d": True, "stochastic_rounding": True}),
    ("rht", {"columnwise": True, "rht": True}),
    ("rht-col", {"rowwise": False, "columnwise": True, "rht": True}),
    ("rht-sr", {"columnwise": True, "rht": True, "stochastic_rounding": True}),
    ("row-scaled", {"row_scaled": True}),
    ("row-scaled+col", {"row_scaled": True, "columnwise": True}),
    ("row-scaled-4over6", {"row_scaled": True, "four_over_six": True, "err_fast_math": True}),
    ("4over6-mse-col", {"columnwise": True, "four_over_six": True, "err_mode": "MSE"}),
    ("e256", {"columnwise": True, "e4m3_max": 256}),
]
COMBO_IDS = [name for name, _ in COMBOS]


def _options(**kw) -> dict:
    o = dict(rowwise=True, columnwise=False, block_2d=False, row_scaled=False, four_over_six=False, e4m3_max=448,
             err_mode="MAE", err_fast_math=False, rht=False, stochastic_rounding=False)
    o.update(kw)
    return o


def _planned(x, plan, seed=0, offset=0):
    return C.nvfp4_quantize_planned(x, plan, None, seed, offset)


# ---------------------------------------------------------------------------------------------------
# CPU: a recording extension
# ---------------------------------------------------------------------------------------------------


class _RecordingExt:
    nvfp4_fused_row_amax = True

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def launch(*args, **kwargs):
            norm = tuple("ptr" if isinstance(a, int) and not isinstance(a, bool) and a > 1 << 24 else a
                         for a in args)
            self.calls.append((name, norm, sorted(kwargs.items())))
        return launch


@pytest.fixture
def fake_kernels(monkeypatch):
    ext = _RecordingExt()
    monkeypatch.setattr(_extension, "_ext", ext)
    monkeypatch.setattr(_extension, "_ext_loaded", True)
    monkeypatch.setattr(C, "_require_cuda", lambda x, what: None)
    monkeypatch.setattr(C, "_stream_of", lambda device: 0)
    monkeypatch.setitem(C._AMAX_WS, (None, 0), torch.zeros(4, dtype=torch.int32))
    monkeypatch.setattr(C, "_ALPHA_WS", {})
    return ext


def _same_structure(got: tuple, want) -> None:
    for f, g, w in zip(FIELDS, got[:6], want):
        assert (g is None) == (w is None), f
        if w is not None:
            assert g.shape == w.shape and g.dtype == w.dtype and g.is_contiguous(), f
    if want.amax is not None and want.amax_t is not None:
        # the same aliasing as the general path (one tensor for both copies' per-tensor amax, or not)
        assert (got[2] is got[5]) == (want.amax is want.amax_t)


@pytest.mark.parametrize("name,kw", COMBOS, ids=COMBO_IDS)
def test_cached_launch_calls_what_the_wrapper_calls(fake_kernels, name, kw):
    opts = _options(**kw)
    plan = C.QuantizePlan(**opts)
    assert plan.valid
    x = torch.randn(48, 64).bfloat16()
    for rep, (seed, offset) in enumerate([(5, 0), (5, 2**40 + 3), (2**63 + 1, 7)]):
        fake_kernels.calls.clear()
        got = _planned(x, plan, seed, offset)
        planned = list(fake_kernels.calls)
        fake_kernels.calls.clear()
        want = C.nvfp4_quantize(x, seed=seed, offset=offset, **opts)
        assert planned == fake_kernels.calls and planned, f"{name} call {rep}"
        assert got[6] is None and got[7] is None
        _same_structure(got, want)
    assert list(plan.launches) == [(x.shape, x.dtype)]


def test_launch_cache_per_shape_and_dtype_and_capped(fake_kernels, monkeypatch):
    plan = C.QuantizePlan(**_options(columnwise=True))
    for m in (16, 32, 16):
        for dt in (torch.bfloat16, torch.float32):
            _planned(torch.randn(m, 32).to(dt), plan)
    assert sorted((tuple(s), str(d)) for s, d in plan.launches) == sorted(
        ((m, 32), str(dt)) for m in (16, 32) for dt in (torch.bfloat16, torch.float32))
    monkeypatch.setattr(C, "_MAX_LAUNCHES", 4)
    fake_kernels.calls.clear()
    got = _planned(torch.randn(64, 32), plan)  # past the cap: the general path, the same calls
    planned = list(fake_kernels.calls)
    fake_kernels.calls.clear()
    want = C.nvfp4_quantize(torch.randn(64, 32), columnwise=True)
    assert planned == fake_kernels.calls and len(plan.launches) == 4
    _same_structure(got, want)


def test_empty_input_takes_the_general_path(fake_kernels):
    plan = C.QuantizePlan(**_options(columnwise=True))
    x = torch.randn(0, 32)
    got = _planned(x, plan)
    want = C.nvfp4_quantize(x, columnwise=True)
    assert not plan.launches
    _same_structure(got, want)


def test_unaligned_input_is_copied_as_by_the_general_path(fake_kernels):
    plan = C.QuantizePlan(**_options(columnwise=True, rht=True))
    base = torch.randn(48 * 64 + 1).bfloat16()
    x = base[1:].view(48, 64)  # 2 bytes past a 16-byte boundary
    _planned(torch.randn(48, 64).bfloat16(), plan)  # the cached launch exists
    fake_kernels.calls.clear()
    with _CountOps() as ops_seen:
        got = _planned(x, plan)
    planned = list(fake_kernels.calls)
    fake_kernels.calls.clear()
    want = C.nvfp4_quantize(x, columnwise=True, rht=True)
    assert planned == fake_kernels.calls
    assert "aten.clone.default" in ops_seen.names  # _aligned's copy
    _same_structure(got, want)


def test_errors_after_a_cached_launch_are_the_general_paths(fake_kernels, monkeypatch):
    plan = C.QuantizePlan(**_options(columnwise=True))
    x = torch.randn(32, 64)
    _planned(x, plan)
    assert plan.launches
    monkeypatch.undo()  # the real checks again (and no recording extension: nothing may launch)
    with pytest.raises(ValueError) as cached:
        _planned(x, plan)
    fresh = C.QuantizePlan(**_options(columnwise=True))
    with pytest.raises(ValueError) as general:
        _planned(x, fresh)
    assert str(cached.value) == str(general.value) == \
        "nvfp4_quantize: the CUDA kernel needs a CUDA tensor, got one on cpu"
    # a shape the options reject never gets a launch, and keeps its message
    with pytest.raises(ValueError, match="must be a multiple of 16"):
        _planned(torch.randn(24, 64), fresh)
    assert not fresh.launches


@pytest.mark.parametrize("name,kw", COMBOS, ids=COMBO_IDS)
def test_cached_launch_with_units_calls_what_the_wrapper_calls(fake_kernels, name, kw):
    """Unit operands (a Linear's activation and gradient casts write the rowwise one) take the resolved launch:
    the same kernel calls, unit pointers included, as ``nvfp4_quantize_with_units``."""
    opts = _options(**kw)
    plan = C.QuantizePlan(**opts)
    x = torch.randn(48, 64).bfloat16()
    for units in ((True, False), (False, True), (True, True)):
        fake_kernels.calls.clear()
        got = C.nvfp4_quantize_planned(x, plan, None, 5, 2**40 + 3, units)
        planned = list(fake_kernels.calls)
        fake_kernels.calls.clear()
        want, unit, unit_t = C.nvfp4_quantize_with_units(x, unit_rowwise=units[0], unit_columnwise=units[1], seed=5,
                                                         offset=2**40 + 3, **opts)
        assert planned == fake_kernels.calls and planned, f"{name} units {units}"
        _same_structure(got, want)
        for g, w in ((got[6], unit), (got[7], unit_t)):
            assert (g is None) == (w is None), f"{name} units {units}"
            if w is not None:
                assert g.shape == w.shape and g.dtype == torch.bfloat16 and g.is_contiguous()
    assert list(plan.launches) == [(x.shape, x.dtype)]


def test_amax_override_takes_the_general_path(fake_kernels):
    plan = C.QuantizePlan(**_options(columnwise=True))
    x = torch.randn(32, 64)
    got = C.nvfp4_quantize_planned(x, plan, torch.tensor(3.0), 0, 0)
    assert not plan.launches
    want = C.nvfp4_quantize(x, amax=torch.tensor(3.0), columnwise=True)
    _same_structure(got, want)


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name,kw,expect", [
    # RHT (default recipe's activation and gradient): 4 copies' tensors + one 8-byte amax pair, split once
    ("rht", {"columnwise": True, "rht": True}, {"aten.empty.memory_format": 5, "aten.unbind.int": 1}),
    # 2-D weight: 4 tensors + one amax shared by both copies
    ("2d", {"columnwise": True, "block_2d": True}, {"aten.empty.memory_format": 5}),
    # row-scaled rowwise only: data, scale and the per-row amax (computed by the quantize launch)
    ("row-scaled", {"row_scaled": True}, {"aten.empty.memory_format": 3}),
    ("row-scaled+col", {"row_scaled": True, "columnwise": True}, {"aten.empty.memory_format": 6}),
    # an absent copy allocates nothing (the general path makes (0,) placeholders)
    ("rowwise", {}, {"aten.empty.memory_format": 3}),
])
def test_allocations_per_quantize(fake_kernels, name, kw, expect):
    plan = C.QuantizePlan(**_options(**kw))
    x = torch.randn(32, 64).bfloat16()
    _planned(x, plan)
    with _CountOps() as seen:
        _planned(x, plan)
    counts = {}
    for n in seen.names:
        counts[n] = counts.get(n, 0) + 1
    assert counts == expect, name


def test_alpha_workspace_is_per_stream_and_reused(fake_kernels):
    data = torch.zeros(32, 32, dtype=torch.uint8)
    scale = torch.zeros(32, 4, dtype=torch.uint8).view(torch.float8_e4m3fn)
    amax = torch.tensor(2.0)
    outs, ab1 = C.nvfp4_unit_operands([(data, scale), (data, scale)], amax, amax, alpha_workspace=True)
    _, ab2 = C.nvfp4_unit_operands([(data, scale)], amax, amax, alpha_workspace=True)
    assert ab1 is ab2 and ab1 is C._ALPHA_WS[(None, 0, threading.get_ident())] and ab1.shape == (4,) and ab1.dtype == torch.float32
    assert len(outs) == 2 and all(o.shape == (32, 64) and o.dtype == torch.bfloat16 for o in outs)
    _, fresh1 = C.nvfp4_unit_operands([(data, scale)], amax, amax)
    _, fresh2 = C.nvfp4_unit_operands([(data, scale)], amax, amax)
    assert fresh1 is not ab1 and fresh2 is not fresh1  # the default: a fresh tensor per call
    _, none = C.nvfp4_unit_operands([(data, scale)], with_alpha=False, alpha_workspace=True)
    assert none is None
    # every call launches once, with the same arguments but for the alpha pointer
    assert [c[0] for c in fake_kernels.calls] == ["nvfp4_decode_unit_bf16"] * 5
    with _CountOps() as seen:
        C.nvfp4_unit_operands([(data, scale), (data, scale)], amax, amax, alpha_workspace=True)
    assert seen.names == ["aten.empty.memory_format"] * 2  # the two unit operands only


def test_unit_operands_errors_unchanged(fake_kernels):
    data = torch.zeros(32, 32, dtype=torch.uint8)
    scale = torch.zeros(32, 4, dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"1 to 4 copies per call \(0 with alpha and a device\), got 5"):
        C.nvfp4_unit_operands([(data, scale)] * 5)
    with pytest.raises(ValueError, match=r"1 to 4 copies per call \(0 with alpha and a device\), got 0"):
        C.nvfp4_unit_operands([])
    with pytest.raises(ValueError, match="each copy needs contiguous uint8 data"):
        C.nvfp4_unit_operands([(data.t(), scale)], alpha_workspace=True)
    assert not fake_kernels.calls


def test_emulated_gemm_uses_the_workspace_only_with_its_own_decode(fake_kernels, monkeypatch):
    """The GEMM passes alpha_workspace to the module's own nvfp4_unit_operands; a replaced one (tests'
    fakes) is called with the public keywords only."""
    from fp_recipes.gemm import cublaslt, nvfp4_emulated as E
    from fp_recipes.gemm.operands import Nvfp4Operand

    seen = []
    monkeypatch.setattr(cublaslt, "available", lambda: True)
    monkeypatch.setattr(cublaslt, "bf16_gemm_device_alpha",
                        lambda a, b, out, ab, *, bias=None: seen.append(ab) or True)
    monkeypatch.setattr(C, "unit_operands_available", lambda: True)
    q = R.nvfp4_quantize(torch.randn(32, 64))
    op = Nvfp4Operand(q.data, q.scale, q.amax, False, 448, False)
    E.emulated_cuda_eager(op, op, torch.float32, None)
    E.emulated_cuda_eager(op, op, torch.float32, None)
    assert seen[0] is seen[1] is C._ALPHA_WS[(None, 0, threading.get_ident())]

    def fake(copies, amax_a=None, amax_b=None, e_a=448, e_b=448, *, with_alpha=True, device=None):
        return [torch.zeros(d.shape[0], d.shape[1] * 2, dtype=torch.bfloat16) for d, _ in copies], torch.zeros(4)

    monkeypatch.setattr(C, "nvfp4_unit_operands", fake)
    E.emulated_cuda_eager(op, op, torch.float32, None)
    assert seen[2] is not seen[0]


# ---------------------------------------------------------------------------------------------------
# CUDA: bytes
# ---------------------------------------------------------------------------------------------------


def _assert_same(got, want, what):
    from test_cuda_nvfp4_kernels import assert_same_bytes

    for f, g, w in zip(FIELDS, got[:6], want):
        assert_same_bytes(g, w, f"{f} {what}")


def _inputs(shape, dtype, seeds):
    from test_cuda_nvfp4_kernels import make_input

    kinds = ("randn", "huge", "special", "zeros", "tiny")
    return [make_input(shape, dtype, kinds[i % len(kinds)], seed=s) for i, s in enumerate(seeds)]


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(16, 16), (48, 2064), (256, 1024), (2048, 4096)], ids=str)
@pytest.mark.parametrize("name,kw", COMBOS, ids=COMBO_IDS)
def test_cached_launch_bytes_equal_reference_and_general_path(name, kw, shape, dtype):
    opts = _options(**kw)
    if opts["rht"] and dtype != torch.bfloat16:
        pytest.skip("RHT takes bfloat16 input")
    plan = C.QuantizePlan(**opts)
    for rep, x in enumerate(_inputs(shape, dtype, seeds=(1, 2, 3))):  # the 2nd and 3rd hit the cached launch
        seed, offset = 1234 + rep, rep * (2**33 + 5)
        got = _planned(x, plan, seed, offset)
        what = f"{name} {tuple(shape)} {dtype} call {rep}"
        _assert_same(got, R.nvfp4_quantize(x, seed=seed, offset=offset, **opts), what + " vs reference")
        _assert_same(got, C.nvfp4_quantize(x, seed=seed, offset=offset, **opts), what + " vs general path")
    assert list(plan.launches) == [(torch.Size(shape), dtype)]


@cuda
def test_cached_launch_back_to_back_without_sync():
    """Many cached launches of several plans queued on one stream (one amax workspace) before any result
    is read: each must equal the reference."""
    plans = [(C.QuantizePlan(**_options(**kw)), _options(**kw)) for _, kw in COMBOS]
    xs = _inputs((64, 256), torch.bfloat16, seeds=range(6))
    results = []
    for rep in range(2):
        for i, x in enumerate(xs):
            plan, opts = plans[(i + rep) % len(plans)]
            results.append((_planned(x, plan, 7, i), x, opts, i))
    torch.cuda.synchronize()
    for got, x, opts, i in results:
        _assert_same(got, R.nvfp4_quantize(x, seed=7, offset=i, **opts), f"queued {opts}")


@cuda
def test_cached_launch_unaligned_input():
    plan = C.QuantizePlan(**_options(columnwise=True, rht=True))
    x0 = _inputs((64, 128), torch.bfloat16, seeds=(4,))[0]
    _planned(x0, plan)
    base = torch.empty(64 * 128 + 3, dtype=torch.bfloat16, device="cuda")
    x = base[3:].view(64, 128)
    x.copy_(x0 * 2)
    assert x.data_ptr() % 16
    _assert_same(_planned(x, plan), R.nvfp4_quantize(x, columnwise=True, rht=True), "unaligned")


@cuda
def test_cached_launch_on_a_reference_device(monkeypatch):
    """A device whose first-use check chose the reference twin: the cached launch steps aside."""
    idx = torch.cuda.current_device()
    opts = _options(columnwise=True, block_2d=True)
    plan = C.QuantizePlan(**opts)
    x = _inputs((64, 128), torch.float32, seeds=(5,))[0]
    _planned(x, plan)
    monkeypatch.setitem(C._E2M1, idx, "reference")
    calls = []
    real = C._quantize_reference
    monkeypatch.setattr(C, "_quantize_reference", lambda *a: calls.append(1) or real(*a))
    got = _planned(x, plan)
    assert calls, "the reference twin did not run"
    _assert_same(got, R.nvfp4_quantize(x, **opts), "reference device")


@cuda
def test_quantizer_bytes_unchanged():
    """The Linear quantizers of the default and row-scaled+4over6 recipes through the cached launch:
    every copy equal to the reference twin's, over repeated steps."""
    from fp_recipes import NVFP4BlockScaling
    from fp_recipes.quantizers.nvfp4 import NVFP4Quantizer
    from fp_recipes.quantizers.roles import ModuleKind, QuantizerRole, TensorKind

    recipes = [NVFP4BlockScaling(), NVFP4BlockScaling(
        row_scaled_activation=True, disable_rht=True, disable_2d_quantization=True, disable_stochastic_rounding=True,
        nvfp4_4over6="all", nvfp4_4over6_err_use_fast_math=True)]
    for recipe in recipes:
        for tensor in (TensorKind.ACTIVATION, TensorKind.WEIGHT, TensorKind.GRAD_OUTPUT):
            q = NVFP4Quantizer(recipe.plan(QuantizerRole(ModuleKind.LINEAR, tensor)))
            opts = dict(q._make_plan().options)
            for rep, x in enumerate(_inputs((256, 512), torch.bfloat16, seeds=(11, 12, 13))):
                seed, offset = q.seed, q.offset
                got = q(x.view(2, 128, 512))
                want = R.nvfp4_quantize(x, seed=seed, offset=offset, **opts)
                _assert_same(tuple(getattr(got, f) for f in FIELDS), want, f"{tensor} {opts} step {rep}")


def _operands(m, n, k, gen_seed, row_scaled=False):
    from fp_recipes.gemm.operands import Nvfp4Operand

    g = torch.Generator(device="cuda").manual_seed(gen_seed)
    x = torch.randn(m, k, device="cuda", generator=g) * (1 + gen_seed)
    w = torch.randn(n, k, device="cuda", generator=g) / (1 + gen_seed)
    qa = C.nvfp4_quantize(x, row_scaled=row_scaled)
    qb = C.nvfp4_quantize(w, e4m3_max=256)
    return (Nvfp4Operand(qa.data, qa.scale, qa.amax, row_scaled, 448, False),
            Nvfp4Operand(qb.data, qb.scale, qb.amax, False, 256, False))


def _python_host_path(monkeypatch):
    monkeypatch.setattr(_extension, "_fast", None)
    monkeypatch.setattr(_extension, "_fast_loaded", True)


@cuda
@pytest.mark.parametrize("host", ["cpp", "python"])
@pytest.mark.parametrize("name,kw", [c for c in COMBOS if c[0] in ("rowwise", "rht", "rht-sr", "2d", "row-scaled",
                                                                  "row-scaled-4over6", "col")], ids=lambda v: str(v))
def test_cached_launch_units_bytes_equal_general_path(monkeypatch, host, name, kw):
    """The resolved launch's unit operands (C++ and Python host paths) and its copies: the general path's bytes, and
    each unit bit-equal to decoding its copy."""
    from test_cuda_nvfp4_units import assert_units_decode

    if host == "python":
        _python_host_path(monkeypatch)
    opts = _options(**kw)
    for units in ((True, False), (True, True), (False, True)):
        plan = C.QuantizePlan(**opts)
        for rep, x in enumerate(_inputs((272, 2064) if not opts["rht"] else (272, 2048), torch.bfloat16, (1, 2))):
            got = C.nvfp4_quantize_planned(x, plan, None, 77, rep, units)
            want, unit, unit_t = C.nvfp4_quantize_with_units(x, unit_rowwise=units[0], unit_columnwise=units[1],
                                                             seed=77, offset=rep, **opts)
            what = f"{name} {host} units {units} call {rep}"
            _assert_same(got, want, what)
            for g, w in ((got[6], unit), (got[7], unit_t)):
                assert (g is None) == (w is None), what
                if w is not None:
                    assert torch.equal(g.view(torch.int16), w.view(torch.int16)), what
            assert_units_decode(got, what)
        assert list(plan.launches) == [(torch.Size(x.shape), x.dtype)]


@cuda
@pytest.mark.parametrize("host", ["cpp", "python"])
def test_fused_bias_grad_with_units(monkeypatch, host):
    """A gradient's cast with its bias gradient and the rowwise unit in one launch: the copies and db of the fused
    cast without units, the unit bit-equal to decoding the rowwise copy."""
    from test_cuda_nvfp4_units import assert_units_decode

    if host == "python":
        _python_host_path(monkeypatch)
    for opts in (_options(columnwise=True, rht=True, stochastic_rounding=True), _options(columnwise=True)):
        plan, plan0 = C.QuantizePlan(**opts), C.QuantizePlan(**opts)
        for rep, x in enumerate(_inputs((256, 1024), torch.bfloat16, (3, 4))):
            got, db = C.nvfp4_quantize_planned_dbias(x, plan, 9, rep, torch.bfloat16, (True, False))
            want, db0 = C.nvfp4_quantize_planned_dbias(x, plan0, 9, rep, torch.bfloat16)
            what = f"{opts} call {rep}"
            _assert_same(got, want, what)
            assert torch.equal(db.view(torch.int16), db0.view(torch.int16)), what
            assert got[6] is not None and got[7] is None and want[6] is None, what
            assert_units_decode(got, what)


def _fresh_alpha(monkeypatch):
    """Route the GEMM through a replaced nvfp4_unit_operands: a fresh alpha per call (the old path; the Python host
    path, as the C++ one keeps its own per-stream alpha)."""
    _python_host_path(monkeypatch)
    own = C.own_unit_operands

    def fresh(copies, amax_a=None, amax_b=None, e_a=448, e_b=448, *, with_alpha=True, device=None):
        return own(copies, amax_a, amax_b, e_a, e_b, with_alpha=with_alpha, device=device)

    monkeypatch.setattr(C, "nvfp4_unit_operands", fresh)


@cuda
@pytest.mark.parametrize("row_scaled", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gemm_alpha_workspace_same_bits_as_fresh_alpha(monkeypatch, row_scaled, out_dtype):
    from fp_recipes.gemm import nvfp4_emulated as E

    cases = [_operands(m, n, k, s, row_scaled) for s, (m, n, k) in
             enumerate([(256, 512, 1024), (64, 96, 128), (1000, 48, 4096), (16, 16, 16)])]
    outs = [E.emulated_cuda_eager(a, b, out_dtype, None) for a, b in cases]  # queued back to back, one alpha ws
    assert all(o is not None for o in outs)
    torch.cuda.synchronize()
    with monkeypatch.context() as mp:
        _fresh_alpha(mp)
        want = [E.emulated_cuda_eager(a, b, out_dtype, None) for a, b in cases]
    for i, (o, w) in enumerate(zip(outs, want)):
        assert torch.equal(o.view(torch.uint8), w.view(torch.uint8)), f"case {i}"


@cuda
@pytest.mark.parametrize("host", ["python", "c++"])
@pytest.mark.parametrize("ws_before_capture", [False, True])
def test_gemm_alpha_workspace_in_cuda_graph(monkeypatch, ws_before_capture, host):
    """Two GEMMs with different alphas captured on one stream (with the stream's alpha workspace made
    before the capture, or none: a fresh alpha in the graph's pool) replay with new operand values like
    eager GEMMs; on both host paths (the C++ one holds its per-stream workspaces itself)."""
    from fp_recipes.gemm import nvfp4_emulated as E

    fast = _extension.fast_ops()
    if host == "python":
        _python_host_path(monkeypatch)
    elif fast is None:
        pytest.skip(f"fp_recipes._torch_ops: {_extension.fast_ops_status()}")
    held = fast.buffers()[2] if host == "c++" else 0
    monkeypatch.setattr(C, "_ALPHA_WS", {})
    cases = [_operands(128, 256, 512, s) for s in (1, 2)]
    stream = torch.cuda.Stream()
    if ws_before_capture:
        with torch.cuda.stream(stream):
            E.emulated_cuda_eager(*cases[0], torch.float32, None)
        stream.synchronize()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        outs = [E.emulated_cuda_eager(a, b, torch.float32, None) for a, b in cases]
    if host == "python":
        assert ((torch.cuda.current_device(), stream.cuda_stream, threading.get_ident()) in C._ALPHA_WS) == \
            ws_before_capture
    else:  # one more workspace (the eager call's), none made while capturing
        assert not C._ALPHA_WS and fast.buffers()[2] == held + ws_before_capture
    for seed in (3, 4):
        for (a, b), s in zip(cases, (seed, seed + 10)):
            na, nb = _operands(128, 256, 512, s)
            for dst, src in ((a, na), (b, nb)):
                dst.data.copy_(src.data)
                dst.scale.copy_(src.scale)
                dst.amax.copy_(src.amax)
        graph.replay()
        torch.cuda.synchronize()
        with monkeypatch.context() as mp:
            _fresh_alpha(mp)
            want = [E.emulated_cuda_eager(a, b, torch.float32, None) for a, b in cases]
        for i, (o, w) in enumerate(zip(outs, want)):
            assert torch.equal(o, w), f"graph GEMM {i} (replay {seed})"


@cuda
@pytest.mark.parametrize("host", ["python", "c++"])
def test_gemm_alpha_workspace_per_thread(monkeypatch, host):
    """Two threads running emulated GEMMs on one stream: their launches interleave (decode A, decode B, GEMM A),
    and each GEMM must read its own call's alpha (a workspace per thread), so every result equals the same GEMM
    run alone. The interpreter switches threads every microsecond here, to interleave the Python path's launches."""
    from _threads import run_in_threads

    from fp_recipes.gemm import nvfp4_emulated as E

    if host == "python":
        _python_host_path(monkeypatch)
    elif _extension.fast_ops() is None:
        pytest.skip(f"fp_recipes._torch_ops: {_extension.fast_ops_status()}")
    cases = [_operands(64, 128, 256, s) for s in range(8)]  # 8 different alphas
    want = [E.emulated_cuda_eager(a, b, torch.float32, None).clone() for a, b in cases]
    torch.cuda.synchronize()

    def run(t):
        return [[E.emulated_cuda_eager(a, b, torch.float32, None) for a, b in cases[t::2]] for _ in range(25)]

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        got = run_in_threads(run, [(0,), (1,)])
    finally:
        sys.setswitchinterval(old)
    torch.cuda.synchronize()
    for t in (0, 1):
        for rep, outs in enumerate(got[t]):
            for j, out in enumerate(outs):
                assert torch.equal(out, want[t + 2 * j]), f"thread {t}, repeat {rep}, GEMM {j}"


def test_cached_launch_takes_the_cpp_launch_only_with_unit_operands(monkeypatch):
    """The resolved launch hands its runs to the C++ ``Nvfp4Launch`` only where that build takes unit operands
    (``nvfp4_launch_units``); an older ``_torch_ops`` build is left to the Python lines of ``_Launch.run``, which pass
    the units, instead of failing on (or dropping) them."""
    from types import SimpleNamespace

    made = []

    class Fast:
        def Nvfp4Launch(self, *args):  # noqa: N802 (the C++ class's name)
            made.append(args)
            return "cpp"

    x = SimpleNamespace(shape=torch.Size((32, 64)), dtype=torch.bfloat16, is_cuda=True)
    plan = C.QuantizePlan(**_options(columnwise=True))
    for units_attr, want in ((True, "cpp"), (False, None)):
        fast = Fast()
        if units_attr:
            fast.nvfp4_launch_units = True
        monkeypatch.setattr(_extension, "fast_ops", lambda fast=fast: fast)
        assert C._Launch(plan, x).cpp == want
    assert len(made) == 1
