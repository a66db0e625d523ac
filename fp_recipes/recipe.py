"""TransformerEngine's ``transformer_engine.common.recipe`` names, so a TE script ports by its import line.

``from transformer_engine.common import recipe`` -> ``from fp_recipes import recipe``; then
``recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16)``,
``recipe.Float8CurrentScaling()``, ``recipe.NVFP4BlockScaling()`` build fp_recipes' own recipes (the
same field names and meanings; docs/transformer_engine.md lists every difference). TE recipes that
fp_recipes does not implement (MXFP8, FP8 block scaling) are names here too: building one raises an
error that says so and what to use instead, rather than an ImportError far from the cause.
"""

from __future__ import annotations

from typing import Any, NoReturn

from .recipes import DelayedScaling, Float8CurrentScaling, Format, NVFP4BlockScaling, PerTokenScaling, Recipe

__all__ = ["CustomRecipe", "DelayedScaling", "Float8BlockScaling", "Float8CurrentScaling", "Format",
           "MXFP8BlockScaling", "NVFP4BlockScaling", "PerTokenScaling", "Recipe"]


class _NotImplementedRecipe:
    """A TransformerEngine recipe fp_recipes does not implement: constructing it explains the choice."""

    _why = ""

    def __init__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"fp_recipes.recipe.{type(self).__name__}: {self._why}")


class MXFP8BlockScaling(_NotImplementedRecipe):
    _why = ("MXFP8 (E8M0 scales per 32 elements, Blackwell) is not implemented in fp_recipes. Use "
            "Float8CurrentScaling() (per-tensor FP8, every GPU from sm_89) or NVFP4BlockScaling().")


class Float8BlockScaling(_NotImplementedRecipe):
    _why = ("FP8 block scaling (1x128 / 128x128 scales) is not implemented in fp_recipes. Use "
            "Float8CurrentScaling() or, for one scale per token, PerTokenScaling(fmt='e4m3').")


class CustomRecipe(_NotImplementedRecipe):
    _why = ("custom quantizer factories are not supported; every fp_recipes recipe answers "
            "recipe.plan(QuantizerRole(...)) with a QuantizerSpec (see docs/recipes.md).")
