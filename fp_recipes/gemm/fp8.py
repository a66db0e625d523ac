"""FP8 x FP8 with per-tensor scales.

On CUDA sm_89+, any pair except E5M2 x E5M2 (which cuBLASLt does not support): cuBLASLt through the
cached plan of the problem's shape (``cublaslt.fp8_gemm``: descriptors and algorithm chosen once per
shape, one ``cublasLtMatmul`` per call), else ``torch._scaled_mm`` (cuBLASLt not loadable, a problem
its FP8 kernels refuse), which runs the same library's heuristic on every call (~70 us of host time per
GEMM on an H100 host; issue 14). Traced code (torch.compile) calls the same through the op
``torch.ops.fp_recipes.fp8_mm``. Both compute the same math (FP32 accumulation,
per-tensor FP32 scales, the bias added in the FP32 epilogue, one rounding to the output dtype); the
results differ at most by the algorithm the heuristic picks.

K and N are zero-padded to multiples of 16 when needed (zeros add nothing to a dot product, so the
result is unchanged; a fused bias is zero-padded with N). Elsewhere an exact emulation: the FP8 values are exact in FP32, the FP32 matmul
accumulates, and the product of the two dequantization scales is applied in the FP32 epilogue, as the
hardware does."""

from __future__ import annotations

from typing import Optional

import torch

from . import _common, cublaslt
from ._common import finish, gemm_ready, mm_fp32, pad_to
from ..ops.op_library import define_op, register_fake
from .operands import Fp8Operand

__all__ = ["fp8_gemm_engine", "fp8_native_gemm_available", "gemm_fp8_fp8"]


def fp8_native_gemm_available(device: torch.device, a_dtype: torch.dtype = torch.float8_e4m3fn,
                              b_dtype: torch.dtype = torch.float8_e4m3fn) -> bool:
    """True when ``torch._scaled_mm`` can run this FP8 pair on ``device`` (CUDA sm_89+, not E5M2 x E5M2)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    if a_dtype == torch.float8_e5m2 and b_dtype == torch.float8_e5m2:
        return False
    return _common.device_capability(device) >= (8, 9)


def fp8_gemm_engine(device: torch.device) -> str:
    """What runs a native FP8 GEMM on ``device`` (for reports: doctor, the demo's table)."""
    return "cuBLASLt, cached plans" if cublaslt.available() else "torch._scaled_mm"


def gemm_fp8_fp8(a: Fp8Operand, b: Fp8Operand, *, out_dtype: torch.dtype,
                 bias: Optional[torch.Tensor] = None, use_fast_accum: bool = False) -> torch.Tensor:
    """FP8 x FP8 with per-tensor scales: ``(a.data @ b.data^T) * (a.scale_inv * b.scale_inv) + bias``."""
    a_data, b_data = a.data, b.data
    # (traced code never looks the C++ path up: its first look-up takes a lock a trace cannot enter)
    fast = (_FAST_GEMM[0] if _FAST_GEMM else _first_fast_gemm()) if a_data.is_cuda and not \
        torch.compiler.is_compiling() else None
    if fast is not None:
        # this function's cuBLASLt branch as one C++ call (fp_recipes._torch_ops); None: the branch below
        out = fast.fp8_linear_gemm(a_data, b_data, a.scale_inv, b.scale_inv, out_dtype, bias, use_fast_accum,
                                   cublaslt.WORKSPACE_BYTES)
        if out is not None:
            return out
    (m, k), n = a_data.shape, b_data.shape[0]
    if k != b_data.shape[1]:
        raise ValueError(f"gemm: contraction dims differ: {tuple(a_data.shape)} x {tuple(b_data.shape)}^T")
    if fp8_native_gemm_available(a_data.device, a_data.dtype, b_data.dtype):
        if m == 0 or n == 0 or k == 0:
            return finish(torch.zeros(m, n, device=a_data.device), bias, out_dtype)
        if k % 16 or n % 16:
            a_data, b_data = pad_to(a_data, 1, 16), pad_to(pad_to(b_data, 1, 16), 0, 16)
        a_data, b_data = gemm_ready(a_data), gemm_ready(b_data)
        fuse_bias = bias is not None and bias.dtype == out_dtype and out_dtype in (torch.bfloat16,
                                                                                   torch.float16)
        mm_dtype = out_dtype if (bias is None or fuse_bias) else torch.float32
        mm_bias = bias if fuse_bias else None
        if mm_bias is not None and b_data.shape[0] != n:
            # N padded to a multiple of 16: the epilogue reads a bias of the padded width (zeros for the
            # padding columns, which are sliced off)
            mm_bias = pad_to(mm_bias, 0, 16)
        mm = _fp8_mm_op if torch.compiler.is_compiling() else _fp8_mm
        out = mm(a_data, b_data, a.scale_inv, b.scale_inv, mm_dtype, mm_bias, use_fast_accum)
        if out.shape[1] != n:
            out = out[:, :n]
        if bias is not None and not fuse_bias:
            return finish(out, bias, out_dtype)
        return out
    acc = mm_fp32(a.data.float(), b.data.float())
    return finish(acc * (a.scale_inv * b.scale_inv), bias, out_dtype)


_FAST_GEMM: list = []  # [the torch-linked host path, or None], looked up on the first FP8 GEMM
_TRACED_KERNELS: list = []  # [the op names with C++ CUDA kernels]: set by register_traced_kernels


def _first_fast_gemm():
    """The first eager FP8 GEMM's look-up: also registers the traced ops' C++ kernels (outside any op call)."""
    fast = _fast_gemm()
    register_traced_kernels()
    return fast


def _fast_gemm():
    """The torch-linked host path when it and the cuBLASLt launcher it calls are both available."""
    from .. import _extension

    fast = _extension.fast_ops()
    _FAST_GEMM.append(fast if fast is not None and cublaslt.available() and cublaslt.single_gemm() else None)
    return _FAST_GEMM[0]


def register_traced_kernels() -> list:
    """Give the traced FP8 ops (the casts of ``ops/cuda_fp8.py``, :data:`_fp8_mm_op`) their C++ CUDA kernels from
    the torch-linked host path (``_torch_ops.register_traced_ops``), so a compiled graph's cast or GEMM enters no
    Python; where a C++ call declines, the op's Python implementation runs. Once per process, before a graph runs:
    a trace's preparation (``modules/base.py``) and the first eager FP8 GEMM call it (a kernel registered while
    another thread dispatches the op would race the dispatcher's table). Returns the op names registered."""
    if not _TRACED_KERNELS:
        from .. import _extension

        fast = _extension.fast_ops()
        names: list = []
        if fast is not None and hasattr(fast, "register_traced_ops"):
            from ..ops import cuda_fp8, cuda_fp8_act

            impls = cuda_fp8.traced_cast_impls()
            if getattr(fast, "fp8_cast_acts", False):  # (a module built with the activation casts)
                impls.update(cuda_fp8_act.traced_cast_impls())
            if (_FAST_GEMM[0] if _FAST_GEMM else _fast_gemm()) is not None:
                impls["fp8_mm"] = _fp8_mm  # (with cuBLASLt's single GEMM: the C++ call's plan)
            names = list(fast.register_traced_ops(impls, cublaslt.WORKSPACE_BYTES))
        _TRACED_KERNELS.append(names)
    return _TRACED_KERNELS[0]


def _fp8_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype,
            bias: Optional[torch.Tensor], use_fast_accum: bool) -> torch.Tensor:
    """``a @ b.T`` scaled (operands ready for cuBLASLt: K, N multiples of 16): the cached cuBLASLt plan,
    else ``torch._scaled_mm``. Traced code calls it as an op (:data:`_fp8_mm_op`), so a compiled step
    gets the cached plan too, not ``torch._scaled_mm``'s heuristic query on every call."""
    if a.is_cuda:
        # (when the op runs, not while traced: the look-up's lock is safe here) the same cached plan through the
        # torch-linked host path: one C++ call, which also copies an unaligned scale; None: the branch below
        fast = _FAST_GEMM[0] if _FAST_GEMM else _fast_gemm()
        if fast is not None:
            out = fast.fp8_linear_gemm(a, b, scale_a, scale_b, out_dtype, bias, use_fast_accum,
                                       cublaslt.WORKSPACE_BYTES)
            if out is not None:
                return out
    # cuBLASLt (ours and torch._scaled_mm's) refuses a scale that is not 16-byte aligned, e.g. one
    # element of a packed vector: a fresh 0-dim copy is aligned
    if scale_a.data_ptr() % 16:
        scale_a = scale_a.clone()
    if scale_b.data_ptr() % 16:
        scale_b = scale_b.clone()
    out = cublaslt.fp8_gemm(a, b, scale_a, scale_b, out_dtype, bias, use_fast_accum) if a.is_cuda else None
    if out is None:
        out = torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype,
                               use_fast_accum=use_fast_accum)
    return out


_fp8_mm_op = define_op("fp8_mm", _fp8_mm)


@register_fake(_fp8_mm_op)
def _(a, b, scale_a, scale_b, out_dtype, bias, use_fast_accum):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)
