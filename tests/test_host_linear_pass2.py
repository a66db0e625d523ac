"""The second host-path pass keeps the full path's results: NVFP4Tensor's own split for save_for_backward
and the columnwise-only copy the backward keeps (no constructor checks, the same fields)."""

from __future__ import annotations

import torch

import fp_recipes
from fp_recipes.modules import replay
from fp_recipes.modules.base import columnwise_only
from fp_recipes.quantizers.nvfp4 import NVFP4Tensor

_FIELDS = ("data", "scale", "amax", "data_t", "scale_t", "amax_t", "gemm_unit", "gemm_unit_t")


def _nvfp4(tensor=fp_recipes.TensorKind.ACTIVATION):
    spec = fp_recipes.NVFP4BlockScaling().plan(fp_recipes.QuantizerRole(fp_recipes.ModuleKind.LINEAR, tensor))
    return fp_recipes.make_quantizer(spec)(torch.randn(32, 64, dtype=torch.bfloat16))


def test_nvfp4_tensor_split_for_saving_round_trips_and_keeps_no_tensor_in_the_shell():
    t = _nvfp4()
    t.gemm_unit = torch.ones(2)  # a GEMM unit cache travels with the saved tensors
    tensors, shells = replay.pack([t, None])
    assert not any(isinstance(v, torch.Tensor) for v in shells[0][1].__dict__.values())
    back = replay.unpack(shells, tensors)
    assert isinstance(back[0], NVFP4Tensor) and back[1] is None
    for name in _FIELDS:
        a, b = getattr(t, name), getattr(back[0], name)
        assert (a is None and b is None) or a is b
    assert torch.equal(back[0].dequantize(), t.dequantize())
    for name in ("row_scaled", "e4m3_max", "four_over_six", "rht_columnwise", "orig_dtype", "shape"):
        assert getattr(back[0], name) == getattr(t, name)


def test_columnwise_only_nvfp4_matches_a_constructed_copy():
    t = _nvfp4()
    assert t.data is not None and t.data_t is not None
    t.gemm_unit = t.gemm_unit_t = torch.ones(2)
    got = columnwise_only(t)
    want = NVFP4Tensor(None, None, None, t.data_t, t.scale_t, t.amax_t, row_scaled=t.row_scaled,
                       e4m3_max=t.e4m3_max, four_over_six=t.four_over_six, rht_columnwise=t.rht_columnwise,
                       orig_dtype=t.orig_dtype, shape=t.shape)
    assert type(got) is NVFP4Tensor and t.data is not None  # the source keeps its rowwise copy
    for name in _FIELDS + ("row_scaled", "e4m3_max", "four_over_six", "rht_columnwise", "orig_dtype", "shape"):
        assert getattr(got, name) is getattr(want, name) or getattr(got, name) == getattr(want, name), name
    assert torch.equal(got.dequantize_columnwise(), want.dequantize_columnwise())


def test_rht_cast_of_an_unsupported_dtype_names_the_role():
    import pytest

    from fp_recipes.modules.base import quantize_operand

    spec = fp_recipes.NVFP4BlockScaling().plan(
        fp_recipes.QuantizerRole(fp_recipes.ModuleKind.LINEAR, fp_recipes.TensorKind.ACTIVATION))
    assert spec.rht_columnwise and spec.columnwise
    q = fp_recipes.make_quantizer(spec)
    with pytest.raises(TypeError, match=r"quantize \(linear\[0\]\.activation\): input dtype int32 is not supported"):
        quantize_operand(q, torch.ones(32, 64, dtype=torch.int32))
    x = torch.randn(32, 64)  # FP32: cast to BF16 first, as before
    assert torch.equal(quantize_operand(q, x).dequantize(), q(x.to(torch.bfloat16)).dequantize())
