"""Functional API for direct use, without modules or autocast.

>>> qt = fp_recipes.quantize(x, spec)                 # spec -> make_quantizer(spec)
>>> y = fp_recipes.dequantize(qt, torch.bfloat16)
>>> pt = fp_recipes.per_token_cast(x, "e5m6", round_sf=True)
>>> y = fp_recipes.cast_back(pt)                      # or cast_back(data, scales, "e5m6", ...)
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from . import ops
from .quantizers.base import QuantizedTensor, Quantizer
from .quantizers.factory import make_quantizer
from .quantizers.per_token import PerTokenTensor, per_token_quantize
from .quantizers.roles import QuantizerSpec


def quantize(x: torch.Tensor, spec_or_quantizer: Union[QuantizerSpec, Quantizer], **kwargs) -> QuantizedTensor:
    """Quantize ``x`` with a quantizer, or with a fresh one built from a spec. Note that a fresh
    delayed-scaling quantizer has scale 1; keep the quantizer to carry its state across calls."""
    if isinstance(spec_or_quantizer, QuantizerSpec):
        q = make_quantizer(spec_or_quantizer)
        if q is None:
            raise ValueError(f"quantize: spec {spec_or_quantizer.describe()!r} keeps the tensor in high "
                             "precision; there is nothing to quantize")
    elif isinstance(spec_or_quantizer, Quantizer):
        q = spec_or_quantizer
    else:
        raise TypeError(f"quantize: expected a QuantizerSpec or a Quantizer, got {type(spec_or_quantizer).__name__}")
    return q.quantize(x, **kwargs)


def dequantize(qt: QuantizedTensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``qt.dequantize(dtype)``; dtype defaults to the tensor's original dtype (``qt.orig_dtype``, which
    every quantized tensor type records), whatever default the type's own method has."""
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"dequantize: expected a quantized tensor, got {type(qt).__name__}")
    if dtype is None:
        dtype = getattr(qt, "orig_dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dequantize: {type(qt).__name__} records no original dtype (orig_dtype); "
                            "pass dtype= explicitly")
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"dequantize: dtype must be float32, float16 or bfloat16, got {dtype}")
    return qt.dequantize(dtype)


def per_token_cast(x: torch.Tensor, fmt: str = "e5m6", *, round_sf: bool = False, scale_format: str = "fp32",
                   block_size: Optional[int] = None) -> PerTokenTensor:
    """Per-token cast of ``x`` (..., H) to E5M6 or E4M3 (TileKernels' contract, docs/numerics.md).
    The result's ``.data`` / ``.scales`` are the raw kernel outputs."""
    return per_token_quantize(x, fmt, round_sf=round_sf, scale_format=scale_format, block_size=block_size)


def cast_back(data: Union[PerTokenTensor, torch.Tensor], scales: Optional[torch.Tensor] = None,
              fmt: Optional[str] = None, *, out_dtype: Optional[torch.dtype] = None, scale_format: str = "fp32",
              block_size: Optional[int] = None) -> torch.Tensor:
    """Dequantize a per-token cast: pass a :class:`PerTokenTensor`, or the raw ``data, scales, fmt``
    (2-D, as :func:`fp_recipes.ops.per_token_cast` returns them; out_dtype defaults to BF16)."""
    if isinstance(data, PerTokenTensor):
        if scales is not None or fmt is not None:
            raise ValueError("cast_back: a PerTokenTensor carries its own scales and fmt; do not pass them")
        return data.dequantize(out_dtype)
    if scales is None or fmt is None:
        raise ValueError("cast_back: raw data needs scales and fmt")
    return ops.cast_back(data, scales, fmt, out_dtype=out_dtype or torch.bfloat16, scale_format=scale_format,
                         block_size=block_size)


__all__ = ["cast_back", "dequantize", "per_token_cast", "quantize"]
