"""The NVFP4 reference twin is device-agnostic: run as torch CUDA ops it must give the same bytes as on
CPU (it is the oracle of the kernel sweeps, which run the reference on the GPU). These tests call the
reference module directly, never the dispatching ``fp_recipes.ops`` (which would pick the kernel)."""

from __future__ import annotations

import pytest
import torch

from fp_recipes.ops import ref_nvfp4 as R

pytestmark = pytest.mark.cuda

OPTIONS = [
    {},
    {"columnwise": True},
    {"rowwise": False, "columnwise": True},
    {"block_2d": True, "columnwise": True},
    {"row_scaled": True, "columnwise": True},
    {"four_over_six": True, "columnwise": True, "err_mode": "MAE"},
    {"four_over_six": True, "err_mode": "MSE", "err_fast_math": True, "e4m3_max": 256},
    {"four_over_six": True, "block_2d": True, "columnwise": True, "err_mode": "MSE"},
    {"four_over_six": True, "block_2d": True, "err_fast_math": True, "e4m3_max": 256},
    {"four_over_six": True, "row_scaled": True, "e4m3_max": 256, "err_fast_math": True},
    {"rht": True, "columnwise": True},
    {"rht": True, "columnwise": True, "stochastic_rounding": True, "seed": 7, "offset": 3},
    {"stochastic_rounding": True, "block_2d": True, "columnwise": True, "seed": 2**40 + 5, "offset": 2**33},
]
SHAPES = [(16, 16), (1, 64), (48, 80), (256, 512), (528, 1040)]


def _inputs(shape, dtype):
    g = torch.Generator().manual_seed(shape[0] * 7919 + shape[1])
    x = torch.randn(shape, generator=g) * torch.logspace(-4, 4, shape[1])
    flat = x.view(-1)
    if flat.numel() > 40:  # specials: zeros block, huge, Inf, NaN of both signs, -0, tiny
        flat[:16] = 0
        flat[17] = 3e38
        flat[20] = float("inf")
        flat[21] = float("-inf")
        flat[25] = float("nan")
        flat[26] = -torch.tensor(float("nan"))
        flat[30] = -0.0
        flat[33] = 1e-40
    return x.to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bytes equal; for FP32 outputs (amax, dequantized values) NaN payloads are not part of the
    contract (CPU and GPU arithmetic make different NaNs), so NaN positions must match instead."""
    b = b.cpu()
    if a.dtype != torch.float32:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    na, nb = torch.isnan(a), torch.isnan(b)
    return torch.equal(na, nb) and torch.equal(a.view(torch.int32)[~na], b.view(torch.int32)[~nb])


# Columnwise copies and 2-D tiles need M % 16 == 0: those pairs are not generated at all.
_CASES = [(shape, opts) for shape in SHAPES for opts in OPTIONS
          if not ((opts.get("columnwise") or opts.get("block_2d")) and shape[0] % 16)]


@pytest.mark.parametrize("shape,opts", _CASES,
                         ids=[f"{s[0]}x{s[1]}-" + (",".join(f"{k}={v}" for k, v in o.items()) or "plain")
                              for s, o in _CASES])
@pytest.mark.parametrize("special", [False, True])
def test_reference_bytes_cpu_equal_cuda(shape, opts, special):
    m, n = shape
    dtype = torch.bfloat16 if (opts.get("rht") or special) else torch.float32
    x = _inputs(shape, dtype) if special else torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    cpu = R.nvfp4_quantize(x, **opts)
    gpu = R.nvfp4_quantize(x.cuda(), **opts)
    for name, a, b in zip(cpu._fields, cpu, gpu):
        if a is None:
            assert b is None, name
            continue
        assert b.is_cuda, name
        assert _same(a, b), f"{name} differs between CPU and CUDA for {opts}"
    if cpu.data is not None:
        rs = opts.get("row_scaled", False)
        e = opts.get("e4m3_max", 448)
        d_cpu = R.nvfp4_dequantize(cpu.data, cpu.scale, cpu.amax, e4m3_max=e, row_scaled=rs)
        d_gpu = R.nvfp4_dequantize(gpu.data, gpu.scale, gpu.amax, e4m3_max=e, row_scaled=rs)
        assert _same(d_cpu, d_gpu)


def test_rht_and_amax_cpu_equal_cuda():
    x = _inputs((64, 256), torch.bfloat16)
    assert torch.equal(R.nvfp4_rht(x).view(torch.int16), R.nvfp4_rht(x.cuda()).cpu().view(torch.int16))
    assert _same(R.nvfp4_row_amax(x), R.nvfp4_row_amax(x.cuda()))
    a = R.nvfp4_gemm_alpha(torch.tensor(3.7), torch.tensor(0.02), 256, 448)
    b = R.nvfp4_gemm_alpha(torch.tensor(3.7).cuda(), torch.tensor(0.02).cuda(), 256, 448)
    assert a.item() == b.item()


def test_large_reference_runs_on_gpu():
    """The sweep sizes of the kernel tests (up to 16384 x 8192) must fit and run on the GPU."""
    x = torch.randn(16384, 8192, device="cuda", dtype=torch.bfloat16)
    q = R.nvfp4_quantize(x, columnwise=True, rht=True, stochastic_rounding=True)
    assert q.data.shape == (16384, 4096) and q.data_t.shape == (8192, 8192)
    q = R.nvfp4_quantize(x, four_over_six=True, block_2d=True, columnwise=True)
    assert q.scale.shape == (16384, 512)
