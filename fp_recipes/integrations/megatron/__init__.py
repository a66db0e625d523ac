"""fp_recipes as a Megatron-core backend (optional: needs ``pip install fp_recipes[megatron]``).

    from fp_recipes.integrations.megatron import get_gpt_layer_spec
    model = GPTModel(config, transformer_layer_spec=get_gpt_layer_spec(), ...)

Importing ``fp_recipes`` never imports this package (nor megatron)."""

from __future__ import annotations

try:
    import megatron.core  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("fp_recipes.integrations.megatron needs megatron-core: "
                      "pip install 'fp_recipes[megatron]'") from exc

from .grouped import FpColumnParallelGroupedLinear, FpRowParallelGroupedLinear
from .layer import FpRecipesTransformerLayer
from .linear import FpColumnParallelLinear, FpLayerNormColumnParallelLinear, FpRowParallelLinear
from .norm import FpNorm
from .provider import FpRecipesSpecProvider
from .quant import MegatronQuantized
from .recipes import recipe_from_config, recipe_from_payload
from .specs import get_gpt_decoder_block_spec, get_gpt_layer_spec

__all__ = [
    "FpColumnParallelGroupedLinear", "FpColumnParallelLinear", "FpLayerNormColumnParallelLinear",
    "FpNorm", "FpRecipesSpecProvider", "FpRecipesTransformerLayer", "FpRowParallelGroupedLinear",
    "FpRowParallelLinear", "MegatronQuantized", "get_gpt_decoder_block_spec",
    "get_gpt_layer_spec", "recipe_from_config", "recipe_from_payload",
]
