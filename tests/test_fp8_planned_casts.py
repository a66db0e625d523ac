"""The FP8 quantizers' planned eager casts (ops/cuda_fp8.py ``fp8_cast_planned``) on CPU, end to end.

On a GPU the planned cast launches the same kernels as the general wrappers with its outputs' FP32 values
(scale_inv, amax, current scaling's scale) in one allocation. What can go wrong is Python-side plumbing:
which address gets which value, the output shapes, the bias-gradient workspace. Here a stand-in extension
runs each kernel's pure-torch twin on the raw addresses it is handed (CPU tensors have real host addresses),
so a planned cast through a quantizer must give the reference's bytes field by field, and the tensors it
builds must be where the kernel wrote. (tests/test_cuda_fp8_kernels.py checks the kernels themselves.)
"""

from __future__ import annotations

import contextlib
import ctypes

import pytest
import torch

import fp_recipes
from fp_recipes import _extension, ops
from fp_recipes.ops import cuda_fp8, ref_fp8, workspace
from fp_recipes.quantizers import float8 as f8
from fp_recipes.quantizers.factory import make_quantizer
from fp_recipes.quantizers.roles import ModuleKind, QuantizerRole, TensorKind

_DTYPES = {code: dt for dt, code in cuda_fp8.DTYPE_CODE.items()}
_FMT = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def _at(ptr: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over the memory at host address ``ptr`` (what a kernel would read or write)."""
    n = 1
    for s in shape:
        n *= s
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    buf = (ctypes.c_char * max(nbytes, 1)).from_address(ptr)
    return torch.frombuffer(buf, dtype=dtype, count=n).reshape(shape)


def _put(ptr: int, value: torch.Tensor) -> None:
    if ptr:
        _at(ptr, tuple(value.shape), value.dtype).copy_(value)


class TwinExtension:
    """Launchers that run the twins on host memory; every call is logged."""

    fp8_amax_workspace = True

    def __init__(self) -> None:
        self.calls: list = []

    def _outputs(self, r, m, n, out, out_t, scale_inv, amax, partials, db, db_code, x):
        _put(out, r.data) if out else None
        _put(out_t, r.data_t) if out_t else None
        _put(scale_inv, r.scale_inv.reshape(()))
        _put(amax, r.amax.reshape(()))
        if db_code is not None:
            assert partials != 0 and db != 0
            _put(db, ref_fp8.bias_grad(x, _DTYPES[db_code]))

    def fp8_current_scaling_quantize(self, x_ptr, in_code, m, n, out_code, pow2, eps, out, out_t, scale, scale_inv,
                                     amax, stream, ws, partials=0, db=0, db_code=None):
        self.calls.append(("current", m, n, out_code, pow2, eps, bool(out), bool(out_t), ws != 0, db_code))
        x = _at(x_ptr, (m, n), _DTYPES[in_code])
        r = ref_fp8.fp8_current_scaling_quantize(x, _FMT[_DTYPES[out_code]], use_power_2_scales=pow2,
                                                 amax_epsilon=eps, rowwise=True, columnwise=True)
        self._outputs(r, m, n, out, out_t, scale_inv, amax, partials, db, db_code, x)
        _put(scale, r.scale.reshape(()))

    def fp8_current_scaling_quantize_dbias(self, x_ptr, in_code, m, n, out_code, pow2, eps, out, out_t, scale,
                                           scale_inv, amax, partials, db, db_code, stream, ws):
        self.fp8_current_scaling_quantize(x_ptr, in_code, m, n, out_code, pow2, eps, out, out_t, scale, scale_inv,
                                          amax, stream, ws, partials, db, db_code)

    def fp8_quantize_record(self, x_ptr, in_code, m, n, scale_ptr, out_code, out, out_t, scale_inv, amax, record,
                            stream, partials=0, db=0, db_code=None):
        self.calls.append(("delayed", m, n, out_code, bool(out), bool(out_t), db_code))
        x = _at(x_ptr, (m, n), _DTYPES[in_code])
        scale = _at(scale_ptr, (), torch.float32).clone()
        r = ref_fp8.fp8_quantize(x, scale, _FMT[_DTYPES[out_code]], rowwise=True, columnwise=True)
        self._outputs(r, m, n, out, out_t, scale_inv, amax, partials, db, db_code, x)
        slot = _at(record, (), torch.float32)
        slot.copy_(torch.maximum(slot, r.amax.reshape(())))

    def fp8_quantize_dbias(self, x_ptr, in_code, m, n, scale_ptr, out_code, out, out_t, scale_inv, amax, record,
                           partials, db, db_code, stream):
        self.fp8_quantize_record(x_ptr, in_code, m, n, scale_ptr, out_code, out, out_t, scale_inv, amax, record,
                                 stream, partials, db, db_code)

    def bias_grad(self, *args):  # present (the quantizers check for it); the planned casts never call it
        raise AssertionError("bias_grad called")

    def fp8_quantize(self, *args):
        raise AssertionError("the general cast was called instead of the planned one")


@pytest.fixture
def twin(monkeypatch):
    ext = TwinExtension()
    monkeypatch.setattr(_extension, "_ext", ext)
    monkeypatch.setattr(_extension, "_ext_loaded", True)
    monkeypatch.setattr(cuda_fp8, "_stream", lambda device: 0)
    monkeypatch.setattr(cuda_fp8, "_AMAX_WS_OK", [])
    monkeypatch.setitem(workspace.AMAX_WS, (None, 0), torch.zeros(4, dtype=torch.int32))
    for name in ("fp8_quantize", "fp8_current_scaling_quantize"):  # CPU tensors take the CUDA wrappers
        monkeypatch.setattr(ops, name, getattr(cuda_fp8, name))
    for name, value in (("_CUDA_QUANTIZE", []), ("_PLANNED", []),
                        ("_RECORDING", [lambda: False, None]), ("_FUSED_DBIAS", [lambda: False, None, None, None]),
                        ("_TRACED_CASTS", [None] * 4), ("_FROM_AMAX", [None, None])):
        monkeypatch.setattr(f8, name, value)
    monkeypatch.setattr(f8, "_cuda_quantize", _patched_cuda_quantize(monkeypatch))
    return ext


def _patched_cuda_quantize(monkeypatch):
    """f8._cuda_quantize with backend.extension() answering the stand-in (the lookup it makes)."""
    original = f8._cuda_quantize

    def lookup():
        if not f8._CUDA_QUANTIZE:
            monkeypatch.setattr(cuda_fp8.backend, "extension", lambda: _extension._ext)
        return original()
    return lookup


def _assert_bytes(got, want, what):
    assert (got is None) == (want is None), what
    if got is None:
        return
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.shape} {got.dtype}"
    g = got.contiguous().view(torch.uint8) if got.element_size() == 1 else got.contiguous().reshape(-1).view(torch.uint8)
    w = want.contiguous().view(torch.uint8) if want.element_size() == 1 else want.contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(g, w), what


def _quantizer(recipe, tensor):
    return make_quantizer(recipe.plan(QuantizerRole(ModuleKind.LINEAR, tensor)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_planned_current_casts_are_the_reference(twin, dtype):
    recipe = fp_recipes.Float8CurrentScaling()
    x = (torch.randn(48, 80) * 7).to(dtype)
    x[5, 7] = 300.0
    for tensor in (TensorKind.ACTIVATION, TensorKind.WEIGHT, TensorKind.GRAD_OUTPUT):
        q = _quantizer(recipe, tensor)
        s = q.spec
        want = ref_fp8.fp8_current_scaling_quantize(x, q.fmt, use_power_2_scales=s.use_power_2_scales,
                                                    amax_epsilon=s.amax_epsilon, rowwise=s.rowwise,
                                                    columnwise=s.columnwise)
        for rep in range(2):  # the second call reuses the plan's launch
            got = q.quantize(x)
            for field in ("data", "data_t", "scale_inv", "amax"):
                _assert_bytes(getattr(got, field), getattr(want, field), f"{tensor.value} {field} rep {rep}")
        got, scale = q.quantize_rowwise(x)
        _assert_bytes(scale, want.scale, f"{tensor.value} rowwise scale")
        got, db = q.quantize_with_bias_grad(x, dtype)
        _assert_bytes(got.data_t, want.data_t, f"{tensor.value} dbias data_t")
        _assert_bytes(db, ref_fp8.bias_grad(x, dtype), f"{tensor.value} db")
    assert twin.calls and all(c[0] == "current" for c in twin.calls)
    assert any(c[-1] is not None for c in twin.calls) and all(c[8] for c in twin.calls)  # dbias; the workspace


def test_planned_delayed_casts_are_the_reference_and_record(twin):
    recipe = fp_recipes.DelayedScaling(amax_history_len=4)
    x = torch.randn(32, 64, dtype=torch.bfloat16) * 3
    for tensor in (TensorKind.ACTIVATION, TensorKind.GRAD_OUTPUT):
        q = _quantizer(recipe, tensor)
        q.scale.fill_(0.625)
        q.amax_history.fill_(0.0)
        want = ref_fp8.fp8_quantize(x, q.scale.clone(), q.fmt, rowwise=q.spec.rowwise, columnwise=q.spec.columnwise)
        got = q.quantize(x)
        for field in ("data", "data_t", "scale_inv", "amax"):
            _assert_bytes(getattr(got, field), getattr(want, field), f"{tensor.value} {field}")
        _assert_bytes(q.amax_history[0], want.amax.reshape(()), f"{tensor.value} history slot")
        got, db = q.quantize_with_bias_grad(x * 2, torch.float32)
        _assert_bytes(db, ref_fp8.bias_grad(x * 2, torch.float32), f"{tensor.value} db")
        _assert_bytes(q.amax_history[0], ref_fp8.fp8_amax(x * 2), f"{tensor.value} history slot after dbias")
    assert [c[0] for c in twin.calls] == ["delayed"] * 4


@contextlib.contextmanager
def _reference_path():
    """A context in which the casts take the dispatcher's CPU twins (no stand-in, nothing planned)."""
    import fp_recipes.ops as ops_pkg

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops_pkg, "fp8_quantize", ref_fp8.fp8_quantize)
        mp.setattr(ops_pkg, "fp8_current_scaling_quantize", ref_fp8.fp8_current_scaling_quantize)
        mp.setattr(_extension, "_ext", None)
        mp.setattr(f8, "_CUDA_QUANTIZE", [None])
        yield


def _checkpointed_autocast_step(layer, x, recipe):
    """A step as a fine-tuning job runs it: torch.autocast(bf16) around fp_recipes.autocast, the layer under
    activation checkpointing (its forward runs twice: the recompute must quantize as the first pass did)."""
    import torch.utils.checkpoint as cp

    with torch.autocast("cpu", dtype=torch.bfloat16), fp_recipes.autocast(recipe=recipe):
        y = cp.checkpoint(layer, x, use_reentrant=False)
    y.float().square().sum().backward()
    return y.detach(), x.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone()


@pytest.mark.parametrize("recipe_cls", [fp_recipes.Float8CurrentScaling, fp_recipes.DelayedScaling])
def test_planned_casts_under_checkpoint_and_torch_autocast_and_from_two_threads(twin, recipe_cls):
    """The planned casts in a checkpointed step under torch.autocast(bf16), run from two threads at once (two
    layers of different shapes, each with its own plans), give the reference path's outputs and gradients."""
    from _threads import run_in_threads

    def make(k, n, m, seed):
        torch.manual_seed(seed)
        layer = fp_recipes.Linear(k, n)
        ref = fp_recipes.Linear(k, n)
        ref.load_state_dict(layer.state_dict())
        x = torch.randn(m, k)
        return layer, ref, x

    jobs = [make(64, 48, 32, 0), make(96, 32, 16, 1)]
    got = run_in_threads(lambda layer, x: _checkpointed_autocast_step(layer, x.clone().requires_grad_(True),
                                                                      recipe_cls()),
                         [(layer, x) for layer, _, x in jobs])
    assert len([c for c in twin.calls]) >= 6  # x, W, dy of both layers went through the planned casts
    with _reference_path():
        for i, (_, ref, x) in enumerate(jobs):
            want = _checkpointed_autocast_step(ref, x.clone().requires_grad_(True), recipe_cls())
            for g, w, what in zip(got[i], want, ("output", "input grad", "weight grad", "bias grad")):
                assert g.dtype == w.dtype and torch.equal(g, w), f"layer {i}: {what}"


def test_a_linear_step_through_planned_casts_is_the_reference_step(twin):
    """A Linear forward + backward under current scaling with every cast planned equals the same step with
    the pure-torch twins (the CPU reference path: no stand-in)."""
    torch.manual_seed(0)
    layer = fp_recipes.Linear(64, 48)
    ref_layer = fp_recipes.Linear(64, 48)
    ref_layer.load_state_dict(layer.state_dict())
    x = torch.randn(16, 64, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    recipe = fp_recipes.Float8CurrentScaling()
    with fp_recipes.autocast(recipe=recipe):
        y = layer(x)
    y.float().square().sum().backward()
    planned_q = list(twin.calls)
    assert len([c for c in planned_q if c[0] == "current"]) == 3  # x, W, dy (the last with the bias gradient)
    # the reference step: the dispatcher's CPU twins
    with _reference_path():
        with fp_recipes.autocast(recipe=recipe):
            yr = ref_layer(xr)
        yr.float().square().sum().backward()
    assert torch.equal(y, yr)
    assert torch.equal(x.grad, xr.grad)
    assert torch.equal(layer.weight.grad, ref_layer.weight.grad)
    assert torch.equal(layer.bias.grad, ref_layer.bias.grad)
