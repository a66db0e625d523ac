"""FP8 recipe ranges are checked when the recipe is built, with a message that says why, instead of
failing at the first scale update (margin=128: "cannot be converted to type float without overflow",
margin=2000: OverflowError) or allocating gigabytes (amax_history_len=10**9)."""

from __future__ import annotations

import pytest
import torch

import fp_recipes
from fp_recipes import DelayedScaling, Float8CurrentScaling, Linear
from fp_recipes.recipes.fp8 import MAX_AMAX_HISTORY_LEN, Format, max_margin


@pytest.mark.parametrize("margin", [15, 128, 2000])
def test_margin_past_the_format_range_is_refused_at_construction(margin):
    with pytest.raises(ValueError, match=rf"margin={margin} is too large .*smallest normal.*0 <= margin <= 14"):
        DelayedScaling(margin=margin)


@pytest.mark.parametrize("fmt,limit", [("E4M3", 14), ("HYBRID", 14), ("E5M2", 29)])
def test_largest_margin_trains_and_keeps_the_amax_normal(fmt, limit):
    """The bound is exact: at the limit the amax maps to a normal FP8 value (a step runs and the scale
    is finite and positive); one more is refused."""
    assert max_margin(Format(fmt)) == limit
    recipe = DelayedScaling(margin=limit, fp8_format=fmt, amax_history_len=2)
    mod = Linear(16, 16)
    for _ in range(2):
        with fp_recipes.autocast(recipe=recipe):
            y = mod(torch.randn(8, 16))
        y.sum().backward()
    q = mod.quantizer_sets[0].activation
    amax = mod.quantizer_sets[0].activation.amax_history[-1]
    fmax, fmin = (448.0, 2.0 ** -6) if fmt != "E5M2" else (57344.0, 2.0 ** -14)
    assert 0 < q.scale.item() < float("inf") and (amax * q.scale).item() >= fmin
    assert (amax * q.scale).item() <= fmax
    with pytest.raises(ValueError, match="margin"):
        DelayedScaling(margin=limit + 1, fp8_format=fmt)


def test_margin_from_the_environment_names_its_source(monkeypatch):
    monkeypatch.setenv("FP_RECIPES_DELAYED_MARGIN", "40")
    with pytest.raises(ValueError, match=r"margin=40 \(from env FP_RECIPES_DELAYED_MARGIN=40\) is too large"):
        DelayedScaling()


def test_history_length_is_bounded():
    DelayedScaling(amax_history_len=MAX_AMAX_HISTORY_LEN)
    for bad in (MAX_AMAX_HISTORY_LEN + 1, 10 ** 9):
        with pytest.raises(ValueError, match=rf"amax_history_len={bad} is too long: allowed 1 <= "
                                             rf"amax_history_len <= {MAX_AMAX_HISTORY_LEN}"):
            DelayedScaling(amax_history_len=bad)
    with pytest.raises(ValueError, match="amax_history_len"):
        DelayedScaling(amax_history_len=0)


def test_amax_epsilon_must_be_an_fp32_value():
    """1e39 was accepted and failed at the first cast ("cannot be converted to type float")."""
    Float8CurrentScaling(amax_epsilon=3e38)
    with pytest.raises(ValueError, match=r"amax_epsilon=1e\+39 is not representable in FP32"):
        Float8CurrentScaling(amax_epsilon=1e39)
