"""fp_recipes: FP8 and NVFP4 training recipes for PyTorch.

Public API only. Names are resolved lazily so that ``import fp_recipes`` stays cheap and never reads
environment variables (recipes read them when they are constructed).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # recipes
    "Recipe": "fp_recipes.recipes",
    "Format": "fp_recipes.recipes",
    "DelayedScaling": "fp_recipes.recipes",
    "Float8CurrentScaling": "fp_recipes.recipes",
    "NVFP4BlockScaling": "fp_recipes.recipes",
    "PerTokenScaling": "fp_recipes.recipes",
    "recipe_from_env": "fp_recipes.recipes",
    # roles and specs
    "QuantizerRole": "fp_recipes.quantizers.roles",
    "QuantizerSpec": "fp_recipes.quantizers.roles",
    "ModuleKind": "fp_recipes.quantizers.roles",
    "TensorKind": "fp_recipes.quantizers.roles",
    # autocast
    "autocast": "fp_recipes.autocast",
    "fp8_autocast": "fp_recipes.autocast",
    "get_autocast_state": "fp_recipes.autocast",
    # quantized tensors and quantizers
    "QuantizedTensor": "fp_recipes.quantizers",
    "Quantizer": "fp_recipes.quantizers",
    "Float8Tensor": "fp_recipes.quantizers",
    "NVFP4Tensor": "fp_recipes.quantizers",
    "PerTokenTensor": "fp_recipes.quantizers",
    "GroupedTensor": "fp_recipes.quantizers",
    "Float8Quantizer": "fp_recipes.quantizers",
    "Float8CurrentScalingQuantizer": "fp_recipes.quantizers",
    "NVFP4Quantizer": "fp_recipes.quantizers",
    "PerTokenQuantizer": "fp_recipes.quantizers",
    "GroupedQuantizer": "fp_recipes.quantizers",
    "make_quantizer": "fp_recipes.quantizers",
    # functional API
    "quantize": "fp_recipes.functional",
    "dequantize": "fp_recipes.functional",
    "per_token_cast": "fp_recipes.functional",
    "cast_back": "fp_recipes.functional",
    # modules
    "Linear": "fp_recipes.modules",
    "LayerNormLinear": "fp_recipes.modules",
    "LayerNormMLP": "fp_recipes.modules",
    "GroupedLinear": "fp_recipes.modules",
    "convert_model": "fp_recipes.modules",
    # CUDA graphs
    "make_graphed_callables": "fp_recipes.graphs",
    # backend
    "backend_info": "fp_recipes._info",
}

# submodules that are part of the public surface: ``fp_recipes.recipe`` is TransformerEngine's
# ``transformer_engine.common.recipe`` (``from fp_recipes import recipe`` works either way)
_SUBMODULES = ("recipe",)

__all__ = sorted(_EXPORTS) + list(_SUBMODULES) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"fp_recipes.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fp_recipes' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


class _Package(types.ModuleType):
    """``fp_recipes.autocast`` is the context-manager class, also after its submodule of the same name
    is imported: Python binds a loaded submodule on its package (``fp_recipes.autocast = <module>``),
    and torch.compile cannot trace a call of a module object (the module is callable too, but only
    eagerly). The submodule stays in ``sys.modules`` (``from fp_recipes.autocast import ...``)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "autocast" and isinstance(value, types.ModuleType) and hasattr(value, "autocast"):
            value = value.autocast
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
