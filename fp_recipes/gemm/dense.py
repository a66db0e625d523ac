"""High-precision and mixed GEMMs: plain tensors, per-token tensors, mixed formats.

Both operands are dequantized to FP32 and multiplied in FP32; two plain tensors of one dtype use
torch's own matmul in that dtype (the ``backward_override="high_precision"`` path behaves exactly
like torch)."""

from __future__ import annotations

from typing import Optional

import torch

from .. import ops
from ._common import finish, mm_fp32
from .operands import Nvfp4Operand, nvfp4_operand, operand_kind

__all__ = ["gemm_high_precision", "dense_operand"]


def gemm_high_precision(a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype,
                        bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain operands: torch's own matmul when operands and output share a dtype (exactly like torch);
    otherwise an FP32 matmul (exact products of the narrower inputs) and one cast to ``out_dtype``."""
    if a.dtype == b.dtype == out_dtype and a.dtype != torch.float32:
        out = a @ b.t()
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out.to(out_dtype)
    return finish(mm_fp32(a, b), bias, out_dtype)


def _dequantize_nvfp4_operand(op: Nvfp4Operand) -> torch.Tensor:
    """FP32 values of one NVFP4 copy by the dequantize contract (NUMERICS.md step 7); used only where
    an NVFP4 copy meets a non-NVFP4 operand."""
    return ops.nvfp4_dequantize(op.data, op.scale, op.amax, e4m3_max=op.e4m3_max,
                                row_scaled=op.row_scaled, out_dtype=torch.float32)


def dense_operand(t, transpose: bool) -> torch.Tensor:
    """A high-precision (rows, K) view: a plain tensor as is, a quantized one dequantized to FP32."""
    if isinstance(t, torch.Tensor):
        if t.dim() != 2:
            t = t.reshape(-1, t.shape[-1])
        return t.t() if transpose else t
    if operand_kind(t) == "nvfp4" and transpose and getattr(t, "rht_columnwise", False):
        raise ValueError("gemm: the columnwise copy of this NVFP4 tensor is Hadamard-transformed (RHT); it "
                         "can only be multiplied by another RHT'd columnwise NVFP4 operand")
    if operand_kind(t) == "nvfp4" and transpose:
        return _dequantize_nvfp4_operand(nvfp4_operand(t, True))
    d = t.dequantize(torch.float32)
    if d.dim() != 2:
        d = d.reshape(-1, d.shape[-1])
    return d.t() if transpose else d
