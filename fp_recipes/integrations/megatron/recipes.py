"""Which fp_recipes recipe a Megatron module runs: from ``TransformerConfig``, a recipe given
directly, or a per-module ``quant_recipe`` payload.

Precedence for one module (most specific wins):
1. its ``quant_recipe`` match (Megatron hands it over in ``finish_init``);
2. a recipe object bound to the spec (``FpRecipesSpecProvider(recipe=...)``);
3. ``config.fp8`` / ``config.fp4`` (TransformerEngine's fields, mapped below).
``first_last_layers_bf16`` turns 2. and 3. off in the first/last layers, as Megatron does for TE.
An ``fp_recipes.autocast`` entered by the user overrides all of them (that is the core's rule).

Every option we cannot honour is refused here, at model build, with the option's name.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from ...recipes import RECIPES, DelayedScaling, Float8CurrentScaling, Format, NVFP4BlockScaling, Recipe

__all__ = ["recipe_from_config", "recipe_from_payload", "is_bf16_layer", "check_config", "check_cuda_graphs"]

_FP8_FORMATS = {"e4m3": Format.E4M3, "hybrid": Format.HYBRID}
# TransformerConfig fields that change numerics TE-side and that this backend does not implement.
_UNSUPPORTED_TRUE = {
    "fp8_param": "FP8 parameters (fp8_param_gather) are not implemented: weights stay high precision",
    "fp4_param": "FP4 parameters (fp4_param_gather) are not implemented: weights stay high precision",
    "fp8_dot_product_attention": "attention runs in Megatron's local core attention, not in FP8",
    "fp8_multi_head_attention": "attention runs in Megatron's local core attention, not in FP8",
    "tp_comm_overlap": "userbuffer TP-communication overlap is a TransformerEngine feature",
    "gradient_accumulation_fusion": "fused wgrad accumulation (main_grad) is not implemented",
    "delay_wgrad_compute": "delayed wgrad compute is not implemented",
}


def _get(config: Any, name: str, default: Any = None) -> Any:
    return getattr(config, name, default)


def check_config(config: Any, quantized: bool) -> None:
    """Refuse the config options this backend cannot honour (named, with the reason)."""
    for field, why in _UNSUPPORTED_TRUE.items():
        if field in ("tp_comm_overlap", "gradient_accumulation_fusion", "delay_wgrad_compute") \
                and not quantized:
            continue  # Megatron's own local path handles these where it can
        if _get(config, field):
            raise ValueError(f"fp_recipes Megatron backend: TransformerConfig.{field}=True is not "
                             f"supported ({why}); set it to False")
    if (_get(config, "fp8") or _get(config, "fp4")) and _get(config, "recompute_granularity"):
        raise ValueError(
            "fp_recipes Megatron backend: config.fp8/config.fp4 with recompute_granularity="
            f"{_get(config, 'recompute_granularity')!r} is not supported: with config.fp8/fp4 set, "
            "Megatron recomputes through TransformerEngine's te_checkpoint, which does not exist "
            "without TE. Give the recipe through the quant_recipe route instead (config.quant_recipe "
            "with payload {'recipe': 'delayed'|'current'|'nvfp4', ...}, config.fp8/fp4 unset) or "
            "FpRecipesSpecProvider(recipe=...); both recompute with Megatron's own checkpoint")


def check_cuda_graphs(config: Any) -> None:
    """Refuse Megatron's own CUDA graphs around a quantized layer. ``cuda_graph_impl="local"`` captures the layer with
    ``torch.cuda.graph`` and knows nothing of this backend's state: an NVFP4 stochastic-rounding counter would be
    baked into the graph (every replay drawing the same numbers) and the delayed-scaling bookkeeping done in Python
    at the backward's start would not be replayed, silently. ``"transformer_engine"`` fills the layers with graphs
    made by TransformerEngine's ``make_graphed_callables``, which does not know these modules."""
    impl = _get(config, "cuda_graph_impl", "none")
    legacy = [name for name in ("enable_cuda_graph", "external_cuda_graph") if _get(config, name)]
    if impl in (None, "none") and not legacy:
        return
    what = f"cuda_graph_impl={impl!r}" if impl not in (None, "none") else f"{legacy[0]}=True"
    raise ValueError(
        f"fp_recipes Megatron backend: TransformerConfig.{what} is not supported with quantized layers: Megatron's "
        "capture would freeze the recipe's host-side state (NVFP4 stochastic-rounding counters, delayed-scaling "
        "updates) into the graph. Set cuda_graph_impl='none', or capture the layers with "
        "fp_recipes.make_graphed_callables, which keeps that state on the GPU (docs/cuda_graphs.md)")


def recipe_from_config(config: Any) -> Optional[Recipe]:
    """The recipe ``config.fp8`` / ``config.fp4`` describe (None when both are unset)."""
    fp8, fp4 = _get(config, "fp8"), _get(config, "fp4")
    if fp8 and fp4:
        raise ValueError("fp_recipes Megatron backend: config.fp8 and config.fp4 are both set; "
                         "pick one")
    if fp8:
        fmt = _FP8_FORMATS.get(str(fp8).lower())
        if fmt is None:
            raise ValueError(f"fp_recipes Megatron backend: config.fp8={fp8!r} is not supported; "
                             f"allowed: {', '.join(_FP8_FORMATS)}")
        kind = str(getattr(_get(config, "fp8_recipe"), "value", _get(config, "fp8_recipe"))).lower()
        if kind == "delayed":
            return DelayedScaling(fp8_format=fmt, margin=int(_get(config, "fp8_margin", 0)),
                                  amax_history_len=int(_get(config, "fp8_amax_history_len", 1)),
                                  amax_compute_algo=str(_get(config, "fp8_amax_compute_algo",
                                                             "most_recent")))
        if kind == "tensorwise":
            if _get(config, "fp8_margin", 0):
                raise ValueError("fp_recipes Megatron backend: config.fp8_margin applies to "
                                 "fp8_recipe='delayed' only (tensorwise scales from the current amax)")
            return Float8CurrentScaling(fp8_format=fmt)
        raise ValueError(f"fp_recipes Megatron backend: config.fp8_recipe={kind!r} is not supported; "
                         "allowed: delayed, tensorwise (mxfp8/blockwise/custom are TransformerEngine "
                         "recipes; for NVFP4 use config.fp4='nvfp4')")
    if fp4:
        if str(fp4).lower() != "nvfp4":
            raise ValueError(f"fp_recipes Megatron backend: config.fp4={fp4!r} is not supported; "
                             "allowed: nvfp4")
        kind = str(getattr(_get(config, "fp4_recipe"), "value", _get(config, "fp4_recipe"))).lower()
        if kind != "nvfp4":
            raise ValueError(f"fp_recipes Megatron backend: config.fp4_recipe={kind!r} is not "
                             "supported; allowed: nvfp4 (for NVFP4 options such as row-scaled "
                             "activations or 4over6 give a recipe object or a quant_recipe payload)")
        return NVFP4BlockScaling()
    return None


def is_bf16_layer(config: Any, layer_number: Optional[int]) -> bool:
    """Megatron's ``first_last_layers_bf16`` rule; ``layer_number`` is the global 1-based number."""
    if layer_number is None or not _get(config, "first_last_layers_bf16"):
        return False
    index = layer_number - 1
    start = int(_get(config, "num_layers_at_start_in_bf16", 0) or 0)
    end = int(_get(config, "num_layers_at_end_in_bf16", 0) or 0)
    return index < start or index >= int(config.num_layers) - end


def recipe_from_payload(payload: Dict[str, Any], where: str = "") -> Optional[Recipe]:
    """``{"recipe": <FP_RECIPES_RECIPE name>, <field>: <value>, ...}`` -> a recipe (None for "none")."""
    at = f" (quant_recipe config {where})" if where else ""
    if not isinstance(payload, dict) or "recipe" not in payload:
        raise ValueError(f"fp_recipes Megatron backend: a quant_recipe config must be a mapping with "
                         f"a 'recipe' key naming one of: none, {', '.join(RECIPES)}; got "
                         f"{payload!r}{at}")
    fields = dict(payload)
    name = str(fields.pop("recipe")).strip().lower()
    if name == "none":
        if fields:
            raise ValueError(f"fp_recipes Megatron backend: recipe 'none' takes no fields, got "
                             f"{sorted(fields)}{at}")
        return None
    cls = RECIPES.get(name)
    if cls is None:
        raise ValueError(f"fp_recipes Megatron backend: unknown recipe {name!r}{at}; allowed: none, "
                         f"{', '.join(RECIPES)}")
    try:
        return cls(**fields)
    except Exception as exc:  # pydantic names the field and what is allowed
        raise ValueError(f"fp_recipes Megatron backend: bad quant_recipe payload{at}: {exc}") from exc
