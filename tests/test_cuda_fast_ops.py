"""The torch-linked host path (``fp_recipes._torch_ops``, FP_RECIPES_TORCH_OPS) against the Python path it
replaces, byte for byte: the same launches with the same arguments must give the same bytes. Covers the planned
casts (current and delayed scaling, each copy choice, the fused bias gradient, the history record), the FP8 GEMM
branch (row strides, unaligned starts and scales, bias, every output dtype, declines), a side stream (its own
workspaces), a Linear step of both recipes, the NVFP4 quantize launches (every amax mode: plain, with the RHT amax,
per row, per row fused; 2-D blocks, stochastic rounding, 4over6, the fused bias gradient), the emulated NVFP4 GEMM
(per tensor and row-scaled, row chunks, fused and FP32 biases, cached unit copies), and the CUDA-graph rule
(no amax workspace while capturing). Needs a GPU and the module built (``pip install --no-build-isolation``, as
``../shared/device/setup.sh`` does)."""

from __future__ import annotations

import pytest
import torch

import fp_recipes
from fp_recipes import _extension
from fp_recipes.gemm import cublaslt
from fp_recipes.gemm import fp8 as gemm_fp8
from fp_recipes.gemm.operands import Fp8Operand
from fp_recipes.ops import cuda_fp8, cuda_nvfp4

pytestmark = pytest.mark.cuda
DEV = "cuda"


@pytest.fixture(scope="module")
def fast():
    mod = _extension.fast_ops()
    if mod is None and _extension.fast_ops_status().startswith("not built"):
        pytest.skip(f"fp_recipes._torch_ops: {_extension.fast_ops_status()}")
    assert mod is not None, _extension.fast_ops_status()
    return mod


@pytest.fixture
def python_path(monkeypatch):
    """Run the block with the Python host path (what FP_RECIPES_TORCH_OPS=off selects at start-up)."""
    fast = _extension.fast_ops()
    switched = []

    def use_python():
        monkeypatch.setattr(_extension, "_fast", None)  # casts, and NVFP4 launches resolved from here on
        monkeypatch.setattr(gemm_fp8, "_FAST_GEMM", [None])
        if fast is not None and hasattr(fast, "traced_ops_enabled"):  # the traced ops' C++ kernels too
            switched.append(fast.traced_ops_enabled(False))
    yield use_python
    if switched:
        fast.traced_ops_enabled(switched[0])


def same(got, want, what):
    if want is None:
        assert got is None, what
        return
    assert got is not None, what
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), what
    if got.dtype.is_floating_point and got.element_size() > 1:
        nan = torch.isnan(got) & torch.isnan(want)
        got, want = torch.where(nan, 0, got), torch.where(nan, 0, want)
    gb = got.contiguous().reshape(-1).view(torch.uint8)
    wb = want.contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(gb, wb), f"{what}: {int((gb != wb).sum())} bytes differ"


def assert_paths_equal(run, python_path, what):
    """``run()``'s tensors with the C++ host path, then with the Python one: the same bytes, one by one."""
    got = run()
    python_path()
    want = run()
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        same(a, b, f"{what} output {i}")


def make(shape, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(shape, generator=g, device=DEV) * torch.exp2(
        torch.randint(-20, 20, shape, generator=g, device=DEV).float())
    x = x.to(dtype)
    if x.numel() > 7:
        x.view(-1)[3] = float("nan")
        x.view(-1)[5] = float("inf") if dtype != torch.float16 else 60000.0
    return x


def planned(x, plan, scale=None, record=None, bias_dtype=None):
    out = cuda_fp8.fp8_cast_planned(x, plan, scale, record, bias_dtype)
    assert out is not None
    return out


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16))
def test_casts_equal_the_python_path(fast, python_path, dtype):
    shapes = ((1, 16), (65, 64), (257, 1008), (128, 4096), (3, 7))
    got, hist_got = [], []
    for fast_on in (True, False):
        if not fast_on:
            python_path()
        outs, hists = [], []
        for j, shape in enumerate(shapes):
            x = make(shape, dtype, j)
            for rw, cw in ((True, False), (True, True), (False, True)):
                cur = cuda_fp8.CastPlan("e4m3", rw, cw, True, use_power_2_scales=j % 2 == 0, amax_epsilon=1e-12)
                outs.append(planned(x, cur))
                outs.append(planned(x, cur, bias_dtype=dtype))
                scale = torch.tensor(0.8125, device=DEV)
                hist = torch.full((), 0.25, device=DEV)
                dl = cuda_fp8.CastPlan("e5m2", rw, cw, False)
                outs.append(planned(x, dl, scale, hist))
                outs.append(planned(x, dl, scale, hist, torch.bfloat16))
                hists.append(hist)
        got.append(outs)
        hist_got.append(hists)
    assert len(got[0]) == len(got[1])
    for i, (a, b) in enumerate(zip(*got)):
        assert len(a) == len(b), i
        for f, (ta, tb) in enumerate(zip(a, b)):
            same(ta, tb, f"cast {i} output {f}")
    for i, (a, b) in enumerate(zip(*hist_got)):
        same(a, b, f"history {i}")


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16))
def test_activation_casts_equal_the_python_path(fast, python_path, dtype):
    """The cast of gelu(x) (ops/cuda_fp8_act.py) through the C++ call and through Python, eager and as the traced
    ops: the same bytes and history records, each copy choice, both scalings and formats."""
    from fp_recipes.ops import cuda_fp8_act

    assert fast.fp8_cast_acts
    gemm_fp8.register_traced_kernels()
    ops = torch.ops.fp_recipes
    python_launches = []
    real = cuda_fp8_act._launch

    def counting(*args, **kwargs):
        python_launches.append(1)
        return real(*args, **kwargs)

    def run():
        outs = []
        for j, shape in enumerate(((1, 16), (65, 64), (257, 1008), (3, 7))):
            x = make(shape, dtype, 20 + j)
            for rw, cw in ((True, False), (True, True), (False, True)):
                scale, hist = torch.tensor(0.8125, device=DEV), torch.full((), 0.25, device=DEV)
                r = cuda_fp8_act.fp8_act_quantize(x, "gelu", "e5m2", rw, cw, scale=scale, record=hist)
                outs += [r.data, r.data_t, r.scale_inv, r.amax, r.scale, hist]
                r = cuda_fp8_act.fp8_act_quantize(x, "gelu", "e4m3", rw, cw, use_power_2_scales=j % 2 == 0,
                                                  amax_epsilon=1e-12)
                outs += [r.data, r.data_t, r.scale_inv, r.amax, r.scale]
                hist = torch.zeros(4, device=DEV)
                outs += list(ops.fp8_delayed_act_cast.default(x, scale, hist, "e4m3", rw, cw, "gelu")) + [hist]
                outs += list(ops.fp8_current_act_cast.default(x, "e5m2", True, 0.0, rw, cw, "gelu"))
        return outs

    import unittest.mock as mock
    with mock.patch.object(cuda_fp8_act, "_launch", counting):
        got = run()
        assert not python_launches, "an activation cast took the Python launch with the C++ host path on"
        python_path()
        want = run()
        assert python_launches, "python_path() left the activation casts on the C++ host path"
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        same(a, b, f"activation cast output {i}")


def test_cast_declines_what_python_declines(fast):
    plan = cuda_fp8.CastPlan("e4m3", True, True, True)
    x = make((64, 96), torch.bfloat16, 1)
    assert fast.fp8_cast(x.t(), 3, True, True, True, False, 0.0, None, None, None) is None  # not contiguous
    assert fast.fp8_cast(x[:0], 3, True, True, True, False, 0.0, None, None, None) is None  # empty
    assert fast.fp8_cast(x.to(torch.int32), 3, True, True, True, False, 0.0, None, None, None) is None
    assert fast.fp8_cast(x.cpu(), 3, True, True, True, False, 0.0, None, None, None) is None
    assert fast.fp8_cast(x, 3, True, True, True, False, 0.0, None, None, torch.int32) is None  # bias dtype
    assert fast.fp8_cast(x, 4, True, True, False, False, 0.0, None, None, None) is None  # delayed, no scale
    assert cuda_fp8.fp8_cast_planned(x.t(), plan) is None


def _traced_op_outputs(dtype) -> list:
    """What the traced-cast ops and the FP8 GEMM op return (and write into a history) for odd shapes, every copy
    choice, both scalings, with and without the fused bias gradient."""
    ops = torch.ops.fp_recipes
    outs = []
    for j, shape in enumerate(((1, 16), (65, 64), (257, 1008), (3, 7))):
        x = make(shape, dtype, 10 + j)
        for rw, cw in ((True, False), (True, True), (False, True)):
            hist = torch.full((4,), 0.25, device=DEV)
            scale = torch.tensor(0.8125, device=DEV)
            outs += list(ops.fp8_delayed_cast.default(x, scale, hist, "e4m3", rw, cw))
            outs += list(ops.fp8_delayed_cast_dbias.default(x, scale, hist, "e5m2", rw, cw, torch.bfloat16))
            outs += list(ops.fp8_current_scaling_quantize.default(x, "e4m3", j % 2 == 0, 1e-12, rw, cw))
            outs += list(ops.fp8_current_cast_dbias.default(x, "e5m2", False, 0.0, rw, cw, dtype))
            outs.append(hist)
        outs += list(ops.fp8_delayed_rowwise_cast.default(x, scale, torch.zeros(2, device=DEV), "e4m3"))
    for a, b, sa, sb, dt, bias, fast_runs in _linear_gemm_cases():
        if fast_runs and a.is_contiguous() and b.is_contiguous():  # (ready for cuBLASLt, as gemm_fp8_fp8 hands them)
            outs.append(ops.fp8_mm.default(a, b, sa, sb, dt, bias, False))
    return outs


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_traced_ops_equal_the_python_path(fast, python_path, dtype, monkeypatch):
    """A torch.compile graph calls the casts and the GEMM as ops; their implementations take the C++ host path
    (fp8_cast_op, fp8_linear_gemm): the same outputs and history records as the Python branch, and no two outputs
    of one op share storage (an op's outputs must not alias)."""
    if not cublaslt.available():
        pytest.skip(f"cuBLASLt: {cublaslt.status()}")
    assert set(gemm_fp8.register_traced_kernels()) == {"fp8_delayed_cast", "fp8_delayed_cast_dbias", "fp8_mm",
                                                       "fp8_delayed_rowwise_cast", "fp8_current_scaling_quantize",
                                                       "fp8_current_cast_dbias", "fp8_delayed_act_cast",
                                                       "fp8_current_act_cast"}
    x = make((96, 64), dtype, 4)
    scale, hist = torch.tensor(0.5, device=DEV), torch.zeros(4, device=DEV)
    one_op = torch.ops.fp_recipes.fp8_delayed_cast_dbias.default(x, scale, hist, "e4m3", True, True, torch.bfloat16)
    storages = [t.untyped_storage().data_ptr() for t in one_op if t.numel()]
    assert len(set(storages)) == len(storages)
    python_casts = []  # the Python branch's delayed casts: none through the C++ kernels, every one after python_path
    real = cuda_fp8.fp8_quantize_recording

    def counting(*args, **kwargs):
        python_casts.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cuda_fp8, "fp8_quantize_recording", counting)
    got = _traced_op_outputs(dtype)
    assert not python_casts, "a traced delayed cast ran the Python branch with the C++ kernels registered"
    python_path()
    want = _traced_op_outputs(dtype)
    assert python_casts, "python_path() left the traced ops on their C++ kernels"
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        same(a, b, f"traced op output {i}")


def test_traced_cast_declines_to_the_python_branch(fast):
    """What the C++ kernel of an op declines reaches the op's Python implementation, which says what is wrong (a
    non-contiguous input, a negative epsilon, a scale that is not one FP32 value); the op form's declines are the
    eager form's."""
    x = make((64, 96), torch.bfloat16, 5)
    assert fast.fp8_cast_op(x.t(), 3, True, True, True, False, 0.0, None, None, None) is None
    assert fast.fp8_cast_op(x.cpu(), 3, True, True, True, False, 0.0, None, None, None) is None
    ops = torch.ops.fp_recipes
    with pytest.raises(ValueError, match="x must be contiguous"):
        ops.fp8_current_scaling_quantize.default(x.t(), "e4m3", False, 0.0, True, True)
    with pytest.raises(ValueError, match="amax_epsilon must be >= 0"):
        ops.fp8_current_cast_dbias.default(x, "e4m3", False, -1.0, True, True, torch.bfloat16)
    hist = torch.zeros(4, device=DEV)
    with pytest.raises((ValueError, TypeError), match="scale"):
        ops.fp8_delayed_cast.default(x, torch.ones(2, device=DEV), hist, "e4m3", True, True)
    assert torch.equal(hist, torch.zeros(4, device=DEV))  # nothing recorded by a refused cast


def _linear_gemm_cases():
    """(a, b, scale_a, scale_b, out_dtype, bias, fast path expected to run it)."""
    g = torch.Generator(device=DEV).manual_seed(9)

    def fp8(rows, cols, dtype=torch.float8_e4m3fn):
        return (torch.randn(rows, cols, generator=g, device=DEV) * 3).to(dtype)

    sa, sb = torch.tensor(0.375, device=DEV), torch.tensor(1.5, device=DEV)
    odd = torch.tensor([0.5, 0.375, 1.25, 2.0], device=DEV)[1]
    for m, n, k in ((1, 16, 16), (200, 384, 256), (129, 4096, 512)):
        a, b = fp8(m, k), fp8(n, k)
        for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
            yield a, b, sa, sb, out_dtype, None, True
        yield a, b, odd, sb, torch.bfloat16, None, True  # a misaligned scale: copied, as _fp8_mm does
        bias = torch.randn(n, generator=g, device=DEV)
        yield a, b, sa, sb, torch.bfloat16, bias.bfloat16(), True  # fused into the epilogue
        yield a, b, sa, sb, torch.float16, bias.half(), True
        yield a, b, sa, sb, torch.bfloat16, bias, False  # an FP32 bias: added in FP32 by the Python branch
        yield a, fp8(n, k, torch.float8_e5m2), sa, sb, torch.bfloat16, None, True
        yield fp8(m, k, torch.float8_e5m2), fp8(n, k, torch.float8_e5m2), sa, sb, torch.bfloat16, None, False
    wide = fp8(96, 512)  # a column slice of a wider buffer: rows strided, read in place
    yield wide[:, 128:384], fp8(64, 256), sa, sb, torch.bfloat16, None, True
    yield wide[:, 8:264], fp8(64, 256), sa, sb, torch.bfloat16, None, True  # start not 16-byte aligned: a copy
    yield fp8(64, 256).t().contiguous().t(), fp8(32, 256), sa, sb, torch.bfloat16, None, True  # column-major
    yield fp8(64, 40), fp8(32, 40), sa, sb, torch.bfloat16, None, False  # K padded to 48 by the Python branch
    yield fp8(64, 32), fp8(24, 32), sa, sb, torch.bfloat16, None, False  # N padded
    yield fp8(0, 32), fp8(16, 32), sa, sb, torch.bfloat16, None, False  # empty


def test_linear_gemm_equals_the_python_branch(fast, python_path):
    if not cublaslt.available():
        pytest.skip(f"cuBLASLt: {cublaslt.status()}")
    cases = list(_linear_gemm_cases())
    ran = [fast.fp8_linear_gemm(a, b, sa, sb, dt, bias, False, cublaslt.WORKSPACE_BYTES) is not None
           for a, b, sa, sb, dt, bias, _ in cases]
    assert ran == [c[-1] for c in cases]
    a, b, sa, sb = cases[0][:4]
    with pytest.raises(ValueError, match="contraction dims differ"):  # declined by C++, raised by the branch
        gemm_fp8.gemm_fp8_fp8(Fp8Operand(a, sa), Fp8Operand(b[:, :8], sb), out_dtype=torch.bfloat16)
    got = [gemm_fp8.gemm_fp8_fp8(Fp8Operand(a, sa), Fp8Operand(b, sb), out_dtype=dt, bias=bias)
           for a, b, sa, sb, dt, bias, _ in cases]
    python_path()
    want = [gemm_fp8.gemm_fp8_fp8(Fp8Operand(a, sa), Fp8Operand(b, sb), out_dtype=dt, bias=bias)
            for a, b, sa, sb, dt, bias, _ in cases]
    for i, (g_, w_) in enumerate(zip(got, want)):
        same(g_, w_, f"linear gemm case {i}")


def test_side_stream_has_its_own_workspaces(fast):
    x = make((96, 256), torch.bfloat16, 2)
    plan = cuda_fp8.CastPlan("e4m3", True, True, True)
    want = planned(x, plan)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = planned(x, plan)
    torch.cuda.current_stream().wait_stream(side)
    assert fast.buffers()[0] >= 2  # the current stream's and the side stream's
    for f, (a, b) in enumerate(zip(got, want)):
        same(a, b, f"side stream output {f}")


def linear_steps(recipes, steps: int, tokens: int) -> list:
    """Outputs and gradients of a Linear trained a few steps per recipe (a weight update after each)."""
    torch.manual_seed(0)
    layer = fp_recipes.Linear(256, 384, bias=True, params_dtype=torch.bfloat16, device=DEV)
    outs = []
    for recipe in recipes:
        for _ in range(steps):
            x = torch.randn(tokens, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
            with fp_recipes.autocast(recipe=recipe):
                y = layer(x)
            y.backward(torch.randn_like(y))
            outs += [y.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()]
            with torch.no_grad():
                layer.weight.add_(layer.weight.grad, alpha=-1e-2)
            layer.weight.grad = layer.bias.grad = None
    return outs


def _delayed_state_steps() -> list:
    """A delayed-scaling Linear's state after each of 4 steps (the second step's input holds a NaN): every
    buffer's bytes and version counter, and the NonFiniteAmaxWarnings raised."""
    import warnings

    from fp_recipes.quantizers.nonfinite import NonFiniteAmaxWarning

    torch.manual_seed(1)
    layer = fp_recipes.Linear(128, 256, bias=False, params_dtype=torch.bfloat16, device=DEV)
    recipe = fp_recipes.DelayedScaling(amax_history_len=4)
    outs, warned = [], []
    for step in range(4):
        x = torch.randn(64, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        if step == 1:
            x.data[3, 5] = float("nan")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", NonFiniteAmaxWarning)
            with fp_recipes.autocast(recipe=recipe):
                y = layer(x)
            y.backward(torch.randn_like(y))
            torch.cuda.synchronize()  # (the flags of this step's updates are read at the next update)
        warned += [str(w.message) for w in seen if issubclass(w.category, NonFiniteAmaxWarning)]
        for name, buf in sorted(layer.named_buffers()):
            outs += [buf.detach().clone(), torch.tensor([buf._version])]
    return outs, warned


def test_delayed_updates_equal_the_python_path(fast, python_path):
    """The scale updates as one C++ call (DelayedUpdates): the same histories and scales, the same version
    bumps of the scales (a cached quantized weight is keyed by them), the same non-finite warnings. (Which update
    reports a flag depends on whether the flagging kernel has finished when the flags are read, on either path:
    the warnings of the whole run are compared.)"""
    got, got_warned = _delayed_state_steps()
    assert got_warned, "the NaN step raised no NonFiniteAmaxWarning on the C++ path"
    python_path()
    want, want_warned = _delayed_state_steps()
    assert sorted(got_warned) == sorted(want_warned)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        same(a, b, f"delayed state {i}")


@pytest.mark.parametrize("recipe", ("delayed", "current"))
def test_linear_steps_equal_the_python_path(fast, python_path, recipe):
    def make_recipe():
        return fp_recipes.DelayedScaling() if recipe == "delayed" else fp_recipes.Float8CurrentScaling()
    assert_paths_equal(lambda: linear_steps([make_recipe()], 3, 200), python_path, f"{recipe} steps")


def test_captured_casts_take_no_workspace(fast):
    """A capture stream never seen before: taking a workspace inside the capture would add one."""
    x = make((128, 512), torch.bfloat16, 3)
    plan = cuda_fp8.CastPlan("e4m3", True, True, True)
    want = planned(x, plan)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    seen = fast.buffers()[0]
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph, stream=side):
            out = planned(x, plan)
    torch.cuda.current_stream().wait_stream(side)
    assert fast.buffers()[0] == seen
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        for f, (a, b) in enumerate(zip(out, want)):
            same(a, b, f"replayed output {f}")


# ---- NVFP4: ops/cuda_nvfp4.py _Launch.run as one C++ call -----------------------------------------------------

NVFP4_PLANS = {  # name: QuantizePlan options (the amax mode _Launch picks in the comment)
    "1d row+col": dict(rowwise=True, columnwise=True, block_2d=False, row_scaled=False, four_over_six=False,
                       err_mode="MAE", err_fast_math=False, rht=False, stochastic_rounding=False),  # plain
    "2d weight": dict(rowwise=True, columnwise=True, block_2d=True, row_scaled=False, four_over_six=False,
                      err_mode="MAE", err_fast_math=False, rht=False, stochastic_rounding=False),  # plain
    "grad SR + RHT col": dict(rowwise=True, columnwise=True, block_2d=False, row_scaled=False, four_over_six=False,
                              err_mode="MAE", err_fast_math=False, rht=True, stochastic_rounding=True),  # both
    "RHT col only": dict(rowwise=False, columnwise=True, block_2d=False, row_scaled=False, four_over_six=False,
                         err_mode="MAE", err_fast_math=False, rht=True, stochastic_rounding=False),  # plain, RHT amax
    "row-scaled 4over6 fast": dict(rowwise=True, columnwise=False, block_2d=False, row_scaled=True,
                                   four_over_six=True, err_mode="MAE", err_fast_math=True, rht=False,
                                   stochastic_rounding=False),  # fused_row
    "row-scaled + col, 4over6 MSE": dict(rowwise=True, columnwise=True, block_2d=False, row_scaled=True,
                                         four_over_six=True, err_mode="MSE", err_fast_math=False, rht=False,
                                         stochastic_rounding=False),  # row
}


def _nvfp4_outputs(shapes, dtype, plans):
    outs = []
    for name, opts in plans.items():
        plan = cuda_nvfp4.QuantizePlan(e4m3_max=448, **opts)
        for j, shape in enumerate(shapes):
            x = make(shape, dtype, 40 + j)
            for rep in range(2):  # the second call takes the resolved launch
                outs.append((f"{name} {shape} rep {rep}",
                             cuda_nvfp4.nvfp4_quantize_planned(x, plan, None, seed=1234 + j, offset=rep * 7)))
            if opts["columnwise"] and not opts["block_2d"]:
                got = cuda_nvfp4.nvfp4_quantize_planned_dbias(x, plan, 99, 3, torch.bfloat16)
                assert got is not None, name
                outs.append((f"{name} {shape} dbias", got[0] + (got[1],)))
    return outs


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_nvfp4_quantize_equals_the_python_path(fast, python_path, dtype):
    shapes = ((32, 64), (128, 256), (96, 2048))
    plans = {k: v for k, v in NVFP4_PLANS.items() if dtype == torch.bfloat16 or not v["rht"]}  # RHT: BF16 only
    got_all = _nvfp4_outputs(shapes, dtype, plans)
    python_path()
    want_all = _nvfp4_outputs(shapes, dtype, plans)
    assert [n for n, _ in got_all] == [n for n, _ in want_all]
    for (name, got), (_, want) in zip(got_all, want_all):
        assert len(got) == len(want), name
        for f, (a, b) in enumerate(zip(got, want)):
            same(a, b, f"nvfp4 {name} output {f}")


def test_nvfp4_launch_declines_what_python_declines(fast):
    plan = cuda_nvfp4.QuantizePlan(e4m3_max=448, **NVFP4_PLANS["1d row+col"])
    x = make((64, 128), torch.bfloat16, 7)
    cuda_nvfp4.nvfp4_quantize_planned(x, plan, None, seed=1, offset=0)
    launch = plan.launches[(x.shape, x.dtype)]
    assert launch.cpp is not None
    assert launch.cpp.run(x, 1, 0, None, None) is not None
    buf = torch.empty(x.numel() + 1, dtype=x.dtype, device=DEV)
    shifted = buf[1:].view(x.shape)  # x's shape and dtype, 2 bytes past a 16-byte boundary
    shifted.copy_(x)
    assert launch.cpp.run(shifted, 1, 0, None, None) is None  # not 16-byte aligned
    assert launch.cpp.run(x.float(), 1, 0, None, None) is None  # another dtype than the launch's
    assert launch.cpp.run(x.cpu(), 1, 0, None, None) is None
    with pytest.raises(ValueError, match="mode must be 0..3"):
        fast.Nvfp4Launch(64, 128, 2, 7, True, True, False, False, False, True, 0, False, 448.0, False)


def test_nvfp4_linear_steps_equal_the_python_path(fast, python_path):
    def recipes():
        return [fp_recipes.NVFP4BlockScaling(),
                fp_recipes.NVFP4BlockScaling(row_scaled_activation=True, disable_rht=True,
                                             disable_2d_quantization=True, disable_stochastic_rounding=True,
                                             nvfp4_4over6="all", nvfp4_4over6_err_use_fast_math=True)]
    assert_paths_equal(lambda: linear_steps(recipes(), 2, 192), python_path, "nvfp4 steps")


def _nvfp4_operand(rows, k, seed, *, row_scaled=False, e4m3_max=448, unit=False):
    from fp_recipes.gemm.nvfp4_emulated import decode_nvfp4_unit
    from fp_recipes.gemm.operands import Nvfp4Operand
    from fp_recipes.ops import ref_nvfp4

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 8
    x[0, :16] = 0.0  # an all-zero block
    q = ref_nvfp4.nvfp4_quantize(x, rowwise=True, columnwise=False, row_scaled=row_scaled, e4m3_max=e4m3_max)
    data, scale = q.data.to(DEV), q.scale.to(DEV)
    u = decode_nvfp4_unit(data, scale, torch.bfloat16) if unit else None
    return Nvfp4Operand(data, scale, q.amax.to(DEV), row_scaled, e4m3_max, False, u)


# (name, M, N, K, a options, b options, out dtype, bias dtype): per tensor and row-scaled (a's rows, b's rows, both),
# one and several row chunks (>= 2048 rows), a bias of the output's dtype (fused) and of another (added in FP32),
# every output dtype, cached unit copies on neither, one or both sides
_EMULATED_CASES = (
    ("per tensor", 64, 48, 128, {}, {"e4m3_max": 256}, torch.bfloat16, torch.bfloat16),
    ("per tensor fp32 bias", 96, 32, 64, {}, {}, torch.bfloat16, torch.float32),
    ("per tensor fp32 out", 48, 64, 256, {}, {}, torch.float32, None),
    ("per tensor fp16", 32, 16, 32, {}, {}, torch.float16, torch.float16),
    ("a unit cached", 64, 48, 128, {"unit": True}, {}, torch.bfloat16, None),
    ("b unit cached", 64, 48, 128, {}, {"unit": True}, torch.bfloat16, torch.bfloat16),
    ("both cached", 64, 48, 128, {"unit": True}, {"unit": True}, torch.float32, None),
    ("row-scaled a", 80, 48, 96, {"row_scaled": True}, {}, torch.bfloat16, torch.bfloat16),
    ("row-scaled b", 32, 64, 64, {}, {"row_scaled": True}, torch.float16, None),
    ("row-scaled both", 48, 32, 64, {"row_scaled": True}, {"row_scaled": True}, torch.float32, torch.float32),
    ("row-scaled 3 chunks", 3100, 64, 64, {"row_scaled": True, "unit": True}, {}, torch.bfloat16, torch.float32),
)


def test_nvfp4_emulated_gemm_equals_the_python_path(fast, python_path):
    from fp_recipes.gemm import nvfp4_emulated as E

    def run():
        outs = []
        for i, (name, m, n, k, a_opts, b_opts, out_dtype, bias_dtype) in enumerate(_EMULATED_CASES):
            a = _nvfp4_operand(m, k, 10 + i, **a_opts)
            b = _nvfp4_operand(n, k, 50 + i, **b_opts)
            bias = None if bias_dtype is None else \
                torch.randn(n, generator=torch.Generator().manual_seed(i)).to(bias_dtype).to(DEV)
            out = E.emulated_cuda_eager(a, b, out_dtype, bias)
            assert out is not None and out.dtype == out_dtype and out.shape == (m, n), name
            # the torch emulation computes the same products; only cuBLAS's FP32 summation order differs
            want = E.gemm_nvfp4_emulated(a, b, out_dtype, bias)
            torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=1e-2, msg=name)
            outs.append(out)
        return outs
    assert_paths_equal(run, python_path, "emulated NVFP4 GEMM")


def test_nvfp4_emulated_gemm_declines_what_python_declines(fast):
    a = _nvfp4_operand(32, 64, 1)
    b = _nvfp4_operand(16, 64, 2)
    args = lambda a, b, out_dtype=torch.bfloat16, bias=None: (  # noqa: E731
        a.data, a.scale, a.amax, a.unit, a.row_scaled, a.e4m3_max, b.data, b.scale, b.amax, b.unit, b.row_scaled,
        b.e4m3_max, out_dtype, bias, cublaslt.WORKSPACE_BYTES, 1024, 4)
    assert fast.nvfp4_emulated_gemm(*args(a, b)) is not None
    assert fast.nvfp4_emulated_gemm(*args(a, b, torch.float8_e4m3fn)) is None  # an output dtype it does not make
    cpu = _nvfp4_operand(32, 64, 1)
    cpu.data, cpu.scale, cpu.amax = cpu.data.cpu(), cpu.scale.cpu(), cpu.amax.cpu()
    assert fast.nvfp4_emulated_gemm(*args(cpu, b)) is None
    odd = _nvfp4_operand(32, 64, 1)
    odd.data = odd.data.t().contiguous().t()  # not contiguous: the Python path raises in the decode, then declines
    assert fast.nvfp4_emulated_gemm(*args(odd, b)) is None
    short = _nvfp4_operand(32, 64, 1, row_scaled=True)
    short.amax = short.amax[:5]  # a per-row amax of the wrong length: the Python epilogue raises
    assert fast.nvfp4_emulated_gemm(*args(short, b)) is None
    assert fast.nvfp4_emulated_gemm(*args(a, b, torch.bfloat16, torch.zeros(15, device=DEV))) is None


# ---- as a job runs it: activation checkpointing, torch.autocast(bf16), two threads --------------------------

def _job_steps(recipe_factory) -> list:
    """Two layers trained from two threads at once, each step under torch.autocast(bf16) with the layer inside
    activation checkpointing (its forward runs twice: the recompute must quantize as the first pass did)."""
    import torch.utils.checkpoint as cp
    from _threads import run_in_threads

    torch.manual_seed(0)
    layers = [fp_recipes.Linear(256, 256, bias=True, device=DEV) for _ in range(2)]
    xs = [torch.randn(128, 256, device=DEV) for _ in range(2)]

    def run(i):
        res = []
        for _ in range(2):
            x = xs[i].clone().requires_grad_(True)
            with torch.autocast("cuda", dtype=torch.bfloat16), fp_recipes.autocast(recipe=recipe_factory()):
                y = cp.checkpoint(layers[i], x, use_reentrant=False)
            y.float().square().mean().backward()
            res += [y.detach(), x.grad, layers[i].weight.grad.clone()]
            layers[i].weight.grad = layers[i].bias.grad = None
        return res

    outs = run_in_threads(run, [(0,), (1,)])
    torch.cuda.synchronize()
    return outs[0] + outs[1]


@pytest.mark.parametrize("recipe", ("delayed", "current", "nvfp4"))
def test_checkpointed_autocast_steps_from_two_threads_equal_the_python_path(fast, python_path, recipe):
    factory = {"delayed": fp_recipes.DelayedScaling, "current": fp_recipes.Float8CurrentScaling,
               "nvfp4": fp_recipes.NVFP4BlockScaling}[recipe]
    assert_paths_equal(lambda: _job_steps(factory), python_path, f"{recipe} job steps")
