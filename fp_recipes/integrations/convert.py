"""``convert_model``: swap ``torch.nn.Linear`` modules of any model for ``fp_recipes.Linear``.

The new modules hold the *same* parameter objects (no copy), so optimizers built before the swap keep
working, and outside autocast the model computes exactly what it computed before. Hooks registered on
the original modules (forward, pre-forward, backward, state-dict) move with them."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch
from torch.nn.modules.module import _WrappedHook

__all__ = ["convert_model"]


# nn.Module's hook registries: carried over as the *same* dict objects, so handles returned by
# register_*_hook on the original module still remove the hook from the converted one
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_pre_hooks",
               "_backward_hooks", "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


def carry_module_state(old: torch.nn.Module, new: torch.nn.Module) -> None:
    """Give ``new`` what was registered on ``old``: its parameters and buffers (the same objects), its
    hooks (same order, handles still work; hooks bound to ``old`` are rebound to ``new``), the training
    flag and plain (non-callable) attributes ``new`` lacks, e.g. tags set by a training framework."""
    for name, p in old._parameters.items():
        new.register_parameter(name, p)
    for name, b in old._buffers.items():
        new.register_buffer(name, b, persistent=name not in old._non_persistent_buffers_set)
    for name, m in old._modules.items():
        new.add_module(name, m)
    for name in _HOOK_DICTS:
        theirs = old.__dict__.get(name)
        if theirs is None:
            continue
        theirs.update(new.__dict__[name])  # the new module's own hooks (if any) after the original's
        for hook in theirs.values():
            if isinstance(hook, _WrappedHook) and hook.with_module and hook.module() is old:
                hook.module = weakref.ref(new)
        object.__setattr__(new, name, theirs)
    if old._backward_hooks or old._backward_pre_hooks:
        object.__setattr__(new, "_is_full_backward_hook", old._is_full_backward_hook)
    for name, value in old.__dict__.items():
        if name not in new.__dict__ and not callable(value):
            object.__setattr__(new, name, value)  # e.g. weight_norm's computed .weight, framework tags
    new.train(old.training)


def _swap(linear: torch.nn.Linear) -> torch.nn.Module:
    from ..modules.base import QuantizedModule
    from ..modules.linear import Linear

    new = Linear.__new__(Linear)
    QuantizedModule.__init__(new)  # quantizer state only; the parameters are the old ones
    new.in_features = linear.in_features
    new.out_features = linear.out_features
    carry_module_state(linear, new)
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
