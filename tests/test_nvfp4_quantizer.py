"""NVFP4Tensor / NVFP4Quantizer: spec handling, dispatch, SR state, serialization, consumer errors."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import fp_recipes.ops as ops
from fp_recipes.ops import ref_nvfp4 as R
from fp_recipes.quantizers import make_quantizer
from fp_recipes.quantizers.nvfp4 import NVFP4Quantizer, NVFP4Tensor
from fp_recipes.quantizers.roles import QuantizerRole, QuantizerSpec


def spec(tensor="activation", **kw) -> QuantizerSpec:
    return QuantizerSpec(role=QuantizerRole("linear", tensor), fmt="nvfp4", scaling="nvfp4", **kw)


def same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                                              b.view(torch.uint8) if b.dtype != torch.float32 else b)


def assert_same_tensor(a: NVFP4Tensor, b: NVFP4Tensor) -> None:
    for f in ("data", "scale", "amax", "data_t", "scale_t", "amax_t"):
        assert same(getattr(a, f), getattr(b, f)), f
    for f in ("row_scaled", "e4m3_max", "four_over_six", "rht_columnwise", "orig_dtype", "shape"):
        assert getattr(a, f) == getattr(b, f), f


def test_factory_builds_nvfp4_quantizer():
    q = make_quantizer(spec())
    assert isinstance(q, NVFP4Quantizer)
    assert "nvfp4" in repr(q)


def test_quantize_flattens_leading_dims_and_matches_reference():
    x = torch.randn(2, 3, 16, 32, generator=torch.Generator().manual_seed(0)).bfloat16()
    q = NVFP4Quantizer(spec(columnwise=True, block_2d=False, four_over_six=True, err_mode="MSE", e4m3_max=256))
    t = q(x)
    assert t.shape == x.shape and t.dtype == torch.bfloat16 and t.rows == 96
    ref = R.nvfp4_quantize(x.reshape(96, 32), columnwise=True, four_over_six=True, err_mode="MSE", e4m3_max=256)
    for f, r in zip(("data", "scale", "amax", "data_t", "scale_t", "amax_t"), ref):
        assert same(getattr(t, f), r), f
    d = t.dequantize(torch.bfloat16)
    assert d.shape == x.shape and d.dtype == torch.bfloat16
    assert torch.equal(d.reshape(96, 32), R.nvfp4_dequantize(ref.data, ref.scale, ref.amax, e4m3_max=256,
                                                              out_dtype=torch.bfloat16))
    assert t.dequantize_columnwise().shape == (32, 96)


def test_quantizer_dispatches_through_ops(monkeypatch):
    calls = []
    real = R.nvfp4_quantize

    def spy(*a, **k):
        calls.append(k)
        return real(*a, **k)

    monkeypatch.setattr(ops, "nvfp4_quantize", spy, raising=False)
    NVFP4Quantizer(spec())(torch.randn(4, 32))
    assert len(calls) == 1 and calls[0]["rowwise"] is True


def test_1d_input_is_one_row():
    t = NVFP4Quantizer(spec())(torch.randn(48))
    assert t.shape == (48,) and t.data.shape == (1, 24)
    assert t.dequantize().shape == (48,)


def test_row_scaled_tensor_and_amax_override():
    x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1))
    q = NVFP4Quantizer(spec(row_scaled=True))
    t = q(x)
    assert t.row_scaled and t.amax.shape == (32,)
    override = torch.full((32,), 10.0)
    t2 = q.quantize(x, amax=override)
    assert torch.equal(t2.amax, override)
    assert torch.equal(t2.data, R.nvfp4_quantize(x.reshape(32, 32), amax=override, row_scaled=True).data)
    with pytest.raises(ValueError, match=r"\(M,\) = \(32,\)"):
        q.quantize(x, amax=torch.tensor(1.0))
    d = t.dequantize()
    assert ((d - x).abs() <= 0.2 * x.reshape(32, 32).abs().amax(1).reshape(4, 8, 1)).all()


def test_shape_errors_name_the_original_shape():
    q = NVFP4Quantizer(spec(columnwise=True))
    with pytest.raises(ValueError, match=r"shape \(3, 5, 32\).*M=15 must be a multiple of 16"):
        q(torch.zeros(3, 5, 32))
    with pytest.raises(ValueError, match="N=20 must be a multiple of 16"):
        NVFP4Quantizer(spec())(torch.zeros(4, 20))
    with pytest.raises(TypeError, match="not supported"):
        NVFP4Quantizer(spec())(torch.zeros(4, 32, dtype=torch.float64))


@pytest.mark.parametrize("a,b", [
    ("four_over_six", "rht_columnwise"), ("four_over_six", "stochastic_rounding"),
    ("row_scaled", "rht_columnwise"), ("row_scaled", "block_2d"), ("row_scaled", "stochastic_rounding"),
    ("rht_columnwise", "block_2d"),
])
def test_incompatible_spec_names_both(a, b):
    with pytest.raises(ValueError) as ei:
        NVFP4Quantizer(spec(columnwise=True, **{a: True, b: True}))
    assert a in str(ei.value) and b in str(ei.value)


def test_wrong_spec_kind():
    with pytest.raises(ValueError, match="scaling=nvfp4"):
        NVFP4Quantizer(QuantizerSpec(role=QuantizerRole("linear", "weight"), fmt="e4m3", scaling="current"))


def test_rht_needs_bf16_and_only_touches_columnwise():
    q = NVFP4Quantizer(spec("grad_output", columnwise=True, rht_columnwise=True))
    with pytest.raises(TypeError, match="bfloat16"):
        q(torch.randn(16, 32))
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(2)).bfloat16()
    t = q(x)
    assert t.rht_columnwise and "rht" in repr(t)
    assert torch.equal(t.data, R.nvfp4_quantize(x).data)
    d = t.dequantize_columnwise().double()
    ref = R.nvfp4_rht(x.t().contiguous()).double()  # the columnwise copy lives in the RHT domain
    assert ((d - ref).abs() <= 0.2 * ref.abs().max()).all()
    # rht on a rowwise-only spec is a no-op flag (the transform applies to the columnwise copy only)
    t2 = NVFP4Quantizer(spec("grad_output", rht_columnwise=True))(x)
    assert not t2.rht_columnwise and t2.data_t is None


def test_sr_state_advances_and_restores():
    q = NVFP4Quantizer(spec("grad_output", columnwise=True, stochastic_rounding=True), seed=42)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert q.state_dict() == {"seed": 42, "offset": 0}
    t1 = q(x)
    assert q.offset == 32 * 64 // 16
    t2 = q(x)
    assert not torch.equal(t1.data, t2.data)  # fresh draws
    assert torch.equal(t1.data, R.nvfp4_quantize(x, columnwise=True, stochastic_rounding=True, seed=42, offset=0).data)
    assert torch.equal(t2.data, R.nvfp4_quantize(x, columnwise=True, stochastic_rounding=True, seed=42,
                                                 offset=128).data)
    saved = q.state_dict()
    t3 = q(x)
    other = NVFP4Quantizer(spec("grad_output", columnwise=True, stochastic_rounding=True))
    other.load_state_dict(saved)
    assert_same_tensor(other(x), t3)
    with pytest.raises(ValueError, match="missing"):
        other.load_state_dict({"seed": 1})


def test_sr_device_state_draws_and_advances_as_the_int_state():
    """use_sr_device_state (what make_graphed_callables switches SR quantizers to): the same bytes and the same
    offsets as the host ints, the state in one int64 (2,) tensor written in place, state_dict read from it.
    (On the CPU the reference path reads the tensor; on a GPU the kernels do: tests/test_cuda_nvfp4_device_rng.py.)"""
    sp = spec("grad_output", columnwise=True, stochastic_rounding=True, rht_columnwise=True)
    host = NVFP4Quantizer(sp, seed=2**63 + 5)
    dev = NVFP4Quantizer(sp, seed=2**63 + 5)
    host.offset = dev.offset = 2**64 - 3  # the counter wraps at 2^64 in both
    state = dev.use_sr_device_state("cpu")
    assert state.dtype == torch.int64 and state.shape == (2,)
    assert dev.use_sr_device_state("cpu") is state  # once
    g = torch.Generator().manual_seed(5)
    for shape in ((32, 64), (16, 16), (48, 32)):
        x = torch.randn(*shape, generator=g).bfloat16()
        assert_same_tensor(dev(x), host(x))
        assert dev.offset == host.offset
    assert dev._rng_d is state and dev.state_dict() == host.state_dict()
    dev.load_state_dict({"seed": 7, "offset": 11})
    assert state.tolist() == [7, 11] and dev.seed == 7 and dev.offset == 11
    with pytest.raises(ValueError, match="already on cpu"):
        dev.use_sr_device_state("meta")


def test_a_copied_or_loaded_device_state_advances_its_own_counter():
    """deepcopy and torch.save keep the offset element a view of the copy's own state tensor: a copy whose advance
    wrote elsewhere would draw the same numbers at every cast."""
    sp = spec("grad_output", columnwise=True, stochastic_rounding=True)
    q = NVFP4Quantizer(sp, seed=3)
    q.use_sr_device_state("cpu")
    buf = io.BytesIO()
    torch.save(q, buf)
    buf.seek(0)
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(6)).bfloat16()
    for other in (copy.deepcopy(q), torch.load(buf, weights_only=False)):
        first, second = other(x), other(x)
        assert other.offset == 2 * 32 * 32 // 16 and q.offset == 0
        assert not torch.equal(first.data_t, second.data_t)


def test_sr_device_state_made_under_inference_mode_still_advances_outside_it():
    """The state tensor is a normal tensor even when made inside torch.inference_mode() (an inference tensor would
    refuse the in-place advance of every later training cast)."""
    q = NVFP4Quantizer(spec("grad_output", columnwise=True, stochastic_rounding=True))
    with torch.inference_mode():
        q.use_sr_device_state("cpu")
    assert not q._rng_d.is_inference()
    q(torch.randn(32, 32).bfloat16())
    assert q.offset == 32 * 32 // 16


def test_sr_device_state_takes_over_the_traced_state_and_refuses_a_trace():
    """Modules prepare every quantizer for torch.compile at init_quantizer_state (the CPU tensors a graph reads):
    the device state takes their values and replaces them; a trace after that is refused with a message."""
    sp = spec("grad_output", columnwise=True, stochastic_rounding=True)
    q = NVFP4Quantizer(sp, seed=9)
    q.use_sr_tensors()
    q.offset = 2**64 - 1
    state = q.use_sr_device_state("cpu")
    assert state.tolist() == [9, -1] and q._offset_t is None and q._seed_t is None
    q.use_sr_tensors()  # (a later prepare-for-trace leaves the device state alone)
    assert q._offset_t is None and q._rng_d is state
    with pytest.raises(RuntimeError, match="CUDA graph of fp_recipes.make_graphed_callables.*torch.compile"):
        q._quantize_traced(torch.zeros(16, 16), torch.zeros(16, 16), None, q._eager_plan())


def test_default_seed_differs_by_role_and_rn_does_not_advance():
    a = NVFP4Quantizer(spec("grad_output", stochastic_rounding=True))
    b = NVFP4Quantizer(spec("activation", stochastic_rounding=True))
    assert a.seed != b.seed
    c = NVFP4Quantizer(spec())
    c(torch.randn(16, 32))
    assert c.offset == 0


def test_tensor_to_state_dict_and_torch_save_round_trip():
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(4)).bfloat16()
    t = NVFP4Quantizer(spec("weight", columnwise=True, block_2d=True, four_over_six=True, e4m3_max=256))(x)
    assert_same_tensor(NVFP4Tensor.from_state_dict(t.state_dict()), t)
    buf = io.BytesIO()
    torch.save(t.state_dict(), buf)  # plain tensors and Python values: loads with weights_only=True
    buf.seek(0)
    assert_same_tensor(NVFP4Tensor.from_state_dict(torch.load(buf, weights_only=True)), t)
    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    assert_same_tensor(torch.load(buf, weights_only=False), t)
    moved = t.to("cpu")
    assert_same_tensor(moved, t)
    assert moved.device == torch.device("cpu") and moved is not t
    assert "NVFP4Tensor(shape=(2, 16, 32)" in repr(t) and "E=256" in repr(t) and "4over6" in repr(t)


def test_consumer_errors():
    x = torch.randn(32, 32)
    col_only = NVFP4Quantizer(spec(rowwise=False, columnwise=True))(x)
    with pytest.raises(ValueError, match="no rowwise copy"):
        col_only.dequantize()
    row_only = NVFP4Quantizer(spec())(x)
    with pytest.raises(ValueError, match="no columnwise copy"):
        row_only.dequantize_columnwise()
    st = row_only.state_dict()
    with pytest.raises(ValueError, match="version"):
        NVFP4Tensor.from_state_dict({**st, "version": 99})
    with pytest.raises(ValueError, match="unknown fields"):
        NVFP4Tensor.from_state_dict({**st, "amax_per_column": True})
    with pytest.raises(ValueError, match="e4m3_max"):
        NVFP4Tensor.from_state_dict({**st, "e4m3_max": 240})
    with pytest.raises(ValueError, match="amax must be float32 of shape"):
        NVFP4Tensor.from_state_dict({**st, "row_scaled": True})  # a scalar amax cannot be row-scaled
    with pytest.raises(ValueError, match="incomplete"):
        NVFP4Tensor.from_state_dict({**st, "scale": None})
    with pytest.raises(ValueError, match="kind"):
        NVFP4Tensor.from_state_dict({**st, "kind": "float8"})


def test_dequantize_uses_tensor_metadata():
    """The E4M3 bound and row scaling travel with the tensor: dequantize never needs the spec."""
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(5))
    t = NVFP4Quantizer(spec(four_over_six=True, e4m3_max=256, row_scaled=True))(x)
    expect = R.nvfp4_dequantize(t.data, t.scale, t.amax, e4m3_max=256, row_scaled=True)
    assert torch.equal(t.dequantize(), expect)
    wrong = R.nvfp4_dequantize(t.data, t.scale, t.amax.max(), e4m3_max=448)
    assert not torch.equal(t.dequantize(), wrong)


class _FakeCudaNvfp4:
    """Stands in for ops/cuda_nvfp4.py on a CPU (a quantizer plan's ``cuda``): ``nvfp4_quantize`` is whatever the
    dispatcher resolves for CPU tensors (so the quantizer takes its CUDA branch), and the fused call computes the
    documented results with the reference, recording its arguments; ``decline`` makes it return None as the CUDA
    module does where the fused launch does not apply."""

    def __init__(self, x: torch.Tensor, decline: bool = False) -> None:
        from fp_recipes.ops.backend import resolved

        self.nvfp4_quantize = resolved("nvfp4_quantize", x)
        self.decline = decline
        self.calls = []

    @staticmethod
    def _outputs(x, seed, offset):
        q = R.nvfp4_quantize(x, columnwise=True, stochastic_rounding=True, seed=seed, offset=offset)
        return q.data, q.scale, q.amax, q.data_t, q.scale_t, q.amax_t, None, None

    def nvfp4_quantize_planned(self, x, plan, amax, seed, offset, units=None):
        self.calls.append(("planned", seed, offset))
        return self._outputs(x, seed, offset)

    def nvfp4_quantize_planned_dbias(self, x, plan, seed, offset, bias_dtype, units=None):
        assert units is None  # (the quantizer asks for unit operands on CUDA tensors only)
        self.calls.append((tuple(x.shape), seed, offset, bias_dtype))
        return None if self.decline else (self._outputs(x, seed, offset), ops.bias_grad(x, bias_dtype))


@pytest.mark.parametrize("decline", [False, True], ids=["fused", "declined"])
def test_quantize_with_bias_grad_takes_the_fused_cuda_call_and_advances_sr(decline):
    """The CUDA branch of NVFP4Quantizer.quantize_with_bias_grad (wiring only; the kernel is tested on GPU in
    test_bias_grad.py): the fused call gets the quantizer's seed and offset, its outputs become the tensor that
    quantize() would build, the stochastic-rounding offset advances once; a declined call falls back to quantize()
    and ops.bias_grad with the same results."""
    x = (torch.randn(48, 64, generator=torch.Generator().manual_seed(5)) * 3).bfloat16()
    q = NVFP4Quantizer(spec("grad_output", columnwise=True, stochastic_rounding=True), seed=9)
    q._make_plan().cuda = fake = _FakeCudaNvfp4(x, decline)
    t, db = q.quantize_with_bias_grad(x, torch.float32)
    assert fake.calls == [((48, 64), 9, 0, torch.float32)] + ([("planned", 9, 0)] if decline else [])
    assert q.offset == 48 * 64 // 16
    want = NVFP4Quantizer(spec("grad_output", columnwise=True, stochastic_rounding=True), seed=9)(x)
    assert_same_tensor(t, want)
    assert torch.equal(db, ops.bias_grad(x, torch.float32))
    t2, _ = q.quantize_with_bias_grad(x, torch.bfloat16)  # the next call draws fresh numbers
    assert fake.calls[-2 if decline else -1] == ((48, 64), 9, 48 * 64 // 16, torch.bfloat16)
    assert not torch.equal(t2.data, t.data)
