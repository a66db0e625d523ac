"""Integrations with other frameworks: model conversion (``convert_model``, Hugging Face MoE experts),
FSDP2, Megatron-core. Names resolve lazily, so importing one integration never imports the others."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "convert_model": ".convert",
    "default_module_filter": ".convert",
    "GroupedExperts": ".hf_moe",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fp_recipes.integrations' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
