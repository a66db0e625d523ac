"""Quantized tensors serialize as documented (issue 11): ``dequantize`` without a dtype gives the
original dtype for every type; pickle, deepcopy and ``torch.save``/``torch.load(weights_only=True)``
round-trip bit-exactly, float8 payloads included (torch 2.13 cannot pickle float8 storages)."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import fp_recipes
from fp_recipes import DelayedScaling, Float8CurrentScaling, NVFP4BlockScaling, QuantizerRole
from fp_recipes.quantizers import GroupedQuantizer, PerTokenTensor


def _fields(t) -> dict:
    """Every field of a quantized tensor, tensors as raw bytes (bitwise comparison, NaN-safe)."""
    out = {}
    for key, value in t.state_dict().items():
        if isinstance(value, torch.Tensor):
            out[key] = (value.dtype, tuple(value.shape), value.contiguous().reshape(-1).view(torch.uint8))
        else:
            out[key] = value
    return out


def _assert_same(a, b) -> None:
    assert type(a) is type(b)
    fa, fb = _fields(a), _fields(b)
    assert fa.keys() == fb.keys()
    for key in fa:
        if isinstance(fa[key], tuple) and len(fa[key]) == 3 and isinstance(fa[key][2], torch.Tensor):
            assert fa[key][:2] == fb[key][:2], key
            assert torch.equal(fa[key][2], fb[key][2]), key
        else:
            assert fa[key] == fb[key], key
    assert torch.equal(a.dequantize(torch.float32).view(torch.int32), b.dequantize(torch.float32).view(torch.int32))


def _pickle(t):
    return pickle.loads(pickle.dumps(t))


def _torch_weights_only(t):
    buf = io.BytesIO()
    torch.save({"q": t}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)["q"]


ROUND_TRIPS = {"pickle": _pickle, "deepcopy": copy.deepcopy, "torch_weights_only": _torch_weights_only}


def _x(dtype=torch.bfloat16, shape=(3, 8, 64)):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=g) * 5
    if x.numel():
        x.reshape(-1, shape[-1])[0, :4] = torch.tensor([0.0, -0.0, 1e-6, -1e4])
    return x.to(dtype)


def _per_token_cases():
    return {
        "e4m3_fp32_scales": fp_recipes.per_token_cast(_x(), "e4m3"),
        "e4m3_ue8m0_blocks": fp_recipes.per_token_cast(_x(), "e4m3", round_sf=True, scale_format="ue8m0",
                                                       block_size=32),
        "e5m6": fp_recipes.per_token_cast(_x(torch.float32), "e5m6", round_sf=True),
    }


def _grouped(recipe) -> "fp_recipes.GroupedTensor":
    spec = recipe.plan(QuantizerRole("grouped_linear", "weight"))
    q = GroupedQuantizer(spec, 3)
    return q.quantize([_x(torch.float16, (16, 32)), _x(torch.float16, (0, 32)), _x(torch.float16, (8, 32)) * 100])


@pytest.mark.parametrize("how", sorted(ROUND_TRIPS))
@pytest.mark.parametrize("case", ["e4m3_fp32_scales", "e4m3_ue8m0_blocks", "e5m6"])
def test_per_token_tensor_round_trips_bit_exactly(how, case):
    t = _per_token_cases()[case]
    back = ROUND_TRIPS[how](t)
    _assert_same(t, back)
    assert back.shape == t.shape and back.orig_dtype == t.orig_dtype
    assert back.data.data_ptr() != t.data.data_ptr()  # a copy, not the same storage


@pytest.mark.parametrize("how", sorted(ROUND_TRIPS))
@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling(fp8_format="E5M2")],
                         ids=["e4m3_delayed", "e5m2_current"])
def test_grouped_tensor_round_trips_bit_exactly(how, recipe):
    t = _grouped(recipe)
    assert t.data.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    back = ROUND_TRIPS[how](t)
    _assert_same(t, back)
    assert back.member_shapes == t.member_shapes
    for i in range(3):  # members are still views of the restored buffer
        assert torch.equal(back.member(i).dequantize(torch.float32), t.member(i).dequantize(torch.float32))


@pytest.mark.parametrize("how", sorted(ROUND_TRIPS))
def test_float8_tensor_round_trips_bit_exactly(how):
    spec = Float8CurrentScaling().plan(QuantizerRole("linear", "activation"))
    t = fp_recipes.quantize(_x(), spec)
    assert t.data is not None and t.data_t is not None
    _assert_same(t, ROUND_TRIPS[how](t))


def test_pickled_state_is_uint8_and_restores_float8_dtypes():
    t = _per_token_cases()["e4m3_fp32_scales"]
    state = t.__getstate__()
    assert state["data"].dtype == torch.uint8 and state["float8_fields"] == {"data": "float8_e4m3fn"}
    back = PerTokenTensor.__new__(PerTokenTensor)
    back.__setstate__(state)
    assert back.data.dtype == torch.float8_e4m3fn
    bad = dict(state, float8_fields={"data": "float9_e4m3"})
    with pytest.raises(ValueError, match="float9_e4m3.*allowed"):
        PerTokenTensor.__new__(PerTokenTensor).__setstate__(bad)


def test_every_quantized_tensor_type_is_allowed_in_weights_only_load():
    from fp_recipes.quantizers import Float8Tensor, GroupedTensor, NVFP4Tensor

    from fp_recipes.quantizers._tensor_io import register_weights_only_types

    registered = register_weights_only_types()
    assert set(registered) == {Float8Tensor, NVFP4Tensor, PerTokenTensor, GroupedTensor}
    allowed = set(torch.serialization.get_safe_globals())
    assert {Float8Tensor, NVFP4Tensor, PerTokenTensor, GroupedTensor} <= allowed


def test_nvfp4_tensor_loads_with_weights_only():
    spec = NVFP4BlockScaling(disable_rht=True).plan(QuantizerRole("linear", "weight"))
    t = fp_recipes.quantize(_x(torch.float32, (32, 64)), spec)
    back = _torch_weights_only(t)
    _assert_same(t, back)


@pytest.mark.parametrize("make", [
    lambda: fp_recipes.quantize(_x(torch.float16), DelayedScaling().plan(QuantizerRole("linear", "activation"))),
    lambda: fp_recipes.quantize(_x(torch.bfloat16, (32, 64)),
                                NVFP4BlockScaling().plan(QuantizerRole("linear", "weight"))),
    lambda: fp_recipes.per_token_cast(_x(torch.float16), "e5m6"),
    lambda: _grouped(Float8CurrentScaling()),
], ids=["float8", "nvfp4", "per_token", "grouped"])
def test_dequantize_without_dtype_gives_the_original_dtype(make):
    t = make()
    out = fp_recipes.dequantize(t)
    assert out.dtype == t.orig_dtype and out.dtype != torch.float32
    assert torch.equal(out, t.dequantize(t.orig_dtype))


def test_dequantize_rejects_non_quantized_and_bad_dtype():
    with pytest.raises(TypeError, match="quantized tensor"):
        fp_recipes.dequantize(torch.ones(2))
    t = fp_recipes.per_token_cast(_x(), "e4m3")
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        fp_recipes.dequantize(t, torch.int8)
