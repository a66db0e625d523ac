"""Native NVFP4 x NVFP4 GEMM on Blackwell (sm_100 / sm_120): ``torch._scaled_mm`` on FP4 tensor cores.

The operands are the NVFP4 copies as quantized, nothing re-encoded:

* data: the packed (rows, K/2) uint8 copy viewed as ``torch.float4_e2m1fn_x2``. Our packing (element
  2k in the LOW nibble of byte k, element 2k+1 in the high nibble; docs/nvfp4.md section 1) is the one
  torch's ``float4_e2m1fn_x2`` and cuBLAS's ``CUDA_R_4F_E2M1`` use (torchao packs the same way:
  ``pack_uint4`` puts the even element in the low nibble), so the bytes go in as they are.
  ``_scaled_mm`` takes A (M, K/2) row-major and B as (K/2, N) column-major, i.e. the (N, K/2)
  row-major weight copy transposed: both copies are contraction-last, as stored.
* block scales: the E4M3 (rows, K/16) copy in cuBLAS's swizzled 128 x 4 tile layout
  (:mod:`.scale_layout`), zero-padded. The global factor is NOT folded into them (seed 003).
* shapes: cuBLAS needs K % 32 == 0 and N % 16 == 0; other shapes are zero-padded (zero codes with
  zero scales add nothing) and the output is sliced.

The GEMM returns the FP32 accumulator ``sum (q_a sf_a)(q_b sf_b)`` (``out_dtype=float32``) and the
global factors are applied by the emulation's own epilogue
(:func:`.nvfp4_emulated.apply_global_factors`: FP32 alpha per tensor, or the unit alpha and then the
per-row amax product for row-scaled operands, bias in FP32, one cast). The products are exact on both
paths, so native and emulated results differ only by the FP32 accumulation order.

NOT RUN ON HARDWARE: this project had no Blackwell GPU. The scale layout, padding and dispatch are
tested on CPU; on the first NVFP4 GEMM on an sm_100+ device, :mod:`.nvfp4` compares this path with the
emulation and falls back to the emulation (with one warning) if it raises or disagrees.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._common import pad_to
from .nvfp4_emulated import apply_global_factors
from .operands import Nvfp4Operand
from .scale_layout import to_blocked

__all__ = ["native_operands", "native_accumulator", "gemm_nvfp4_native"]

K_MULTIPLE = 32  # cuBLAS: the packed K (K/2 bytes) a multiple of 16
N_MULTIPLE = 16


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """Contiguous with a 16-byte aligned start (cuBLASLt's requirement for operands and scales)."""
    if not x.is_contiguous():
        x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def native_operands(op: Nvfp4Operand, rows_multiple: int = 1) -> tuple:
    """(float4_e2m1fn_x2 data (rows', K'/2), swizzled E4M3 scales (1-D)) of one copy, K zero-padded to a
    multiple of 32 and rows to a multiple of ``rows_multiple``. The scale matrix needs no explicit
    padding: its swizzled layout is zero-padded to 128-row and 4-column tiles, which covers both."""
    data = op.data
    if data.dtype != torch.uint8:
        data = data.view(torch.uint8)
    data = pad_to(data, 1, K_MULTIPLE // 2)
    if rows_multiple > 1:
        data = pad_to(data, 0, rows_multiple)
    scale = op.scale if op.scale.dtype == torch.float8_e4m3fn else op.scale.view(torch.float8_e4m3fn)
    return _aligned(data).view(torch.float4_e2m1fn_x2), _aligned(to_blocked(scale))


def native_accumulator(a: Nvfp4Operand, b: Nvfp4Operand) -> torch.Tensor:
    """The FP32 (M, N) accumulator ``sum (q_a sf_a)(q_b sf_b)`` of one ``torch._scaled_mm`` call (no
    global factor). Raises what torch raises."""
    m, n, k = a.data.shape[0], b.data.shape[0], a.data.shape[1] * 2
    if m == 0 or n == 0 or k == 0:  # what the emulation's matmul gives: zeros
        return torch.zeros((m, n), dtype=torch.float32, device=a.data.device)
    da, sa = native_operands(a)
    db, sb = native_operands(b, N_MULTIPLE)
    acc = torch._scaled_mm(da, db.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    return acc if acc.shape[1] == n else acc[:, :n]


def gemm_nvfp4_native(a: Nvfp4Operand, b: Nvfp4Operand, out_dtype: torch.dtype,
                      bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``op(a) @ op(b)^T`` through ``torch._scaled_mm`` (FP4 x FP4, E4M3 block scales, FP32 out), then the
    emulation's epilogue. Raises what torch raises (the caller decides whether to fall back)."""
    return apply_global_factors(native_accumulator(a, b), a, b, out_dtype, bias)
