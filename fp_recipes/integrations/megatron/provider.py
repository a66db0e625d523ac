"""``FpRecipesSpecProvider``: Megatron's ``BackendSpecProvider`` on fp_recipes modules.

Linears, the fused layernorm-linear, the norms and the MoE grouped linears are ours; core
attention is Megatron's local one (no GEMM weights to quantize). Works with megatron-core 0.16
(``grouped_mlp_modules`` returns ``(module, submodules)``) and 0.19 (it returns a builder).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Dict, Optional

from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe import experts as _experts

from .grouped import FpColumnParallelGroupedLinear, FpRowParallelGroupedLinear
from .linear import FpColumnParallelLinear, FpLayerNormColumnParallelLinear, FpRowParallelLinear
from .norm import FpNorm

__all__ = ["FpRecipesSpecProvider"]

_BOUND: Dict[tuple, type] = {}


def _bind(cls: type, recipe: Any) -> type:
    """A subclass of ``cls`` whose instances default to ``recipe`` (spec builders take classes)."""
    if recipe is None:
        return cls
    key = (cls, id(recipe))
    bound = _BOUND.get(key)
    if bound is None:
        bound = _BOUND[key] = type(cls.__name__, (cls,), {"bound_recipe": recipe,
                                                          "__module__": cls.__module__})
    return bound


_NEW_GROUPED_API = "moe_use_legacy_grouped_gemm" not in inspect.signature(
    LocalSpecProvider.grouped_mlp_modules).parameters


class FpRecipesSpecProvider(BackendSpecProvider):
    """Spec provider on fp_recipes modules. ``recipe`` (optional) is an fp_recipes recipe every
    quantized module uses by default (instead of ``config.fp8``/``config.fp4``); ``quant_recipe``
    matches still win per module, and an ``fp_recipes.autocast`` around the step overrides all."""

    def __init__(self, recipe: Optional[Any] = None) -> None:
        if recipe is not None:
            from ...recipes import Recipe

            if not isinstance(recipe, Recipe):
                raise TypeError(f"FpRecipesSpecProvider(recipe=...) needs an fp_recipes recipe, got "
                                f"{type(recipe).__qualname__}")
        self.recipe = recipe

    def linear(self) -> type:
        raise NotImplementedError("FpRecipesSpecProvider: a duplicated (non-parallel) linear is not "
                                  "provided; multi-latent attention is not supported")

    def column_parallel_linear(self) -> type:
        return _bind(FpColumnParallelLinear, self.recipe)

    def row_parallel_linear(self) -> type:
        return _bind(FpRowParallelLinear, self.recipe)

    def fuse_layernorm_and_linear(self) -> bool:
        return True

    def column_parallel_layer_norm_linear(self) -> Optional[type]:
        return _bind(FpLayerNormColumnParallelLinear, self.recipe)

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False) -> type:
        # The norm kind comes from config.normalization (as for TE's TENorm).
        return FpNorm

    def core_attention(self) -> type:
        return LocalSpecProvider().core_attention()

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool,
                            moe_use_legacy_grouped_gemm: Optional[bool] = None) -> Any:
        if moe_use_grouped_gemm:
            fc1 = _bind(FpColumnParallelGroupedLinear, self.recipe)
            fc2 = _bind(FpRowParallelGroupedLinear, self.recipe)
            if _NEW_GROUPED_API:
                return functools.partial(_experts.TEGroupedMLP, submodules=_experts.GroupedMLPSubmodules(
                    linear_fc1=fc1, linear_fc2=fc2, activation_func=None))
            return _experts.TEGroupedMLP, MLPSubmodules(linear_fc1=fc1, linear_fc2=fc2)
        sub = MLPSubmodules(linear_fc1=self.column_parallel_linear(), linear_fc2=self.row_parallel_linear())
        if _NEW_GROUPED_API:
            return functools.partial(_experts.SequentialMLP, submodules=sub)
        return _experts.SequentialMLP, sub

    def activation_func(self) -> Any:
        return None
