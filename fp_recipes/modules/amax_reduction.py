"""Delayed scaling across modules: one amax all-reduce after the forward and one after the backward.

A delayed-scaling quantizer (``Float8Quantizer``) quantizes with the scale it already has and records
the amax of what it quantized into ``amax_history[0]`` (max-accumulated, so a module called twice in
one step records the max of both calls and both calls use the same scale). Nothing is synchronised
per call. Instead:

* **forward**: every quantizer used inside an autocast region is remembered; when the OUTERMOST
  autocast exits, the amaxes of all of them are stacked into one FP32 vector, reduced with ONE
  ``all_reduce(MAX)`` over the autocast's ``amax_reduction_group`` -- or, when none is given and
  torch.distributed is initialised with more than one rank, over the default world group, as
  TransformerEngine does (skipped when torch.distributed is not initialised) -- written back, and each
  quantizer's ``update_scale()`` runs (scale from the history by ``amax_compute_algo`` and ``margin``,
  then the history rolls). Every rank then holds the state one process that saw all ranks' data would.
* **backward**: the grad_output quantizers record their amaxes as the backward runs; the first one
  of a pass (an autograd graph task) queues a callback with the autograd engine that runs once the
  whole backward pass has finished and does the same single reduction + update for the backward
  quantizers. A pass that raises never runs its callback: its partial records are discarded when
  autograd drops it, and later passes update as usual (a bad batch costs one step, not the run).

Quantizers whose spec says ``reduce_amax=False`` (``DelayedScaling(reduce_amax=False)``) are updated
without taking part in the reduction: each rank then keeps its own scales.
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any, Dict, List, Optional

import torch

from .. import _extension, formats
from ..ops.op_library import define_op, register_fake
from ..ops.workspace import stream_capturing
from ..autocast import TRACED_RECORDS_SEEN, get_autocast_state, outermost_enabled_state, register_outermost_exit_hook
from ..quantizers import nonfinite
from ..quantizers.nonfinite import NonfiniteWatch

__all__ = ["AmaxReducer", "NO_REDUCTION", "batched_update_scales", "discard_records", "reducer",
           "reduce_and_update", "reduction_group"]

_COUNTERS: Dict[str, int] = {"all_reduce": 0}


NO_REDUCTION = object()  # reduction_group(): the amaxes are not reduced (one process, or no group)
# torch.distributed.is_available(), asked on the first update pass: fixed by the torch build, so nothing
# invalidates it (whether a process group is initialised is asked every pass)
_DIST_AVAILABLE: Optional[bool] = None


def reduction_group(group: Any) -> Any:
    """The process group the amaxes are MAX-reduced over, or ``NO_REDUCTION``.

    * torch.distributed not available or not initialised: no reduction;
    * an explicit ``amax_reduction_group``: that group (also of one rank);
    * ``None`` (none given): the default world group (``None`` to torch.distributed), as
      TransformerEngine does, unless the world has one rank (the reduction would be the identity).
      Without this, ranks that see different data drift apart silently. Opt out per recipe with
      ``DelayedScaling(reduce_amax=False)``."""
    global _DIST_AVAILABLE
    import torch.distributed as dist

    if _DIST_AVAILABLE is None:
        _DIST_AVAILABLE = dist.is_available()
    if not (_DIST_AVAILABLE and dist.is_initialized()):
        return NO_REDUCTION
    if group is None and dist.get_world_size() == 1:
        return NO_REDUCTION
    return group


def _mark_captured() -> None:
    """A delayed-scaling forward cast is being captured in a CUDA graph: flag this thread's outermost enabled
    autocast, whose exit must then be captured as well (checked there)."""
    state = outermost_enabled_state()
    if state is not None and not state.captured:
        object.__setattr__(state, "captured", True)  # (a frozen dataclass: this one flag is set after creation)


def reduce_and_update(quantizers: List[Any], group: Any) -> None:
    """Reduce ``amax_history[0]`` of ``quantizers`` with one all_reduce(MAX) over
    :func:`reduction_group` of ``group``, then update their scales. Quantizers whose spec says
    ``reduce_amax=False`` take no part in the reduction."""
    if not quantizers:
        return
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        batched_update_scales(quantizers)  # the common case: nothing to reduce
        return
    reduced = [q for q in quantizers if getattr(q.spec, "reduce_amax", True)]
    target = reduction_group(group) if reduced else NO_REDUCTION
    if target is not NO_REDUCTION:
        amaxes = torch.stack([q.amax_history[0] for q in reduced]).float()
        # NaN -> +Inf first: MAX then propagates a non-finite amax on every backend (NaN need not
        # survive MAX), so every rank drops it together, as one process holding all ranks' data would.
        amaxes.nan_to_num_(nan=float("inf"), posinf=float("inf"), neginf=float("inf"))
        dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=target)
        _COUNTERS["all_reduce"] += 1
        for q, v in zip(reduced, amaxes.unbind(0)):
            q.amax_history[0].copy_(v)
    batched_update_scales(quantizers)


_F8Q: Any = None


def _batch_key(q: Any):
    global _F8Q
    if _F8Q is None:
        from ..quantizers.float8 import Float8Quantizer

        _F8Q = Float8Quantizer
    if type(q) is not _F8Q:
        return None
    h = q.amax_history
    return (q.fmt_max, q.spec.margin, q.spec.amax_compute_algo, h.numel(), h.device)


_CONSTANTS: Dict[Any, torch.Tensor] = {}


def _constant(value: float, device: torch.device) -> torch.Tensor:
    """A cached FP32 0-dim device tensor (``scalar / tensor`` in torch is ``reciprocal(t) * scalar``,
    which rounds twice; a tensor numerator keeps the division correctly rounded, and caching it saves a
    fill kernel per step)."""
    key = (value, device)
    t = _CONSTANTS.get(key)
    if t is None:
        t = _CONSTANTS[key] = torch.full((), value, dtype=torch.float32, device=device)
    return t


class _UpdatePlan:
    """Everything one batch's update needs that does not change between steps: the destination
    tensors, a gather buffer and a staging buffer with their per-quantizer views, the roll
    permutation. Building these views is most of the host time of an update (a few microseconds per
    view, several views per quantizer), so it happens once per set of quantizers, not once per step."""

    def __init__(self, qs: List[Any], length: int, device: torch.device) -> None:
        n = len(qs)
        self.n, self.length = n, length
        self.dsts = [q.amax_history for q in qs] + [q.scale.view(1) for q in qs]
        self.flat = torch.empty(n * length + n, dtype=torch.float32, device=device)
        self.hist = self.flat[:n * length].view(n, length)
        self.hist0 = self.hist[:, 0]
        self.old = self.flat[n * length:]
        stage = torch.empty_like(self.flat)
        self.stage_hist = stage[:n * length].view(n, length)
        self.stage_col0 = self.stage_hist[:, 0]
        self.stage_scales = stage[n * length:]
        self.srcs = list(self.stage_hist.unbind(0)) + list(self.stage_scales.split(1))
        # roll by -1 along the history: out[:, i] = hist[:, (i + 1) % L]
        self.perm = torch.arange(1, length + 1, device=device) % length
        self.watch = NonfiniteWatch(n, device)


_PLANS: Dict[Any, _UpdatePlan] = {}


def _plan(qs: List[Any], length: int, device: torch.device) -> _UpdatePlan:
    # Keyed by the identities of the state tensors (a module.to() or bind_state() rebinds them, which
    # makes a new plan); the plan holds them, so an id cannot be reused while its entry exists.
    key = tuple([(id(q.amax_history), id(q.scale)) for q in qs])
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= 256:
            _PLANS.clear()
        plan = _PLANS[key] = _UpdatePlan(qs, length, device)
    return plan


# On CUDA (extension built), a batch is updated by ONE kernel launch instead of the torch ops below
# (fp_recipes/ops/cuda_delayed.py): the step is host-bound, and each op is a launch. The torch ops stay
# the reference twin; set this to False to run them on CUDA too (the tests compare both bit for bit).
USE_UPDATE_KERNEL = True

_KERNEL_PLANS: Dict[Any, Any] = {}
_KERNEL_OK: Optional[bool] = None


def _kernel_plan(qs: List[Any], length: int, device: torch.device) -> Any:
    """The cached one-launch updater of these quantizers' state tensors, or None (torch ops). Keyed
    like :func:`_plan`, plus the data pointers: the kernel writes through raw pointers, so a tensor
    whose storage was swapped in place (``t.data = ...``) must not reuse a stale table."""
    global _KERNEL_OK
    if _KERNEL_OK is None:
        from ..ops import cuda_delayed

        _KERNEL_OK = cuda_delayed.available()
    if not _KERNEL_OK:
        return None
    key = tuple([(id(q.amax_history), q.amax_history.data_ptr(), id(q.scale), q.scale.data_ptr()) for q in qs])
    hit = _KERNEL_PLANS.get(key, _KERNEL_PLANS)
    if hit is _KERNEL_PLANS:
        from ..ops.cuda_delayed import DelayedUpdate

        if len(_KERNEL_PLANS) >= 256:
            _KERNEL_PLANS.clear()
        watch = NonfiniteWatch(len(qs), device)
        # the kernel sets the flags in mapped host memory where it can: report() then reads them without
        # a copy or an event per update
        update = DelayedUpdate.build([q.amax_history for q in qs], [q.scale for q in qs], length, device,
                                     watch.flags, watch.mapped_flags())
        hit = _KERNEL_PLANS[key] = None if update is None else (update, watch, [q.scale for q in qs])
    return hit


def batched_update_scales(quantizers: List[Any]) -> None:
    """``q.update_scale()`` for every quantizer, with the Float8Quantizers of one kind updated together:
    on CUDA by one kernel launch (see USE_UPDATE_KERNEL), otherwise by the torch ops below, about ten
    kernels in all (instead of ~15 per quantizer), with no per-quantizer tensor views
    built per step (cached in an :class:`_UpdatePlan`): the delayed-scaling step overhead on a GPU is
    host time, so the op count is what matters.

    The batched rule is Float8Quantizer.update_scale's, op for op (same FP32 ops, same order):
    non-finite history entries become +0.0 (and flag the quantizer: one NonFiniteAmaxWarning each,
    read without a host sync, see NonfiniteWatch); amax_ref = max(history) or history[0];
    new = (fmt_max / amax_ref) / 2^margin with +Inf -> FLT_MAX; keep the old scale unless amax_ref > 0;
    roll the history by -1; zero slot 0. tests/test_modules_delayed.py and
    tests/test_faults_delayed_nonfinite.py check it against update_scale() bit for bit."""
    if torch.compiler.is_compiling():
        _traced_update_scales(quantizers)
        return
    key = tuple(map(id, quantizers))
    fast = _FAST_PLANS.get(key)
    if fast is not None and USE_UPDATE_KERNEL and fast.valid():
        fast.run()
        return
    steps: Optional[List[Any]] = []  # the kernel launches of this update (None: some other path ran)
    groups: Dict[Any, List[Any]] = {}
    for q in quantizers:
        bkey = _batch_key(q)
        if bkey is None:
            q.update_scale()
            steps = None
        else:
            groups.setdefault(bkey, []).append(q)
    for (fmt_max, margin, algo, length, device), qs in groups.items():
        if USE_UPDATE_KERNEL and device.type == "cuda":
            hit = _kernel_plan(qs, length, device)
            if hit is not None:
                update, watch, scales = hit
                update(fmt_max, margin, algo)  # one launch, the same bits as the ops below
                # the kernel writes through raw pointers: bump the scales' version counters as the torch
                # ops' in-place writes do (a cached quantized weight is keyed by its scale's version)
                torch.autograd.graph.increment_version(scales)
                watch.report(qs)
                if steps is not None:
                    steps.append((update, (fmt_max, margin, algo), watch, qs, scales))
                continue
        steps = None
        p = _plan(qs, length, device)
        torch.cat(p.dsts, out=p.flat)  # one gather of every history and scale
        bad = torch.isfinite(p.hist).all(dim=1).logical_not_()
        torch.logical_or(p.watch.flags, bad, out=p.watch.flags)
        p.hist.nan_to_num_(0.0, 0.0, 0.0)  # NaN/+-Inf do not count (written back by the roll)
        amax_ref = p.hist.amax(dim=1) if algo == "max" else p.hist0
        new = torch.div(_constant(fmt_max, device), amax_ref)
        if margin:
            new = torch.div(new, _constant(2.0 ** margin, device))
        new = new.clamp_max_(formats.FP32_MAX)  # +Inf (amax_ref 0 or subnormal) -> FLT_MAX
        torch.where(amax_ref > 0, new, p.old, out=p.stage_scales)
        if length > 1:
            torch.index_select(p.hist, 1, p.perm, out=p.stage_hist)
            p.stage_col0.zero_()  # a fill kernel; `t[:, 0] = 0.0` copies a host scalar (a sync on CUDA)
        else:
            p.stage_hist.zero_()
        torch._foreach_copy_(p.dsts, p.srcs)
        p.watch.report(qs)
    if steps:
        if len(_FAST_PLANS) >= 256:
            _FAST_PLANS.clear()
        _FAST_PLANS[key] = _FastUpdate(quantizers, steps)


class _FastUpdate:
    """What :func:`batched_update_scales` did for one list of quantizers when every batch ran the
    one-launch kernel: the next update of the same list (the same quantizers in the same order, each
    still holding the same state tensors at the same addresses) repeats the launches without grouping,
    keys or plan lookups. Holds the quantizers, so the ids of its key stay theirs."""

    __slots__ = ("checks", "steps", "scales", "cpp")

    def __init__(self, quantizers: List[Any], steps: List[Any]) -> None:
        self.checks = [(q, q.amax_history, q.scale, q.amax_history.data_ptr(), q.scale.data_ptr(), q.spec)
                       for q in quantizers]
        self.steps = [(update, args, watch, qs) for update, args, watch, qs, _ in steps]
        self.scales = [s for *_, scales in steps for s in scales]
        self.cpp = _cpp_updates(self.steps, self.scales)

    def valid(self) -> bool:
        for q, h, s, hp, sp, spec in self.checks:
            if q.amax_history is not h or q.scale is not s or q.spec is not spec or h.data_ptr() != hp \
                    or s.data_ptr() != sp:
                return False
        return True

    def run(self) -> None:
        cpp = self.cpp
        if cpp is not None and _extension.fast_ops() is not None:
            # the launches and version bumps below as one C++ call; True: the non-finite flags were read and are
            # clear, so the reports would do nothing (unless a CUDA-graph capture counts eager reports)
            clean = cpp.run()
            if clean is not None:
                if not clean or nonfinite._DEFERRED:
                    for _, _, watch, qs in self.steps:
                        watch.report(qs)
                return
        for update, args, _, _ in self.steps:
            update(*args)
        torch.autograd.graph.increment_version(self.scales)
        for _, _, watch, qs in self.steps:
            watch.report(qs)


def _cpp_updates(steps: List[Any], scales: List[torch.Tensor]) -> Any:
    """The torch-linked host path's ``DelayedUpdates`` for these launches (FP_RECIPES_TORCH_OPS), or None: not
    built, or the batches are on different devices."""
    fast = _extension.fast_ops()
    if fast is None or not hasattr(fast, "DelayedUpdates") or not steps:
        return None
    devices = {(update.device.type, update.device.index) for update, *_ in steps}
    if len(devices) != 1 or next(iter(devices))[0] != "cuda":
        return None
    batches = []
    for update, (fmt_max, margin, algo), watch, _ in steps:
        # (the flags' place was decided when the launcher was built: mapped_flags)
        batches.append((update.table_ptr, update.count, update.length, float(fmt_max), int(margin), algo == "max",
                        *watch.mapped_host()))
    index = devices.pop()[1]
    return fast.DelayedUpdates(-1 if index is None else index, batches, scales)


_FAST_PLANS: Dict[Any, _FastUpdate] = {}


def _traced_update_scales(quantizers: List[Any]) -> None:
    """:func:`batched_update_scales` as torch.compile traces it: the same FP32 ops in the same order
    (so the same bits), without the cached plans (persistent buffers and views built on the host),
    and without the non-finite warning (its flags are read on the host; the non-finite entries
    still count as 0)."""
    for q in quantizers:
        if _batch_key(q) is None:
            q.update_scale()
    groups: Dict[Any, List[Any]] = {}
    for q in quantizers:
        key = _batch_key(q)
        if key is not None:
            groups.setdefault(key, []).append(q)
    for (fmt_max, margin, algo, length, device), qs in groups.items():
        hist = torch.stack([q.amax_history for q in qs])
        old = torch.stack([q.scale for q in qs])
        hist = hist.nan_to_num(0.0, 0.0, 0.0)
        amax_ref = hist.amax(dim=1) if algo == "max" else hist[:, 0]
        new = torch.div(torch.full((), fmt_max, dtype=torch.float32, device=device), amax_ref)
        if margin:
            new = torch.div(new, torch.full((), 2.0 ** margin, dtype=torch.float32, device=device))
        new = new.clamp_max(formats.FP32_MAX)
        scales = torch.where(amax_ref > 0, new, old)
        if length > 1:
            # roll by -1 along the history, then slot 0 (the step just recorded, now last) starts at 0
            rolled = torch.roll(hist, -1, 1).index_fill(1, torch.zeros(1, dtype=torch.long, device=device), 0.0)
        else:
            rolled = torch.zeros_like(hist)
        for q, h, sc in zip(qs, rolled.unbind(0), scales.unbind(0)):
            q.amax_history.copy_(h)
            q.scale.copy_(sc)


class _BackwardPass:
    """The delayed-scaling quantizers recorded in ONE autograd backward pass (one graph task), and that
    pass's end-of-backward update: the object itself is the callback queued with the autograd engine.

    The engine holds the only strong reference. When the pass finishes, it calls the object (reduce and
    update). When the pass raises, the engine never calls it and drops it as the exception leaves
    ``backward()``: ``__del__`` then discards the pass's partial amax records (slot 0 of its quantizers,
    which hold nothing else since their last update), so the failed pass leaves the state as if it had
    not run, and the next pass updates normally."""

    __slots__ = ("reducer", "task", "quantizers", "group", "done", "__weakref__")

    def __init__(self, reducer: "AmaxReducer", task: int) -> None:
        self.reducer = reducer
        self.task = task
        self.quantizers: Dict[int, Any] = {}
        self.group: Any = None
        self.done = False

    def __call__(self) -> None:
        self.done = True
        self.reducer._finish_backward(self)

    def __del__(self) -> None:
        if not self.done and not sys.is_finalizing():
            self.done = True
            self.reducer._abandon_backward(self)


class AmaxReducer:
    """Collects the delayed-scaling quantizers used in one forward / one backward pass.

    Backward state is kept per autograd graph task (``torch._C._current_graph_task_id()``), each pass
    with its own queued update (:class:`_BackwardPass`): a pass that raises (a NaN under
    ``detect_anomaly``, an out-of-memory error) costs that pass only, and the next backward updates the
    grad_output scales as usual."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # RLock: a dropped pass's __del__ may run on any thread
        self._forward: Dict[int, Any] = {}
        self._forward_group: Any = None
        self._passes: Dict[int, "weakref.ref[_BackwardPass]"] = {}
        self._hook_handle: Any = None
        self._ensure_exit_hook()

    # ------------------------------------------------------------------ forward
    def _ensure_exit_hook(self) -> None:
        if self._hook_handle is not None:
            return
        self._hook_handle = register_outermost_exit_hook(self.on_outermost_exit)

    def record_forward(self, quantizer: Any, group: Any) -> None:
        """Remember a forward quantizer until the outermost autocast exits."""
        if torch.compiler.is_compiling():
            traced_record_forward(quantizer)
            return
        if TRACED_RECORDS_SEEN[0]:  # (_eager_traced_records, without a call until a trace saw an autocast)
            records = get_autocast_state().records
            if records is not None:
                _append_once(records, quantizer)
                return
        if self._hook_handle is None:
            self._ensure_exit_hook()
        if stream_capturing():
            _mark_captured()
        with self._lock:
            self._forward[id(quantizer)] = quantizer
            self._forward_group = group

    def record_forward_many(self, quantizers: List[Any], group: Any) -> None:
        """:meth:`record_forward` for a list (one lock round for a grouped layer's experts)."""
        if not quantizers:
            return
        if torch.compiler.is_compiling() or _eager_traced_records() is not None:
            for q in quantizers:
                self.record_forward(q, group)
            return
        self._ensure_exit_hook()
        if stream_capturing():
            _mark_captured()
        with self._lock:
            for q in quantizers:
                self._forward[id(q)] = q
            self._forward_group = group

    def on_outermost_exit(self, state: Any = None) -> None:
        records = getattr(state, "records", None)
        if torch.compiler.is_compiling():
            if records is None:
                # The autocast was entered outside this graph (a graph break, or an autocast method
                # compiled as a frame of its own): its quantizers were handed to the reducer when their
                # graphs ran, so the update must run eagerly, after this graph (a graph break here).
                from torch._dynamo import disable

                disable(self.on_outermost_exit)(state)
                return
            # the autocast was entered in a traced function: the quantizers its forward recorded (in its
            # list, see traced_record_forward) are reduced and updated as graph ops
            if records:
                reduce_and_update(list(records), getattr(state, "amax_reduction_group", None))
            return
        if getattr(state, "captured", False) and not stream_capturing():
            with self._lock:
                self._forward.clear()
                self._forward_group = None
            raise RuntimeError(
                "fp_recipes: delayed-scaling casts were captured in a CUDA graph inside an fp_recipes.autocast "
                "entered outside the capture. The autocast's exit (the amax reduction and scale update) is not in "
                "the graph, and no Python runs when it replays, so its scales would never be updated again. Enter "
                "fp_recipes.autocast inside the captured region, or capture with fp_recipes.make_graphed_callables "
                "(docs/cuda_graphs.md)")
        with self._lock:
            quantizers = list(self._forward.values())
            if records:  # an autocast entered in a traced frame, exiting eagerly
                quantizers += [q for q in records if id(q) not in self._forward]
            group = getattr(state, "amax_reduction_group", None) if state is not None else None
            if group is None:
                group = self._forward_group
            self._forward.clear()
            self._forward_group = None
        reduce_and_update(quantizers, group)

    def pending_forward(self) -> int:
        return len(self._forward)

    # ------------------------------------------------------------------ backward
    def record_backward(self, quantizer: Any, group: Any) -> None:
        """Remember a backward quantizer; the first one of a backward pass queues that pass's update."""
        self.record_backward_many([quantizer], group)

    def record_backward_many(self, quantizers: List[Any], group: Any) -> None:
        """Remember backward quantizers (their amaxes are already in ``amax_history[0]``) until the end
        of the current backward pass. Outside an autograd pass (a direct call of a Function's backward,
        e.g. in a test) the end of this call is the end of the "backward": update now."""
        if not quantizers:
            return
        if torch.compiler.is_compiling():
            # traced into a backward graph: the pass's bookkeeping runs when the graph runs, in an op
            for q in quantizers:
                traced_record_backward(q)
            return
        task = torch._C._current_graph_task_id()
        if task < 0:
            reduce_and_update(list({id(q): q for q in quantizers}.values()), group)
            return
        new = None
        with self._lock:
            ref = self._passes.get(task)
            bpass = ref() if ref is not None else None
            if bpass is None:
                bpass = new = _BackwardPass(self, task)
                self._passes[task] = weakref.ref(bpass)
            for q in quantizers:
                bpass.quantizers[id(q)] = q
            bpass.group = group
        if new is not None:
            torch.autograd.Variable._execution_engine.queue_callback(new)

    def pending_backward(self) -> int:
        """How many backward passes are recording now (0 between passes)."""
        with self._lock:
            return sum(1 for ref in self._passes.values() if ref() is not None)

    def _take(self, bpass: _BackwardPass) -> List[Any]:
        with self._lock:
            ref = self._passes.get(bpass.task)
            if ref is not None and ref() in (bpass, None):
                del self._passes[bpass.task]
            quantizers = list(bpass.quantizers.values())
            bpass.quantizers = {}
        return quantizers

    def _finish_backward(self, bpass: _BackwardPass) -> None:
        reduce_and_update(self._take(bpass), bpass.group)

    def _abandon_backward(self, bpass: _BackwardPass) -> None:
        quantizers = self._take(bpass)
        if quantizers:
            discard_records(quantizers)


def discard_records(quantizers: List[Any]) -> None:
    """Zero ``amax_history[0]`` of these quantizers (the records of a pass that did not finish)."""
    slots = [q.amax_history[0] for q in quantizers if isinstance(getattr(q, "amax_history", None), torch.Tensor)]
    if slots:
        torch._foreach_zero_(slots)


reducer = AmaxReducer()


# ----------------------------------------------------------------------------------------------
# torch.compile: the bookkeeping a graph does when it runs
#
# A graph cannot replay the reducer's Python bookkeeping (which quantizers a pass used), so a traced
# forward outside a traced autocast, and every traced backward, call these ops: they name their
# quantizer by a *handle tensor* (a CPU int64 scalar per quantizer, a graph input like any state
# tensor), never by a constant baked into the graph, so identical layers share one compiled graph.
# An autocast entered inside the traced function collects its quantizers at trace time instead and
# updates them with graph ops when it exits (AmaxReducer.on_outermost_exit).

_HANDLES: Dict[int, Any] = {}       # handle -> weakref to the quantizer
_HANDLE_SETS: Dict[int, Any] = {}   # handle -> weakref to its GemmQuantizers (the call's group)
_NEXT_HANDLE = [1]


def register_traced(qs: Any) -> None:
    """Give the quantizers of the set ``qs`` a handle tensor the ops below resolve (eager, at trace
    time). A copy of a quantizer (deepcopy) that carries another's handle gets its own."""
    for q in qs.quantizers.values():
        if q is None:
            continue
        t = q.__dict__.get("_trace_handle")
        ref = _HANDLES.get(int(t)) if t is not None else None
        if t is None or (ref is not None and ref() is not q):
            if len(_HANDLES) > 4096:
                for h in [h for h, r in _HANDLES.items() if r() is None]:
                    _HANDLES.pop(h, None)
                    _HANDLE_SETS.pop(h, None)
            h = _NEXT_HANDLE[0]
            _NEXT_HANDLE[0] += 1
            q._trace_handle = torch.tensor(h, dtype=torch.int64)
        else:
            h = int(t)
        _HANDLES[h] = weakref.ref(q)
        _HANDLE_SETS[h] = weakref.ref(qs)
    reducer._ensure_exit_hook()


def _resolve(handle: torch.Tensor) -> "tuple[Any, Any]":
    h = int(handle)
    ref = _HANDLES.get(h)
    q = ref() if ref is not None else None
    if q is None:
        raise RuntimeError("fp_recipes: a compiled graph refers to a quantizer that no longer exists "
                           "(its module was deleted or its quantizer state reset): compile again")
    sref = _HANDLE_SETS.get(h)
    qs = sref() if sref is not None else None
    return q, None if qs is None else qs.amax_reduction_group


def _delayed_record_forward_impl(handle: torch.Tensor) -> None:
    q, group = _resolve(handle)
    reducer.record_forward(q, group)


_delayed_record_forward = define_op("delayed_record_forward", _delayed_record_forward_impl, side_effect=True)


@register_fake(_delayed_record_forward)
def _(handle):
    return None


def _delayed_record_backward_impl(handle: torch.Tensor, history: torch.Tensor) -> None:
    q, group = _resolve(handle)
    reducer.record_backward(q, group)


_delayed_record_backward = define_op("delayed_record_backward", _delayed_record_backward_impl, side_effect=True)


@register_fake(_delayed_record_backward)
def _(handle, history):
    return None


class _FlushState:
    __slots__ = ("amax_reduction_group",)

    def __init__(self, group: Any) -> None:
        self.amax_reduction_group = group


def _delayed_flush_forward_impl(anchor: torch.Tensor, handle: torch.Tensor) -> None:
    if reducer.pending_forward():
        _, group = _resolve(handle)
        with torch.inference_mode(False):
            reducer.on_outermost_exit(_FlushState(group))


_delayed_flush_forward = define_op("delayed_flush_forward", _delayed_flush_forward_impl, side_effect=True)


@register_fake(_delayed_flush_forward)
def _(anchor, handle):
    return None


def _traced_records() -> Optional[list]:
    """The quantizer list of this thread's innermost autocast when that (outermost enabled) autocast was
    entered by a function torch.compile traced (None otherwise, always outside torch.compile)."""
    return get_autocast_state().records


def _eager_traced_records() -> Optional[list]:
    """:func:`_traced_records` for eager calls: nothing to look up until torch.compile traced an autocast."""
    return get_autocast_state().records if TRACED_RECORDS_SEEN[0] else None


def _append_once(records: list, quantizer: Any) -> None:
    for seen in records:
        if seen is quantizer:
            return
    records.append(quantizer)


def traced_record_forward(quantizer: Any) -> None:
    """(traced) Remember a forward quantizer: in the traced autocast's list when the outermost enabled
    autocast was entered in this trace (its exit updates them in the graph), else with the reducer when
    the graph runs (the eager autocast exit, or a module recipe's backward, updates them)."""
    records = _traced_records()
    if records is None:
        torch.ops.fp_recipes.delayed_record_forward(quantizer._trace_handle)
        return
    _append_once(records, quantizer)


def traced_record_backward(quantizer: Any) -> None:
    """(traced) The backward's pass bookkeeping for ``quantizer``, run when the graph runs."""
    # The history just recorded into is an argument: it ties the call to the backward (an op that read
    # only the handle, a forward input, could be placed in the forward graph by the partitioner, where
    # it would find no backward pass and update at once). The recorded amax reaches the module's
    # tensor when the backward graph ends, before the pass's end runs the update.
    torch.ops.fp_recipes.delayed_record_backward(quantizer._trace_handle, quantizer.amax_history)


def traced_flush_forward(qs: Any, anchor: torch.Tensor) -> None:
    """(traced) A module recipe's backward flushes the pending forward amaxes, when the graph runs
    (``anchor``: a tensor of the backward, which places the call)."""
    for q in qs.quantizers.values():
        if q is not None:
            torch.ops.fp_recipes.delayed_flush_forward(anchor, q._trace_handle)
            return


def all_reduce_count() -> int:
    """How many amax all-reduces this process issued (for tests and diagnostics)."""
    return _COUNTERS["all_reduce"]
