"""CPU-side checks of the FP8 kernel family (run in CI, no GPU needed): the built extension loads and
reports its ops, the fake (meta) implementations give the kernels' shapes and dtypes, torch.compile
traces the ops in one graph, and the extension's own argument checks raise before touching a GPU."""

from __future__ import annotations

import glob
import os

import pytest
import torch

import fp_recipes
from fp_recipes.ops import backend

BUILT = bool(glob.glob(os.path.join(os.path.dirname(fp_recipes.__file__), "_C*.so")))
needs_ext = pytest.mark.skipif(not BUILT, reason="fp_recipes._C not built here (no nvcc / FP_RECIPES_NO_CUDA)")

FP8_OPS = ("fp8_amax", "fp8_quantize", "fp8_current_scaling_quantize", "fp8_dequantize", "fp8_grouped_quantize",
           "fp8_grouped_amax", "fp8_grouped_dequantize", "per_token_cast", "cast_back")


@needs_ext
def test_extension_loads_and_backend_info_reports_it():
    assert backend.extension() is not None, backend.extension_error()
    info = fp_recipes.backend_info()
    assert isinstance(info["grouped_gemm"], str)
    assert info["extension"] is True
    archs = info["built_archs"].split(";")
    assert archs and all(a.rstrip("af").isdigit() for a in archs)
    for name in FP8_OPS:
        assert name in info["cuda_ops"], name
    if not torch.cuda.is_available():
        assert info["backend"] == "reference" and "no CUDA device" in info["summary"]


@needs_ext
def test_extension_argument_checks_raise_without_a_gpu():
    ext = backend.extension()
    with pytest.raises(ValueError, match="float8_e4m3fn or float8_e5m2"):
        ext.fp8_quantize(0, 2, 4, 4, 0, 0, 0, 0, 0, 0, 0)  # output dtype float32
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        ext.fp8_amax(0, 3, 4, 0, 0)
    with pytest.raises(ValueError, match="unknown dtype code"):
        ext.fp8_amax(0, 17, 4, 0, 0)
    with pytest.raises(ValueError, match="block_size 3 must be positive and divide hidden 16"):
        ext.per_token_cast(0, 2, 2, 16, 0, False, False, 3, 0, 0, 0)
    with pytest.raises(ValueError, match="multiples of 8"):
        ext.per_token_cast(0, 2, 2, 12, 0, False, False, 12, 0, 0, 0)
    with pytest.raises(ValueError, match="ue8m0 scales require round_sf"):
        ext.per_token_cast(0, 2, 2, 16, 1, False, True, 16, 0, 0, 0)
    with pytest.raises(ValueError, match="no groups"):
        ext.fp8_grouped_quantize(0, 2, 10, 0, 0, 0, 3, 0, 0, 0, 0)
    assert ext.per_token_max_hidden(True) >= 32768


def _meta(shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


@needs_ext
def test_fake_impls_give_kernel_shapes_and_dtypes():
    from fp_recipes.ops import cuda_fp8 as cu

    x = _meta((5, 24))
    s = _meta((), torch.float32)
    q = cu.fp8_quantize(x, s, "e5m2", rowwise=True, columnwise=True)
    assert q.data.shape == (5, 24) and q.data.dtype == torch.float8_e5m2
    assert q.data_t.shape == (24, 5) and q.data_t.dtype == torch.float8_e5m2
    assert q.scale_inv.shape == () and q.amax.dtype == torch.float32 and q.scale is s
    q = cu.fp8_quantize(x, s, "e4m3", rowwise=False, columnwise=True)
    assert q.data is None and q.data_t.shape == (24, 5)
    c = cu.fp8_current_scaling_quantize(x, "e4m3")
    assert c.data.dtype == torch.float8_e4m3fn and c.data_t is None and c.scale.shape == ()
    assert cu.fp8_dequantize(q.data_t, q.scale_inv, torch.float16).dtype == torch.float16
    assert cu.fp8_amax(x).shape == ()
    offsets = _meta((4,), torch.int64)
    g = cu.fp8_grouped_quantize(x, offsets, _meta((3,), torch.float32), "e4m3")
    assert g.data.shape == (5, 24) and g.scale_inv.shape == (3,) and g.amax.shape == (3,)
    assert cu.fp8_grouped_amax(x, offsets).shape == (3,)
    assert cu.fp8_grouped_dequantize(g.data, offsets, g.scale_inv, torch.bfloat16).dtype == torch.bfloat16
    p = cu.per_token_cast(_meta((7, 64)), "e5m6", round_sf=True, scale_format="ue8m0", block_size=16)
    assert p.data.shape == (7, 96) and p.data.dtype == torch.uint8
    assert p.scales.shape == (7, 4) and p.scales.dtype == torch.uint8
    p = cu.per_token_cast(_meta((7, 64), torch.float32), "e4m3")
    assert p.data.shape == (7, 64) and p.data.dtype == torch.float8_e4m3fn
    assert p.scales.shape == (7, 1) and p.scales.dtype == torch.float32
    b = cu.cast_back(_meta((7, 96), torch.uint8), _meta((7, 4), torch.uint8), "e5m6", out_dtype=torch.float32,
                     scale_format="ue8m0", block_size=16)
    assert b.shape == (7, 64) and b.dtype == torch.float32


@needs_ext
def test_torch_compile_traces_the_ops_in_one_graph():
    from fp_recipes.ops import cuda_fp8 as cu

    def f(x, s, offsets, scales):
        q = cu.fp8_quantize(x, s, "e4m3", rowwise=True, columnwise=True)
        c = cu.fp8_current_scaling_quantize(x, "e5m2", use_power_2_scales=True)
        d = cu.fp8_dequantize(q.data, q.scale_inv, torch.bfloat16)
        g = cu.fp8_grouped_quantize(x, offsets, scales, "e4m3")
        p = cu.per_token_cast(x, "e5m6", round_sf=True, scale_format="ue8m0", block_size=8)
        b = cu.cast_back(p.data, p.scales, "e5m6", out_dtype=torch.float32, scale_format="ue8m0", block_size=8)
        return q.data_t, c.scale, d, g.amax, b

    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True, backend="eager")(
        _meta((16, 64)), _meta((), torch.float32), _meta((3,), torch.int64), _meta((2,), torch.float32))
    assert [tuple(o.shape) for o in out] == [(64, 16), (), (16, 64), (2,), (16, 64)]
    assert out[2].dtype == torch.bfloat16 and out[4].dtype == torch.float32


@needs_ext
def test_custom_op_refuses_cpu_tensors_with_a_clear_message():
    import fp_recipes.ops.cuda_fp8  # noqa: F401  (registers the ops)

    x = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="CUDA kernel.*reference for CPU tensors"):
        torch.ops.fp_recipes.fp8_quantize(x, torch.ones(()), "e4m3", True, False)
    with pytest.raises(ValueError, match="CUDA kernel"):
        torch.ops.fp_recipes.per_token_cast(x, "e4m3", False, "fp32", 8)
    with pytest.raises(ValueError, match="fp8_cast_from_amax is the CUDA kernel"):
        torch.ops.fp_recipes.fp8_current_cast_from_amax(x, torch.ones(()), "e4m3", False, 0.0, True, False)


@needs_ext
def test_the_traced_cast_and_gemm_ops_have_the_kernels_shapes_under_fake_cuda_tensors():
    """What torch.compile sees of the ops a traced CUDA step calls (quantizers/float8.py, gemm/fp8.py):
    their fake implementations on fake CUDA tensors (no GPU needed) give the copies, scalars and bias
    gradient the kernels write."""
    import fp_recipes.gemm.fp8  # noqa: F401  (registers fp8_mm)
    import fp_recipes.ops.cuda_fp8  # noqa: F401
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = torch.ops.fp_recipes
    with FakeTensorMode():
        x = torch.empty(48, 80, dtype=torch.bfloat16, device="cuda")
        scale = torch.empty((), dtype=torch.float32, device="cuda")
        history = torch.empty(4, dtype=torch.float32, device="cuda")
        outs = {
            "delayed": ops.fp8_delayed_cast(x, scale, history, "e4m3", True, True),
            "delayed, rowwise only": ops.fp8_delayed_cast(x, scale, history, "e4m3", True, False),
            "delayed dbias": ops.fp8_delayed_cast_dbias(x, scale, history, "e5m2", True, True, torch.bfloat16),
            "current dbias": ops.fp8_current_cast_dbias(x, "e5m2", False, 0.0, True, True, torch.float32),
            "delayed rowwise + scale": ops.fp8_delayed_rowwise_cast(x, scale, history, "e4m3"),
            "current from amax": ops.fp8_current_cast_from_amax(x, scale, "e4m3", False, 0.0, True, False),
            "current from amax dbias": ops.fp8_current_cast_from_amax_dbias(x, scale, "e4m3", True, 0.0, False, True,
                                                                            torch.bfloat16),
        }
        a = torch.empty(48, 80, dtype=torch.float8_e4m3fn, device="cuda")
        b = torch.empty(32, 80, dtype=torch.float8_e4m3fn, device="cuda")
        y = ops.fp8_mm(a, b, scale, scale, torch.bfloat16, None, True)
    shapes = {k: [(tuple(t.shape), t.dtype) for t in v] for k, v in outs.items()}
    e4, e5, f32 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float32
    assert shapes["delayed"] == [((48, 80), e4), ((80, 48), e4), ((), f32), ((), f32)]
    assert shapes["delayed, rowwise only"] == [((48, 80), e4), ((0,), e4), ((), f32), ((), f32)]
    assert shapes["delayed dbias"] == [((48, 80), e5), ((80, 48), e5), ((), f32), ((), f32), ((80,), torch.bfloat16)]
    assert shapes["current dbias"] == [((48, 80), e5), ((80, 48), e5), ((), f32), ((), f32), ((80,), f32)]
    assert shapes["delayed rowwise + scale"] == [((48, 80), e4), ((), f32), ((), f32), ((), f32)]
    assert shapes["current from amax"] == [((48, 80), e4), ((0,), e4), ((), f32), ((), f32)]
    assert shapes["current from amax dbias"] == [((0,), e4), ((80, 48), e4), ((), f32), ((), f32),
                                                 ((80,), torch.bfloat16)]
    assert "Tensor(a2!) history" in str(ops.fp8_delayed_rowwise_cast.default._schema)
    assert (tuple(y.shape), y.dtype, y.device.type) == ((48, 32), torch.bfloat16, "cuda")
    schema = str(ops.fp8_delayed_cast.default._schema)
    assert "Tensor(a2!) history" in schema  # the history is the op's mutated argument: the graph keeps the order


@needs_ext
def test_the_traced_delayed_cast_refuses_a_history_it_cannot_record_into():
    import fp_recipes.ops.cuda_fp8  # noqa: F401

    x = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="history must be a non-empty contiguous FP32 tensor"):
        torch.ops.fp_recipes.fp8_delayed_cast(x, torch.ones(()), torch.zeros(4), "e4m3", True, True)


def test_the_traced_current_cast_with_the_amax_in_the_graph_is_wired_as_the_eager_cast(monkeypatch):
    """Float8CurrentScalingQuantizer.compile_visible_amax: the traced cast computes max |x| with graph ops and
    hands it to the cast op (here a stand-in running the reference with that amax: on CUDA it is the kernel,
    checked byte for byte in test_cuda_fp8_kernels.py); the tensor it builds must be the eager cast's."""
    from fp_recipes import Float8CurrentScaling
    from fp_recipes.ops import ref_fp8
    from fp_recipes.quantizers import float8 as f8
    from fp_recipes.quantizers.factory import make_quantizer
    from fp_recipes.quantizers.roles import ModuleKind, QuantizerRole, TensorKind

    seen = []

    def from_amax(x, amax, fmt, pow2, eps, rowwise, columnwise, bias_dtype=None):
        seen.append(amax)
        scale = ref_fp8.current_scale(amax, ref_fp8.formats.FP8_MAX[fmt], use_power_2_scales=pow2, amax_epsilon=eps)
        r = ref_fp8.fp8_quantize(x, scale, fmt, rowwise=True, columnwise=True)
        out = (r.data if rowwise else torch.empty(0), r.data_t if columnwise else torch.empty(0), r.scale_inv, scale)
        return out if bias_dtype is None else (*out, ref_fp8.bias_grad(x, bias_dtype))

    monkeypatch.setattr(f8, "_FROM_AMAX", [from_amax, from_amax])
    monkeypatch.setattr(f8.Float8CurrentScalingQuantizer, "compile_visible_amax", True)
    recipe = Float8CurrentScaling()
    x = torch.randn(32, 48, dtype=torch.bfloat16) * 3
    x[3, 5] = 200.0
    for tensor in (TensorKind.ACTIVATION, TensorKind.GRAD_OUTPUT):
        role = f"linear {tensor.value}"
        q = make_quantizer(recipe.plan(QuantizerRole(ModuleKind.LINEAR, tensor)))
        assert isinstance(q, f8.Float8CurrentScalingQuantizer)
        got, scale = q._cast_visible_amax(x, x, q.spec.rowwise, q.spec.columnwise)
        want = q.quantize(x)  # eager (the reference on CPU)
        assert torch.equal(seen[-1], x.abs().amax().float())
        for field in ("data", "data_t", "scale_inv", "amax"):
            g, w = getattr(got, field), getattr(want, field)
            assert (g is None) == (w is None), field
            if g is not None:
                assert torch.equal(g.view(torch.uint8) if g.element_size() == 1 else g,
                                   w.view(torch.uint8) if w.element_size() == 1 else w), f"{role} {field}"
        got_db = q._cast_visible_amax(x, x, True, True, torch.bfloat16)[2]
        assert torch.equal(got_db, ref_fp8.bias_grad(x, torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_graph_amax_is_the_amax_kernels_value(dtype):
    """graph_amax (the traced amax of compile_visible_amax) is max |x| exactly, specials included, and stays so
    when torch.compile fuses it into the kernel that produced x: a GELU computed in FP32 and stored as ``dtype``
    must be reduced as stored (a float abs().amax() fused there may see the unrounded FP32 values)."""
    from fp_recipes.ops import ref_fp8
    from fp_recipes.quantizers.float8 import graph_amax

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(96, 40, generator=g) * 37).to(dtype)
    assert torch.equal(graph_amax(x), ref_fp8.fp8_amax(x))
    y = x.clone()
    y[1, 2] = float("inf")
    assert torch.isinf(graph_amax(y))
    y[4, 5] = float("nan")
    assert torch.isnan(graph_amax(y))
    assert graph_amax(-torch.zeros(3, 8, dtype=dtype)).item() == 0.0
    assert graph_amax(torch.empty(0, 8, dtype=dtype)).item() == 0.0

    def produce_and_reduce(h):
        a = torch.nn.functional.gelu(h, approximate="tanh")
        return a, graph_amax(a)

    torch._dynamo.reset()
    fused = torch.compile(produce_and_reduce, fullgraph=True, backend="inductor")
    for seed in range(3):
        h = (torch.randn(64, 48, generator=torch.Generator().manual_seed(seed)) * 5).to(dtype)
        a, amax = fused(h)
        assert torch.equal(amax, ref_fp8.fp8_amax(a)), f"seed {seed}: the fused amax is not that of the stored values"
