"""Megatron's ``TransformerLayer`` that tells each fp_recipes module its global layer number, so
``first_last_layers_bf16`` applies as Megatron applies it to TransformerEngine's layers."""

from __future__ import annotations

from typing import Any

from megatron.core.transformer.transformer_layer import TransformerLayer

from .quant import MegatronQuantized

__all__ = ["FpRecipesTransformerLayer"]


class FpRecipesTransformerLayer(TransformerLayer):
    """A ``TransformerLayer`` whose fp_recipes modules know their (global, 1-based) layer number."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for module in self.modules():
            if isinstance(module, MegatronQuantized):
                module.set_layer_number(self.layer_number)
