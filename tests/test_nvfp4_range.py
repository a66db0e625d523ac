"""The amax range docs/nvfp4.md states for exact NVFP4 quantize -> dequantize (E = 448): inside
[2^-116, 2^119] scaling x by a power of two leaves every byte unchanged and scales the dequantized values
exactly; one binade beyond either end it does not (the contract's S_enc clamp below, RN(sf * amax)
overflow above). A change of the formulas that moves the range fails here."""

import pytest
import torch

from fp_recipes.ops import ref_nvfp4 as R


def _unit_x():
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    return x / x.abs().max()


@pytest.mark.parametrize("k", [-116, -60, 0, 60, 119])
def test_scale_invariant_inside_the_range(k):
    x = _unit_x()
    q0 = R.nvfp4_quantize(x)
    q = R.nvfp4_quantize(x * 2.0 ** k)
    assert torch.equal(q.data, q0.data) and torch.equal(q.scale.view(torch.uint8), q0.scale.view(torch.uint8))
    d0 = R.nvfp4_dequantize(q0.data, q0.scale, q0.amax)
    assert torch.equal(R.nvfp4_dequantize(q.data, q.scale, q.amax), d0 * 2.0 ** k)


def test_outside_the_range():
    x = _unit_x()
    lo = R.nvfp4_quantize(x * 2.0 ** -117)
    d = R.nvfp4_dequantize(lo.data, lo.scale, lo.amax) * 2.0 ** 117
    assert (d - x).abs().max() > 0.2  # S_enc clamped at FLT_MAX: precision lost
    hi = R.nvfp4_quantize(x * 2.0 ** 120)
    assert not torch.isfinite(R.nvfp4_dequantize(hi.data, hi.scale, hi.amax)).all()  # RN(sf * amax) overflows
