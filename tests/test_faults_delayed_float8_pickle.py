"""Float8Tensor serializes: pickle (torch 2.13 cannot unpickle float8 storages), copy.deepcopy and
torch.save / torch.load(weights_only=True) give back the exact bytes, scales, amax, format, original
dtype and shape."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

from fp_recipes.quantizers.float8 import Float8Tensor

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _every_byte(rows: int, cols: int, fmt: str) -> torch.Tensor:
    """All 256 byte patterns (NaNs, +-0, subnormals, +-max, E5M2's Infs) and then some."""
    b = (torch.arange(rows * cols) * 37 % 256).to(torch.uint8).reshape(rows, cols)
    return b.view(FP8[fmt])


def _tensors():
    out = []
    for fmt in ("e4m3", "e5m2"):
        d = _every_byte(16, 32, fmt)
        amax, sinv = torch.tensor(3.5), torch.tensor(0.125)
        out.append(Float8Tensor(d, sinv, amax, fmt, torch.bfloat16, (4, 4, 32), data_t=d.t().contiguous()))
        out.append(Float8Tensor(d, sinv, amax, fmt, torch.float32, (16, 32)))
        out.append(Float8Tensor(None, sinv, amax, fmt, torch.float16, (16, 32), data_t=d.t().contiguous()))
    buf = _every_byte(64, 32, "e4m3")
    out.append(Float8Tensor(buf[16:32], torch.tensor(2.0), torch.tensor(1.0), "e4m3", torch.float32, (16, 32)))
    return out


def _same(a: Float8Tensor, b: Float8Tensor) -> None:
    assert type(b) is Float8Tensor and b.fmt == a.fmt and b.orig_dtype == a.orig_dtype and b.shape == a.shape
    for name in ("data", "data_t"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert y.dtype == x.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name
    for name in ("scale_inv", "amax"):
        assert torch.equal(getattr(a, name).view(torch.int32), getattr(b, name).view(torch.int32)), name
    assert torch.equal(a.dequantize(torch.float32).view(torch.int32), b.dequantize(torch.float32).view(torch.int32))


@pytest.mark.parametrize("i", range(7))
def test_pickle_deepcopy_and_weights_only_load_round_trip_bit_exact(i):
    t = _tensors()[i]
    _same(t, pickle.loads(pickle.dumps(t)))
    _same(t, copy.deepcopy(t))
    f = io.BytesIO()
    torch.save({"q": t, "list": [t]}, f)
    f.seek(0)
    back = torch.load(f, weights_only=True)
    _same(t, back["q"])
    _same(t, back["list"][0])


def test_a_view_into_a_larger_buffer_writes_only_its_bytes():
    big = _every_byte(4096, 32, "e4m3")
    t = Float8Tensor(big[:16], torch.tensor(1.0), torch.tensor(1.0), "e4m3", torch.float32, (16, 32))
    assert len(pickle.dumps(t)) < 16 * 32 + 4096
    _same(t, pickle.loads(pickle.dumps(t)))


def test_a_bad_pickled_state_is_a_clear_error():
    from fp_recipes.quantizers.float8 import _rebuild_float8_tensor

    with pytest.raises(ValueError, match="fmt 'e4m3' or 'e5m2'"):
        _rebuild_float8_tensor({"fmt": "e3m4"})
