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

from ..quantizers.float8 import NonfiniteWatch

__all__ = ["AmaxReducer", "batched_update_scales", "discard_records", "reducer", "reduce_and_update",
           "reduction_group"]

_COUNTERS: Dict[str, int] = {"all_reduce": 0}


_NO_REDUCTION = object()


def reduction_group(group: Any) -> Any:
    """The process group the amaxes are MAX-reduced over, or ``_NO_REDUCTION``.

    * torch.distributed not available or not initialised: no reduction;
    * an explicit ``amax_reduction_group``: that group (also of one rank);
    * ``None`` (none given): the default world group (``None`` to torch.distributed), as
      TransformerEngine does, unless the world has one rank (the reduction would be the identity).
      Without this, ranks that see different data drift apart silently. Opt out per recipe with
      ``DelayedScaling(reduce_amax=False)``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return _NO_REDUCTION
    if group is None and dist.get_world_size() == 1:
        return _NO_REDUCTION
    return group


def reduce_and_update(quantizers: List[Any], group: Any) -> None:
    """Reduce ``amax_history[0]`` of ``quantizers`` with one all_reduce(MAX) over
    :func:`reduction_group` of ``group``, then update their scales. Quantizers whose spec says
    ``reduce_amax=False`` take no part in the reduction."""
    if not quantizers:
        return
    reduced = [q for q in quantizers if getattr(q.spec, "reduce_amax", True)]
    target = reduction_group(group) if reduced else _NO_REDUCTION
    if target is not _NO_REDUCTION:
        import torch.distributed as dist

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
    key = tuple((id(q.amax_history), id(q.scale)) for q in qs)
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
    key = tuple((id(h), h.data_ptr(), id(s), s.data_ptr())
                for h, s in ((q.amax_history, q.scale) for q in qs))
    hit = _KERNEL_PLANS.get(key, _KERNEL_PLANS)
    if hit is _KERNEL_PLANS:
        from ..ops.cuda_delayed import DelayedUpdate

        if len(_KERNEL_PLANS) >= 256:
            _KERNEL_PLANS.clear()
        watch = NonfiniteWatch(len(qs), device)
        update = DelayedUpdate.build([q.amax_history for q in qs], [q.scale for q in qs], length, device,
                                     watch.flags)
        hit = _KERNEL_PLANS[key] = None if update is None else (update, watch)
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
    from .. import formats

    groups: Dict[Any, List[Any]] = {}
    for q in quantizers:
        key = _batch_key(q)
        if key is None:
            q.update_scale()
        else:
            groups.setdefault(key, []).append(q)
    for (fmt_max, margin, algo, length, device), qs in groups.items():
        if USE_UPDATE_KERNEL and device.type == "cuda":
            hit = _kernel_plan(qs, length, device)
            if hit is not None:
                update, watch = hit
                update(fmt_max, margin, algo)  # one launch, the same bits as the ops below
                watch.report(qs)
                continue
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

    # ------------------------------------------------------------------ forward
    def _ensure_exit_hook(self) -> None:
        if self._hook_handle is not None:
            return
        from .. import autocast as autocast_mod

        register = getattr(autocast_mod, "register_outermost_exit_hook", None)
        if register is None:
            register = getattr(getattr(autocast_mod, "autocast"), "register_outermost_exit_hook")
        self._hook_handle = register(self.on_outermost_exit)

    def record_forward(self, quantizer: Any, group: Any) -> None:
        """Remember a forward quantizer until the outermost autocast exits."""
        self._ensure_exit_hook()
        with self._lock:
            self._forward[id(quantizer)] = quantizer
            self._forward_group = group

    def record_forward_many(self, quantizers: List[Any], group: Any) -> None:
        """:meth:`record_forward` for a list (one lock round for a grouped layer's experts)."""
        if not quantizers:
            return
        self._ensure_exit_hook()
        with self._lock:
            for q in quantizers:
                self._forward[id(q)] = q
            self._forward_group = group

    def on_outermost_exit(self, state: Any = None) -> None:
        with self._lock:
            quantizers = list(self._forward.values())
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


def all_reduce_count() -> int:
    """How many amax all-reduces this process issued (for tests and diagnostics)."""
    return _COUNTERS["all_reduce"]
