"""Recipes: validated, env-resolved descriptions of how a model's GEMMs are quantized."""

from __future__ import annotations

import os
from typing import Optional

from .base import CaseInsensitiveEnum, Format, Recipe
from .env import EnvVarDeprecationWarning, EnvVarError, UnknownEnvVarWarning
from .fp8 import AmaxComputeAlgo, DelayedScaling, Float8CurrentScaling
from .nvfp4 import ErrMode, FourOverSixScope, NVFP4BlockScaling
from .per_token import PerTokenFormat, PerTokenScaling, ScaleFormat

RECIPES = {cls.recipe_name: cls for cls in
           (DelayedScaling, Float8CurrentScaling, NVFP4BlockScaling, PerTokenScaling)}


def recipe_from_env(default: str = "delayed") -> Optional[Recipe]:
    """The recipe ``FP_RECIPES_RECIPE`` names (``default`` when unset), built now from the env.

    Returns None for ``none`` (quantization off). Values: none | delayed | current | nvfp4 |
    per_token, any case.
    """
    from .env import BY_NAME, warn_unknown_env

    var = BY_NAME["FP_RECIPES_RECIPE"]
    if str(default).lower() not in var.choices:
        raise ValueError(f"recipe_from_env(default={default!r}): allowed: {' | '.join(var.choices)}")
    raw = os.environ.get(var.name, "")
    name = var.parse(raw) if raw.strip() else var.parse(default)
    if name == "none":
        warn_unknown_env()
        return None
    return RECIPES[name]()


__all__ = [
    "AmaxComputeAlgo",
    "CaseInsensitiveEnum",
    "DelayedScaling",
    "EnvVarDeprecationWarning",
    "EnvVarError",
    "ErrMode",
    "Float8CurrentScaling",
    "FourOverSixScope",
    "Format",
    "NVFP4BlockScaling",
    "PerTokenFormat",
    "PerTokenScaling",
    "RECIPES",
    "Recipe",
    "ScaleFormat",
    "UnknownEnvVarWarning",
    "recipe_from_env",
]
