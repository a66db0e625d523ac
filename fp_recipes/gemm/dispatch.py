"""``gemm(a, b)``: one GEMM on quantized or plain operands, dispatched on the operands' own types.

Convention (TN, as cuBLAS and the operand table in ``quantizers/roles.py``): both operands have the
contraction dimension LAST. ``gemm(a, b)`` returns ``op(a) @ op(b)^T`` of shape (rows(a), rows(b)),
where ``op(x)`` is the rowwise copy of ``x`` or, with ``transpose_x=True``, its columnwise copy (the
quantization of ``x^T``)::

    fprop  y  = gemm(x,  w)                                   (M,K) x (N,K) -> (M,N)
    dgrad  dx = gemm(dy, w,  transpose_b=True)                 (M,N) x (K,N) -> (M,K)
    wgrad  dw = gemm(dy, x,  transpose_a=True, transpose_b=True)  (N,M) x (K,M) -> (N,K)

The dispatcher reads only the tensors' own metadata (format, scales, amax, ``row_scaled``,
``e4m3_max``, RHT flag) -- never a recipe. FP8 x FP8: :mod:`.fp8`; NVFP4 x NVFP4: :mod:`.nvfp4`;
anything else (a high-precision operand, per-token tensors, mixed formats): :mod:`.dense`.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ._common import finish, mm_fp32
from .dense import dense_operand, gemm_high_precision
from .fp8 import gemm_fp8_fp8
from .nvfp4 import gemm_nvfp4_nvfp4
from .operands import fp8_operand, nvfp4_operand, operand_kind

__all__ = ["Operand", "gemm"]

Operand = Union[torch.Tensor, object]


def gemm(a: Operand, b: Operand, *, transpose_a: bool = False, transpose_b: bool = False,
         out_dtype: Optional[torch.dtype] = None, bias: Optional[torch.Tensor] = None,
         use_fast_accum: bool = False) -> torch.Tensor:
    """``op(a) @ op(b)^T (+ bias)``: both operands with the contraction dim last (see module doc).

    ``out_dtype`` defaults to the original dtype of ``a`` (or FP32). ``use_fast_accum`` only affects
    the native FP8 path (cuBLASLt's fast accumulation; torchao and TE use it for fprop only)."""
    ka, kb = operand_kind(a), operand_kind(b)
    if out_dtype is None:
        out_dtype = a.dtype if ka == "tensor" else getattr(a, "orig_dtype", torch.float32)
    if ka == "fp8" and kb == "fp8":
        return gemm_fp8_fp8(fp8_operand(a, transpose_a), fp8_operand(b, transpose_b), out_dtype=out_dtype,
                            bias=bias, use_fast_accum=use_fast_accum)
    if ka == "nvfp4" and kb == "nvfp4":
        return gemm_nvfp4_nvfp4(nvfp4_operand(a, transpose_a), nvfp4_operand(b, transpose_b),
                                out_dtype=out_dtype, bias=bias)
    da, db = dense_operand(a, transpose_a), dense_operand(b, transpose_b)
    if da.shape[1] != db.shape[1]:
        raise ValueError(f"gemm: contraction dims differ: {tuple(da.shape)} x {tuple(db.shape)}^T")
    if ka == "tensor" and kb == "tensor":
        return gemm_high_precision(da, db, out_dtype=out_dtype, bias=bias)
    return finish(mm_fp32(da, db), bias, out_dtype)
