"""NVFP4Tensor copies bit-exactly through pickle, deepcopy and torch.save/torch.load(weights_only=True)
(torch cannot pickle float8 storages: the E4M3 scales travel as uint8 views), and dequantize() defaults
to the original dtype."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

from fp_recipes.ops import ref_nvfp4 as R
from fp_recipes.quantizers._tensor_io import allow_in_weights_only_load
from fp_recipes.quantizers.nvfp4 import NVFP4Tensor


def _tensor(dtype=torch.bfloat16, *, rowwise=True, columnwise=True, row_scaled=False):
    x = (torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(4)) * 7).to(dtype)
    r = R.nvfp4_quantize(x.reshape(48, 64), rowwise=rowwise, columnwise=columnwise, row_scaled=row_scaled)
    return NVFP4Tensor(r.data, r.scale, r.amax, r.data_t, r.scale_t, r.amax_t, row_scaled=row_scaled,
                       e4m3_max=448, four_over_six=False, rht_columnwise=False, orig_dtype=dtype, shape=x.shape)


def _same(a: NVFP4Tensor, b: NVFP4Tensor) -> None:
    assert type(b) is NVFP4Tensor and b.shape == a.shape and b.orig_dtype == a.orig_dtype
    assert (b.row_scaled, b.e4m3_max, b.four_over_six, b.rht_columnwise) == \
        (a.row_scaled, a.e4m3_max, a.four_over_six, a.rht_columnwise)
    for name, t in a._tensors().items():
        u = getattr(b, name)
        if t is None:
            assert u is None, name
            continue
        assert u.dtype == t.dtype and u.shape == t.shape, name
        assert torch.equal(u.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize("kw", [{}, {"columnwise": False}, {"rowwise": False}, {"row_scaled": True, "columnwise": False}])
def test_pickle_deepcopy_bit_exact(kw):
    t = _tensor(**kw)
    _same(t, pickle.loads(pickle.dumps(t)))
    _same(t, copy.deepcopy(t))


def test_torch_save_load_weights_only():
    allow_in_weights_only_load(NVFP4Tensor)
    t = _tensor(torch.float16)
    buf = io.BytesIO()
    torch.save({"q": t, "plain": torch.ones(2)}, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    _same(t, back["q"])
    assert torch.equal(back["q"].dequantize(), t.dequantize())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_defaults_to_original_dtype(dtype):
    t = _tensor(dtype)
    assert t.dequantize().dtype == dtype and t.dequantize_columnwise().dtype == dtype
    assert torch.equal(t.dequantize(), t.dequantize(torch.float32).to(dtype))
    assert t.dequantize(torch.float32).dtype == torch.float32
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        t.dequantize(torch.float64)
