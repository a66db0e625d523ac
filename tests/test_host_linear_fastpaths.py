"""The FP8 Linear host path's shortcuts keep the full path's results and errors: the quantizers' and the
CUDA cast wrappers' accept-checks (anything unusual takes the full checks), Float8Tensor's own split for
save_for_backward, the per-type operand kinds, gemm_ready with one stride() call, and the autocast exit
hooks' autograd mode without the inference_mode(False) context."""

from __future__ import annotations

import pytest
import torch

import fp_recipes
from fp_recipes.gemm import _common
from fp_recipes.gemm.operands import operand_kind
from fp_recipes.modules import replay
from fp_recipes.ops import cuda_fp8
from fp_recipes.quantizers.float8 import Float8Tensor, checked_2d


def _cast(x, scale=None, fmt="e4m3", rowwise=True, columnwise=False):
    scale = torch.tensor(0.5) if scale is None else scale
    return cuda_fp8.fp8_quantize(x, scale, fmt, rowwise=rowwise, columnwise=columnwise)


@pytest.mark.parametrize("case, error, match", [
    ("int input", TypeError, "x has dtype int32"),
    ("3-D input", ValueError, "must be 2-D"),
    ("fmt", ValueError, "fmt must be one of"),
    ("fp16 scale", TypeError, "scale must be float32"),
    ("1-D scale", ValueError, "scale must have shape"),
    ("no copy", ValueError, "nothing to produce"),
])
def test_cuda_cast_wrapper_raises_the_twins_errors(case, error, match):
    x = torch.randn(4, 8)
    kwargs = {"int input": dict(x=x.int()), "3-D input": dict(x=x.reshape(2, 2, 8)), "fmt": dict(fmt="e3m4"),
              "fp16 scale": dict(scale=torch.tensor(0.5, dtype=torch.float16)),
              "1-D scale": dict(scale=torch.ones(1)), "no copy": dict(rowwise=False)}[case]
    args = dict(x=x)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        _cast(**args)


def test_cuda_cast_wrapper_accepts_an_upper_case_fmt_through_the_full_check():
    # not the quantizers' spelling: the full check normalises it, then the launch refuses a CPU tensor
    assert not cuda_fp8._plain_cast_args(torch.randn(4, 8), "E4M3", True, False)
    with pytest.raises(ValueError, match="is the CUDA kernel"):
        _cast(torch.randn(4, 8), fmt="E4M3")


def test_checked_2d_keeps_the_full_checks_errors():
    x = torch.randn(3, 4)
    assert checked_2d(x, "q") is x
    assert checked_2d(torch.randn(2, 3, 4), "q").shape == (6, 4)
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        checked_2d([1.0], "q")
    with pytest.raises(TypeError, match="input dtype int64 is not supported"):
        checked_2d(torch.ones(2, 2, dtype=torch.int64), "q")
    with pytest.raises(ValueError, match="at least 1 dims"):
        checked_2d(torch.tensor(1.0), "q")


def test_float8_tensor_split_for_saving_round_trips_and_keeps_no_tensor_in_the_shell():
    recipe = fp_recipes.Float8CurrentScaling()
    spec = recipe.plan(fp_recipes.QuantizerRole(fp_recipes.ModuleKind.LINEAR, fp_recipes.TensorKind.ACTIVATION))
    q = fp_recipes.make_quantizer(spec)
    t = q(torch.randn(8, 16))
    tensors, shells = replay.pack([t, None, torch.ones(2)])
    shell = shells[0]
    assert not any(isinstance(v, torch.Tensor) for v in shell[1].__dict__.values())
    back = replay.unpack(shells, tensors)
    assert isinstance(back[0], Float8Tensor) and back[1] is None and torch.equal(back[2], torch.ones(2))
    for name in ("data", "data_t", "scale_inv", "amax"):
        a, b = getattr(t, name), getattr(back[0], name)
        assert (a is None and b is None) or a is b
    assert torch.equal(back[0].dequantize(), t.dequantize())
    assert back[0].shape == t.shape and back[0].fmt == t.fmt and back[0].orig_dtype == t.orig_dtype


def test_operand_kinds_per_type_and_never_cached_for_other():
    class Other:
        def dequantize(self):
            return torch.zeros(1)

    assert operand_kind(torch.ones(1)) == "tensor"
    assert operand_kind(torch.nn.Parameter(torch.ones(1))) == "tensor"
    assert operand_kind(Other()) == "other"
    plain = Other()
    del Other.dequantize
    with pytest.raises(TypeError, match="unsupported operand type"):
        operand_kind(plain)


@pytest.mark.parametrize("make", [
    lambda: torch.zeros(32, 64, dtype=torch.uint8),
    lambda: torch.zeros(32, 96, dtype=torch.uint8)[:, :64],   # strided rows, aligned
    lambda: torch.zeros(32, 72, dtype=torch.uint8)[:, :64],   # row stride not a multiple of 16
    lambda: torch.zeros(32, 64, dtype=torch.uint8)[:, 1:17],  # unaligned start
    lambda: torch.zeros(64, 32, dtype=torch.uint8).t(),       # column-major
    lambda: torch.zeros(1, 16, dtype=torch.uint8),
])
def test_gemm_ready_is_the_stride_rule(make):
    x = make()
    want_in_place = (x.stride(1) == 1 and x.stride(0) >= max(1, x.shape[1])
                     and (x.stride(0) * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0)
    out = _common.gemm_ready(x)
    assert (out is x) == want_in_place
    assert torch.equal(out, x)


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference"])
def test_outermost_exit_hooks_run_with_grad_on_and_inference_mode_off(mode):
    seen = []

    def hook(state):
        seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))

    ctx = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference": torch.inference_mode}[mode]
    with fp_recipes.autocast.register_outermost_exit_hook(hook):
        with ctx():
            with fp_recipes.autocast(recipe=fp_recipes.Float8CurrentScaling()):
                pass
            state = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
    assert seen == [(True, False)]
    assert state == {"grad": (True, False), "no_grad": (False, False), "inference": (False, True)}[mode]
