"""``convert_model``: swap ``torch.nn.Linear`` modules of any model for ``fp_recipes.Linear``, and
Hugging Face fused MoE experts for grouped GEMMs (``hf_moe.GroupedExperts``).

The new modules hold the *same* parameter objects (no copy), so optimizers built before the swap keep
working, and outside autocast the model computes exactly what it computed before. Hooks registered on
the original modules (forward, pre-forward, backward, state-dict) move with them."""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Optional

import torch
from torch.nn.modules.module import _WrappedHook

__all__ = ["convert_model", "default_module_filter"]


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


ModuleFilter = Callable[[torch.nn.Module, str], bool]


def default_module_filter(model: torch.nn.Module) -> ModuleFilter:
    """The filter :func:`convert_model` uses when given none: convert everything except

    * the output head (``model.get_output_embeddings()`` of a Hugging Face model, else a child named
      ``lm_head``): the logits feed a softmax over the vocabulary, whose error FP8/NVFP4 would raise
      for little speed (one GEMM per model), and its size is often not a multiple of 16;
    * routers: ``nn.Linear`` children of a module that also holds ``experts`` (e.g. Qwen2-MoE's
      ``shared_expert_gate``, older Mixtral's ``gate``): a top-k over their outputs picks the experts, so
      a quantization error changes which experts run, and they are tiny (out_features = E or 1).

    (transformers 5's routers are ``*TopKRouter`` modules with a raw weight, never converted.) This is
    what Megatron/TransformerEngine and DeepSeek-V3's FP8 training keep in high precision and what
    torchtitan's float8 filter skips by default. Compose it with your own:
    ``base = default_module_filter(model); convert_model(model, module_filter_fn=lambda m, fqn:
    base(m, fqn) and ...)``."""
    keep = set()
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if head is None and isinstance(getattr(model, "_modules", {}).get("lm_head"), torch.nn.Module):
        head = model._modules["lm_head"]
    for fqn, module in model.named_modules():
        if module is head and head is not None:
            keep.add(fqn)
        if "experts" in module._modules:
            for name, child in module.named_children():
                if type(child) is torch.nn.Linear:
                    keep.add(f"{fqn}.{name}" if fqn else name)
    frozen = frozenset(keep)

    def module_filter_fn(module: torch.nn.Module, fqn: str) -> bool:
        return fqn not in frozen

    module_filter_fn.keeps = frozen  # type: ignore[attr-defined]  (for inspection and tests)
    return module_filter_fn


def convert_model(model: torch.nn.Module, recipe: Any = None,
                  module_filter_fn: Optional[ModuleFilter] = None) -> torch.nn.Module:
    """Convert ``model`` in place for fp_recipes; return it.

    * every ``torch.nn.Linear`` becomes ``fp_recipes.Linear`` (same parameters, hooks and attributes);
    * every Hugging Face fused experts module (3-D ``gate_up_proj``/``down_proj``, transformers 5's
      Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3, ...) becomes :class:`~fp_recipes.integrations.hf_moe.GroupedExperts`
      (grouped GEMMs with token permutation; same parameters and state-dict keys). Expert modules of a
      layout it cannot reproduce exactly stay as they are, with a warning saying why.

    ``module_filter_fn(module, fqn) -> bool`` (torchao's name and convention) is asked for each such
    module; False keeps it in high precision. Without one, :func:`default_module_filter` keeps the
    output head and MoE routers in high precision. ``recipe``, if given, is attached as
    ``model.fp_recipe`` so training code can do ``with fp_recipes.autocast(recipe=model.fp_recipe)``;
    the quantization itself always happens under :func:`fp_recipes.autocast`, never implicitly.
    Subclasses of ``nn.Linear`` with extra behaviour (e.g. ``NonDynamicallyQuantizableLinear`` inside
    ``nn.MultiheadAttention``, which accesses ``.weight`` directly) are left alone."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert_model needs a torch.nn.Module, got {type(model).__name__}")
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise TypeError(f"convert_model(module_filter_fn=...) must be a callable (module, fqn) -> bool, got "
                        f"{type(module_filter_fn).__name__}")
    if recipe is not None:
        from ..recipes import Recipe

        if not isinstance(recipe, Recipe):
            raise TypeError(f"convert_model(recipe=...) needs an fp_recipes recipe, got {type(recipe).__name__}")
    keep = module_filter_fn if module_filter_fn is not None else default_module_filter(model)
    converted = _convert_one(model, "", keep)
    if converted is not None:
        model = converted
    else:
        _convert_children(model, "", keep)
    if recipe is not None:
        model.fp_recipe = recipe
    return model


def _convert_one(module: torch.nn.Module, fqn: str, module_filter_fn: ModuleFilter) -> Optional[torch.nn.Module]:
    """The replacement for ``module``, or None to keep it (and look inside it)."""
    from .hf_moe import GroupedExperts, fused_experts_problem, is_fused_experts

    if type(module) is torch.nn.Linear:
        return _swap(module) if _wanted(module_filter_fn, module, fqn) else None
    if is_fused_experts(module) and not isinstance(module, GroupedExperts):
        if not _wanted(module_filter_fn, module, fqn):
            return None
        problem = fused_experts_problem(module)
        if problem is None:
            return GroupedExperts(module)
        warnings.warn(f"convert_model: {fqn or 'the model'} ({type(module).__name__}) stays in high precision: "
                      f"{problem}. Pass module_filter_fn returning False for it to silence this.", stacklevel=3)
    return None


def _wanted(module_filter_fn: ModuleFilter, module: torch.nn.Module, fqn: str) -> bool:
    answer = module_filter_fn(module, fqn)
    if not isinstance(answer, bool):
        raise TypeError(f"convert_model: module_filter_fn must return a bool, returned {answer!r} for {fqn!r}")
    return answer


def _convert_children(parent: torch.nn.Module, prefix: str, module_filter_fn: ModuleFilter) -> None:
    for name, child in list(parent.named_children()):
        fqn = f"{prefix}.{name}" if prefix else name
        if isinstance(child, torch.nn.MultiheadAttention):
            continue  # uses its out_proj weights through F.multi_head_attention_forward
        new = _convert_one(child, fqn, module_filter_fn)
        if new is not None:
            setattr(parent, name, new)
        else:
            _convert_children(child, fqn, module_filter_fn)
