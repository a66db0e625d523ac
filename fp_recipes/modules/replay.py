"""Activation checkpointing: a recomputed forward quantizes exactly as the original forward did.

``torch.utils.checkpoint`` runs a region's forward twice: once in the forward pass (its activations
dropped) and again inside the backward to rebuild them. The second run must not read the ambient
state (the autocast may have exited, the backward may run on another thread), must quantize with the
scales the first run used (delayed scaling updates them when the autocast exits, in between), must
draw the same stochastic-rounding numbers, and must record no amax.

So a forward that may be recomputed leaves a :class:`CallRecord` in its module's FIFO: the quantizer
sets it used, a snapshot of the delayed-scaling forward scales, and the stochastic-rounding offsets of
the forward quantizers. A forward that runs inside a backward (``torch._C._current_graph_task_id()
!= -1``) while its module has records is a recompute: it takes the oldest live record and quantizes
with :func:`replay_sets` (copies of the forward quantizers bound to the snapshot, recording nothing).
Recomputes of one module happen in the order of its forwards (each region's recompute replays it
in forward order; pipeline schedules backpropagate the oldest micro-batch first).

Which forwards may be recomputed, cheaply decided per call:

* grad enabled and a saved-tensors hook active (``torch.utils.checkpoint`` with ``use_reentrant=False``
  runs the first pass under its hook): the record is held by the call's autograd node (``ctx``) and
  only weakly by the FIFO, so it goes away with the graph; the node's backward marks it done;
* grad disabled, module in training mode, inside an ``autograd.Function`` forward: the first pass of
  a reentrant checkpoint (``use_reentrant=True``, Megatron's and DeepSpeed's ``CheckpointFunction``)
  runs so. Held by the FIFO (bounded) until the recompute takes it.

Everything else (plain training, eval, inference) records nothing.

Operands for the backward are kept as saved tensors (:func:`pack`/:func:`unpack`), so autograd frees
them after a backward that does not retain the graph, keeps them for ``retain_graph=True``, and
checkpointing drops them with the rest of the region's activations.
"""

from __future__ import annotations

import collections
import sys
import weakref
from typing import Any, Callable, Deque, List, Optional, Sequence, Tuple

import torch

from ..quantizers.roles import ScalingKind, TensorKind

__all__ = ["CallRecord", "RecordQueue", "pack", "unpack", "may_be_recomputed", "in_backward", "replay_sets"]

_FORWARD_OPERANDS = (TensorKind.ACTIVATION, TensorKind.WEIGHT)
_MAX_RECORDS = 4096  # per module: a safety bound; records leave when recomputed, done or collected


def in_backward() -> bool:
    """True while this thread runs an autograd backward (where a checkpoint recomputes)."""
    return torch._C._current_graph_task_id() != -1


_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_APPLY_CODE = torch.autograd.function.Function.apply.__func__.__code__


def _inside_function_forward(limit: int = 128) -> bool:
    """Whether an ``autograd.Function.apply`` is on this thread's stack (a reentrant checkpoint runs
    its first pass inside one)."""
    frame = sys._getframe(2)
    while frame is not None and limit:
        if frame.f_code is _APPLY_CODE:
            return True
        frame = frame.f_back
        limit -= 1
    return False


def may_be_recomputed(training: bool) -> bool:
    """Whether this forward may run again under activation checkpointing (see the module doc)."""
    if torch.is_grad_enabled():
        return _top_hooks(False) is not None
    return training and not torch.is_inference_mode_enabled() and _inside_function_forward()


class CallRecord:
    """What one forward call quantized with: ``sets`` (None: it did not quantize), the delayed-scaling
    forward scales (one stacked snapshot) and the stochastic-rounding offsets of its forward
    quantizers."""

    __slots__ = ("sets", "scales", "offsets", "done", "weight_recast", "__weakref__")

    def __init__(self, sets: Optional[List[Any]]) -> None:
        self.sets = sets
        self.done = False
        # per set (keyed by id of its quantizers dict, shared by the set's per-call variants): whether the
        # call made its weight's columnwise copy in the backward (weight_columnwise.py); a recompute
        # repeats the choice, so it saves the same tensors (non-reentrant checkpoint compares them)
        self.weight_recast: dict = {}
        scales: List[torch.Tensor] = []
        offsets: List[int] = []
        for qs in sets or ():
            for tensor in _FORWARD_OPERANDS:
                q = qs.quantizers[tensor]
                if q is None:
                    continue
                if q.spec.scaling is ScalingKind.DELAYED:
                    scales.append(q.scale)
                if getattr(q.spec, "stochastic_rounding", False):
                    offsets.append(q.offset)
        # one kernel for all of them (the scales change in place when the autocast exits)
        self.scales = torch.stack(scales) if scales else None
        self.offsets = offsets


def _clone_object(q: Any) -> Any:
    new = object.__new__(type(q))
    new.__dict__.update(q.__dict__)
    if new.__dict__.get("_offset_t") is not None or new.__dict__.get("_rng_d") is not None:
        # NVFP4 SR state tensors (CPU, or on the device for a CUDA graph): the copy keeps its own ints
        new.__dict__.update(_seed_t=None, _offset_t=None, _rng_d=None, _rng_step=None, _seed=q.seed, _offset=q.offset)
    return new


def replay_sets(record: CallRecord, make: Callable[..., Any]) -> Optional[List[Any]]:
    """The quantizer sets a recompute of ``record``'s call uses: forward quantizers copied and bound to
    the snapshot (delayed: the scale used then, a scratch history; SR: the offset used then);
    grad_output quantizers are the module's own (a reentrant checkpoint's backward runs through the
    recomputed graph and must update the real gradient state). ``make(qs, quantizers)`` builds one
    set with ``replay=True``."""
    if record.sets is None:
        return None
    si = oi = 0
    out = []
    for qs in record.sets:
        quantizers = dict(qs.quantizers)
        for tensor in _FORWARD_OPERANDS:
            q = quantizers[tensor]
            if q is None:
                continue
            delayed = q.spec.scaling is ScalingKind.DELAYED
            sr = getattr(q.spec, "stochastic_rounding", False)
            if not (delayed or sr):
                continue
            q = _clone_object(q)
            if delayed:
                q.scale = record.scales[si]
                q.amax_history = q.amax_history.clone()  # written by quantize, then dropped
                si += 1
            if sr:
                q.offset = record.offsets[oi]
                oi += 1
            quantizers[tensor] = q
        out.append(make(qs, quantizers))
    return out


class RecordQueue:
    """One module's FIFO of call records (weak entries for records owned by an autograd node)."""

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: Deque[Any] = collections.deque(maxlen=_MAX_RECORDS)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def push(self, record: CallRecord, weak: bool) -> None:
        items = self._items
        while items and _live(items[0]) is None:
            items.popleft()
        items.append(weakref.ref(record) if weak else record)

    def pop(self) -> Optional[CallRecord]:
        items = self._items
        while items:
            record = _live(items.popleft())
            if record is not None:
                return record
        return None

    def clear(self) -> None:
        self._items.clear()


def _live(entry: Any) -> Optional[CallRecord]:
    record = entry() if isinstance(entry, weakref.ref) else entry
    if record is None or record.done:
        return None
    return record


# ----------------------------------------------------------------------------------------------
# backward operands as saved tensors


def pack(objs: Sequence[Any]) -> Tuple[List[Optional[torch.Tensor]], List[Any]]:
    """Split operands into (tensors for ``ctx.save_for_backward``, shells to rebuild them).

    A tensor or None is kept as is; a quantized tensor (a plain object holding tensors) becomes a
    shell without its tensors; an object with ``split_saved() -> (tensors, shell)`` and
    ``shell.with_saved_tensors(tensors)`` (Float8Tensor, NVFP4Tensor, the grouped FP8 casts) says itself
    what its tensors are."""
    tensors: List[Optional[torch.Tensor]] = []
    shells: List[Any] = []
    for o in objs:
        if o is None or isinstance(o, torch.Tensor):
            shells.append(None)
            tensors.append(o)
        elif hasattr(o, "split_saved"):
            ts, shell = o.split_saved()
            shells.append(("custom", shell, len(ts)))
            tensors.extend(ts)
        else:
            d = o.__dict__
            names = [k for k, v in d.items() if isinstance(v, torch.Tensor)]
            shell = object.__new__(type(o))
            shell.__dict__.update(d)
            for k in names:
                shell.__dict__[k] = None
            shells.append(("object", shell, names))
            tensors.extend(d[k] for k in names)
    return tensors, shells


def unpack(shells: Sequence[Any], tensors: Sequence[Optional[torch.Tensor]]) -> List[Any]:
    """Inverse of :func:`pack` (fresh objects; the shells are not modified)."""
    out: List[Any] = []
    i = 0
    for shell in shells:
        if shell is None:
            out.append(tensors[i])
            i += 1
        elif shell[0] == "custom":
            n = shell[2]
            out.append(shell[1].with_saved_tensors(list(tensors[i:i + n])))
            i += n
        else:
            obj = object.__new__(type(shell[1]))
            obj.__dict__.update(shell[1].__dict__)
            for k in shell[2]:
                obj.__dict__[k] = tensors[i]
                i += 1
            out.append(obj)
    return out
