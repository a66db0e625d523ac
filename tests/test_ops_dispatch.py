"""The op dispatcher: reference on CPU, markers respected, unknown names rejected clearly."""

import pytest
import torch

import fp_recipes.ops as ops
from fp_recipes.ops import reference


def test_unknown_op_is_a_clear_error():
    with pytest.raises(AttributeError, match="no op 'fp8_quantise'"):
        ops.dispatch("fp8_quantise")


def test_cpu_tensor_runs_the_reference():
    x = torch.randn(4, 32)
    out = ops.fp8_amax(x)
    assert torch.equal(out, reference.fp8_amax(x))


def test_device_agnostic_op_is_the_reference_itself():
    # nvfp4_gemm_alpha is scalar math: no kernel, no fallback warning on CUDA tensors.
    assert ops.dispatch("nvfp4_gemm_alpha") is reference.nvfp4_gemm_alpha
    assert ops.dispatch("fp8_quantize") is not reference.fp8_quantize


def test_current_stream_asks_torch_for_the_raw_handle_of_the_right_device(monkeypatch):
    """Every kernel launch takes its stream from backend.current_stream: the handle of the given
    device's current stream (the current device for an index-less device), without a Stream object."""
    import torch

    from fp_recipes.ops import backend

    asked = []
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: asked.append(index) or 7000 + index,
                        raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert backend.current_stream(torch.device("cuda", 1)) == 7001
    assert backend.current_stream(torch.device("cuda")) == 7003
    assert asked == [1, 3]
