"""Modules whose GEMMs are quantized under ``fp_recipes.autocast``, and model conversion."""

from .grouped_linear import GroupedLinear
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear
from ..integrations.convert import convert_model

__all__ = ["GroupedLinear", "LayerNormLinear", "LayerNormMLP", "Linear", "convert_model"]
