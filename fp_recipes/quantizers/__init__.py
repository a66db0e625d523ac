"""Quantized tensor types and the quantizers that make them (one module per family)."""

from __future__ import annotations

import importlib
from typing import Any

from .base import QuantizedTensor, Quantizer
from .roles import QuantizerRole, QuantizerSpec

_EXPORTS = {
    "Float8Tensor": ".float8",
    "Float8Quantizer": ".float8",
    "Float8CurrentScalingQuantizer": ".float8",
    "NVFP4Tensor": ".nvfp4",
    "NVFP4Quantizer": ".nvfp4",
    "PerTokenTensor": ".per_token",
    "PerTokenQuantizer": ".per_token",
    "GroupedTensor": ".grouped",
    "GroupedQuantizer": ".grouped",
    "make_quantizer": ".factory",
}

__all__ = ["QuantizedTensor", "Quantizer", "QuantizerRole", "QuantizerSpec", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'fp_recipes.quantizers' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value
