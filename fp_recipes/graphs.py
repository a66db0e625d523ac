"""``fp_recipes.make_graphed_callables``: CUDA graphs of training steps under an fp_recipes recipe.

Modelled on ``torch.cuda.make_graphed_callables`` (and TransformerEngine's function of the same name):
each callable's forward and backward are captured as two CUDA graphs and replayed by one autograd
node, with static input/output buffers. What is particular to quantized training:

* **The recipe is part of the graph.** The forward is captured inside ``fp_recipes.autocast(recipe)``
  entered by this function, so its outermost exit -- the delayed-scaling amax reduction and scale update
  -- is captured too, as device work (the one-launch update kernel, or its torch-op twin, both write the
  state tensors in place: the graph's pointers stay valid). The end-of-backward update, run by the
  autograd engine's final callback inside the captured backward, is captured likewise. A replay
  therefore leaves amax histories and scales exactly where eager execution would, and no Python
  bookkeeping (the amax reducer's lists) is touched by a replay.
* **Warm-up does not count.** The warm-up iterations (eager, needed to build cached plans, decode
  tables and cuBLAS state outside the capture) update the delayed-scaling state; it is snapshotted
  before and copied back (in place) after, so the first replay starts from the state the module had.
* **Weights are cast at every replay** (the optimizer changes them in place between replays), unless
  ``weight_caching=True``: then a second graph pair reuses the weights quantized by the last
  ``is_first_microbatch=True`` replay (TransformerEngine's ``fp8_weight_caching``).
* **Host syncs are deferred.** The non-finite amax warning reads a device flag: during capture the
  report is deferred (registered for the capture's own stream only, so other threads and streams report
  as usual) and, after each replay, made eagerly from the flags the graph set (no wait).

* **Stochastic rounding draws fresh numbers at every replay.** The NVFP4 gradient quantizers of the
  modules keep their Philox seed and counter on the device from the capture on
  (``NVFP4Quantizer.use_sr_device_state``): the kernels read the counter when they run and a captured add
  advances it after each cast, so replays draw what eager steps would. The warm-up's advance is undone
  like the delayed-scaling state.

Refused with a message: CPU tensors or modules, stochastic rounding in a plain function (its modules'
counters cannot be found: pass the nn.Module), an amax reduction over a non-NCCL group, calls under another recipe than the captured one,
arguments of another shape/dtype/device/requires_grad, and replaced state tensors or parameters.
See docs/cuda_graphs.md.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch.utils import _pytree as pytree

from .autocast import _resolve_recipe, autocast, get_autocast_state
from .modules import amax_reduction
from .modules.base import QuantizedModule
from .modules.weight_cache import AUTO
from .quantizers.nonfinite import DeferredReports, NonfiniteWatch
from .quantizers.roles import ModuleKind, QuantizerRole, ScalingKind, TensorKind

__all__ = ["make_graphed_callables", "prepare_for_capture"]

_Callable = Union[torch.nn.Module, Callable[..., Any]]
_WHO = "fp_recipes.make_graphed_callables"
_TENSORS = (TensorKind.ACTIVATION, TensorKind.WEIGHT, TensorKind.GRAD_OUTPUT)


# ----------------------------------------------------------------------------------------------
# argument handling (CPU-checkable: nothing here needs a GPU)


def _te_aliases(enabled: bool, recipe: Any, group: Any, weight_caching: bool, fp8_enabled: Optional[bool],
                fp8_recipe: Any, fp8_group: Any, fp8_weight_caching: Optional[bool],
                fp8_calibrate: bool) -> Tuple[bool, Any, Any, bool]:
    """TransformerEngine's ``fp8_*`` keyword names, mapped onto ours (both given: an error)."""
    if fp8_calibrate:
        raise ValueError(f"{_WHO}(fp8_calibrate=True) is not supported: calibrate eagerly inside "
                         "fp_recipes.autocast(enabled=False), then capture")

    def pick(name: str, ours: Any, default: Any, theirs: Any, te_name: str) -> Any:
        if theirs is None:
            return ours
        if ours is not default and ours != theirs:
            raise ValueError(f"{_WHO}: {name}={ours!r} and {te_name}={theirs!r} disagree; pass one of them")
        return theirs

    enabled = pick("enabled", enabled, True, fp8_enabled, "fp8_enabled")
    recipe = pick("recipe", recipe, None, fp8_recipe, "fp8_recipe")
    group = pick("amax_reduction_group", group, None, fp8_group, "fp8_group")
    weight_caching = pick("weight_caching", weight_caching, False, fp8_weight_caching, "fp8_weight_caching")
    for name, value in (("enabled", enabled), ("weight_caching", weight_caching)):
        if not isinstance(value, bool):
            raise TypeError(f"{_WHO}: {name} must be a bool, got {value!r}")
    return enabled, recipe, group, weight_caching


def _where(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')} {tuple(t.shape)} on {t.device}"


def _quantized_modules(fn: _Callable) -> List[QuantizedModule]:
    owner = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    if not isinstance(owner, torch.nn.Module):
        return []
    return [m for m in owner.modules() if isinstance(m, QuantizedModule)]


def _check_module(fn: _Callable, index: int) -> None:
    """Every parameter and buffer on a CUDA device, no hooks (as torch requires), frozen buffers."""
    if not isinstance(fn, torch.nn.Module):
        if not callable(fn):
            raise TypeError(f"{_WHO}: callable {index} is a {type(fn).__name__}, not an nn.Module or function")
        return
    name = type(fn).__name__
    for pname, t in list(fn.named_parameters()) + list(fn.named_buffers()):
        if t.device.type != "cuda":
            raise ValueError(f"{_WHO}: {name} (callable {index}) has {pname} on {t.device}; CUDA graphs "
                             "replay GPU work only: move the module to a GPU first (module.cuda())")
    for b in fn.buffers():
        if b.requires_grad:
            raise ValueError(f"{_WHO}: {name} (callable {index}) has a buffer that requires grad; only "
                             "parameters may be trainable in a graphed module")
    for m in fn.modules():
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks:
            raise ValueError(f"{_WHO}: {type(m).__name__} in callable {index} has hooks registered; hooks "
                             "would run at capture only. Register them after make_graphed_callables")


def _check_sample_args(args: Any, index: int) -> Tuple[List[Any], Any]:
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"{_WHO}: sample_args for callable {index} must be a tuple of arguments, got "
                        f"{type(args).__name__}")
    leaves, spec = pytree.tree_flatten(tuple(args))
    devices = set()
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if leaf.requires_grad and not leaf.is_leaf:
                # its autograd history (made outside the capture, on another stream) would be part of
                # the captured backward
                raise ValueError(f"{_WHO}: sample argument {i} of callable {index} requires grad but is not a "
                                 "leaf (it has a grad_fn): pass a leaf, e.g. x.detach().requires_grad_()")
            if leaf.device.type != "cuda":
                raise ValueError(f"{_WHO}: sample argument {i} of callable {index} is a {_where(leaf)}; "
                                 "CUDA graphs need CUDA tensors (x.cuda())")
            devices.add(leaf.device)
    if len(devices) > 1:
        raise ValueError(f"{_WHO}: callable {index}'s sample arguments are on several devices {sorted(map(str, devices))}")
    return leaves, spec


def _specs_of(recipe: Any, mods: Sequence[Any]) -> Iterator[Any]:
    """The specs of every operand of ``mods`` (a plain function's modules are unknown: ``None`` stands
    for every module kind)."""
    for m in mods:
        if m is None:
            for kind in ModuleKind:
                for tensor in _TENSORS:
                    yield recipe.plan(QuantizerRole(kind, tensor, 0, None))
            continue
        for g in range(m.num_gemms):
            for tensor in _TENSORS:
                yield recipe.plan(QuantizerRole(m.module_kind, tensor, g, None))


def _check_recipe(recipe: Any, mods: Sequence[Any]) -> Tuple[bool, bool]:
    """Whether any operand uses delayed scaling, and whether any rounds stochastically."""
    delayed = stochastic = False
    for spec in _specs_of(recipe, mods):
        stochastic = stochastic or bool(getattr(spec, "stochastic_rounding", False))
        delayed = delayed or spec.scaling is ScalingKind.DELAYED
    return delayed, stochastic


def prepare_for_capture(model: torch.nn.Module, recipe: Any = None) -> torch.nn.Module:
    """Make ``model``'s fp_recipes modules capturable by a CUDA graph you capture yourself (``torch.cuda.graph``,
    ``torch.cuda.make_graphed_callables``): build their quantizer state for ``recipe`` now (``None``: as
    ``fp_recipes.autocast``: ``FP_RECIPES_RECIPE``, else DelayedScaling) and keep their stochastic-rounding seeds and counters on the GPU, so that
    each replay draws fresh numbers. ``make_graphed_callables`` does this itself; without it, capturing a
    stochastically rounded NVFP4 cast is an error. Delayed-scaling state is not snapshotted here: a warm-up's
    updates stay (``make_graphed_callables`` undoes them). Returns ``model``."""
    recipe = _resolve_recipe(recipe)
    mods = [m for m in model.modules() if isinstance(m, QuantizedModule)]
    if recipe is not None:
        for m in mods:
            m.init_quantizer_state(recipe)
    _device_rng_states(mods)
    return model


def _device_rng_states(mods: Sequence[QuantizedModule]) -> None:
    """Move every stochastically rounding quantizer's seed and counter to its module's device (see the module
    docstring): the graphs read and advance them there."""
    for m in mods:
        device = m._param_device() or torch.device("cuda", torch.cuda.current_device())
        for qs in m.quantizer_sets or ():
            for q in qs.quantizers.values():
                if q is not None and getattr(q.spec, "stochastic_rounding", False):
                    q.use_sr_device_state(device)


def _reduced(recipe: Any, mods: Sequence[QuantizedModule]) -> bool:
    return any(spec.scaling is ScalingKind.DELAYED and getattr(spec, "reduce_amax", True)
               for spec in _specs_of(recipe, mods))


def _check_reduction(group: Any) -> str:
    """The capture mode for the amax all-reduce the delayed update issues: none, or NCCL (capturable);
    anything else (gloo syncs with the host) is refused."""
    target = amax_reduction.reduction_group(group)
    if target is amax_reduction.NO_REDUCTION:
        return "global"
    import torch.distributed as dist

    backend = str(dist.get_backend(target)).lower()
    if "nccl" not in backend:
        raise RuntimeError(
            f"{_WHO}: the delayed-scaling amaxes are all-reduced over a {backend} group, which cannot be "
            "captured in a CUDA graph (only NCCL can). Pass an NCCL amax_reduction_group, or "
            "DelayedScaling(reduce_amax=False) to keep per-rank scales")
    # NCCL's watchdog thread queries events: a global capture mode would refuse those calls
    return "thread_local"


# ----------------------------------------------------------------------------------------------
# the pieces a capture needs


class _StateSnapshot:
    """The delayed-scaling tensors (amax histories, scales) and the device stochastic-rounding states of the
    modules, copied so the warm-up's updates can be undone in place (the graphs hold these tensors'
    addresses)."""

    def __init__(self, mods: Sequence[QuantizedModule], recipe: Any) -> None:
        self.pairs: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.slots: List[Tuple[Any, str, torch.Tensor]] = []
        self.scales: Dict[int, List[torch.Tensor]] = {}
        for m in mods:
            for qs in m.quantizer_sets or ():
                for q in qs.quantizers.values():
                    for attr in ("amax_history", "scale", "_rng_d"):
                        t = getattr(q, attr, None)
                        if isinstance(t, torch.Tensor):
                            self.pairs.append((t, t.detach().clone()))
                            self.slots.append((q, attr, t))
                            if attr == "scale":
                                self.scales.setdefault(id(m), []).append(t)

    def restore(self) -> None:
        with torch.no_grad():
            for t, saved in self.pairs:
                t.copy_(saved)


def _take_reports(reports: DeferredReports, what: str) -> List[Tuple[NonfiniteWatch, list]]:
    """The non-finite reports the capture of the {what} deferred (repeated eagerly after each replay)."""
    if reports.outside:
        raise RuntimeError(
            f"{_WHO}: a delayed-scaling update of the {what} ran outside the CUDA graph being captured "
            "(the autograd engine did not run its final callback on the capturing stream); the replay "
            "would not update the scales. Please report this with your torch version")
    return reports.take()


class _HoldingCache:
    """A module's weight cache that also keeps what the capture stores in it: the quantized weights of an
    ``is_first_microbatch=True`` graph live in its pool and are read by the reuse graph, so they must
    outlive the module cache (an optimizer step clears that)."""

    def __init__(self, cache: Any, keep: List[Any]) -> None:
        self.cache, self.keep = cache, keep

    def lookup(self, *args: Any) -> Any:
        return self.cache.lookup(*args)

    def store(self, key: Any, weights: Any, value: Any) -> None:
        self.keep.append(value)
        self.cache.store(key, weights, value)


@contextlib.contextmanager
def _weight_cache_mode(mods: Sequence[QuantizedModule], first: Optional[bool], keep: Optional[List[Any]]) -> Iterator[None]:
    """Decide every module's weight cache for the calls in this block: None: no cache (cast every
    call); True: cast and store; False: reuse the stored copy (TE's ``is_first_microbatch``)."""
    saved = []
    for m in mods:
        saved.append((m, m.__dict__.get("weight_cache_for")))
        if first is None:
            def choose(is_first_microbatch: Optional[bool] = None) -> Tuple[Any, str]:
                return None, AUTO
        else:
            method = type(m).weight_cache_during_capture.__get__(m)  # (weight_cache_for refuses a hit in a capture)

            def choose(is_first_microbatch: Optional[bool] = None, _method: Any = method) -> Tuple[Any, str]:
                cache, mode = _method(first)
                if cache is not None and keep is not None:
                    cache = _HoldingCache(cache, keep)
                return cache, mode
        m.__dict__["weight_cache_for"] = choose
    try:
        yield
    finally:
        for m, previous in saved:
            if previous is None:
                m.__dict__.pop("weight_cache_for", None)
            else:
                m.__dict__["weight_cache_for"] = previous


class _GraphPair:
    """One callable's forward and backward graphs with their static buffers (one per weight-cache
    variant), and what a replay does on the host afterwards."""

    def __init__(self, user_inputs: List[torch.Tensor], surface: List[torch.Tensor],
                 scales: List[torch.Tensor]) -> None:
        self.user_inputs = user_inputs
        self.surface = surface
        self.scales = scales
        self.fwd = torch.cuda.CUDAGraph()
        self.bwd: Optional[torch.cuda.CUDAGraph] = None
        self.static_outputs: Tuple[torch.Tensor, ...] = ()
        self.out_spec: Any = None
        self.static_grad_outputs: Tuple[Optional[torch.Tensor], ...] = ()
        self.static_grad_inputs: Tuple[Optional[torch.Tensor], ...] = ()
        self.fwd_reports: List[Tuple[NonfiniteWatch, list]] = []
        self.bwd_reports: List[Tuple[NonfiniteWatch, list]] = []
        self.grad_views: Tuple[Optional[torch.Tensor], ...] = ()

    def after(self, reports: List[Tuple[NonfiniteWatch, list]]) -> None:
        # the replay rewrote the scales in place: bump their versions as the eager update does (a cached
        # quantized weight is keyed by its scale's version)
        if self.scales:
            torch.autograd.graph.increment_version(self.scales)
        for watch, quantizers in reports:
            watch.report(quantizers)  # eager, no wait: reads the flags one replay or two later


class _Replay(torch.autograd.Function):
    """Forward: copy the new inputs into the static ones, replay the forward graph. Backward: copy the
    incoming grads, replay the backward graph, return the static grads."""

    @staticmethod
    def forward(ctx: Any, pair: _GraphPair, *inputs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        for static, x in zip(pair.user_inputs, inputs):
            if static.data_ptr() != x.data_ptr():
                static.copy_(x)
        pair.fwd.replay()
        pair.after(pair.fwd_reports)
        ctx.pair = pair
        outs = tuple(o.detach() for o in pair.static_outputs)
        frozen = [o for o, s in zip(outs, pair.static_outputs) if not s.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
        pair: _GraphPair = ctx.pair
        if pair.bwd is None:
            return (None,) * (1 + len(pair.surface))
        for static, g in zip(pair.static_grad_outputs, grads):
            if static is None:
                continue
            if g is None:
                static.zero_()
            elif static.data_ptr() != g.data_ptr():
                static.copy_(g)
        pair.bwd.replay()
        pair.after(pair.bwd_reports)
        # Kept referenced until the next backward: autograd then copies a grad into an empty .grad instead
        # of stealing the static buffer (the next replay would overwrite an accumulated .grad in place).
        pair.grad_views = tuple(None if b is None else b.detach() for b in pair.static_grad_inputs)
        return (None,) + pair.grad_views


# ----------------------------------------------------------------------------------------------
# one graphed callable


class _Graphed:
    """The replacement of one callable: checks the call, picks the graph pair, replays it."""

    def __init__(self, owner: "_Capture", index: int, fn: _Callable, leaves: List[Any], arg_spec: Any,
                 params: List[torch.Tensor], mods: List[QuantizedModule]) -> None:
        self.owner, self.index, self.fn = owner, index, fn
        self.leaves, self.arg_spec = leaves, arg_spec
        self.params = params
        self.mods = mods
        self.param_ptrs = [p.data_ptr() for p in params]
        self.pairs: Dict[Optional[bool], _GraphPair] = {}
        self.training = fn.training if isinstance(fn, torch.nn.Module) else None
        self.eager_forward: Optional[Callable[..., Any]] = None

    def _inputs(self, args: Tuple[Any, ...]) -> List[torch.Tensor]:
        leaves, spec = pytree.tree_flatten(tuple(args))
        if spec != self.arg_spec:
            raise TypeError(f"{_WHO}: graphed callable {self.index} was captured with arguments structured as "
                            f"{self.arg_spec}, called with {spec}")
        tensors = []
        for i, (x, s) in enumerate(zip(leaves, self.leaves)):
            if isinstance(s, torch.Tensor):
                if not isinstance(x, torch.Tensor):
                    raise TypeError(f"{_WHO}: argument {i} of graphed callable {self.index} must be a tensor "
                                    f"({_where(s)}), got {type(x).__name__}")
                if x.shape != s.shape or x.dtype != s.dtype or x.device != s.device:
                    raise ValueError(f"{_WHO}: argument {i} of graphed callable {self.index} is a {_where(x)}, "
                                     f"but the graph was captured for a {_where(s)}; a graph replays fixed shapes: "
                                     "capture one per shape (or pad)")
                if x.requires_grad != s.requires_grad:
                    raise ValueError(f"{_WHO}: argument {i} of graphed callable {self.index} has "
                                     f"requires_grad={x.requires_grad}, captured with {s.requires_grad}")
                tensors.append(x)
            elif not (x is s or x == s):
                raise ValueError(f"{_WHO}: argument {i} of graphed callable {self.index} is {x!r}, captured as "
                                 f"{s!r}; non-tensor arguments are constants of the graph")
        return tensors

    def _check_params(self) -> None:
        for p, ptr in zip(self.params, self.param_ptrs):
            if p.data_ptr() != ptr:
                raise RuntimeError(f"{_WHO}: a parameter of graphed callable {self.index} was given new storage "
                                   "after capture (p.data = ..., module.to()); the graph reads the old one. "
                                   "Update parameters in place, or capture again")

    def __call__(self, *args: Any, is_first_microbatch: Optional[bool] = None, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(f"{_WHO}: graphed callables take positional arguments only (and "
                            f"is_first_microbatch), got {sorted(kwargs)}")
        owner = self.owner
        first = owner.variant(is_first_microbatch)
        if self.training is not None and self.fn.training != self.training:
            # as torch does: another training state runs the original forward (eagerly, same recipe)
            with owner.eager_context():
                extra = {} if is_first_microbatch is None else {"is_first_microbatch": is_first_microbatch}
                return self.eager_forward(*args, **extra)
        owner.check_context()
        owner.check_state()
        self._check_params()
        inputs = self._inputs(args)
        pair = self.pairs[first]
        out = _Replay.apply(pair, *inputs, *self.params)
        return pytree.tree_unflatten(list(out), pair.out_spec)


class _Capture:
    """What all callables of one make_graphed_callables call share: recipe, group, weight caching, the
    state snapshot and the checks made at every call."""

    def __init__(self, enabled: bool, recipe: Any, group: Any, weight_caching: bool,
                 mods: List[QuantizedModule]) -> None:
        self.enabled, self.recipe, self.group = enabled, recipe, group
        self.weight_caching = weight_caching
        self.mods = mods
        self.state: Optional[_StateSnapshot] = None
        self.entries: List[Tuple[QuantizedModule, Any]] = []
        self.keep: List[Any] = []  # quantized weights of the caching graph; cuBLASLt workspaces

    def variant(self, is_first_microbatch: Optional[bool]) -> Optional[bool]:
        if not self.weight_caching:
            if is_first_microbatch is not None:
                raise TypeError(f"{_WHO}: is_first_microbatch needs weight_caching=True (fp8_weight_caching) "
                                "at capture; without it every replay casts the weights")
            return None
        if is_first_microbatch is None:
            return True  # the safe default: cast and cache
        if not isinstance(is_first_microbatch, bool):
            raise TypeError(f"is_first_microbatch must be None, True or False, got {is_first_microbatch!r}")
        return is_first_microbatch

    def eager_context(self) -> autocast:
        return autocast(enabled=self.enabled, recipe=self.recipe, amax_reduction_group=self.group)

    def describe(self) -> str:
        return repr(self.recipe) if self.enabled else "quantization off (enabled=False)"

    def check_context(self) -> None:
        state = get_autocast_state()
        if not state.depth:
            return
        if state.enabled != self.enabled or (self.enabled and state.recipe != self.recipe):
            now = repr(state.recipe) if state.enabled else "enabled=False"
            raise RuntimeError(f"{_WHO}: the graphs were captured under {self.describe()}, but are called inside "
                               f"fp_recipes.autocast({now}); a graph replays the casts and scale updates of the "
                               "recipe it was captured with. Capture again under the new recipe, or call the "
                               "graphed callables outside any autocast")
        if self.enabled and state.amax_reduction_group is not None and state.amax_reduction_group is not self.group:
            raise RuntimeError(f"{_WHO}: called inside an autocast with another amax_reduction_group than the "
                               "one captured; the captured all-reduce uses the capture's group")

    def check_state(self) -> None:
        for m, entry in self.entries:
            if m.recipe_state(self.recipe) is not entry:
                raise RuntimeError(f"{_WHO}: {type(m).__name__}'s quantizer state was rebuilt after capture "
                                   "(reset_quantizer_state()); the graphs update the old state. Capture again")
        if self.state is not None:
            for q, attr, t in self.state.slots:
                if getattr(q, attr) is not t:
                    what = "stochastic-rounding state" if attr == "_rng_d" else f"delayed-scaling {attr}"
                    raise RuntimeError(f"{_WHO}: a {what} was replaced after capture "
                                       "(module.to(), .cuda(), .half()); the graphs write the old tensor. "
                                       "Capture again after moving the module")

    def context(self, first: Optional[bool], keep: Optional[List[Any]] = None) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(_weight_cache_mode(self.mods, first, keep))
        stack.enter_context(self.eager_context())
        return stack


# ----------------------------------------------------------------------------------------------
# the entry point


def make_graphed_callables(
    modules: Union[_Callable, Tuple[_Callable, ...]],
    sample_args: Union[Tuple[Any, ...], Tuple[Tuple[Any, ...], ...]],
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    *,
    recipe: Any = None,
    enabled: bool = True,
    amax_reduction_group: Any = None,
    weight_caching: bool = False,
    pool: Any = None,
    fp8_enabled: Optional[bool] = None,
    fp8_recipe: Any = None,
    fp8_group: Any = None,
    fp8_weight_caching: Optional[bool] = None,
    fp8_calibrate: bool = False,
) -> Any:
    """Capture each callable's forward and backward under ``recipe`` as CUDA graphs; return drop-ins.

    ``modules``: an ``nn.Module`` or function, or a tuple of them in the order they run (their graphs
    share one memory pool, captured forward 1..N then backward N..1, and must be replayed so).
    ``sample_args``: a tuple of arguments (a tuple of tuples for a tuple of callables); tensors are the
    static input buffers (later inputs are copied into them), other values are constants of the graph.
    ``recipe``/``enabled``/``amax_reduction_group``: as :class:`fp_recipes.autocast` (``recipe=None``:
    ``FP_RECIPES_RECIPE``, else DelayedScaling); the graph carries its own autocast, so call the result
    outside any autocast or inside one of the same recipe. ``weight_caching=True``: the callables take
    ``is_first_microbatch`` (True or None: cast and keep the weights; False: reuse them).
    TransformerEngine's ``fp8_enabled``/``fp8_recipe``/``fp8_group``/``fp8_weight_caching`` are accepted.
    Modules are returned with their ``forward`` replaced (another ``training`` mode runs it eagerly);
    functions are returned as graphed callables. Outputs are the static output buffers (overwritten by
    the next replay)."""
    enabled, recipe, group, weight_caching = _te_aliases(
        enabled, recipe, amax_reduction_group, weight_caching, fp8_enabled, fp8_recipe, fp8_group,
        fp8_weight_caching, fp8_calibrate)
    single = not isinstance(modules, tuple)
    callables: Tuple[_Callable, ...] = (modules,) if single else modules
    per_args = (sample_args,) if single else sample_args
    if not isinstance(per_args, (tuple, list)) or len(per_args) != len(callables):
        raise TypeError(f"{_WHO}: a tuple of {len(callables)} callables needs a tuple of as many argument tuples")
    if not isinstance(num_warmup_iters, int) or isinstance(num_warmup_iters, bool) or num_warmup_iters < 1:
        raise ValueError(f"{_WHO}: num_warmup_iters must be an int >= 1 (the warm-up builds cached plans and "
                         f"tables outside the capture), got {num_warmup_iters!r}")
    if get_autocast_state().depth:
        raise RuntimeError(f"{_WHO}: call it outside fp_recipes.autocast: it enters its own autocast with the "
                           "recipe you pass, so the capture holds the autocast's exit (the scale update)")
    if torch.is_autocast_enabled("cuda") and torch.is_autocast_cache_enabled():
        raise RuntimeError(f"{_WHO}: torch.autocast needs cache_enabled=False around CUDA graph captures")
    if enabled:
        recipe = _resolve_recipe(recipe)
        enabled = recipe is not None  # FP_RECIPES_RECIPE=none
    else:
        recipe = None

    for i, fn in enumerate(callables):
        if not callable(fn):
            raise TypeError(f"{_WHO}: callable {i} is a {type(fn).__name__}, not an nn.Module or function")
    mods_per = [_quantized_modules(fn) for fn in callables]
    mods = [m for ms in mods_per for m in ms]
    if len({id(m) for m in mods}) != len(mods):
        raise ValueError(f"{_WHO}: a module appears in several callables; each graph must own its modules' "
                         "delayed-scaling state")
    mode = "global"
    if enabled:
        unknown = [None] if any(not ms and not isinstance(fn, torch.nn.Module)
                                for ms, fn in zip(mods_per, callables)) else []
        delayed, stochastic = _check_recipe(recipe, mods + unknown)
        if delayed or stochastic:
            for i, fn in enumerate(callables):
                if not mods_per[i] and not isinstance(fn, torch.nn.Module):
                    what = ("delayed scaling: pass the nn.Module, so the warm-up's changes to its scaling state "
                            "can be undone" if delayed else
                            "stochastic rounding: pass the nn.Module, so its quantizers' Philox counters can "
                            "move to the device (a counter on the host would be a constant of the graph and "
                            "every replay would draw the same numbers)")
                    raise TypeError(f"{_WHO}: callable {i} is a plain function; under {recipe!r} ({what})")
            if _reduced(recipe, mods):
                mode = _check_reduction(group)
    for i, fn in enumerate(callables):
        _check_module(fn, i)
    checked = [_check_sample_args(a, i) for i, a in enumerate(per_args)]
    if not torch.cuda.is_available():
        raise RuntimeError(f"{_WHO}: CUDA is not available")

    capture = _Capture(enabled, recipe, group, weight_caching, mods)
    if enabled:
        for m in mods:
            m.init_quantizer_state(recipe)
        _device_rng_states(mods)
        capture.entries = [(m, m.recipe_state(recipe)) for m in mods]
        capture.state = _StateSnapshot(mods, recipe)
    graphed = []
    for i, fn in enumerate(callables):
        leaves, spec = checked[i]
        params = list(fn.parameters()) if isinstance(fn, torch.nn.Module) else []
        g = _Graphed(capture, i, fn, leaves, spec, params, mods_per[i])
        graphed.append(g)
    _capture(capture, graphed, num_warmup_iters, allow_unused_input, pool, mode)

    out: List[Any] = []
    for g in graphed:
        fn = g.fn
        if isinstance(fn, torch.nn.Module):
            g.eager_forward = fn.forward
            fn.forward = g  # torch's convention: the module itself comes back, graphed
            out.append(fn)
        else:
            g.eager_forward = fn
            out.append(g)
    return out[0] if single else tuple(out)


def _surface(g: _Graphed) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    user = [x for x in g.leaves if isinstance(x, torch.Tensor)]
    return user, user + g.params


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Collect garbage now, then keep Python's cyclic collector off while the graphs are captured.

    Garbage from earlier captures (a graphed model in a reference cycle) may hold CUDA graphs; if the
    collector frees one mid-capture, its ``cudaGraphExecDestroy`` is refused on the capturing stream and
    invalidates the capture (``cudaErrorStreamCaptureInvalidated``). ``torch.cuda.graph`` no longer
    collects before a capture by default, so this does it."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _capture(capture: _Capture, graphed: List[_Graphed], warmup: int, allow_unused: bool, pool: Any,
             mode: str) -> None:
    variants: List[Optional[bool]] = [True, False] if capture.weight_caching else [None]
    torch.cuda.synchronize()
    # warm-up (eager, on a side stream as torch does): lazy inits, cached plans and tables, cuBLAS state
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for first in variants:
            for g in graphed:
                _, surface = _surface(g)
                for _ in range(warmup):
                    with capture.context(first):
                        outs = g.fn(*pytree.tree_unflatten(g.leaves, g.arg_spec))
                    need = [o for o in pytree.tree_leaves(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
                    wrt = [t for t in surface if t.requires_grad]
                    if need and wrt:
                        torch.autograd.grad(need, wrt, grad_outputs=[torch.zeros_like(o) for o in need],
                                            allow_unused=allow_unused)
                    del outs, need
    torch.cuda.synchronize()
    if capture.state is not None:
        capture.state.restore()  # the warm-up's scale updates do not count

    pools = {first: (pool if pool is not None else torch.cuda.graph_pool_handle()) for first in variants}
    # A stream of its own: the non-finite reports of these modules are deferred on it alone (another
    # thread's capture or eager step is not affected), and two captures never share a stream
    stream = torch.cuda.Stream()
    quantizers = [q for m in capture.mods for qs in (m.quantizer_sets or ()) for q in qs.quantizers.values()
                  if q is not None]
    with DeferredReports(stream, quantizers) as reports, _no_cyclic_gc():
        for first in variants:
            keep = capture.keep if first else None
            for g in graphed:  # forwards in order
                user, surface = _surface(g)
                scales = [t for m in g.mods for t in (capture.state.scales.get(id(m), []) if capture.state else [])]
                pair = g.pairs[first] = _GraphPair(user, surface, scales)
                with torch.cuda.graph(pair.fwd, pool=pools[first], stream=stream, capture_error_mode=mode):
                    with capture.context(first, keep):
                        outs = g.fn(*pytree.tree_unflatten(g.leaves, g.arg_spec))
                pair.fwd_reports = _take_reports(reports, "forward")
                flat, pair.out_spec = pytree.tree_flatten(outs)
                for o in flat:
                    if not isinstance(o, torch.Tensor):
                        raise TypeError(f"{_WHO}: callable {g.index} returned a {type(o).__name__}; graphed "
                                        "callables must return tensors (or nested tuples/lists/dicts of them)")
                pair.static_outputs = tuple(flat)
                del outs
            for g in reversed(graphed):  # backwards in reverse
                pair = g.pairs[first]
                need = [o for o in pair.static_outputs if o.requires_grad]
                pair.static_grad_outputs = tuple(torch.empty_like(o) if o.requires_grad else None
                                                 for o in pair.static_outputs)
                wrt = [t for t in pair.surface if t.requires_grad]
                grads: Sequence[Optional[torch.Tensor]] = ()
                if need and wrt:
                    pair.bwd = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(pair.bwd, pool=pools[first], stream=stream, capture_error_mode=mode):
                        grads = torch.autograd.grad(need, wrt, grad_outputs=[s for s in pair.static_grad_outputs
                                                                               if s is not None],
                                                    only_inputs=True, allow_unused=allow_unused)
                    pair.bwd_reports = _take_reports(reports, "backward")
                it = iter(grads)
                pair.static_grad_inputs = tuple(next(it) if (t.requires_grad and grads) else None
                                                for t in pair.surface)
    torch.cuda.synchronize()
    if capture.state is not None:
        capture.state.restore()
    for m in capture.mods:  # the module caches may hold graph-pool copies: eager calls must not reuse them
        m.clear_weight_cache()
    # cuBLASLt keeps a workspace per stream, made inside the first capture on the capture stream: hold
    # it, so an eviction from its table cannot hand the graphs' workspace to another capture
    from .gemm import cublaslt

    capture.keep.extend(getattr(cublaslt, "_workspaces", {}).values())
