"""Quantized tensor types and quantizers (FP8 delayed/current, per-token, grouped) and the functional API:
state updates step by step, round trips through state_dict and torch.save, clear errors."""

import io
import math

import numpy as np
import pytest
import torch

import fp_recipes
from fp_recipes import ops
from fp_recipes.quantizers import (Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor, GroupedQuantizer,
                                   GroupedTensor, PerTokenQuantizer, PerTokenTensor, QuantizerRole, QuantizerSpec,
                                   make_quantizer)
from fp_recipes.quantizers.roles import high_precision_spec

ROLE = QuantizerRole("linear", "activation")
u8 = lambda t: t.view(torch.uint8)  # noqa: E731


def spec(**kw):
    kw.setdefault("fmt", "e4m3")
    kw.setdefault("scaling", "delayed")
    return QuantizerSpec(role=ROLE, **kw)


def save_load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def with_amax(a: float, shape=(2, 4)) -> torch.Tensor:
    x = torch.zeros(shape)
    x.view(-1)[-1] = -a
    return x


# ---- delayed scaling ------------------------------------------------------------------------------

def test_delayed_scaling_step_by_step():
    q = make_quantizer(spec(amax_history_len=3, margin=1))
    assert isinstance(q, Float8Quantizer)
    scale_ptr, hist_ptr = q.scale.data_ptr(), q.amax_history.data_ptr()
    t = q(with_amax(2.0))
    assert t.scale_inv.item() == 1.0  # the initial scale is 1
    q(with_amax(3.0))
    assert q.amax_history.tolist() == [3.0, 0.0, 0.0]
    q.update_scale()
    s3 = float(np.float32(448.0) / np.float32(3.0) / np.float32(2.0))  # margin 1
    assert q.scale.item() == s3 and q.amax_history.tolist() == [0.0, 0.0, 3.0]
    t = q(with_amax(1.0))  # quantized with the scale from earlier steps
    assert t.scale_inv.item() == float(np.float32(1.0) / np.float32(s3))
    q.update_scale()
    assert q.scale.item() == s3 and q.amax_history.tolist() == [0.0, 3.0, 1.0]
    q(with_amax(0.5))
    q.update_scale()
    assert q.amax_history.tolist() == [0.0, 1.0, 0.5]  # 3.0 has left the window
    assert q.scale.item() == s3
    q(with_amax(0.25))
    q.update_scale()
    assert q.scale.item() == 224.0 / 1.0 and q.amax_history.tolist() == [0.0, 0.5, 0.25]  # (448/1)/2
    assert q.scale.data_ptr() == scale_ptr and q.amax_history.data_ptr() == hist_ptr  # mutated in place


def test_delayed_most_recent_and_kept_scale():
    q = make_quantizer(spec(amax_history_len=4, amax_compute_algo="most_recent", fmt="e5m2"))
    q(with_amax(8.0))
    q.update_scale()
    q(with_amax(2.0))
    q.update_scale()
    assert q.scale.item() == 57344.0 / 2.0
    q.update_scale()  # no amax recorded this step: amax_ref 0 -> keep the scale
    assert q.scale.item() == 57344.0 / 2.0
    q(torch.tensor([[math.nan, 1.0]]))
    q.update_scale()  # NaN amax -> keep the scale
    assert q.scale.item() == 57344.0 / 2.0


def test_delayed_history_len_1_and_state_dict():
    q = make_quantizer(spec(amax_history_len=1))
    q(with_amax(4.0))
    q.update_scale()
    assert q.scale.item() == 112.0 and q.amax_history.tolist() == [0.0]
    q2 = make_quantizer(spec(amax_history_len=1))
    q2.load_state_dict(save_load(q.state_dict()))
    assert q2.scale.item() == 112.0
    with pytest.raises(ValueError, match="amax_history"):
        make_quantizer(spec(amax_history_len=5)).load_state_dict(q.state_dict())


def test_delayed_device_mismatch_is_clear():
    q = make_quantizer(spec())
    q.bind_state(torch.ones((), device="meta"), torch.zeros(1024, device="meta"))
    with pytest.raises(ValueError, match="scaling state"):
        q(torch.ones(2, 2))


def test_delayed_matches_op_and_columnwise():
    q = make_quantizer(spec(columnwise=True))
    q.scale.fill_(3.0)
    x = torch.randn(3, 5, 7, dtype=torch.bfloat16)
    t = q(x)
    ref = ops.fp8_quantize(x.reshape(15, 7), torch.tensor(3.0), "e4m3", columnwise=True)
    assert torch.equal(u8(t.data), u8(ref.data)) and torch.equal(u8(t.data_t), u8(ref.data_t))
    assert t.shape == (3, 5, 7) and t.dequantize().dtype == torch.bfloat16
    assert torch.equal(t.dequantize(torch.float32),
                       ops.fp8_dequantize(ref.data, ref.scale_inv).reshape(3, 5, 7))


# ---- current scaling ------------------------------------------------------------------------------

def test_current_scaling_quantizer():
    q = make_quantizer(spec(scaling="current", use_power_2_scales=True))
    assert isinstance(q, Float8CurrentScalingQuantizer) and q.state_dict() == {}
    x = torch.tensor([[3.0, -1.5]])
    t = q(x)
    assert t.scale_inv.item() == 1 / 128 and u8(t.data).tolist() == [[0x7C, 0xF4]]
    t2 = q(x, amax=torch.tensor(6.0))  # a reduced amax: 448/6 = 74.7 -> 64
    assert t2.scale_inv.item() == 1 / 64 and t2.amax.item() == 6.0
    assert u8(t2.data).tolist() == [[0x74, 0xEC]]  # 192 = 1.5*2^7 -> 0x74, -96 = -1.5*2^6 -> 0xEC


# ---- Float8Tensor -------------------------------------------------------------------------------

def test_float8_tensor_api_and_round_trips():
    q = make_quantizer(spec(scaling="current", rowwise=False, columnwise=True))
    x = torch.randn(4, 6, dtype=torch.float16)
    t = q(x)
    assert t.data is None and t.data_t.shape == (6, 4)
    assert torch.equal(u8(t.rowwise_data()), u8(t.data_t).t())
    assert torch.equal(u8(t.t_data()), u8(t.data_t))
    assert t.device.type == "cpu" and t.to("cpu").shape == (4, 6)
    r = repr(t)
    assert "Float8Tensor" in r and "e4m3" in r and "col" in r and "float16" in r
    for back in (Float8Tensor.from_state_dict(t.state_dict()), save_load(t), save_load(t.state_dict())):
        if isinstance(back, dict):
            back = Float8Tensor.from_state_dict(back)
        assert torch.equal(u8(back.data_t), u8(t.data_t)) and back.orig_dtype == torch.float16
        assert torch.equal(back.dequantize(), t.dequantize())


def test_float8_tensor_rejects_bad_metadata():
    t = make_quantizer(spec(scaling="current"))(torch.ones(2, 3))
    st = t.state_dict()
    with pytest.raises(ValueError, match="version"):
        Float8Tensor.from_state_dict({**st, "version": 99})
    with pytest.raises(ValueError, match="not 'float8'"):
        Float8Tensor.from_state_dict({**st, "kind": "nvfp4"})
    with pytest.raises(ValueError, match="dtype name"):
        Float8Tensor.from_state_dict({**st, "orig_dtype": "int4"})
    with pytest.raises(TypeError, match="does not hold"):
        Float8Tensor(t.data, t.scale_inv, t.amax, "e5m2", torch.float32, (2, 3))
    with pytest.raises(ValueError, match="shape"):
        Float8Tensor(t.data, t.scale_inv, t.amax, "e4m3", torch.float32, (3, 2))
    with pytest.raises(TypeError, match="dtype"):
        t.dequantize(torch.int32)


# ---- per-token ------------------------------------------------------------------------------------

def test_per_token_quantizer_and_tensor():
    q = make_quantizer(spec(fmt="e5m6", scaling="per_token", round_sf=True, scale_format="ue8m0"))
    assert isinstance(q, PerTokenQuantizer)
    x = torch.randn(2, 3, 16, dtype=torch.bfloat16)
    t = q(x)
    assert isinstance(t, PerTokenTensor) and t.data.shape == (6, 24) and t.scales.shape == (6, 1)
    ref = ops.per_token_cast(x.reshape(6, 16), "e5m6", round_sf=True, scale_format="ue8m0")
    assert torch.equal(t.data, ref.data) and torch.equal(t.scales, ref.scales)
    assert t.dequantize().shape == (2, 3, 16) and t.dequantize().dtype == torch.bfloat16
    back = save_load(t)
    assert torch.equal(back.dequantize(), t.dequantize()) and "e5m6" in repr(back)
    with pytest.raises(ValueError, match="e5m6 or e4m3"):
        PerTokenQuantizer(spec(fmt="e5m2", scaling="per_token"))
    blocks = PerTokenQuantizer(spec(fmt="e4m3", scaling="per_token"), block_size=8)(x)
    assert blocks.scales.shape == (6, 2)


# ---- grouped ------------------------------------------------------------------------------------

@pytest.mark.parametrize("g", [1, 63, 64, 65])
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_grouped_quantizer_members_equal_single_quantizers(g, scaling):
    gen = torch.Generator().manual_seed(g)
    m = torch.randint(0, 4, (g,), generator=gen).tolist()
    m[0] = 0  # always at least one empty member
    n = 8
    x = torch.randn(sum(m), n, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    gq = GroupedQuantizer(spec(scaling=scaling, amax_history_len=2), g)
    singles = [make_quantizer(spec(scaling=scaling, amax_history_len=2)) for _ in range(g)]
    if scaling == "delayed":
        for i in range(g):
            s = torch.tensor(float(1 + i % 7))
            gq.quantizers[i].scale.copy_(s)
            singles[i].scale.copy_(s)
    gt = gq(x, m_splits=m)
    assert isinstance(gt, GroupedTensor) and gt.num_members == g and gt.shape == x.shape
    start = 0
    for i in range(g):
        part = x[start:start + m[i]]
        start += m[i]
        ref = singles[i](part)
        mem = gt.member(i)
        assert mem.shape == (m[i], n)
        assert torch.equal(u8(mem.data), u8(ref.data)) and torch.equal(mem.scale_inv, ref.scale_inv)
        assert torch.equal(mem.amax, ref.amax)
        if scaling == "delayed":
            assert torch.equal(gq.quantizers[i].amax_history, singles[i].amax_history)
    assert torch.equal(torch.cat([t.reshape(-1) for t in gt.dequantize_members(torch.float32)]),
                       gt.dequantize(torch.float32).reshape(-1))


def test_grouped_quantizer_list_input_state_and_save():
    gq = GroupedQuantizer(spec(amax_history_len=2), 3)
    xs = [torch.randn(2, 3, 4), torch.randn(0, 4), torch.randn(5)]
    gt = gq(xs)
    assert gt.shape == (29,) and [tuple(s) for s in gt.member_shapes] == [(2, 3, 4), (0, 4), (5,)]
    assert gt.member(1).amax.item() == 0.0 and gt.member(-1).shape == (5,)
    assert gq.quantizers[0].amax_history[0].item() == xs[0].abs().max().item()
    gq.update_scale()
    assert gq.quantizers[0].scale.item() == float(np.float32(448.0) / np.float32(xs[0].abs().max().item()))
    assert gq.quantizers[1].scale.item() == 1.0  # empty member: amax 0 keeps the scale
    gq2 = GroupedQuantizer(spec(amax_history_len=2), 3)
    gq2.load_state_dict(save_load(gq.state_dict()))
    assert all(torch.equal(a.scale, b.scale) for a, b in zip(gq.quantizers, gq2.quantizers))
    back = save_load(gt)
    assert torch.equal(u8(back.data), u8(gt.data)) and back.member_shapes == gt.member_shapes
    assert "members=3 (1 empty)" in repr(back)
    with pytest.raises(ValueError, match="3 members"):
        gq(xs[:2])
    with pytest.raises(ValueError, match="sum to the row count"):
        gq(torch.ones(4, 4), m_splits=[1, 1, 1])
    with pytest.raises(ValueError, match="needs m_splits"):
        gq(torch.ones(4, 4))
    with pytest.raises(IndexError):
        gt.member(3)


def test_grouped_quantizer_from_quantizers_shares_state():
    qs = [make_quantizer(spec()) for _ in range(2)]
    gq = GroupedQuantizer.from_quantizers(qs)
    gq([torch.full((1, 2), 5.0), torch.full((1, 2), 7.0)])
    assert qs[0].amax_history[0].item() == 5.0 and qs[1].amax_history[0].item() == 7.0
    with pytest.raises(ValueError, match="every member"):
        GroupedQuantizer(spec(), 2, quantizers=[qs[0], make_quantizer(spec(scaling="current"))])


# ---- functional -----------------------------------------------------------------------------------

def test_functional_api():
    x = torch.randn(4, 16)
    t = fp_recipes.quantize(x, spec(scaling="current"))
    assert isinstance(t, Float8Tensor)
    q = make_quantizer(spec())
    fp_recipes.quantize(x, q)
    assert q.amax_history[0].item() == x.abs().max().item()
    y = fp_recipes.dequantize(t, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    with pytest.raises(ValueError, match="high precision"):
        fp_recipes.quantize(x, high_precision_spec(ROLE))
    with pytest.raises(TypeError, match="QuantizerSpec"):
        fp_recipes.quantize(x, "e4m3")
    pt = fp_recipes.per_token_cast(x, "e5m6", round_sf=True)
    a = fp_recipes.cast_back(pt)
    b = fp_recipes.cast_back(pt.data, pt.scales, "e5m6")
    assert a.dtype == torch.float32 and b.dtype == torch.bfloat16
    assert torch.equal(a.to(torch.bfloat16), b)
    with pytest.raises(ValueError, match="carries its own"):
        fp_recipes.cast_back(pt, pt.scales, "e5m6")
