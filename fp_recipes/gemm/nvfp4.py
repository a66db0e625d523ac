"""NVFP4 x NVFP4: which implementation runs.

Native FP4 GEMMs need sm_100+, which this project cannot test, so today every device runs the exact
emulation (:mod:`.nvfp4_emulated`): on CUDA its few-launch path when it takes the operands, else the
torch ops."""

from __future__ import annotations

from typing import Optional

import torch

from .nvfp4_emulated import gemm_nvfp4_emulated, gemm_nvfp4_emulated_cuda
from .operands import Nvfp4Operand

__all__ = ["gemm_nvfp4_nvfp4", "nvfp4_native_gemm_available"]


def nvfp4_native_gemm_available(device: torch.device) -> bool:
    """Native NVFP4 GEMMs (sm_100+) are deliberately not wired up: this project has no Blackwell GPU to
    test them on, and an untested fast path that silently disagrees with the emulation would be worse
    than the emulation. The emulation is exact in its products and runs on every device."""
    return False


def gemm_nvfp4_nvfp4(a: Nvfp4Operand, b: Nvfp4Operand, *, out_dtype: torch.dtype,
                     bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """NVFP4 x NVFP4: unit-scaled BF16-exact GEMM with FP32 accumulation, global factor as FP32 alpha."""
    if a.rht != b.rht:
        raise ValueError("gemm: one NVFP4 operand is Hadamard-transformed (RHT) along K and the other is "
                         "not; the product would be wrong. RHT must be applied to both wgrad operands")
    ka, kb = a.data.shape[1] * 2, b.data.shape[1] * 2
    if ka != kb:
        raise ValueError(f"gemm: contraction dims differ: {a.data.shape[0]}x{ka} and {b.data.shape[0]}x{kb}")
    if a.data.is_cuda:
        out = gemm_nvfp4_emulated_cuda(a, b, out_dtype, bias)
        if out is not None:
            return out
    return gemm_nvfp4_emulated(a, b, out_dtype, bias)
