"""What every fp_recipes Megatron module shares: its recipe (config / bound / quant_recipe), its
quantizer sets without an outer ``fp_recipes.autocast``, the amax reduction group, and the state
that Megatron's checkpointing must carry.

The module's recipe is the core's per-module recipe (``QuantizedModule.set_recipe``), used when
no ``fp_recipes.autocast`` is around the call; delayed-scaling amaxes are then reduced over
Megatron's amax group (tensor + data parallel, with context parallel) once per forward (when its
backward starts) and once per backward, by the core.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...modules.base import QuantizedModule
from .recipes import check_config, check_cuda_graphs, is_bf16_layer, recipe_from_config, recipe_from_payload

__all__ = ["MegatronQuantized", "RngNeutralQuantizedModule", "amax_group"]


class RngNeutralQuantizedModule(QuantizedModule):
    """:class:`QuantizedModule` whose construction leaves torch's CPU generator as it found it, so a
    Megatron layer built on it draws its weights from the same stream as Megatron's local layer
    (same seed, same weights)."""

    def __init__(self) -> None:
        rng = torch.get_rng_state()
        super().__init__()
        torch.set_rng_state(rng)


def amax_group(config: Any) -> Any:
    """Megatron's amax reduction group (tensor + data parallel, with context parallel), as TE uses."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_amax_reduction_group(
        with_context_parallel=True, tp_only_amax_red=bool(getattr(config, "tp_only_amax_red", False)))


class MegatronQuantized:
    """Mixin placed before the Megatron base class (and :class:`QuantizedModule` after it)."""

    bound_recipe: Any = None  # set on subclasses made by FpRecipesSpecProvider(recipe=...)

    def _setup_quant(self, config: Any) -> None:
        self._mcore_config = config
        self.layer_number: Optional[int] = None
        self.quant_config_key: Optional[str] = None
        if self.bound_recipe is not None and (getattr(config, "fp8", None) or getattr(config, "fp4", None)):
            raise ValueError("fp_recipes Megatron backend: a recipe was given to the spec provider and "
                             "config.fp8/config.fp4 is set too; give the recipe one way only")
        self._base_recipe = self.bound_recipe if self.bound_recipe is not None else recipe_from_config(config)
        check_config(config, quantized=self._base_recipe is not None)
        self._amax_group_cache: Any = ()
        self._set_recipe(self._base_recipe)

    # ------------------------------------------------------------------ which recipe
    def _set_recipe(self, recipe: Any) -> None:
        if recipe is not None:
            check_cuda_graphs(self._mcore_config)  # (every route: config.fp8/fp4, a bound recipe, quant_recipe)
            self._check_recipe(recipe)
        # the core's per-module recipe: used whenever no fp_recipes.autocast is around the call
        self.set_recipe(recipe, amax_reduction_group=self._amax_group())
        if recipe is not None:
            # Build the quantizers (and their delayed-scaling buffers) now, so a fresh model's
            # (sharded) state dict already has the keys a checkpoint loads into.
            self._sets_for(recipe, True)

    def _check_recipe(self, recipe: Any) -> None:
        """Hook for module-specific refusals."""

    def set_layer_number(self, layer_number: int) -> None:
        """Called by the transformer layer: applies ``first_last_layers_bf16``."""
        self.layer_number = layer_number
        if self.quant_config_key is None:
            bf16 = is_bf16_layer(self._mcore_config, layer_number)
            self._set_recipe(None if bf16 else self._base_recipe)

    def finish_init(self, quantization_config: Any) -> None:
        """Megatron's per-module ``quant_recipe`` hook: ``quantization_config.config`` is the payload
        ``{"recipe": <name>, <field>: <value>, ...}`` of the matcher that matched this module."""
        if quantization_config is None:
            return
        key = getattr(quantization_config, "config_key", None)
        path = getattr(getattr(quantization_config, "match_input", None), "module_path", "")
        recipe = recipe_from_payload(quantization_config.config, where=f"{key!r} matched by {path!r}")
        self.quant_config_key = key
        self._set_recipe(recipe)

    def _amax_group(self) -> Any:
        if self._amax_group_cache == ():
            self._amax_group_cache = amax_group(self._mcore_config)
        return self._amax_group_cache

    # ------------------------------------------------------------------ dist checkpoint
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        return self.own_qstate_keys(super().sharded_state_dict(prefix, sharded_offsets, metadata),
                                    prefix)

    def own_qstate_keys(self, sharded: dict, prefix: str, offsets: tuple = ()) -> dict:
        """Delayed-scaling tensors under a key of their own per layer (``...layer{N}.qstate_*``).
        Megatron stacks a layer's tensors across layers under one key; quantizer state may exist in
        some layers only (first/last BF16, quant_recipe) or differ in shape (amax_history_len)."""
        from megatron.core.dist_checkpointing import ShardedTensor

        tag = f"layer{self.layer_number}." if self.layer_number is not None else ""
        for key in [k for k in sharded if k[len(prefix):].startswith("qstate_")]:
            old = sharded[key]
            tensor = old.data if hasattr(old, "data") else old
            sharded[key] = ShardedTensor.from_rank_offsets(
                f"{prefix}{tag}{key[len(prefix):]}", tensor, *offsets,
                replica_id=getattr(old, "replica_id", 0), prepend_axis_num=len(offsets))
        return sharded

    # ------------------------------------------------------------------ state (Megatron's local
    # layers drop extra state; ours carries the recipe identity and NVFP4 stochastic-rounding state)
    def get_extra_state(self) -> Any:
        return QuantizedModule.get_extra_state(self)

    def set_extra_state(self, state: Any) -> None:
        QuantizedModule.set_extra_state(self, state)

    def quant_summary(self) -> str:
        """A short description of what this module runs (for logs and tests)."""
        r = self.recipe
        return "bf16" if r is None else type(r).__name__
