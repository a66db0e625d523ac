"""Pieces every GEMM path shares: the device capability query, the FP32 matmuls of the emulations,
the epilogue (bias in FP32, one cast) and the operand padding/alignment cuBLAS asks for."""

from __future__ import annotations

import functools
from typing import Optional

import torch

__all__ = ["capability", "device_capability", "finish", "mm_fp32", "mm_bf16_fp32_accum", "gemm_ready",
           "pad_to"]


@functools.lru_cache(maxsize=None)
def capability(index: int) -> tuple:
    """``torch.cuda.get_device_capability(index)``, asked once per device."""
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device) -> Optional[tuple]:
    """(major, minor) of a CUDA ``device`` (None index: the current device); None for any other device."""
    if device.type != "cuda":
        return None
    return capability(device.index if device.index is not None else torch.cuda.current_device())


def finish(out32: torch.Tensor, bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """Bias in FP32, then the one cast to the output dtype."""
    if bias is not None:
        out32 = out32 + bias.float()
    return out32 if out_dtype == torch.float32 else out32.to(out_dtype)


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """FP32 ``a @ b^T`` with FP32 accumulation and no TF32 (the exact-emulation matmul)."""
    a = a.float()
    b = b.float()
    if a.is_cuda:
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            return a @ b.t()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev
    return a @ b.t()


def mm_bf16_fp32_accum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b^T`` for BF16-exact operands, accumulated and returned in FP32.

    CUDA: a BF16 tensor-core GEMM with FP32 output (exact products, FP32 accumulation).
    CPU (or an older torch): an FP32 matmul of the same values (the values are exact in FP32 too)."""
    if a.is_cuda:
        try:
            return torch.mm(a.to(torch.bfloat16), b.to(torch.bfloat16).t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError):
            pass
    return mm_fp32(a, b)


def gemm_ready(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when cuBLASLt can read it in place (row-major, 16-byte aligned rows and start: e.g.
    a column slice of a transposed buffer), else a contiguous copy."""
    if torch.compiler.is_compiling():
        return x.contiguous()  # (traced: no addresses to check; torch._scaled_mm checks its operands)
    if x.ndim == 2:
        s0, s1 = x.stride()  # one call for both strides: this runs twice per GEMM
        if s1 == 1 and s0 >= max(1, x.shape[1]) and (s0 * x.itemsize) % 16 == 0 and x.data_ptr() % 16 == 0:
            return x
    return x.contiguous()


def pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """``x`` zero-padded along ``dim`` to a multiple of ``multiple`` (itself when it already is one)."""
    size = x.shape[dim]
    rem = size % multiple
    if rem == 0:
        return x
    pad_shape = list(x.shape)
    pad_shape[dim] = multiple - rem
    return torch.cat([x, torch.zeros(pad_shape, dtype=x.dtype, device=x.device)], dim=dim)
