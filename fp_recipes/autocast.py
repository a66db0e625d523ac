"""``fp_recipes.autocast``: the context in which modules quantize their GEMM operands.

One stack of states per thread (like ``torch.autocast``): a thread that never entered an autocast
sees the disabled default, whatever other threads do; the innermost context of a thread wins, and
leaving a context (normally or by an exception) restores the one around it. Modules read
:func:`get_autocast_state` in their forward and keep what they used for their backward (and for a
recompute of that forward under activation checkpointing), so the backward, which autograd may run
in another thread, never reads the stack.

Outermost-exit hooks: modules register a callback with :func:`register_outermost_exit_hook`; it is
called as ``fn(state)`` once each time the outermost *enabled* autocast exits normally (not on an
exception) *in the thread that entered it*, after the enclosing state has been restored (the
registry is process-wide; "outermost" is per thread). The hooks run with inference mode off, so a
step run inside ``torch.inference_mode()`` creates no inference tensors in the scaling state. This is where the delayed-scaling forward
amaxes of all modules are reduced in one collective. Unregister with the returned handle's
``remove()`` or :func:`unregister_outermost_exit_hook`; ``weak=True`` holds the callback weakly
(bound methods via ``WeakMethod``), so a module that is garbage-collected drops out by itself.

The module object itself is callable, so ``fp_recipes.autocast(...)`` works whether
``fp_recipes.autocast`` resolves to this module or to the :class:`autocast` class.
"""

from __future__ import annotations

import itertools
import sys
import threading
import types
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, List, Optional

from . import _trace_ids

if TYPE_CHECKING:  # pragma: no cover
    from fp_recipes.recipes import Recipe

__all__ = [
    "AutocastState",
    "HookHandle",
    "autocast",
    "fp8_autocast",
    "get_autocast_state",
    "register_outermost_exit_hook",
    "unregister_outermost_exit_hook",
]


@dataclass(frozen=True)
class AutocastState:
    """What the innermost active autocast says.

    ``depth`` counts the autocast contexts currently entered (enabled or not); 0 means none.
    ``recipe`` is None when quantization is off (``enabled=False``).
    """

    enabled: bool = False
    recipe: Optional["Recipe"] = None
    amax_reduction_group: Any = None
    depth: int = 0
    # torch.compile only: the delayed-scaling quantizers recorded while tracing, when the outermost
    # enabled autocast was entered in the traced function (its exit updates them in the graph)
    records: Optional[list] = field(default=None, compare=False, repr=False)
    # a delayed-scaling forward cast under this (outermost enabled) autocast was captured in a CUDA graph: its exit
    # must then be captured too (amax_reduction.py's reducer sets it, the one field set after creation, and checks it)
    captured: bool = field(default=False, compare=False, repr=False)


_DEFAULT_STATE = AutocastState()


class _ThreadStack(threading.local):
    """This thread's stack of entered autocast states (empty in a thread that never entered one)."""

    def __init__(self) -> None:
        self.stack: List[AutocastState] = []


_local = _ThreadStack()


def _stack() -> List[AutocastState]:
    return _local.stack


def get_autocast_state() -> AutocastState:
    """The state of this thread's innermost active autocast (a disabled default outside any)."""
    stack = _local.stack
    return stack[-1] if stack else _DEFAULT_STATE


def outermost_enabled_state() -> Optional[AutocastState]:
    """The state of this thread's outermost enabled autocast (whose exit runs the scale updates), or None."""
    return next((s for s in _local.stack if s.enabled), None)


# ----------------------------------------------------------------------------------------------
# outermost-exit hooks


class HookHandle:
    """Returned by :func:`register_outermost_exit_hook`; ``remove()`` unregisters (idempotent)."""

    _ids = itertools.count()

    def __init__(self, fn: Optional[Callable], ref: Optional[Callable[[], Optional[Callable]]],
                 label: str) -> None:
        self.id = next(HookHandle._ids)
        self._fn = fn  # a strong hook: the callable itself (read by torch.compile as is)
        self._ref = ref  # a weak hook: its weak reference
        self._label = label

    def callback(self) -> Optional[Callable]:
        return self._fn if self._ref is None else self._ref()

    def remove(self) -> None:
        _hooks.pop(self.id, None)

    def __enter__(self) -> "HookHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        alive = "" if self.callback() is not None else ", dead"
        return f"HookHandle({self._label}{alive})"


_hooks: "dict[int, HookHandle]" = {}


def register_outermost_exit_hook(fn: Callable[[AutocastState], None], *,
                                 weak: bool = False) -> HookHandle:
    """Call ``fn(state)`` whenever the outermost enabled autocast exits normally.

    Hooks run in registration order. ``weak=True`` keeps only a weak reference to ``fn`` (a
    ``WeakMethod`` for bound methods): the hook disappears when its owner is collected.
    """
    if not callable(fn):
        raise TypeError(f"register_outermost_exit_hook needs a callable, got {type(fn).__name__}")
    label = getattr(fn, "__qualname__", repr(fn))
    if weak:
        ref = weakref.WeakMethod(fn) if isinstance(fn, types.MethodType) else weakref.ref(fn)
        handle = HookHandle(None, ref, label)
    else:
        handle = HookHandle(fn, None, label)
    _hooks[handle.id] = handle
    return handle


def unregister_outermost_exit_hook(fn_or_handle: Any) -> bool:
    """Remove a hook by its handle or by the callable itself; True if something was removed."""
    if isinstance(fn_or_handle, HookHandle):
        return _hooks.pop(fn_or_handle.id, None) is not None
    removed = False
    for hid, handle in list(_hooks.items()):
        cb = handle.callback()
        if cb is not None and cb == fn_or_handle:
            del _hooks[hid]
            removed = True
    return removed


def _run_outermost_exit_hooks(state: AutocastState) -> None:
    for hid, handle in list(_hooks.items()):
        ref = handle._ref
        cb = handle._fn if ref is None else ref()  # (handle.callback(), inline)
        if cb is None:  # a weak hook whose owner is gone
            _hooks.pop(hid, None)
            continue
        cb(state)


# ----------------------------------------------------------------------------------------------
# the context manager


_RECIPE_CLASS: list = []  # fp_recipes.recipes.Recipe, imported on first use (the recipes import this module)


def _resolve_recipe(recipe: Optional["Recipe"]) -> Optional["Recipe"]:
    if recipe is None:
        from fp_recipes.recipes import recipe_from_env

        return recipe_from_env(default="delayed")  # None when FP_RECIPES_RECIPE=none
    if not _RECIPE_CLASS:
        from fp_recipes.recipes import Recipe

        _RECIPE_CLASS.append(Recipe)
    if not isinstance(recipe, _RECIPE_CLASS[0]):
        raise TypeError(
            "autocast(recipe=...) needs an fp_recipes recipe (DelayedScaling, Float8CurrentScaling, "
            f"NVFP4BlockScaling, PerTokenScaling), got {type(recipe).__module__}."
            f"{type(recipe).__qualname__}"
        )
    if not _compiling():
        _trace_ids.register(recipe)  # (a copy made by a validator: torch < 2.13 traces look it up by id)
    return recipe


_IS_COMPILING: Optional[Callable[[], bool]] = None
#: called with no argument when this thread eagerly enters its outermost *enabled* autocast (not in a trace): the
#: delayed-scaling quantizers that compiled graphs read through a scale copy refresh it there
#: (``quantizers.float8.refresh_trace_scales``). Empty until a graph is traced: eager jobs pay one list check.
OUTERMOST_ENTER_HOOKS: List[Callable[[], None]] = []
# set once an autocast was entered in a function torch.compile traced: only then do eager calls look for
# a traced autocast's quantizer list (see AutocastState.records)
TRACED_RECORDS_SEEN = [False]


def _compiling() -> bool:
    """Whether torch.compile is tracing this call (torch is imported by then: no import cost here)."""
    global _IS_COMPILING
    if _IS_COMPILING is None:
        torch = sys.modules.get("torch")
        if torch is None:
            return False
        _IS_COMPILING = torch.compiler.is_compiling
    return _IS_COMPILING()


class _EntryDepths(threading.local):
    """An autocast's stack heights at entry, per thread (``depths``: None until this thread enters it)."""

    depths: Optional[List[int]] = None


def _recipe_from_env_for_trace() -> Optional["Recipe"]:
    """``recipe=None`` inside a function torch.compile traces: the environment's recipe, read once
    while tracing (a constant of the graph; a later change of the variables is not seen by it)."""
    return _resolve_recipe(None)


# what torch.compiler.assume_constant_result sets (without importing torch._dynamo at import time)
_recipe_from_env_for_trace._dynamo_marked_constant = True  # type: ignore[attr-defined]


class autocast:  # noqa: N801 (a context manager used like a function, as in torch/TE)
    """Quantize the GEMMs of fp_recipes modules inside this context with ``recipe``.

    ``recipe=None`` takes ``FP_RECIPES_RECIPE`` (``none`` turns quantization off), else
    ``DelayedScaling()``; it is resolved when the context is entered. Nestable: the inner context
    wins, the outer one is restored on exit, also when an exception escapes. Usable as a decorator.
    """

    register_outermost_exit_hook = staticmethod(register_outermost_exit_hook)
    unregister_outermost_exit_hook = staticmethod(unregister_outermost_exit_hook)
    get_autocast_state = staticmethod(get_autocast_state)

    def __init__(self, enabled: bool = True, recipe: Optional["Recipe"] = None,
                 amax_reduction_group: Any = None) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"autocast(enabled=...) must be a bool, got {enabled!r}")
        self.enabled = enabled
        self.recipe = recipe
        self.amax_reduction_group = amax_reduction_group
        # stack heights at entry, per thread (re-entrant decorator use); an autocast that torch.compile
        # traces keeps them in a plain list (the graph runs in the calling thread)
        is_compiling = _IS_COMPILING
        compiling = is_compiling() if is_compiling is not None else _compiling()
        self._local = None if compiling else _EntryDepths()
        self._traced_depths: List[int] = []

    def _depths_for(self, compiling: bool) -> List[int]:
        """The stack heights at entry of this thread (of the trace, while ``compiling``)."""
        local = self._local
        if local is None or compiling:
            return self._traced_depths
        depths = local.depths
        if depths is None:
            depths = local.depths = []
        return depths

    def __enter__(self) -> AutocastState:
        _stack = _local.stack
        is_compiling = _IS_COMPILING  # (_compiling(), inline once it is known)
        compiling = is_compiling() if is_compiling is not None else _compiling()
        recipe = self.recipe
        if self.enabled and recipe is None and compiling:
            recipe = _recipe_from_env_for_trace()
        elif self.enabled:
            if recipe is None or not _RECIPE_CLASS or not isinstance(recipe, _RECIPE_CLASS[0]):
                recipe = _resolve_recipe(recipe)  # None when FP_RECIPES_RECIPE=none
        else:
            recipe = None if self.recipe is None else _resolve_recipe(self.recipe)  # type check
        enabled = self.enabled and recipe is not None
        records = None
        if enabled and compiling:
            below = next((s for s in reversed(_stack) if s.enabled), None)
            records = [] if below is None else below.records
            TRACED_RECORDS_SEEN[0] = True
        state = AutocastState(
            enabled=enabled,
            recipe=recipe if enabled else None,
            amax_reduction_group=self.amax_reduction_group if enabled else None,
            depth=len(_stack) + 1,
            records=records,
        )
        local = self._local  # (self._depths_for(compiling), inline)
        if local is None or compiling:
            depths = self._traced_depths
        else:
            depths = local.depths
            if depths is None:
                depths = local.depths = []
        depths.append(state.depth - 1)
        if OUTERMOST_ENTER_HOOKS and enabled and not compiling and not any(s.enabled for s in _stack):
            for hook in OUTERMOST_ENTER_HOOKS:
                hook()
        _stack.append(state)
        return state

    def __exit__(self, exc_type, exc, tb) -> None:
        _stack = _local.stack
        is_compiling = _IS_COMPILING
        compiling = is_compiling() if is_compiling is not None else _compiling()
        local = self._local
        if local is None or compiling:
            height = self._traced_depths.pop()
        else:
            depths = local.depths
            if depths is None:
                depths = local.depths = []
            height = depths.pop()
        exiting = _stack[height]
        del _stack[height:]  # restore the enclosing state (drops anything left above us too)
        if exc_type is None and exiting.enabled:
            for s in _stack:  # (_any_enabled(_stack), inline)
                if s.enabled:
                    return
            if compiling:  # traced: the hooks' updates become graph ops (inference mode is eager-only)
                _run_outermost_exit_hooks(exiting)
                return
            import torch

            if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
                _run_outermost_exit_hooks(exiting)  # what inference_mode(False) would set (it costs calls)
                return
            with torch.inference_mode(False):
                _run_outermost_exit_hooks(exiting)

    def __call__(self, fn: Callable) -> Callable:
        import functools

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)

        return wrapper

    def __repr__(self) -> str:
        return (f"autocast(enabled={self.enabled}, recipe={self.recipe!r}, "
                f"amax_reduction_group={self.amax_reduction_group!r})")


def _any_enabled(stack: List[AutocastState]) -> bool:
    for s in stack:
        if s.enabled:
            return True
    return False


def fp8_autocast(enabled: bool = True, calibrating: bool = False,
                 fp8_recipe: Optional["Recipe"] = None, fp8_group: Any = None) -> autocast:
    """TransformerEngine's older spelling of :class:`autocast` (same argument order)."""
    if calibrating:
        raise ValueError(
            "fp8_autocast(calibrating=True) is not supported by fp_recipes: run the calibration "
            "steps inside fp_recipes.autocast(enabled=False) instead"
        )
    return autocast(enabled=enabled, recipe=fp8_recipe, amax_reduction_group=fp8_group)


class _CallableModule(types.ModuleType):
    """Lets ``fp_recipes.autocast(...)`` work when the name resolves to this module."""

    def __call__(self, *args: Any, **kwargs: Any) -> autocast:
        return autocast(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
