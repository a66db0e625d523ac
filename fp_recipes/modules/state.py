"""The checkpointed quantizer state of a module: names, the recipe it belongs to, validation.

Delayed-scaling tensors are buffers named ``qstate_<tensor><gemm>_<attr>`` (``attr``: ``scale`` or
``amax_history``); the extra state names the recipe they belong to (its class and the fields that
decide the state's shape), so a checkpoint is never applied to another recipe's quantizers.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Optional, Tuple

import torch

from ..quantizers.roles import ModuleKind, QuantizerRole, ScalingKind, TensorKind

__all__ = ["PREFIX", "buffer_name", "parse_name", "identity", "expected_shapes", "describe", "EXTRA_VERSION"]

PREFIX = "qstate_"
EXTRA_VERSION = 2
_ATTRS = ("scale", "amax_history")
_TENSORS = (TensorKind.ACTIVATION, TensorKind.WEIGHT, TensorKind.GRAD_OUTPUT)
_NAME = re.compile(r"^qstate_(%s)(\d+)_(%s)$" % ("|".join(t.value for t in _TENSORS), "|".join(_ATTRS)))
#: recipe fields that decide the shape of its state (the rest may change between runs)
_SHAPE_FIELDS = ("amax_history_len",)


def buffer_name(tensor: TensorKind, gemm_index: int, attr: str) -> str:
    return f"{PREFIX}{tensor.value}{gemm_index}_{attr}"


def parse_name(name: str, num_gemms: int) -> Optional[Tuple[TensorKind, int, str]]:
    """(tensor, gemm, attr) of a valid state buffer name for a module of ``num_gemms`` GEMMs, else None."""
    m = _NAME.match(name)
    if m is None or int(m.group(2)) >= num_gemms or m.group(2) != str(int(m.group(2))):
        return None
    return TensorKind(m.group(1)), int(m.group(2)), m.group(3)


def identity(recipe: Any) -> Dict[str, Any]:
    """What a checkpoint's state must agree on with the recipe it is applied to."""
    out: Dict[str, Any] = {"recipe": type(recipe).__name__}
    for f in _SHAPE_FIELDS:
        if f in type(recipe).model_fields:
            out[f] = getattr(recipe, f)
    return out


def describe(ident: Optional[Dict[str, Any]], recipe_repr: Optional[str] = None) -> str:
    if recipe_repr:
        return recipe_repr
    if not ident:
        return "an unknown recipe"
    fields = ", ".join(f"{k}={v!r}" for k, v in ident.items() if k != "recipe")
    return f"{ident['recipe']}({fields})"


def expected_shapes(recipe: Any, kind: ModuleKind, num_gemms: int) -> Dict[str, Tuple[int, ...]]:
    """The state buffers a module of ``kind`` has under ``recipe``, with their shapes."""
    out: Dict[str, Tuple[int, ...]] = {}
    for g in range(num_gemms):
        for tensor in _TENSORS:
            spec = recipe.plan(QuantizerRole(kind, tensor, g, None))
            if spec.scaling is ScalingKind.DELAYED:
                out[buffer_name(tensor, g, "scale")] = ()
                out[buffer_name(tensor, g, "amax_history")] = (int(spec.amax_history_len),)
    return out


def recipe_from_extra(extra: Dict[str, Any]) -> Optional[Any]:
    """The recipe a version-2 extra state was saved under (None when it cannot be rebuilt)."""
    config = extra.get("recipe_config")
    if not config:
        return None
    from ..recipes import Recipe

    try:
        return Recipe.from_config(config)
    except (ValueError, TypeError):
        return None


def shape_errors(tensors: Dict[str, torch.Tensor], expected: Dict[str, Tuple[int, ...]], where: str) -> list:
    """Messages for every tensor that is not in ``expected`` or has another shape."""
    errors = []
    for name, t in tensors.items():
        if name not in expected:
            errors.append(f"{where}: checkpoint state {name} does not exist under this recipe")
        elif tuple(t.shape) != expected[name]:
            errors.append(f"{where}: checkpoint state {name} has shape {tuple(t.shape)} but this recipe's "
                          f"quantizer has {expected[name]} (different amax_history_len?)")
    return errors
