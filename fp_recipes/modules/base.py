"""The module mixin every fp_recipes module builds on: its quantizer sets per recipe and their state.

:class:`QuantizedModule` -- an ``nn.Module`` mixin that builds its quantizers from ``recipe.plan(role)`` for
each role of each of its GEMMs (one set per recipe used), keeps delayed-scaling state (amax history, scale)
as module buffers so it is in ``state_dict``, keeps NVFP4 stochastic-rounding state (seed, offset) in the
module's extra state, and hands delayed-scaling quantizers to the amax reducer (one all-reduce after the
forward, one after the backward). The quantize + GEMM autograd core it calls is ``linear_function.py``
(its names are re-exported here).

A module quantizes under the recipe of this thread's innermost ``fp_recipes.autocast``; outside any
autocast, under its own ``recipe`` attribute when set; otherwise it calls ``torch.nn.functional``
directly, so outputs and gradients are exactly torch's. What a forward quantized with is captured:
its backward and any activation-checkpointing recompute of it use that (``replay.py``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import _trace_ids
from ..gemm.fp8 import register_traced_kernels
from ..ops.workspace import stream_capturing
from ..quantizers.float8 import load_cuda_casts
from ..quantizers.roles import ModuleKind, ScalingKind
from . import replay
from . import state as qstate
from ..autocast import AutocastState, _local as _autocast_tls, _resolve_recipe, get_autocast_state
from .weight_cache import AUTO, WeightCache, cache_mode
from .weight_columnwise import check_policy
from .linear_function import (GemmQuantizers, QuantizedLinearFunction, _INPUT_DTYPES, _OPERANDS,  # noqa: F401
                              _feature_mismatch, _fresh_view, amp_cast, backward_operands, check_input_dtype,
                              columnwise_only, pad_tokens, quantize_operand, quantize_weight, quantized_linear,
                              start_backward, token_multiple, torch_autocast_backward, torch_autocast_dtype,
                              torch_autocast_forward)

__all__ = ["backward_operands", "check_input_dtype", "GemmQuantizers", "pad_tokens", "token_multiple",
           "QuantizedLinearFunction", "QuantizedModule", "quantized_linear", "quantize_operand",
           "torch_autocast_dtype", "torch_autocast_forward", "torch_autocast_backward", "amp_cast"]

# Linear's shortcut (QuantizedModule._linear_shortcut): the C calls it makes instead of Python helpers
_LINEAR_APPLY = torch._C._FunctionBase.__dict__["apply"].__get__(None, QuantizedLinearFunction)
_functorch_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
_graph_task_id = torch._C._current_graph_task_id
_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_grad_enabled = torch.is_grad_enabled
_inference_mode = torch.is_inference_mode_enabled
#: the QuantizedModule methods the shortcut inlines
_SHORTCUT_INLINES = ("gemm_quantizers", "check_input", "weight_cache_for", "_linear_shortcut")


# ----------------------------------------------------------------------------------------------
# module mixin: quantizer sets per recipe, state in state_dict
# ----------------------------------------------------------------------------------------------

_STATE_PREFIX = qstate.PREFIX
_buffer_name = qstate.buffer_name


def _delayed_attrs(q: Any) -> Tuple[str, ...]:
    return tuple(a for a in ("scale", "amax_history") if isinstance(getattr(q, a, None), torch.Tensor))


class _RecipeSets:
    """One recipe's quantizer sets (built on its first use, kept while other recipes are used)."""

    __slots__ = ("recipe", "sets", "module_sets", "has_tensors")

    def __init__(self, recipe: Any, sets: List[GemmQuantizers]) -> None:
        self.recipe = recipe
        self.sets = sets
        # the same quantizers, for calls under the module's own recipe (no autocast around them)
        self.module_sets = [qs.variant(flush_forward=True) for qs in sets]
        self.has_tensors = any(_delayed_attrs(q) for qs in sets for q in qs.quantizers.values() if q is not None)

    def quantizers(self):
        for g, qs in enumerate(self.sets):
            for tensor, q in qs.quantizers.items():
                if q is not None:
                    yield g, tensor, q


class QuantizedModule(torch.nn.Module):
    """Mixin for modules whose GEMMs are quantized under :func:`fp_recipes.autocast`.

    Subclasses set ``module_kind`` and ``num_gemms`` and call :meth:`gemm_quantizers` in forward.

    * Recipe: this thread's innermost ``fp_recipes.autocast`` decides (``enabled=False``: no
      quantization); outside any autocast, ``self.recipe`` (default None: plain torch), with
      ``self.amax_reduction_group`` (see :meth:`set_recipe`).
    * One quantizer set per recipe used, built on first use and kept: a call under another recipe
      (an NVFP4 probe inside delayed-scaling training) leaves every other recipe's state as it was.
    * Checkpointed state (``state_dict``): the delayed-scaling buffers ``qstate_*`` of the *state
      recipe* (the last recipe used that has delayed-scaling state; else the last recipe used), the
      SR seeds/offsets of that recipe's quantizers and the recipe's identity (extra state)."""

    module_kind: ModuleKind = ModuleKind.LINEAR
    #: whether :meth:`_linear_shortcut` may stand in for the methods it inlines (a subclass that
    #: overrides one of them takes the general path)
    _shortcut_ok = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._shortcut_ok = all(getattr(cls, name) is getattr(QuantizedModule, name) for name in _SHORTCUT_INLINES)

    def __init__(self) -> None:
        super().__init__()
        _trace_ids.register(self)  # (torch < 2.13: _prepare_for_trace_by_id finds the module by id)
        # Stochastic-rounding seeds come from torch's default generator, like weight init: the same
        # torch.manual_seed builds the same random streams (deepcopy and state_dict keep them).
        self._sr_seed = int(torch.randint(0, 2**62, (), dtype=torch.int64).item())
        self.recipe: Any = None
        self.amax_reduction_group: Any = None
        self._by_recipe: Dict[Any, _RecipeSets] = {}
        self._last: Optional[Tuple[Any, bool, List[GemmQuantizers]]] = None  # the fast path's cache
        self._quantizer_sets: Optional[List[GemmQuantizers]] = None
        self._state_recipe: Optional[_RecipeSets] = None
        self._state_buffer_names: List[str] = []
        self._pending: Optional[Dict[str, Any]] = None  # loaded state waiting for its recipe
        self._records = replay.RecordQueue()
        self._loading = False
        # torch.compile: (recipe, sets) prepared for tracing [under an autocast, under the module recipe]:
        # by a trace (_traced_sets), and by init_quantizer_state (_compile_ready, read first by a trace)
        self._traced_sets: List[Optional[Tuple[Any, List[GemmQuantizers]]]] = [None, None]
        self._compile_ready: List[Optional[Tuple[Any, List[GemmQuantizers]]]] = [None, None]
        # quantized weights reused while the weights are unchanged (weight_cache.py)
        self.cache_quantized_weights = True
        self._weight_cache = WeightCache()
        self.weight_columnwise_copy = "auto"
        self._sharded_params = False  # a parameter was replaced by a DTensor (FSDP2, tensor parallel)

    @property
    def num_gemms(self) -> int:
        return 1

    #: where dgrad's columnwise FP8 copy of a weight comes from: "save" (cast in the forward and held until the
    #: backward), "recast" (cast in the backward from the weight, the same bytes: less memory, one more read of
    #: the weight) or "auto" (recast when the layer has more outputs than the call has tokens); checked when
    #: set (``__setattr__``), a plain attribute when read (the forward reads it). See weight_columnwise.py.
    weight_columnwise_copy: str = "auto"
    #: whether this module kind can make its weights' columnwise copies in the backward (weight_columnwise.py)
    _recasts_weight_copies = True

    def __setattr__(self, name: str, value: Any) -> None:
        # FSDP2 (fully_shard) replaces the parameters by sharded DTensors, and swaps in the unsharded
        # parameter for each forward and backward, refilled in place by every all-gather without a
        # version bump: the automatic weight cache cannot see those refills, so it stays off here
        if isinstance(value, torch.Tensor) and type(value).__name__ == "DTensor":
            self.__dict__["_sharded_params"] = True
        elif name == "weight_columnwise_copy":
            value = check_policy(value, type(self).__name__, self._recasts_weight_copies)
        super().__setattr__(name, value)

    def train(self, mode: bool = True) -> "QuantizedModule":
        if not mode:
            self.clear_weight_cache()
        return super().train(mode)

    def clear_weight_cache(self) -> None:
        """Drop the cached quantized weights (the next forward quantizes the weights again)."""
        cache = self.__dict__.get("_weight_cache")
        if cache is not None:
            cache.clear()

    def weight_cache_for(self, is_first_microbatch: Optional[bool] = None) -> Tuple[Optional[WeightCache], str]:
        """(the weight cache for this call or None, its mode) from TransformerEngine's
        ``is_first_microbatch`` (None: automatic; True: quantize and cache; False: reuse). None
        outside training mode (the module then keeps no copy), under ``torch.inference_mode()`` and
        torch.compile, with ``cache_quantized_weights = False``, and in automatic mode once a parameter
        was sharded (FSDP2): see ``weight_cache.py``."""
        cache, mode = self.weight_cache_during_capture(is_first_microbatch)
        if cache is not None and stream_capturing():
            # A CUDA graph captured around this call (torch.cuda.graph): a hit would leave the weight's cast out
            # of the graph, whose replays would then read a copy that the next optimizer step makes stale (and
            # the cache frees). Cast inside the graph. (make_graphed_callables decides the cache itself, with
            # weight_cache_during_capture.)
            return None, mode
        return cache, mode

    def weight_cache_during_capture(self, is_first_microbatch: Optional[bool] = None
                                    ) -> Tuple[Optional[WeightCache], str]:
        """:meth:`weight_cache_for` without its refusal inside a CUDA graph capture: for
        ``make_graphed_callables``, whose graphs keep the cached copy alive and replay the reuse
        (``fp8_weight_caching``, ``is_first_microbatch``)."""
        mode = AUTO if is_first_microbatch is None else cache_mode(is_first_microbatch)
        if torch.compiler.is_compiling():
            return None, mode
        cache = self.__dict__.get("_weight_cache")
        if cache is None:
            return None, mode
        if not self.training or not self.cache_quantized_weights or torch.is_inference_mode_enabled():
            cache.clear()
            return None, mode
        if mode == AUTO and self._sharded_params:
            return None, mode
        return cache, mode

    @property
    def quantizer_sets(self) -> Optional[List[GemmQuantizers]]:
        """The quantizers of the last recipe used (None before the first quantized forward)."""
        return self._quantizer_sets

    def recipe_state(self, recipe: Any) -> Optional[object]:
        """This module's quantizers and scaling state for ``recipe`` (an opaque handle, None before its
        first use): a holder of the handle can tell later whether the state was rebuilt
        (``reset_quantizer_state()``), as ``make_graphed_callables`` does."""
        return self._by_recipe.get(recipe)

    def set_recipe(self, recipe: Any, amax_reduction_group: Any = None) -> "QuantizedModule":
        """Quantize with ``recipe`` whenever this thread is inside no ``fp_recipes.autocast`` (an
        explicit autocast, enabled or not, overrides it). Delayed-scaling forward amaxes are then
        reduced over ``amax_reduction_group`` and the scales updated when the backward of that
        forward starts (there is no autocast exit to do it). ``None`` turns it off."""
        if recipe is not None:

            recipe = _resolve_recipe(recipe)
        self.recipe = recipe
        self.amax_reduction_group = amax_reduction_group
        return self

    # ------------------------------------------------------------------ per call
    def _call_recipe(self, state: Optional[AutocastState]) -> tuple:
        """(recipe, module_mode, amax reduction group) of this call: inside an autocast (``state`` with a
        depth) its recipe (None when disabled) and group, else the module's own (``module_mode``)."""
        if state is not None and state.depth:
            return (state.recipe if state.enabled else None), False, state.amax_reduction_group
        return self.recipe, True, self.amax_reduction_group

    def gemm_quantizers(self) -> Optional[List[GemmQuantizers]]:
        """The quantizers for this call (None: no quantization, plain torch).

        A recompute under activation checkpointing gets what its original forward used."""
        if torch.compiler.is_compiling():
            return self._traced_gemm_quantizers()
        if self._records and replay.in_backward():
            record = self._records.pop()
            if record is not None:
                return replay.replay_sets(record, lambda qs, quantizers: qs.variant(
                    quantizers, replay=True, record=None, weight_recast=record.weight_recast.get(id(qs.quantizers))))
        recipe, module_mode, group = self._call_recipe(get_autocast_state())
        if recipe is None:
            sets = None
        else:
            last = self._last
            if last is not None and last[0] is recipe and last[1] is module_mode:
                sets = last[2]
            else:
                sets = self._sets_for(recipe, module_mode)
            if sets[0].amax_reduction_group is not group:
                for qs in sets:
                    qs.amax_reduction_group = group
        if replay.may_be_recomputed(self.training):
            record = replay.CallRecord(sets)
            if sets is not None:
                # this call's own set objects hold the record (through the autograd node's ctx)
                sets = [qs.variant(record=record) for qs in sets]
            self._records.push(record, weak=torch.is_grad_enabled() and sets is not None)
        return sets

    def _linear_shortcut(self, x: torch.Tensor, is_first_microbatch: Optional[bool], norm: bool = False) -> Any:
        """The forward of a Linear (``norm``: a LayerNormLinear, ``(out, ln_out)``) in the common eager
        case, with what :meth:`gemm_quantizers`, :meth:`check_input`, :meth:`weight_cache_for` and
        :func:`quantized_linear` do inlined; None, having done nothing, when a condition fails (the
        caller then takes the general path, which decides everything afresh):

        * not traced by torch.compile (the one compile check of an eager call);
        * this class and instance use the base class's ``gemm_quantizers``, ``check_input`` and
          ``weight_cache_for`` (``make_graphed_callables`` sets its own on the instance), and the
          parameters are registered ones named ``weight`` and ``bias``;
        * no checkpoint recompute (no record waiting, or not inside a backward) and no record to make
          (grad enabled with no saved-tensors hook, or grad disabled outside a training module /
          inside inference mode): see ``replay.py``;
        * no recipe (plain ``F.linear``), or a recipe to quantize with whose sets the previous call
          found (``self._last``: the same recipe object, under an autocast or the module's own recipe
          alike; cleared by a load waiting for its recipe and by ``reset_quantizer_state``), and an
          FP32/BF16/FP16 input."""
        if not self._shortcut_ok or torch.compiler.is_compiling():
            return None
        d = self.__dict__
        if "gemm_quantizers" in d or "weight_cache_for" in d or "check_input" in d or "_weight_cache" not in d:
            return None
        if self._records._items and _graph_task_id() != -1:
            return None
        stack = _autocast_tls.stack
        recipe, module_mode, group = self._call_recipe(stack[-1] if stack else None)
        if _grad_enabled():
            if _top_hooks(False) is not None:
                return None
        elif self.training and not _inference_mode():
            return None
        params = self._parameters
        if "weight" not in params or "bias" not in params:
            return None
        weight = params["weight"]
        bias = params["bias"]
        if recipe is None:  # plain torch
            if norm:
                ln_out = x = self.normalize(x)
                return torch.nn.functional.linear(x, weight, bias), ln_out
            return torch.nn.functional.linear(x, weight, bias)
        last = self._last
        if last is None or last[0] is not recipe or last[1] is not module_mode or weight is None \
                or x.dtype not in _INPUT_DTYPES or x.ndim == 0:
            return None
        sets = last[2]
        qs = sets[0]
        if qs.amax_reduction_group is not group:
            for s in sets:
                s.amax_reduction_group = group
        # (weight_cache_for)
        mode = AUTO if is_first_microbatch is None else cache_mode(is_first_microbatch)
        cache = d["_weight_cache"]
        if cache is not None:
            if not self.training or not self.cache_quantized_weights or _inference_mode():
                cache.clear()
                cache = None
            elif mode == AUTO and self._sharded_params:
                cache = None
            elif stream_capturing():
                cache = None  # (a CUDA graph captured around this call: cast inside it, see weight_cache_for)
        if norm:
            ln_out = x = self.normalize(x)
        # (quantized_linear)
        if x.shape[-1] != weight.shape[1]:
            _feature_mismatch(x, weight)
        ndim = x.ndim
        x2 = x if ndim == 2 else x.reshape(-1, x.shape[-1])
        tokens = x2.shape[0]
        if qs.token_multiple != 1:
            x2 = pad_tokens(x2, qs.token_multiple)
        copy_policy = self.weight_columnwise_copy
        if _functorch_active():
            y = QuantizedLinearFunction.apply(x2, weight, bias, qs, cache, mode, copy_policy, None)
        else:  # what Function.apply runs then (QuantizedLinearFunction defines no setup_context)
            y = _LINEAR_APPLY(_unwrap_if_dead(x2), _unwrap_if_dead(weight),
                              None if bias is None else _unwrap_if_dead(bias), qs, cache, mode, copy_policy, None)
        if ndim != 2 or y.shape[0] != tokens:
            y = _fresh_view(y[:tokens] if y.shape[0] != tokens else y, (*x.shape[:-1], weight.shape[0]))
        return (y, ln_out) if norm else y

    def _traced_gemm_quantizers(self) -> Optional[List[GemmQuantizers]]:
        """:meth:`gemm_quantizers` as torch.compile traces it.

        The quantizer sets are built (or found) by :func:`_prepare_for_trace`, which runs eagerly
        while the graph is traced (building creates state tensors and registers buffers, which a
        graph cannot do), then read back through the module so the graph guards on them: another
        recipe, a reset state or a rebuilt set compiles again. No checkpoint record is made:
        torch.compile's own activation checkpointing recomputes inside the graph, where the state
        updates are not repeated."""

        recipe, module_mode, group = self._call_recipe(get_autocast_state())
        if recipe is None:
            return None
        _require_compile_support()
        slot = 1 if module_mode else 0
        entry = self._compile_ready[slot]
        if entry is None or entry[0] is not recipe:
            # Not made ready by init_quantizer_state: prepare now. The graph then holds this module's
            # identity (torch.compile guards on the prepare's arguments); a module made ready before
            # tracing shares its graph with every module of the same shape (see init_quantizer_state).
            if _ID_CONSTANTS:
                # older Dynamo hands a constant function only constants: the objects by id (_trace_ids)
                _prepare_for_trace_by_id(id(self), id(recipe), module_mode)
            else:
                _prepare_for_trace(self, recipe, module_mode)
            entry = self._traced_sets[slot]  # first read in this trace: what prepare wrote
            if entry is None or entry[0] is not recipe:
                raise RuntimeError("fp_recipes: quantizer sets were not prepared for tracing")
        sets = entry[1]
        for qs in sets:
            if qs.amax_reduction_group is not group:
                qs.amax_reduction_group = group
        return sets

    def check_input(self, x: torch.Tensor, sets: Optional[List[GemmQuantizers]]) -> None:
        """FP32/BF16/FP16 input when quantizing (before any cast could hide a wrong dtype)."""
        if sets is not None and x.dtype not in _INPUT_DTYPES:
            recipe = self._quantizer_recipe_name()
            check_input_dtype(type(self).__name__, x, recipe)

    def _quantizer_recipe_name(self) -> str:
        last = self._last
        return type(last[0]).__name__ if last is not None else ""

    # ------------------------------------------------------------------ building
    def _sets_for(self, recipe: Any, module_mode: bool) -> List[GemmQuantizers]:
        entry = self._by_recipe.get(recipe)
        if entry is None:
            entry = self._build(recipe)
        if self._pending is not None:
            self._apply_pending(entry)
        if entry is not self._state_recipe and (entry.has_tensors or self._state_recipe is None
                                                or not self._state_recipe.has_tensors):
            self._make_state_recipe(entry)
        sets = entry.module_sets if module_mode else entry.sets
        self._quantizer_sets = entry.sets
        self._last = (recipe, module_mode, sets)
        return sets

    def _build(self, recipe: Any) -> _RecipeSets:
        device = self._param_device()
        # built outside inference mode: state created by a first forward under torch.inference_mode()
        # must stay usable for training
        with torch.inference_mode(False):
            sets = [GemmQuantizers.from_recipe(recipe, self.module_kind, g) for g in range(self.num_gemms)]
            for g, qs in enumerate(sets):
                for tensor, q in qs.quantizers.items():
                    if q is None:
                        continue
                    if hasattr(q, "seed") and isinstance(getattr(q, "seed"), int):
                        # distinct, reproducible SR streams per module, GEMM and operand
                        q.seed = (self._sr_seed + 4 * g + _OPERANDS.index(tensor) + 1) % 2**64
                    if device is not None:
                        for attr in _delayed_attrs(q):
                            buf = getattr(q, attr)
                            if buf.device != device:
                                setattr(q, attr, buf.to(device))
        entry = _RecipeSets(recipe, sets)
        self._by_recipe[recipe] = entry
        return entry

    def _make_state_recipe(self, entry: _RecipeSets) -> None:
        """Register ``entry``'s delayed-scaling tensors as the ``qstate_*`` buffers."""
        for name in self._state_buffer_names:
            self._buffers.pop(name, None)
        self._state_buffer_names = []
        for g, tensor, q in entry.quantizers():
            for attr in _delayed_attrs(q):
                name = _buffer_name(tensor, g, attr)
                self.register_buffer(name, getattr(q, attr), persistent=True)
                self._state_buffer_names.append(name)
        self._state_recipe = entry

    def init_quantizer_state(self, recipe: Any) -> "QuantizedModule":
        """Build ``recipe``'s quantizer state now, as the first forward under it would (nothing is
        quantized or recorded), so ``state_dict()`` already has that state's keys.

        ``torch.distributed.checkpoint.load`` fills only the keys the destination state dict has: a
        fresh model would otherwise silently skip the checkpoint's delayed-scaling buffers and fail
        on the structure of its extra state. Call it on every module before ``dcp.load``."""

        recipe = _resolve_recipe(recipe)
        if recipe is not None:
            self._sets_for(recipe, False)
            # ready for torch.compile too: a graph traced through one module then serves every module
            # of the same shape (blocks compiled one by one share their graph)
            _prepare_for_trace(self, recipe, False, ready=True)
            if self.recipe is recipe:
                _prepare_for_trace(self, recipe, True, ready=True)
        return self

    def reset_quantizer_state(self) -> None:
        """Forget every recipe's quantizer state and any loaded state not applied yet (fresh start)."""
        for name in self._state_buffer_names:
            self._buffers.pop(name, None)
        self._state_buffer_names = []
        self._by_recipe = {}
        self._last = None
        self._quantizer_sets = None
        self._state_recipe = None
        self._pending = None
        self._records.clear()
        self._traced_sets = [None, None]
        self._compile_ready = [None, None]
        self.clear_weight_cache()

    def _param_device(self) -> Optional[torch.device]:
        for p in self.parameters(recurse=False):
            return p.device
        return None

    def _iter_quantizers(self):
        if self._state_recipe is not None:
            yield from self._state_recipe.quantizers()

    # ------------------------------------------------------------------ state
    def _rebind_state_buffers(self) -> None:
        """Point each quantizer at its (possibly replaced) buffer, e.g. after ``module.to()``."""
        for g, tensor, q in self._iter_quantizers():
            for attr in _delayed_attrs(q):
                name = _buffer_name(tensor, g, attr)
                buf = self._buffers.get(name)
                if buf is None:
                    continue
                if buf.dtype != torch.float32:  # model.half()/.bfloat16(): scaling state stays FP32
                    buf = self._buffers[name] = buf.float()
                if buf is not getattr(q, attr):
                    setattr(q, attr, buf)

    def _apply(self, fn, *args, **kwargs):
        self.clear_weight_cache()
        out = super()._apply(fn, *args, **kwargs)
        self._rebind_state_buffers()
        # the other recipes' state (not buffers now) moves along
        for entry in self._by_recipe.values():
            if entry is self._state_recipe:
                continue
            for _, _, q in entry.quantizers():
                for attr in _delayed_attrs(q):
                    t = fn(getattr(q, attr))
                    setattr(q, attr, t if t.dtype == torch.float32 else t.float())
        return out

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        state["_records"] = replay.RecordQueue()  # per-graph bookkeeping: not copied
        # a copy is prepared for tracing afresh (its quantizers get their own handles)
        state["_traced_sets"] = [None, None]
        state["_compile_ready"] = [None, None]
        state["_weight_cache"] = WeightCache()  # copies of this module's weights, not of the copy's
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        _trace_ids.register(self)  # a copy (deepcopy, pickle) is traced by id like the original

    def get_extra_state(self) -> Any:
        pending = self._pending
        if pending is not None:
            return {"version": qstate.EXTRA_VERSION, "recipe": pending["identity"],
                    "recipe_repr": pending["repr"], "recipe_config": pending["config"],
                    "quantizer_state": dict(pending["plain"])}
        entry = self._state_recipe
        if entry is None:
            return {"version": qstate.EXTRA_VERSION, "recipe": None, "quantizer_state": {}}
        plain_state: Dict[str, Dict[str, Any]] = {}
        for g, tensor, q in entry.quantizers():
            plain = {k: v for k, v in _quantizer_state(q).items() if not isinstance(v, torch.Tensor)}
            if plain:
                plain_state[f"{tensor.value}{g}"] = plain
        return {"version": qstate.EXTRA_VERSION, "recipe": qstate.identity(entry.recipe),
                "recipe_repr": repr(entry.recipe), "recipe_config": entry.recipe.to_config(),
                "quantizer_state": plain_state}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._pending is not None:  # loaded, not applied yet: that is this module's state
            for name in self._state_buffer_names:
                destination.pop(prefix + name, None)
            for name, t in self._pending["tensors"].items():
                destination[prefix + name] = t if keep_vars else t.detach()

    def set_extra_state(self, state: Any) -> None:
        if self._loading:  # handled (validated first) by _load_from_state_dict
            return
        errors: List[str] = []
        self._load_quantizer_state({}, state, errors, type(self).__name__)
        if errors:
            raise RuntimeError("\n".join(errors))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # Everything is validated before anything is copied: a failed load changes nothing here.
        self.clear_weight_cache()
        where = f"{type(self).__name__} {prefix[:-1] or '(root)'}"
        n_errors = len(error_msgs)
        for name, p in list(self._parameters.items()) + [(n, b) for n, b in self._buffers.items()
                                                         if n not in self._state_buffer_names]:
            key = prefix + name
            if p is not None and key in state_dict and isinstance(state_dict[key], torch.Tensor) \
                    and tuple(state_dict[key].shape) != tuple(p.shape):
                error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                                  f"{tuple(state_dict[key].shape)} from checkpoint, the shape in current "
                                  f"model is {tuple(p.shape)}.")
        state_keys = [k for k in state_dict if k.startswith(prefix + _STATE_PREFIX) and "." not in k[len(prefix):]]
        tensors = {k[len(prefix):]: state_dict[k] for k in state_keys
                   if qstate.parse_name(k[len(prefix):], self.num_gemms)}
        if strict:
            # a misspelt or foreign qstate_* key is an error (its state would be lost), and the load
            # then fails as a whole: copy nothing
            bad = [k for k in state_keys if k[len(prefix):] not in tensors]
            if bad:
                unexpected_keys.extend(bad)
                return
        extra = state_dict.get(prefix + "_extra_state")
        plan = self._load_quantizer_state(tensors, extra, error_msgs, where, dry_run=True)
        if len(error_msgs) > n_errors:
            return
        # torch loads parameters and other buffers; the qstate_* buffers are ours
        hidden = {n: self._buffers.pop(n) for n in self._state_buffer_names if n in self._buffers}
        self._loading = True
        try:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                          unexpected_keys, error_msgs)
        finally:
            self._loading = False
            self._buffers.update(hidden)
        if len(error_msgs) > n_errors:
            return
        # valid state names are ours; misspelt or foreign qstate_* keys stay unexpected (strict fails)
        for key in [k for k in unexpected_keys if k[len(prefix):] in tensors and k.startswith(prefix)]:
            unexpected_keys.remove(key)
        # checkpoints without quantizer state (e.g. from torch.nn.Linear) load too
        for key in [k for k in missing_keys if k == prefix + "_extra_state"]:
            missing_keys.remove(key)
        plan()

    def _load_quantizer_state(self, tensors: Dict[str, torch.Tensor], extra: Any, errors: List[str],
                              where: str, dry_run: bool = False):
        """Validate ``tensors`` (qstate_* by name) and ``extra`` against this module; append messages to
        ``errors``; return a function that applies them (now, or pending until their recipe is used)."""
        extra = extra if isinstance(extra, dict) else {}
        ident = extra.get("recipe")
        plain = dict(extra.get("quantizer_state", {}) or {})
        repr_ = extra.get("recipe_repr")
        config = extra.get("recipe_config")
        if not tensors and not plain:
            return lambda: None
        current = self._state_recipe
        now = current is not None and (qstate.identity(current.recipe) == ident if ident is not None
                                       else current.has_tensors or not tensors)
        if now:
            expected = qstate.expected_shapes(current.recipe, self.module_kind, self.num_gemms)
            errors.extend(qstate.shape_errors(tensors, expected, where))
        elif current is not None and ident is not None and ident.get("recipe") == type(current.recipe).__name__:
            # the same kind of recipe with another state shape: it cannot be this module's state
            errors.append(f"{where}: the checkpoint's quantizer state was saved under "
                          f"{qstate.describe(ident, repr_)}, which does not fit this module's "
                          f"{current.recipe!r} (different amax_history_len?)")
        elif ident is not None:
            recipe = qstate.recipe_from_extra(extra)
            if recipe is not None:
                expected = qstate.expected_shapes(recipe, self.module_kind, self.num_gemms)
                errors.extend(qstate.shape_errors(tensors, expected, where))
        copies = {k: v.detach().clone() for k, v in tensors.items()}

        def apply() -> None:
            if now:
                _copy_state(current, copies, plain)
            else:
                self._pending = {"identity": ident, "repr": repr_, "config": config, "tensors": copies,
                                 "plain": plain}
                self._last = None  # the next forward checks the pending state against its recipe
        if not dry_run and not errors:
            apply()
        return apply

    def _apply_pending(self, entry: _RecipeSets) -> None:
        """Loaded state meets the first recipe used after the load: its own, or an error naming both."""
        pending = self._pending
        ident = pending["identity"]
        saved = qstate.describe(ident, pending["repr"])
        hint = ("; run it under the checkpoint's recipe, or call reset_quantizer_state() to start "
                "this recipe's state afresh")
        if ident is not None and ident != qstate.identity(entry.recipe):
            raise ValueError(f"{type(self).__name__}: the loaded checkpoint holds quantizer state of "
                             f"{saved}, but this module now runs under {entry.recipe!r}{hint}")
        expected = qstate.expected_shapes(entry.recipe, self.module_kind, self.num_gemms)
        errors = qstate.shape_errors(pending["tensors"], expected, type(self).__name__)
        if errors:
            raise ValueError("\n".join(errors) + f" (the module runs under {entry.recipe!r}){hint}")
        _copy_state(entry, pending["tensors"], pending["plain"])
        self._pending = None


def _check_fused_activation(module: QuantizedModule) -> None:
    """The fused activation cast's first-use check (ops/cuda_fp8_act.py) for each input dtype on a ``Linear``'s
    CUDA device, which a trace cannot run: a traced FC2 (``Linear.forward_activation``) takes the fused op only
    where it passed. (Once per process and device: the results are kept.)"""
    weight = getattr(module, "weight", None)
    if module.module_kind is not ModuleKind.LINEAR or not isinstance(weight, torch.Tensor) or not weight.is_cuda:
        return
    from ..ops import cuda_fp8_act

    if cuda_fp8_act.available():
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for activation in cuda_fp8_act.ACT_CODES:
                cuda_fp8_act.fusion_ok(weight.device, dtype, activation)


def _prepare_for_trace(module: QuantizedModule, recipe: Any, module_mode: bool, ready: bool = False) -> None:
    """Runs eagerly while torch.compile traces ``module``'s forward (marked as a constant function:
    torch.compile calls it with the real objects, guarding on their identity): build or find the
    quantizer sets of ``recipe``, as the eager path would, and make them known to the ops a traced
    backward calls."""
    from ..ops import backend
    from .amax_reduction import register_traced

    # The first load of the extension and of the CUDA op modules takes a lock, which a trace cannot
    # enter (a model compiled before any eager quantized call failed there on the GPU): load them now.
    backend.registered_cuda_ops()
    load_cuda_casts()
    register_traced_kernels()  # (the graph's FP8 casts and GEMMs then run C++ kernels: no Python per op)
    _check_fused_activation(module)
    sets = module._sets_for(recipe, module_mode)
    for qs in sets:
        register_traced(qs)
        for q in qs.quantizers.values():
            if q is not None and getattr(q.spec, "stochastic_rounding", False) and hasattr(q, "use_sr_tensors"):
                q.use_sr_tensors()  # the graph reads the SR seed and counter when it runs
            if q is not None and not module_mode and hasattr(q, "use_trace_scale"):
                q.use_trace_scale()  # a forward cast reads a copy of the scale the exit leaves alone
    if any(spec.scaling is ScalingKind.NVFP4 for qs in sets for spec in qs.specs.values()):
        # the emulated NVFP4 GEMM caches a decode table per device and dtype on first use; a graph
        # cannot create it (a tensor made in the graph and kept in a global dict): create it now
        from ..gemm import nvfp4_emulated

        device = module._param_device() or torch.device("cpu")
        for dtype in (torch.float32, torch.bfloat16):
            nvfp4_emulated._byte_pair_table(device, dtype)
    slot = 1 if module_mode else 0
    attr = "_compile_ready" if ready else "_traced_sets"
    current = getattr(module, attr)[slot]
    if current is None or current[0] is not recipe or current[1] is not sets:
        entries = list(getattr(module, attr))
        entries[slot] = (recipe, sets)
        setattr(module, attr, entries)


# The oldest torch whose Dynamo traces the path (tested: 2.11 and 2.13). Before 2.13 it reads no
# ``obj.__dict__`` (quantizers/base.py: shallow_copy) and passes only constants to a constant function
# (_prepare_for_trace_by_id).
COMPILE_MIN_TORCH = (2, 11)
_TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
_ID_CONSTANTS = _TORCH_VERSION < (2, 13)


def _prepare_for_trace_by_id(module_id: int, recipe_id: int, module_mode: bool) -> None:
    """:func:`_prepare_for_trace` for a Dynamo that passes only constants to a constant function."""
    _prepare_for_trace(_trace_ids.lookup(module_id), _trace_ids.lookup(recipe_id), module_mode)


_prepare_for_trace_by_id._dynamo_marked_constant = True  # type: ignore[attr-defined]


def compile_supported() -> bool:
    """Whether this torch can compile fp_recipes modules under a recipe (torch >= 2.11)."""
    return _TORCH_VERSION >= COMPILE_MIN_TORCH


def _require_compile_support() -> None:
    """The first thing a traced forward runs (a constant function: eager, at trace time): on a torch
    too old to trace the rest of the path, the user learns why instead of a Dynamo internal error."""
    if not compile_supported():
        raise RuntimeError(
            f"fp_recipes: torch.compile of fp_recipes modules under a recipe needs torch >= "
            f"{'.'.join(map(str, COMPILE_MIN_TORCH))} (this is torch {torch.__version__}, whose Dynamo cannot "
            "trace the quantized tensors); run the model eagerly, or compile only the parts outside "
            "fp_recipes modules")


# what torch.compiler.assume_constant_result sets (without importing torch._dynamo at import time)
_require_compile_support._dynamo_marked_constant = True  # type: ignore[attr-defined]
_prepare_for_trace._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _copy_state(entry: _RecipeSets, tensors: Dict[str, torch.Tensor], plain: Dict[str, Dict[str, Any]]) -> None:
    with torch.no_grad():
        for g, tensor, q in entry.quantizers():
            for attr in _delayed_attrs(q):
                src = tensors.get(_buffer_name(tensor, g, attr))
                if src is not None:
                    getattr(q, attr).copy_(src)
            if getattr(q, "trace_scale", None) is not None:
                q.sync_trace_scale()  # (a compiled call inside an open autocast reads the copy)
            key = f"{tensor.value}{g}"
            if key in plain:
                _load_extra(q, plain[key])


def _quantizer_state(q: Any) -> Dict[str, Any]:
    if hasattr(q, "state_dict"):
        try:
            return dict(q.state_dict())
        except NotImplementedError:
            return {}
    return {}


def _load_extra(q: Any, plain: Dict[str, Any]) -> None:
    """Restore non-tensor quantizer state (NVFP4 SR seed/offset) without touching tensor state."""
    for key, value in plain.items():
        if hasattr(q, key) and not isinstance(getattr(q, key), torch.Tensor):
            setattr(q, key, value)
