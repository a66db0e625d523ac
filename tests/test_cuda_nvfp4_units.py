"""The quantize kernels' BF16 unit GEMM operands and the memset-free amax (issue 13).

``cuda_nvfp4.nvfp4_quantize_with_units`` writes, next to the packed copies, the emulated GEMM's BF16
operands: they must be bit-equal to ``gemm.nvfp4_emulated.decode_nvfp4_unit(data, scale, bfloat16)`` of the copies the
same call returned, and those copies byte-equal to the reference twin's (every mode, dtype, odd shapes,
tails, zeros, huge values, NaN/Inf, one row). The amax kernels combine through a per-stream workspace that
the last block re-zeroes: repeated calls, NaN, zero-size inputs and CUDA-graph capture must all give the
reference's amax. In a Linear, cached units must give the same bits as decoding (same GEMM inputs).
The CPU part checks the quantizer's unit policy and that the GEMM (gemm/nvfp4_emulated.py) reads a cache only when it fits."""

from __future__ import annotations

import pytest
import torch

from fp_recipes.gemm import nvfp4_emulated as E
from fp_recipes.gemm.operands import Nvfp4Operand
from fp_recipes.ops import ref_nvfp4 as R
from test_cuda_nvfp4_kernels import FIELDS, MODES, _mode_id, _mode_kwargs, assert_same_bytes, make_input

cuda = pytest.mark.cuda

#: NVFP4BlockScaling options of the Linear tests: the default recipe and row-scaled + 4over6 fast
LINEAR_RECIPES = [{}, dict(row_scaled_activation=True, disable_rht=True, disable_2d_quantization=True,
                           disable_stochastic_rounding=True, nvfp4_4over6="all", nvfp4_4over6_err_use_fast_math=True)]


def _check_units(x: torch.Tensor, unit_rowwise: bool = True, unit_columnwise: bool = True, **kw) -> None:
    from fp_recipes.ops import cuda_nvfp4 as C

    want = R.nvfp4_quantize(x, **kw)
    got, unit, unit_t = C.nvfp4_quantize_with_units(x, unit_rowwise=unit_rowwise,
                                                    unit_columnwise=unit_columnwise, **kw)
    what = f"({kw}, {x.dtype}, {tuple(x.shape)})"
    for f in FIELDS:
        assert_same_bytes(getattr(got, f), getattr(want, f), f"{f} {what}")
    for u, data, asked, name in ((unit, got.data, unit_rowwise, "unit"), (unit_t, got.data_t, unit_columnwise, "unit_t")):
        if data is None or not asked:
            assert u is None, f"{name} {what}: written although its copy or the flag is off"
        else:
            assert u is not None, f"{name} {what}: not written"
    assert_units_decode((got.data, got.scale, None, got.data_t, got.scale_t, None, unit, unit_t), what)


def assert_units_decode(res: tuple, what: str) -> None:
    """The unit operands of a planned quantization ``(data, scale, amax, data_t, scale_t, amax_t, unit, unit_t)``
    are bit for bit the decode of the copies next to them (NaN: torch's canonical BF16 NaN)."""
    for u, data, scale, name in ((res[6], res[0], res[1], "unit"), (res[7], res[3], res[4], "unit_t")):
        if u is None:
            continue
        expect = E.decode_nvfp4_unit(data, scale, torch.bfloat16)
        assert u.dtype == torch.bfloat16 and u.shape == expect.shape and u.is_contiguous(), f"{name} {what}"
        nan = torch.isnan(expect)
        assert torch.equal(torch.isnan(u), nan), f"{name} {what}: NaN positions differ"
        ub, eb = u.view(torch.int16), expect.view(torch.int16)
        assert torch.equal(ub[~nan], eb[~nan]), f"{name} {what}: {(ub != eb)[~nan].sum().item()} values differ"
        assert (ub[nan] == 0x7FC0).all(), f"{name} {what}: NaN is not torch's canonical BF16 NaN"


@cuda
@pytest.mark.parametrize("mode", MODES, ids=[_mode_id(m) for m in MODES])
@pytest.mark.parametrize("shape", [(16, 16), (48, 32), (80, 1040), (208, 160)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kind", ["randn", "huge", "special", "zeros"])
def test_units_every_mode(mode, shape, kind):
    x = make_input(shape, torch.bfloat16, kind, seed=shape[0] + shape[1])
    kw = _mode_kwargs(*mode)
    _check_units(x, rowwise=True, columnwise=True, **kw)
    if not kw["block_2d"]:
        _check_units(x, rowwise=True, columnwise=False, **kw)  # the rowwise kernel (no tile)
    _check_units(x, rowwise=False, columnwise=True, **kw)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("kind", ["randn", "mixed", "inf", "tiny", "special"])
@pytest.mark.parametrize("shape", [(1, 16), (1, 4112), (3, 48), (16, 2064), (272, 48), (1040, 80)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_units_dtypes_tails_one_row(dtype, kind, shape):
    x = make_input(shape, dtype, kind, seed=7)
    _check_units(x, rowwise=True, columnwise=False)
    if shape[0] % 16 == 0:
        _check_units(x, rowwise=True, columnwise=True)
        _check_units(x, rowwise=True, columnwise=True, unit_rowwise=False)
        _check_units(x, rowwise=True, columnwise=True, unit_columnwise=False)


@cuda
@pytest.mark.parametrize("shape", [(16, 16), (64, 64), (112, 1040), (1024, 512)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kind", ["randn", "huge", "mixed", "special"])
@pytest.mark.parametrize("sr", [False, True], ids=["rn", "sr"])
def test_units_rht_and_sr(shape, kind, sr):
    x = make_input(shape, torch.bfloat16, kind, seed=11)
    kw = dict(stochastic_rounding=sr, seed=2**63 + 5, offset=2**40 + 3)
    _check_units(x, rowwise=True, columnwise=True, rht=True, **kw)
    _check_units(x, rowwise=False, columnwise=True, rht=True, **kw)
    _check_units(x, rowwise=True, columnwise=True, block_2d=True, **kw)


@cuda
@pytest.mark.parametrize("shape", [(2064, 4112), (4096, 4160), (33, 8208), (17, 16384)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kind", ["randn", "special"])
def test_units_v7_kernels(shape, kind):
    """v7: units from the persistent tile2 kernel (many tiles per block, partial tiles) and from the fused
    row-scaled row kernel (2 and 4 blocks per thread)."""
    x = make_input(shape, torch.bfloat16, kind, seed=shape[1])
    if shape[0] % 16 == 0:
        _check_units(x, rowwise=True, columnwise=True)
        _check_units(x, rowwise=True, columnwise=True, block_2d=True)
        _check_units(x, rowwise=True, columnwise=True, rht=True, stochastic_rounding=True, seed=4, offset=1)
    _check_units(x, rowwise=True, columnwise=False, row_scaled=True)
    _check_units(x, rowwise=True, columnwise=False, row_scaled=True, four_over_six=True, err_fast_math=True)


@cuda
def test_units_with_given_amax_and_large():
    x = make_input((2048, 6144), torch.bfloat16, "randn", seed=3)
    _check_units(x, rowwise=True, columnwise=True, amax=torch.tensor(7.5, device="cuda"))
    _check_units(x, rowwise=True, columnwise=True, rht=True, stochastic_rounding=True, seed=9)
    _check_units(x, rowwise=True, columnwise=False, row_scaled=True)


# ---- memset-free amax ------------------------------------------------------------------------------

def _ws_words():
    from fp_recipes.ops import cuda_nvfp4 as C

    key = (torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream)
    return C._AMAX_WS[key].cpu()


@cuda
def test_amax_memset_free_repeated_calls():
    """Many back-to-back amaxes on one stream share one workspace: every result must be the reference's
    (a leftover maximum would leak into the next call) and the workspace ends zeroed."""
    from fp_recipes.ops import cuda_nvfp4 as C

    cases = [make_input(s, dt, k, seed=i) for i, (s, dt, k) in enumerate([
        ((4096, 4096), torch.bfloat16, "huge"), ((1, 16), torch.bfloat16, "randn"), ((3, 5), torch.float32, "tiny"),
        ((512, 512), torch.float16, "special"), ((64, 1040), torch.float32, "zeros"),
        ((2048, 48), torch.bfloat16, "inf"), ((1, 1), torch.float32, "randn"), ((4096, 4096), torch.bfloat16, "tiny")])]
    cases.append(torch.zeros((0, 16), device="cuda", dtype=torch.bfloat16))
    for rep in range(2):
        for x in cases:
            assert_same_bytes(C.nvfp4_amax(x), R.nvfp4_amax(x), f"amax {tuple(x.shape)} {x.dtype} rep {rep}")
            assert_same_bytes(C.nvfp4_row_amax(x), R.nvfp4_row_amax(x), f"row_amax {tuple(x.shape)} rep {rep}")
            if x.shape[0] % 16 == 0 and x.dtype == torch.bfloat16 and x.numel():
                kw = dict(rowwise=True, columnwise=True, rht=True)
                q, r = C.nvfp4_quantize(x, **kw), R.nvfp4_quantize(x, **kw)
                assert_same_bytes(q.amax, r.amax, "amax (fused with RHT amax)")
                assert_same_bytes(q.amax_t, r.amax_t, "RHT amax")
            if x.shape[0] % 16 == 0 and x.numel():
                kw = dict(rowwise=True, columnwise=True, row_scaled=True)
                q, r = C.nvfp4_quantize(x, **kw), R.nvfp4_quantize(x, **kw)
                assert_same_bytes(q.amax, r.amax, "row amax")
                assert_same_bytes(q.amax_t, r.amax_t, "global amax of the row amax kernel")
    torch.cuda.synchronize()
    assert torch.equal(_ws_words(), torch.zeros(4, dtype=torch.int32)), "workspace not re-zeroed"


@cuda
def test_amax_inside_cuda_graph():
    """Captured amaxes (with and without a workspace made before the capture) replay correctly."""
    from fp_recipes.ops import cuda_nvfp4 as C

    x = make_input((256, 512), torch.bfloat16, "randn", seed=1)
    C.nvfp4_amax(x)  # the current stream's workspace exists; the capture stream gets none (memset path)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a = C.nvfp4_amax(x)
        q = C.nvfp4_quantize(x, rowwise=True, columnwise=True, rht=True)
    for scale in (1.0, 1e-3, 300.0):
        x.copy_(make_input((256, 512), torch.bfloat16, "randn", seed=int(scale * 10)) * scale)
        graph.replay()
        torch.cuda.synchronize()
        r = R.nvfp4_quantize(x, rowwise=True, columnwise=True, rht=True)
        assert_same_bytes(a, R.nvfp4_amax(x), f"graph amax x{scale}")
        for f in FIELDS:
            assert_same_bytes(getattr(q, f), getattr(r, f), f"graph {f} x{scale}")


# ---- in a Linear -----------------------------------------------------------------------------------

@cuda
@pytest.mark.parametrize("recipe_kw", LINEAR_RECIPES, ids=["default", "rowscaled-4over6"])
def test_linear_units_same_bits_as_decode(recipe_kw):
    """fwd+bwd of one Linear with the cached unit operands ("rowwise", "auto", "all") and without ("none"):
    the GEMMs read bit-identical BF16 inputs, so y, dx and dw are identical (same cuBLASLt call, same
    inputs). Each module draws its own SR seeds, so the seeds are pinned too."""
    import fp_recipes
    from fp_recipes import Linear, NVFP4BlockScaling

    torch.manual_seed(0)
    ref = Linear(256, 384, bias=True, params_dtype=torch.bfloat16, device="cuda")
    x0 = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(128, 384, device="cuda", dtype=torch.bfloat16)
    recipe = NVFP4BlockScaling(**recipe_kw)
    results = {}
    for mode in ("none", "rowwise", "auto", "all"):
        mod = Linear(256, 384, bias=True, params_dtype=torch.bfloat16, device="cuda")
        mod.load_state_dict(ref.state_dict())
        with fp_recipes.autocast(recipe=recipe):
            mod(x0)  # builds the quantizers
        for g, qs in enumerate(mod.quantizer_sets):
            for i, q in enumerate(qs.quantizers.values()):
                if q is not None:
                    q.gemm_units = mode
                    q.seed, q.offset = 1000 + 10 * g + i, 0
        x = x0.clone().requires_grad_(True)
        with fp_recipes.autocast(recipe=recipe):
            y = mod(x)
        y.backward(dy)
        results[mode] = (y.detach(), x.grad, mod.weight.grad, mod.bias.grad)
    for mode in ("rowwise", "auto", "all"):
        for name, a, b in zip(("y", "dx", "dw", "db"), results[mode], results["none"]):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{mode}: {name} differs from decoding"


@cuda
def test_quantizer_writes_units_by_role():
    from fp_recipes.quantizers.factory import make_quantizer
    from fp_recipes.quantizers.roles import ModuleKind, QuantizerRole, TensorKind
    from fp_recipes import NVFP4BlockScaling

    recipe = NVFP4BlockScaling()
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    for tensor in (TensorKind.ACTIVATION, TensorKind.WEIGHT, TensorKind.GRAD_OUTPUT):
        q = make_quantizer(recipe.plan(QuantizerRole(ModuleKind.LINEAR, tensor)))
        assert q(x).gemm_unit is None  # default "none"
        q.gemm_units = "auto"
        t = q(x)
        assert t.gemm_unit is not None and t.gemm_unit.shape == (64, 128)
        assert (t.gemm_unit_t is not None) == (tensor is TensorKind.GRAD_OUTPUT and t.has_columnwise)
        if t.gemm_unit_t is not None:
            assert torch.equal(t.gemm_unit_t.view(torch.int16),
                               E.decode_nvfp4_unit(t.data_t, t.scale_t, torch.bfloat16).view(torch.int16))
        assert t.to("cuda").gemm_unit is None  # a cache: not carried by to()
        t.drop_gemm_units()
        assert t.gemm_unit is None and t.gemm_unit_t is None


@cuda
@pytest.mark.parametrize("recipe_kw", LINEAR_RECIPES, ids=["default", "rowscaled-4over6"])
def test_linear_units_peak_memory_not_above_decoding(recipe_kw):
    """A Linear's casts writing the rowwise unit operands (its default) allocate no more at the step's peak than
    decoding in the GEMMs: x's unit replaces the fprop decode of x, dy's the dgrad decode of dy, and dy's is freed
    before wgrad decodes dy's columnwise copy. Same-size allocations in the same order give the same peak; the 1 MiB
    allowance is the caching allocator's rounding of the small buffers (amaxes, alpha)."""
    import fp_recipes
    from fp_recipes import Linear, NVFP4BlockScaling
    from fp_recipes.quantizers.nvfp4 import NVFP4Quantizer

    recipe = NVFP4BlockScaling(**recipe_kw)
    x0 = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(2048, 3072, device="cuda", dtype=torch.bfloat16)
    peaks = {}
    for mode in ("none", "rowwise"):
        torch.manual_seed(0)
        mod = Linear(1024, 3072, bias=True, params_dtype=torch.bfloat16, device="cuda")
        saved = NVFP4Quantizer.module_gemm_units
        NVFP4Quantizer.module_gemm_units = mode
        try:
            for _ in range(2):  # the second step: every plan and workspace made
                x = x0.clone().requires_grad_(True)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                with fp_recipes.autocast(recipe=recipe):
                    y = mod(x)
                y.backward(dy)
                torch.cuda.synchronize()
                peaks[mode] = torch.cuda.max_memory_allocated() - base
        finally:
            NVFP4Quantizer.module_gemm_units = saved
        assert {q.gemm_units for qs in mod.quantizer_sets for q in qs.quantizers.values() if q is not None} == \
            ({"none"} if mode == "none" else {"none", "rowwise"})
        del mod, x, y
    assert peaks["rowwise"] <= peaks["none"] + (1 << 20), peaks


# ---- CPU ---------------------------------------------------------------------------------------------

def test_cpu_module_quantizers_serve_their_gemms():
    """A Linear's and LayerNormLinear's activation and gradient quantizers write the rowwise unit operand (the
    casts feed that call's GEMMs alone); weights (cached, all-gathered) and a GroupedLinear's experts (all cast
    before their GEMMs run) do not."""
    import fp_recipes
    from fp_recipes import GroupedLinear, LayerNormLinear, Linear, NVFP4BlockScaling
    from fp_recipes.quantizers.roles import TensorKind

    mods = [Linear(64, 32), LayerNormLinear(64, 32), GroupedLinear(2, 64, 32)]
    with fp_recipes.autocast(recipe=NVFP4BlockScaling()):
        mods[0](torch.randn(16, 64))
        mods[1](torch.randn(16, 64))
        mods[2](torch.randn(32, 64), [16, 16])
    for mod in mods:
        grouped = type(mod) is GroupedLinear
        for qs in mod.quantizer_sets:
            for tensor, q in qs.quantizers.items():
                want = "rowwise" if tensor is not TensorKind.WEIGHT and not grouped else "none"
                assert q.gemm_units == want, (type(mod).__name__, tensor)


def test_cpu_linear_releases_dy_unit_before_wgrad(monkeypatch):
    """The Linear backward releases dy's rowwise copy and its GEMM cache after dgrad, before wgrad (which reads the
    columnwise copy), so no BF16 operand outlives the GEMM that reads it."""
    import fp_recipes
    from fp_recipes import Linear, NVFP4BlockScaling
    from fp_recipes.modules import linear_function as LF
    from fp_recipes.quantizers.nvfp4 import NVFP4Tensor

    events = []
    real_gemm = LF.gemm

    def gemm(a, b, **kw):
        events.append(("gemm", kw.get("transpose_a", False), kw.get("transpose_b", False)))
        return real_gemm(a, b, **kw)

    real_release = NVFP4Tensor.release_rowwise

    def release(self):
        events.append(("release",))
        real_release(self)

    monkeypatch.setattr(LF, "gemm", gemm)
    monkeypatch.setattr(NVFP4Tensor, "release_rowwise", release)
    mod = Linear(64, 32)
    x = torch.randn(32, 64, requires_grad=True)
    with fp_recipes.autocast(recipe=NVFP4BlockScaling()):
        y = mod(x)
    y.sum().backward()
    assert events == [("gemm", False, False), ("gemm", False, True), ("release",), ("gemm", True, True)], events


def test_cpu_quantizer_writes_no_units_and_checks_mode():
    from fp_recipes.quantizers.factory import make_quantizer
    from fp_recipes.quantizers.roles import ModuleKind, QuantizerRole, TensorKind
    from fp_recipes import NVFP4BlockScaling

    q = make_quantizer(NVFP4BlockScaling().plan(QuantizerRole(ModuleKind.LINEAR, TensorKind.GRAD_OUTPUT)))
    t = q(torch.randn(32, 64, dtype=torch.bfloat16))
    assert t.gemm_unit is None and t.gemm_unit_t is None  # CPU: the reference path, no cache
    assert q.gemm_units == "none"  # the default (see NVFP4Quantizer: measured, not worth its memory)
    q.gemm_units = "auto"
    t = q(torch.randn(32, 64, dtype=torch.bfloat16))
    assert t.gemm_unit is None and t.gemm_unit_t is None
    q.gemm_units = "sometimes"
    with pytest.raises(ValueError, match="gemm_units must be 'none', 'rowwise', 'auto' or 'all'"):
        q(torch.randn(32, 64, dtype=torch.bfloat16))


def test_cpu_cached_unit_only_when_it_fits():
    g = torch.Generator().manual_seed(0)
    q = R.nvfp4_quantize(torch.randn(32, 64, generator=g))
    unit = E.decode_nvfp4_unit(q.data, q.scale, torch.bfloat16)
    op = Nvfp4Operand(q.data, q.scale, q.amax, False, 448, False, unit)
    assert E.cached_unit(op, torch.device("cpu")) is unit
    for bad in (unit.float(), unit[:, :32].contiguous(), unit.t().contiguous().t(), unit[:16]):
        op.unit = bad
        assert E.cached_unit(op, torch.device("cpu")) is None
    op.unit = None
    assert E.cached_unit(op, torch.device("cpu")) is None


def test_cpu_saved_operands_never_keep_a_gemm_unit():
    """What the Linear saves for its backward (``columnwise_only``) never holds the forward GEMM's BF16 unit operand:
    not when it drops the rowwise copy, and not when it keeps a tensor whole (no columnwise copy); the forward's own
    tensor keeps its cache."""
    from fp_recipes.modules.linear_function import columnwise_only
    from fp_recipes.quantizers.nvfp4 import NVFP4Tensor

    x = torch.randn(32, 64)
    for columnwise in (True, False):
        q = R.nvfp4_quantize(x, columnwise=columnwise)
        t = NVFP4Tensor(q.data, q.scale, q.amax, q.data_t, q.scale_t, q.amax_t, row_scaled=False, e4m3_max=448,
                        four_over_six=False, rht_columnwise=False, orig_dtype=x.dtype, shape=x.shape)
        unit = E.decode_nvfp4_unit(q.data, q.scale, torch.bfloat16)
        t.gemm_unit = unit
        saved = columnwise_only(t)
        assert saved is not t and saved.gemm_unit is None and saved.gemm_unit_t is None, columnwise
        assert (saved.data is None) == columnwise and saved.data_t is t.data_t
        assert t.gemm_unit is unit
