"""Independent reference of the module math for tests/test_modules_*.py.

Operands are quantized and dequantized by their spec with the *reference* ops (ops/ref_*.py, called
directly, never through the quantizer classes or fp_recipes.gemm), then multiplied in FP64. The tolerance of a
GEMM result is the textbook bound of an FP32 dot product of length K: |fl(sum) - sum| <= gamma_K *
sum|a_i b_i| with gamma_K ~ K * 2^-24, doubled (the module's FP32 accumulation and the reference's
rounding of each dequantized operand to FP32), plus a few roundings of the scale factors / alpha, plus
one rounding to the output dtype.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from fp_recipes.ops import reference as R
from fp_recipes.quantizers.roles import QuantizerSpec, ScalingKind

EPS32 = 2.0 ** -24


def ref_qdq(x: torch.Tensor, spec: QuantizerSpec, *, scale: Optional[torch.Tensor] = None,
            seed: int = 0, offset: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """(rowwise values (M, K), columnwise values of x^T (K, M)) as FP32, by the spec."""
    x = x.detach()
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1])
    kind = spec.scaling
    if kind is ScalingKind.NONE:
        return x.float(), x.float().t()
    if kind is ScalingKind.DELAYED:
        r = R.fp8_quantize(x, scale.reshape(()).float().clone(), spec.fmt.value, rowwise=True, columnwise=True)
        return (R.fp8_dequantize(r.data, r.scale_inv, torch.float32),
                R.fp8_dequantize(r.data_t, r.scale_inv, torch.float32))
    if kind is ScalingKind.CURRENT:
        r = R.fp8_current_scaling_quantize(x, spec.fmt.value, use_power_2_scales=spec.use_power_2_scales,
                                           amax_epsilon=spec.amax_epsilon, rowwise=True, columnwise=True)
        return (R.fp8_dequantize(r.data, r.scale_inv, torch.float32),
                R.fp8_dequantize(r.data_t, r.scale_inv, torch.float32))
    if kind is ScalingKind.NVFP4:
        xin = x.to(torch.bfloat16) if (spec.rht_columnwise and spec.columnwise) else x
        r = R.nvfp4_quantize(xin, rowwise=True, columnwise=spec.columnwise, block_2d=spec.block_2d,
                             row_scaled=spec.row_scaled, four_over_six=spec.four_over_six,
                             e4m3_max=spec.e4m3_max, err_mode=spec.err_mode,
                             err_fast_math=spec.err_fast_math, rht=spec.rht_columnwise and spec.columnwise,
                             stochastic_rounding=spec.stochastic_rounding, seed=seed, offset=offset)
        row = R.nvfp4_dequantize(r.data, r.scale, r.amax, e4m3_max=spec.e4m3_max, row_scaled=spec.row_scaled)
        col = None
        if r.data_t is not None:
            col = R.nvfp4_dequantize(r.data_t, r.scale_t, r.amax_t, e4m3_max=spec.e4m3_max)
        return row, col
    if kind is ScalingKind.PER_TOKEN:
        r = R.per_token_cast(x, spec.fmt.value, round_sf=spec.round_sf, scale_format=spec.scale_format)
        row = R.cast_back(r.data, r.scales, spec.fmt.value, out_dtype=torch.float32,
                          scale_format=spec.scale_format)
        return row, row.t()
    raise AssertionError(f"no reference for {kind}")


def ref_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b^T in FP64 (the exact-enough reference product)."""
    return a.double() @ b.double().t()


def gemm_tol(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, extra_roundings: int = 8,
             fp8_tensor_cores: bool = False) -> torch.Tensor:
    """Elementwise bound for an FP32-accumulated a @ b^T against ref_mm (see module doc).

    ``fp8_tensor_cores``: the GEMM ran on Hopper FP8 tensor cores (torch._scaled_mm), whose accumulator
    keeps only ~14 significant bits between promotions to FP32 (DeepSeek-V3 report, section 3.3.2);
    add 2^-12 * sum|a_i b_i| (measured worst case on an H200: ~2^-15.3)."""
    k = a.shape[1]
    mag = a.double().abs() @ b.double().abs().t()
    tol = 2 * (k + extra_roundings) * EPS32 * mag
    if fp8_tensor_cores:
        tol = tol + 2.0 ** -12 * mag
    if out_dtype == torch.bfloat16:
        tol = tol + 2.0 ** -8 * mag
    elif out_dtype == torch.float16:
        tol = tol + 2.0 ** -11 * mag
    return tol + 1e-30


def assert_close_gemm(actual: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor, what: str) -> None:
    err = (actual.double() - expected).abs()
    bad = err > tol
    if bad.any():
        i = torch.nonzero(bad)[0].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())} elements out of tolerance; first at {i}: "
                             f"actual {actual[tuple(i)].item()!r} expected {expected[tuple(i)].item()!r} "
                             f"tol {tol[tuple(i)].item():.3g}")


def record_gemm_accumulation(monkeypatch) -> list:
    """Spy on every quantized GEMM a module call makes (the dense ones of ``linear_function`` and the grouped ones of
    ``grouped_linear``): the returned list gets ``(which, use_fast_accum)`` per GEMM, ``which`` being "fprop",
    "dgrad" (transpose_b) or "wgrad" (transpose_a). The real GEMMs run."""
    from fp_recipes.modules import grouped_linear as GL
    from fp_recipes.modules import linear_function as LF

    seen: list = []

    def spy(real):
        def wrapped(a, b, **kw):
            which = "wgrad" if kw.get("transpose_a") else "dgrad" if kw.get("transpose_b") else "fprop"
            seen.append((which, kw.get("use_fast_accum", False)))
            return real(a, b, **kw)
        return wrapped

    monkeypatch.setattr(LF, "gemm", spy(LF.gemm))
    monkeypatch.setattr(GL, "grouped_gemm", spy(GL.grouped_gemm))
    return seen
