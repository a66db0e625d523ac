"""Operand views: which copy of a quantized tensor a GEMM reads, as plain tensors and metadata.

Every GEMM here has the contraction dimension LAST on both sides; ``transpose=True`` selects the
columnwise copy (the quantization of ``x^T``). The views read only the tensor's own fields (format,
scales, amax, ``row_scaled``, ``e4m3_max``, RHT flag), never a recipe."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["operand_kind", "Fp8Operand", "Nvfp4Operand", "fp8_operand", "nvfp4_operand"]


# type -> kind, for the kinds the type alone decides (filled on first sight; 'other' depends on the
# object's attributes and is not kept). Types never change kind, so nothing invalidates an entry.
_KIND_OF_TYPE: dict = {}


def operand_kind(t: object) -> str:
    """'fp8' | 'nvfp4' | 'tensor' | 'other' from the tensor's own type (no recipe involved)."""
    kind = _KIND_OF_TYPE.get(type(t))
    if kind is not None:
        return kind
    kind = _kind_of(t)
    # (not kept while torch.compile traces: a write to module state there is a side effect of the traced
    # autograd.Function, which Dynamo then cannot trace: a model compiled before any eager step failed)
    if kind != "other" and not torch.compiler.is_compiling():
        _KIND_OF_TYPE[type(t)] = kind
    return kind


def _kind_of(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return "tensor"
    name = type(t).__name__
    if name == "Float8Tensor":
        return "fp8"
    if name == "NVFP4Tensor":
        return "nvfp4"
    if hasattr(t, "dequantize"):
        return "other"
    raise TypeError(f"gemm: unsupported operand type {type(t).__name__}; expected a torch.Tensor, "
                    "Float8Tensor, NVFP4Tensor or another QuantizedTensor")


@dataclass
class Fp8Operand:
    data: torch.Tensor  # (rows, K) fp8, contraction last
    scale_inv: torch.Tensor  # FP32, one element


@dataclass
class Nvfp4Operand:
    data: torch.Tensor  # (rows, K/2) uint8 packed E2M1
    scale: torch.Tensor  # (rows, K/16) float8_e4m3fn block scales
    amax: torch.Tensor  # FP32 0-dim, or (rows,) when row_scaled
    row_scaled: bool
    e4m3_max: int
    rht: bool  # a random Hadamard transform was applied along K
    unit: Optional[torch.Tensor] = None  # cached BF16 unit operand (rows, K) = decode_nvfp4_unit(data, scale)


def fp8_operand(t, transpose: bool) -> Fp8Operand:
    # the copy the GEMM reads when the tensor holds it (a Float8Tensor's are 2-D), else made from the other
    data = t.data_t if transpose else t.data
    if data is None:
        if not transpose:
            data = t.rowwise_data() if hasattr(t, "rowwise_data") else t.data
        else:
            data = t.t_data() if hasattr(t, "t_data") else t.data_t
    if data.ndim != 2:
        data = data.reshape(-1, data.shape[-1])
    scale_inv = t.scale_inv
    if scale_inv.dtype != torch.float32 or scale_inv.ndim != 0:  # a Float8Tensor's already is
        scale_inv = scale_inv.float().reshape(())
    return Fp8Operand(data, scale_inv)


def nvfp4_operand(t, transpose: bool) -> Nvfp4Operand:
    # operand_kind says 'nvfp4' only for an NVFP4Tensor, whose constructor set these fields as int/bool
    # (gemm_unit/gemm_unit_t: class defaults None), so they are read directly
    if not transpose:
        if t.data is None:
            raise ValueError("gemm: this NVFP4Tensor has no rowwise copy (quantized with rowwise=False)")
        return Nvfp4Operand(t.data, t.scale, t.amax, t.row_scaled, t.e4m3_max, False, t.gemm_unit)
    if t.data_t is None:
        raise ValueError("gemm: this NVFP4Tensor has no columnwise copy; the dgrad/wgrad GEMMs need "
                         "one (quantize with columnwise=True)")
    # The columnwise copy is always per-tensor scaled, even when the rowwise copy is row-scaled.
    return Nvfp4Operand(t.data_t, t.scale_t, t.amax_t, False, t.e4m3_max, t.rht_columnwise, t.gemm_unit_t)
