"""The NVFP4 quantizer's eager CUDA host path (QuantizePlan / nvfp4_quantize_planned, the tensor built
without constructor checks), on CPU: a recording do-nothing extension stands in for fp_recipes._C, so the
planned path and the public wrapper ``cuda_nvfp4.nvfp4_quantize`` can be compared launch for launch
(the bytes are the kernels': GPU tests). Errors for bad input must be the reference path's."""

from __future__ import annotations

import pytest
import torch

from fp_recipes import NVFP4BlockScaling, _extension, ops
from fp_recipes.ops import cuda_nvfp4
from fp_recipes.quantizers.nvfp4 import NVFP4Quantizer, NVFP4Tensor
from fp_recipes.quantizers.roles import ModuleKind, QuantizerRole, TensorKind


class _RecordingExt:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def launch(*args, **kwargs):
            # pointers differ from call to call: keep only whether one was passed
            norm = tuple("ptr" if isinstance(a, int) and a > 1 << 24 else a for a in args)
            self.calls.append((name, norm, sorted((k, v != 0) for k, v in kwargs.items())))
        return launch


@pytest.fixture
def fake_kernels(monkeypatch):
    ext = _RecordingExt()
    monkeypatch.setattr(_extension, "_ext", ext)
    monkeypatch.setattr(_extension, "_ext_loaded", True)
    monkeypatch.setattr(cuda_nvfp4, "_require_cuda", lambda x, what: None)
    monkeypatch.setattr(cuda_nvfp4, "_stream_of", lambda device: 0)
    monkeypatch.setitem(cuda_nvfp4._AMAX_WS, (None, 0), torch.zeros(4, dtype=torch.int32))
    monkeypatch.setattr(ops, "nvfp4_quantize", cuda_nvfp4.nvfp4_quantize, raising=False)
    return ext


RECIPES = {
    "default": NVFP4BlockScaling(),
    "rs46": NVFP4BlockScaling(row_scaled_activation=True, disable_rht=True, disable_2d_quantization=True,
                              disable_stochastic_rounding=True, nvfp4_4over6="all",
                              nvfp4_4over6_err_use_fast_math=True),
}


def _quantizer(recipe, tensor):
    return NVFP4Quantizer(recipe.plan(QuantizerRole(ModuleKind.LINEAR, tensor)))


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("tensor", [TensorKind.ACTIVATION, TensorKind.WEIGHT, TensorKind.GRAD_OUTPUT])
def test_planned_path_launches_what_the_wrapper_launches(fake_kernels, recipe, tensor):
    q = _quantizer(RECIPES[recipe], tensor)
    x = torch.randn(2, 16, 64).bfloat16()
    seed, offset = q.seed, q.offset
    got = q(x)
    assert q._plan is not None and q._plan.cuda_plan.valid
    planned_calls = list(fake_kernels.calls)
    fake_kernels.calls.clear()
    want = cuda_nvfp4.nvfp4_quantize(x.reshape(32, 64), seed=seed, offset=offset, **q._plan.options)
    assert planned_calls == fake_kernels.calls and planned_calls
    assert type(got) is NVFP4Tensor and got.shape == x.shape and got.orig_dtype == torch.bfloat16
    for field, w in zip(want._fields, want):
        g = getattr(got, field)
        assert (g is None) == (w is None), field
        if w is not None:
            assert g.shape == w.shape and g.dtype == w.dtype, field
    spec = q.spec
    assert (got.row_scaled, got.e4m3_max, got.four_over_six, got.rht_columnwise) == (
        spec.row_scaled, spec.e4m3_max, spec.four_over_six, spec.rht_columnwise and spec.columnwise)
    assert got.gemm_unit is None and got.gemm_unit_t is None
    # the constructor accepts what the planned path built without it
    NVFP4Tensor(got.data, got.scale, got.amax, got.data_t, got.scale_t, got.amax_t, row_scaled=got.row_scaled,
                e4m3_max=got.e4m3_max, four_over_six=got.four_over_six, rht_columnwise=got.rht_columnwise,
                orig_dtype=got.orig_dtype, shape=got.shape)
    if spec.stochastic_rounding:
        assert q.offset == offset + 32 * 64 // 16


def _error(q, *args, **kwargs):
    with pytest.raises((ValueError, TypeError)) as ei:
        q.quantize(*args, **kwargs)
    return type(ei.value), str(ei.value)


@pytest.mark.parametrize("case", ["n", "m", "rht_dtype", "amax_shape", "amax_dtype", "float64"])
def test_planned_path_errors_are_the_reference_paths(monkeypatch, case):
    recipe = RECIPES["default"]
    tensor = TensorKind.WEIGHT if case in ("n", "m") else TensorKind.ACTIVATION
    x = torch.randn(32, 64).bfloat16()
    amax = None
    if case == "n":
        x = torch.randn(32, 40).bfloat16()
    elif case == "m":
        x = torch.randn(24, 64).bfloat16()
    elif case == "rht_dtype":
        x = torch.randn(32, 64)
    elif case == "amax_shape":
        amax = torch.ones(3)
    elif case == "amax_dtype":
        amax = torch.ones((), dtype=torch.float64)
    elif case == "float64":
        x = torch.randn(32, 64, dtype=torch.float64)
    want = _error(_quantizer(recipe, tensor), x, amax=amax)  # the reference path (no extension here)
    with monkeypatch.context() as mp:
        ext = _RecordingExt()
        mp.setattr(_extension, "_ext", ext)
        mp.setattr(_extension, "_ext_loaded", True)
        mp.setattr(cuda_nvfp4, "_require_cuda", lambda x, what: None)
        mp.setattr(ops, "nvfp4_quantize", cuda_nvfp4.nvfp4_quantize, raising=False)
        q = _quantizer(recipe, tensor)
        assert _error(q, x, amax=amax) == want
        assert q._plan.cuda is cuda_nvfp4 and not ext.calls


def test_quantizer_pickles_without_its_plan(fake_kernels):
    import pickle

    q = _quantizer(RECIPES["default"], TensorKind.ACTIVATION)
    q(torch.randn(32, 64).bfloat16())
    assert q._plan is not None
    q2 = pickle.loads(pickle.dumps(q))
    assert q2._plan is None and q2.spec == q.spec and q2.seed == q.seed
    assert q2(torch.randn(32, 64).bfloat16()).data.shape == (32, 32)
