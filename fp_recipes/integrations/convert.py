"""``convert_model``: swap ``torch.nn.Linear`` modules of any model for ``fp_recipes.Linear``.

The new modules hold the *same* parameter objects (no copy), so optimizers built before the swap keep
working, and outside autocast the model computes exactly what it computed before."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

__all__ = ["convert_model"]


def _swap(linear: torch.nn.Linear) -> torch.nn.Module:
    from ..modules.base import QuantizedModule
    from ..modules.linear import Linear

    new = Linear.__new__(Linear)
    QuantizedModule.__init__(new)  # quantizer state only; the parameters are the old ones
    new.in_features = linear.in_features
    new.out_features = linear.out_features
    new.weight = linear.weight
    if linear.bias is not None:
        new.bias = linear.bias
    else:
        new.register_parameter("bias", None)
    new.train(linear.training)
    return new


def convert_model(model: torch.nn.Module, recipe: Any = None,
                  module_filter_fn: Optional[Callable[[torch.nn.Module, str], bool]] = None
                  ) -> torch.nn.Module:
    """Replace every ``torch.nn.Linear`` in ``model`` (in place) by ``fp_recipes.Linear``; return it.

    ``module_filter_fn(module, fqn) -> bool`` (torchao's convention) decides per module; False keeps
    the torch module (e.g. the LM head). ``recipe``, if given, is attached as ``model.fp_recipe`` so
    training code can do ``with fp_recipes.autocast(recipe=model.fp_recipe)``; the quantization
    itself always happens under :func:`fp_recipes.autocast`, never implicitly. Subclasses of
    ``nn.Linear`` with extra behaviour (e.g. ``NonDynamicallyQuantizableLinear`` inside
    ``nn.MultiheadAttention``, which accesses ``.weight`` directly) are left alone."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert_model needs a torch.nn.Module, got {type(model).__name__}")
    if recipe is not None:
        from ..recipes import Recipe

        if not isinstance(recipe, Recipe):
            raise TypeError(f"convert_model(recipe=...) needs an fp_recipes recipe, got {type(recipe).__name__}")
    if type(model) is torch.nn.Linear:
        if module_filter_fn is None or module_filter_fn(model, ""):
            model = _swap(model)
    else:
        _convert_children(model, "", module_filter_fn)
    if recipe is not None:
        model.fp_recipe = recipe
    return model


def _convert_children(parent: torch.nn.Module, prefix: str,
                      module_filter_fn: Optional[Callable[[torch.nn.Module, str], bool]]) -> None:
    for name, child in list(parent.named_children()):
        fqn = f"{prefix}.{name}" if prefix else name
        if type(child) is torch.nn.Linear:
            if module_filter_fn is None or module_filter_fn(child, fqn):
                setattr(parent, name, _swap(child))
        elif isinstance(child, torch.nn.MultiheadAttention):
            continue  # uses its out_proj weights through F.multi_head_attention_forward
        else:
            _convert_children(child, fqn, module_filter_fn)
