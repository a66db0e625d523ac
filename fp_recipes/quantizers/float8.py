"""FP8 per-tensor quantized tensors and their quantizers (delayed and current scaling).

Numerics live in the ops (``fp_recipes.ops.fp8_*``, reference in ``ops/ref_fp8.py``); this module holds
state and shapes. Quantizers always go through the op dispatcher, so a CUDA tensor runs the kernel.
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .. import formats, ops
# (at module level: Dynamo on torch 2.11 cannot trace an import of fp_recipes.autocast, a module of its own class)
from ..autocast import OUTERMOST_ENTER_HOOKS, get_autocast_state
from ..ops.op_library import define_op, register_fake
from ..ops.backend import resolved
from ..ops.ref_fp8 import current_scale
from ._tensor_io import (STATE_VERSION, StatePickle, allow_in_weights_only_load, check_state,
                         dtype_from_name, dtype_name, move, resolve_out_dtype)
from .base import QuantizedTensor, Quantizer, check_input, shallow_copy
from .nonfinite import NonFiniteAmaxWarning, NonfiniteWatch
from .roles import QFormat, QuantizerSpec, ScalingKind, TensorKind

_FMT_OF_DTYPE = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def flatten_2d(x: torch.Tensor, what: str) -> torch.Tensor:
    """(..., K) -> (prod(leading), K); a 1-D tensor becomes one row."""
    if x.dim() == 0:
        raise ValueError(f"{what}: cannot quantize a 0-dim tensor; give it at least one dim")
    return x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def checked_2d(x: torch.Tensor, what: str) -> torch.Tensor:
    """``check_input`` then :func:`flatten_2d`; a plain 2-D float tensor (every Linear operand) passes in
    three attribute reads, anything else takes the full checks and their errors."""
    if type(x) in _PLAIN_TENSORS and x.dtype in _INPUT_DTYPES and x.ndim == 2:
        return x
    check_input(x, what)
    return flatten_2d(x, what)


def fp8_fmt_of_spec(spec: QuantizerSpec, what: str) -> str:
    if spec.fmt not in (QFormat.E4M3, QFormat.E5M2):
        raise ValueError(f"{what}: spec fmt must be e4m3 or e5m2, got {spec.fmt.value} "
                         f"(role {spec.role})")
    return spec.fmt.value


class Float8Tensor(StatePickle, QuantizedTensor):
    """An FP8 tensor with one FP32 scale: value = fp32(data) * scale_inv.

    ``data`` is the rowwise copy, 2-D (prod(leading dims), last dim); ``data_t`` the optional columnwise
    copy, (last dim, prod(leading)). ``shape`` is the original (logical) shape. At least one copy is set.
    """

    kind = "float8"

    #: the instance attributes (shallow_copy in a trace by torch < 2.13)
    COPY_FIELDS = ("data", "data_t", "scale_inv", "amax", "fmt", "orig_dtype", "_shape")

    def __init__(self, data: Optional[torch.Tensor], scale_inv: torch.Tensor, amax: torch.Tensor, fmt: str,
                 orig_dtype: torch.dtype, shape, data_t: Optional[torch.Tensor] = None) -> None:
        if data is None and data_t is None:
            raise ValueError("Float8Tensor needs a rowwise copy (data), a columnwise copy (data_t), or both")
        if fmt not in ("e4m3", "e5m2"):
            raise ValueError(f"Float8Tensor: fmt must be 'e4m3' or 'e5m2', got {fmt!r}")
        shape = torch.Size(shape)
        rows = math.prod(shape[:-1]) if len(shape) else 1
        cols = shape[-1] if len(shape) else 1
        for name, t, want in (("data", data, (rows, cols)), ("data_t", data_t, (cols, rows))):
            if t is None:
                continue
            if _FMT_OF_DTYPE.get(t.dtype) != fmt:
                raise TypeError(f"Float8Tensor: {name} has dtype {t.dtype}, which does not hold fmt {fmt!r}")
            if tuple(t.shape) != want:
                raise ValueError(f"Float8Tensor: {name} must have shape {want} for logical shape "
                                 f"{tuple(shape)}, got {tuple(t.shape)}")
        for name, t in (("scale_inv", scale_inv), ("amax", amax)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 0:
                raise TypeError(f"Float8Tensor: {name} must be an FP32 0-dim tensor")
        self.data = data
        self.data_t = data_t
        self.scale_inv = scale_inv
        self.amax = amax
        self.fmt = fmt
        self.orig_dtype = orig_dtype
        self._shape = shape

    @property
    def shape(self) -> torch.Size:
        return self._shape

    @property
    def device(self) -> torch.device:
        return (self.data if self.data is not None else self.data_t).device

    @property
    def dtype(self) -> torch.dtype:
        """The fp8 storage dtype."""
        return formats.FP8_DTYPE[self.fmt]

    def split_saved(self) -> "tuple[tuple, Float8Tensor]":
        """(its tensors, a shell without them), for ``ctx.save_for_backward`` (``modules/replay.pack``):
        the four fields are known, so nothing is searched per call."""
        shell = shallow_copy(self)
        shell.data = shell.data_t = shell.scale_inv = shell.amax = None
        return (self.data, self.data_t, self.scale_inv, self.amax), shell

    def with_saved_tensors(self, tensors: Sequence[Optional[torch.Tensor]]) -> "Float8Tensor":
        """The inverse of :meth:`split_saved`, on the shell: a new tensor holding ``tensors``."""
        t = shallow_copy(self)
        t.data, t.data_t, t.scale_inv, t.amax = tensors
        return t

    def release_rowwise(self) -> None:
        if self.data_t is not None:
            self.data = None

    def rowwise_data(self) -> torch.Tensor:
        """The rowwise copy; from the columnwise one by a byte transpose if absent (exact)."""
        return self.data if self.data is not None else self.data_t.t().contiguous()

    def t_data(self) -> torch.Tensor:
        """The columnwise copy (N, M); from the rowwise one by a byte transpose if absent (exact)."""
        return self.data_t if self.data_t is not None else self.data.t().contiguous()

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``dtype(fp32(data) * scale_inv)`` in the original shape; dtype defaults to the original dtype."""
        out = ops.fp8_dequantize(self.rowwise_data(), self.scale_inv, resolve_out_dtype(dtype, self.orig_dtype))
        return out.reshape(self._shape)

    def to(self, device) -> "Float8Tensor":
        return Float8Tensor(move(self.data, device), self.scale_inv.to(device), self.amax.to(device),
                            self.fmt, self.orig_dtype, self._shape, data_t=move(self.data_t, device))

    def state_dict(self) -> Dict[str, Any]:
        return {"kind": self.kind, "version": STATE_VERSION, "fmt": self.fmt, "data": self.data,
                "data_t": self.data_t, "scale_inv": self.scale_inv, "amax": self.amax,
                "orig_dtype": dtype_name(self.orig_dtype), "shape": list(self._shape)}

    @classmethod
    def from_state_dict(cls, state: Dict[str, Any]) -> "Float8Tensor":
        check_state(state, cls.kind, ("fmt", "data", "data_t", "scale_inv", "amax", "orig_dtype", "shape"))
        return cls(state["data"], state["scale_inv"], state["amax"], state["fmt"],
                   dtype_from_name(state["orig_dtype"]), state["shape"], data_t=state["data_t"])

    def __reduce__(self):
        """Pickle (also ``copy.deepcopy``, ``torch.save``) with the FP8 bytes as uint8 views: torch
        cannot unpickle float8 storages. A view into a larger buffer is copied, so only its bytes are
        written. :func:`_rebuild_float8_tensor` (allowlisted for ``torch.load(weights_only=True)``)
        restores the exact bytes."""
        state = self.state_dict()
        for key in ("data", "data_t"):
            t = state[key]
            if t is not None:
                if t.untyped_storage().nbytes() != t.numel() or not t.is_contiguous():
                    t = t.contiguous().clone()
                state[key] = t.view(torch.uint8)
        return (_rebuild_float8_tensor, (state,))

    def __repr__(self) -> str:
        copies = "+".join(n for n, t in (("row", self.data), ("col", self.data_t)) if t is not None)
        return (f"Float8Tensor(shape={tuple(self._shape)}, fmt={self.fmt}, copies={copies}, "
                f"scale_inv={self.scale_inv.item():.6g}, amax={self.amax.item():.6g}, "
                f"orig_dtype={dtype_name(self.orig_dtype)}, device={self.device})")


def _rebuild_float8_tensor(state: Dict[str, Any]) -> Float8Tensor:
    """The unpickler of :meth:`Float8Tensor.__reduce__`: views the uint8 bytes as the FP8 dtype again."""
    if not isinstance(state, dict) or state.get("fmt") not in formats.FP8_DTYPE:
        raise ValueError("a pickled Float8Tensor needs a state dict with fmt 'e4m3' or 'e5m2'")
    state = dict(state)
    for key in ("data", "data_t"):
        t = state.get(key)
        if isinstance(t, torch.Tensor) and t.dtype == torch.uint8:
            state[key] = t.view(formats.FP8_DTYPE[state["fmt"]])
    return Float8Tensor.from_state_dict(state)


def _wrap_traced(out: tuple, x: torch.Tensor, fmt: str, spec: QuantizerSpec, rowwise: Optional[bool] = None,
                 columnwise: Optional[bool] = None) -> Float8Tensor:
    """A cast's result in traced code as a Float8Tensor (built as usual, checks included): ``out`` starts
    (data, data_t, scale_inv, amax), an op's tuple (empty placeholders for unwanted copies) or a twin's
    NamedTuple (None there); the copies not wanted (by the spec, or by ``rowwise``/``columnwise`` when
    given) are dropped."""
    data, data_t, scale_inv, amax = out[:4]
    rowwise = spec.rowwise if rowwise is None else rowwise
    columnwise = spec.columnwise if columnwise is None else columnwise
    return Float8Tensor(data if rowwise else None, scale_inv, amax, fmt, x.dtype, x.shape,
                        data_t=data_t if columnwise else None)


def load_cuda_casts() -> None:
    """Look up the CUDA casts now (eagerly, before a trace: the lookup imports)."""
    _cuda_quantize()


def _wrap_planned(out: tuple, x: torch.Tensor, fmt: str) -> Float8Tensor:
    """:func:`_wrap` of a planned cast's ``(data, data_t, scale_inv, amax, scale)``."""
    t = object.__new__(Float8Tensor)
    t.data, t.data_t, t.scale_inv, t.amax = out[0], out[1], out[2], out[3]
    t.fmt = fmt
    t.orig_dtype = x.dtype
    t._shape = x.shape
    return t


def _cast_plan(q: Any, rowwise: bool, columnwise: bool, current: bool) -> Optional[Any]:
    """The quantizer's plan of its eager CUDA casts with these copies (``cuda_fp8.CastPlan``, made once per
    spec and copies), or None where the CUDA casts are not loaded."""
    if not _PLANNED:
        return None
    plans = q.__dict__.get("_cast_plans")
    if plans is None or plans[0] is not q.spec:
        plans = q._cast_plans = (q.spec, {})
    key = (rowwise, columnwise)
    plan = plans[1].get(key)
    if plan is None:
        s = q.spec
        plan = plans[1][key] = _PLANNED[1](q.fmt, rowwise, columnwise, current,
                                           s.use_power_2_scales if current else False,
                                           s.amax_epsilon if current else 0.0)
    return plan


def _wrap(res, x: torch.Tensor, fmt: str) -> Float8Tensor:
    """A quantizer's own eager op result as a Float8Tensor, without the constructor's checks: the op
    made the copies in ``fmt`` from ``x`` flattened to 2-D, and FP32 0-dim scale_inv/amax (the checks
    cost a few microseconds per cast, on the step's host path)."""
    t = object.__new__(Float8Tensor)
    t.data = res.data
    t.data_t = res.data_t
    t.scale_inv = res.scale_inv
    t.amax = res.amax
    t.fmt = fmt
    t.orig_dtype = x.dtype
    t._shape = x.shape
    return t


# [whether the loaded extension has the recording cast, the recording cast]: set by _cuda_quantize
_RECORDING: List[Any] = [lambda: False, None]
# [whether it has the casts with a fused bias gradient, the delayed one, the current one, the CUDA current
# scaling cast]: set by _cuda_quantize too
_FUSED_DBIAS: List[Any] = [lambda: False, None, None, None]
_CUDA_QUANTIZE: List[Any] = []
# [cuda_fp8.fp8_cast_planned, cuda_fp8.CastPlan]: the planned eager casts (one plan per quantizer and copies);
# set by _cuda_quantize
_PLANNED: List[Any] = []
# [the delayed-scaling cast op, the same with the bias gradient, the current-scaling cast + bias gradient op,
# the delayed-scaling rowwise cast that also returns the scale it read] traced code calls on CUDA
# (ops/cuda_fp8.py: one op per cast; None with an extension built before them): set by _cuda_quantize
_TRACED_CASTS: List[Any] = [None, None, None, None]
# [current scaling's traced cast from a graph-computed amax, the same with the bias gradient] (ops/cuda_fp8.py;
# None with an extension built before it): set by _cuda_quantize
_FROM_AMAX: List[Any] = [None, None]


def _cuda_quantize() -> Any:
    """The CUDA implementation of ``fp8_quantize`` (the object ``resolved`` returns for a CUDA tensor), or
    None; looked up once."""
    if not _CUDA_QUANTIZE:
        from ..ops import backend

        impl = None
        if backend.extension() is not None:
            from ..ops import cuda_fp8

            impl = cuda_fp8.fp8_quantize
            _RECORDING[:] = [cuda_fp8.can_record_amax, cuda_fp8.fp8_quantize_recording]
            _FUSED_DBIAS[:] = [cuda_fp8.can_fuse_bias_grad, cuda_fp8.fp8_quantize_dbias,
                               cuda_fp8.fp8_current_scaling_quantize_dbias, cuda_fp8.fp8_current_scaling_quantize]
            if cuda_fp8.can_record_amax() and cuda_fp8.can_fuse_bias_grad():
                _TRACED_CASTS[:] = [cuda_fp8.fp8_delayed_cast_op, cuda_fp8.fp8_delayed_cast_dbias_op,
                                    cuda_fp8.fp8_current_cast_dbias_op, cuda_fp8.fp8_delayed_rowwise_cast_op]
            _PLANNED[:] = [cuda_fp8.fp8_cast_planned, cuda_fp8.CastPlan]
            if cuda_fp8.can_cast_from_amax():
                _FROM_AMAX[:] = [cuda_fp8.fp8_current_cast_from_amax_op, cuda_fp8.fp8_current_cast_from_amax_dbias_op]
        _CUDA_QUANTIZE.append(impl)
    return _CUDA_QUANTIZE[0]


def _state_snapshot_impl(t: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    return t.clone()


_state_snapshot = define_op("state_snapshot", _state_snapshot_impl)


@register_fake(_state_snapshot)
def _(t, after):
    return torch.empty_like(t)


def state_snapshot(t: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """(traced) A copy of a state tensor (a delayed-scaling scale) as an opaque op, made once ``after`` (the tensor
    the cast reads) exists.

    torch.compile's partitioner may save a graph *input* for the backward and recompute what the
    backward needs from it (``scale_inv = 1 / scale``); the scale is updated in place when the autocast
    exits, between the forward and the backward, and autograd then refuses the modified saved tensor.
    What is derived from this copy cannot be recomputed from the input: the backward reads the scale the
    forward used, as in eager mode.

    ``after`` ties the copy to the pass that casts: a backward cast's copy of its gradient quantizer's scale would
    otherwise depend on forward inputs only, and the partitioner computed it, with the GEMM's dequantization factor
    derived from it, in the *forward* graph, while the cast itself read the scale in the backward. With two
    micro-batches' forwards before their backwards (pipeline schedules) the first backward's end-of-pass update
    changes that scale in between, and the gradients came out scaled by the ratio of the two (session 39)."""
    return torch.ops.fp_recipes.state_snapshot(t, after)


class _ColumnwiseRecast:
    """What both per-tensor FP8 quantizers share for a weight's columnwise copy made in the backward
    (``modules/weight_columnwise.py``): their ``quantize_rowwise`` returns the scale the rowwise cast used."""

    fmt: str

    def quantize_columnwise(self, x: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor,
                            amax: torch.Tensor) -> Float8Tensor:
        """The columnwise copy :meth:`quantize` would have made beside the rowwise one of the same ``x``, cast
        with its ``scale`` (from ``quantize_rowwise``): the same bytes. It carries the rowwise cast's
        ``scale_inv``/``amax`` (1 / scale and amax(x): what this cast computes again) and records no amax."""
        x2 = checked_2d(x, "quantize_columnwise")
        if torch.compiler.is_compiling():
            res = ops.fp8_quantize(x2, scale, self.fmt, rowwise=False, columnwise=True)
            return Float8Tensor(None, scale_inv, amax, self.fmt, x.dtype, x.shape, data_t=res.data_t)
        res = resolved("fp8_quantize", x2)(x2, scale, self.fmt, rowwise=False, columnwise=True)
        return _wrap(res._replace(data=None, scale_inv=scale_inv, amax=amax), x, self.fmt)


_ACT_INPUTS = (torch.bfloat16, torch.float16, torch.float32)


class _FusedActivation:
    """What both per-tensor FP8 quantizers share for an input given before its activation (``quantized_linear``'s
    ``input_activation``): eagerly on CUDA the cast kernel applies the activation (``ops/cuda_fp8_act.py``, the
    activation's output never written), with the bytes of ``quantize(activation(x))``, which runs everywhere
    else (another activation, a trace, a device where the fused cast failed its first-use check)."""

    fmt: str
    spec: QuantizerSpec
    #: whether this quantizer takes the fused cast where it can (else ``quantize(activation(x))``: the same bytes).
    #: Delayed scaling: yes, one pass over x instead of the activation's write and the cast's read (model stack at
    #: hidden 2048 on an H100: 16.40 -> 16.12 ms eager, 15.24 -> 14.69 compiled). Current scaling: no by default,
    #: as its amax pass and its cast pass would each evaluate the activation (``tanhf``) on every element, which
    #: makes both passes compute-bound: measured slower than torch's GELU then the cast at hidden 4096 (24.43 ->
    #: 25.20 ms per step on an H100; benchmarks/RESULTS.md session 30). A class attribute: set it on the class or
    #: on one quantizer.
    fuse_activation: bool = True

    def _act_state_ok(self, x: torch.Tensor) -> bool:
        """The scaling state the fused cast reads is FP32 on x's device."""
        raise NotImplementedError

    def _act_cast_args(self, x: torch.Tensor) -> dict:
        raise NotImplementedError

    def _traced_act_cast(self, x: torch.Tensor, activation: str) -> tuple:
        raise NotImplementedError

    def fuses_activation(self, activation: str, x: torch.Tensor) -> bool:
        if not (self.fuse_activation and x.is_cuda and x.ndim == 2 and x.dtype in _ACT_INPUTS and
                x.is_contiguous()):
            return False
        from ..ops import cuda_fp8_act

        if activation not in cuda_fp8_act.ACT_CODES or not cuda_fp8_act.available() or not self._act_state_ok(x):
            return False
        if torch.compiler.is_compiling():  # (the first-use check ran while the trace was prepared, or it is off)
            return cuda_fp8_act.checked(x.device, x.dtype, activation)
        return cuda_fp8_act.fusion_ok(x.device, x.dtype, activation)

    def quantize_activation(self, x: torch.Tensor, activation: str) -> Float8Tensor:
        if not self.fuses_activation(activation, x):
            return super().quantize_activation(x, activation)  # type: ignore[misc]
        if torch.compiler.is_compiling():  # one op, as the plain traced casts
            return _wrap_traced(self._traced_act_cast(x, activation), x, self.fmt, self.spec)
        from ..ops import cuda_fp8_act

        res = cuda_fp8_act.fp8_act_quantize(x, activation, self.fmt, self.spec.rowwise, self.spec.columnwise,
                                            **self._act_cast_args(x))
        return _wrap(res, x, self.fmt)


#: delayed-scaling forward quantizers whose traced casts read ``trace_scale`` (see :meth:`Float8Quantizer.use_trace_scale`)
_TRACE_SCALED: "weakref.WeakSet[Float8Quantizer]" = weakref.WeakSet()
_TRACE_SCALED_LOCK = threading.Lock()  # (a trace in one thread registers while another thread's enter refreshes)


def refresh_trace_scales() -> None:
    """(eager, when a thread enters its outermost enabled autocast) ``trace_scale = scale`` for every registered
    quantizer: one in-place foreach copy per device (a new copy where the state moved device)."""
    by_device: Dict[torch.device, Tuple[list, list]] = {}
    with torch.inference_mode(False), torch.no_grad():
        with _TRACE_SCALED_LOCK:
            members = list(_TRACE_SCALED)
        for q in members:
            src, dst = q.scale, q.trace_scale
            if dst is None or dst.device != src.device:
                q.trace_scale = src.detach().clone()
                continue
            dsts, srcs = by_device.setdefault(src.device, ([], []))
            dsts.append(dst)
            srcs.append(src)
        for dsts, srcs in by_device.values():
            torch._foreach_copy_(dsts, srcs)


class Float8Quantizer(_ColumnwiseRecast, _FusedActivation, Quantizer):
    """FP8 delayed scaling: quantize with the scale derived from *earlier* steps' amaxes.

    State (FP32, mutated in place, never rebound, so modules can register them as buffers):
    ``scale`` (0-dim) and ``amax_history`` (amax_history_len,).

    History convention (TransformerEngine's): slot 0 collects the current step's amax;
    ``quantize`` does ``amax_history[0] = max(amax_history[0], amax(x))`` (NaN propagates). After the
    step (and after any cross-rank MAX reduction of slot 0), :meth:`update_scale`:

    0. every non-finite history entry (NaN, +Inf, -Inf; normally only slot 0, the step just recorded)
       becomes +0.0: it does not count, so one bad step never freezes the scale for
       ``amax_history_len`` steps (TransformerEngine keeps it); the first time, a
       :class:`NonFiniteAmaxWarning` names the quantizer's role (see :class:`NonfiniteWatch`);
    1. ``amax_ref = max(amax_history)`` ("max") or ``amax_history[0]`` ("most_recent");
    2. if ``amax_ref > 0``: ``scale = RN(RN(fmt_max / amax_ref) / 2^margin)``, an overflow to +Inf
       (subnormal amax_ref) becoming FLT_MAX; otherwise the scale is kept;
    3. the history rolls by -1 (``torch.roll(h, -1)``: the current slot moves to the last position,
       older entries move one slot toward 0) and slot 0 is zeroed for the next step. With length 1 only
       the zeroing happens.

    The batched update (``modules/amax_reduction.batched_update_scales``) and the CUDA kernel
    (``csrc/delayed_update.cu``) implement this rule bit for bit.
    """

    def __init__(self, spec: QuantizerSpec) -> None:
        super().__init__(spec)
        if spec.scaling is not ScalingKind.DELAYED:
            raise ValueError(f"Float8Quantizer is for delayed scaling, got a {spec.scaling.value} spec")
        self.fmt = fp8_fmt_of_spec(spec, "Float8Quantizer")
        if spec.amax_history_len < 1:
            raise ValueError(f"Float8Quantizer: amax_history_len must be >= 1, got {spec.amax_history_len}")
        self.fmt_max = formats.FP8_MAX[self.fmt]
        self.scale = torch.ones((), dtype=torch.float32)
        self.amax_history = torch.zeros(spec.amax_history_len, dtype=torch.float32)

    #: (torch.compile) a copy of ``scale`` that a traced forward cast reads instead of ``scale`` itself, refreshed when
    #: the outermost enabled autocast is entered eagerly. The autocast exit rewrites ``scale`` in place before the
    #: backward; under activation checkpointing inside the compiled region the backward recomputes the cast from its
    #: inputs, and autograd refuses a modified one. The copy is not touched until the next step's enter.
    trace_scale: Optional[torch.Tensor] = None

    def use_trace_scale(self) -> None:
        """(eager, while a trace is prepared) Give a forward quantizer (activation, weight) its ``trace_scale`` and
        have every later outermost autocast enter refresh it. The casts of the backward's quantizers run once,
        at backward time, as in eager mode: they keep reading ``scale``."""
        if self.spec.role.tensor not in (TensorKind.ACTIVATION, TensorKind.WEIGHT):
            return
        with _TRACE_SCALED_LOCK:
            if self in _TRACE_SCALED:
                return
            with torch.inference_mode(False), torch.no_grad():
                self.trace_scale = self.scale.detach().clone()
            _TRACE_SCALED.add(self)
        if refresh_trace_scales not in OUTERMOST_ENTER_HOOKS:
            OUTERMOST_ENTER_HOOKS.append(refresh_trace_scales)

    def sync_trace_scale(self) -> None:
        """``trace_scale = scale`` now: for state written between autocast enters (a loaded checkpoint), which a
        compiled call may read before the next enter refreshes the copy."""
        ts = self.trace_scale
        if ts is not None and ts.device == self.scale.device:
            with torch.no_grad():
                ts.copy_(self.scale)

    def _scale_for_trace(self) -> torch.Tensor:
        """(traced) The scale a forward cast reads: ``trace_scale`` when this thread's outermost enabled autocast
        was entered eagerly (so its enter refreshed the copy), else ``scale`` (an autocast entered inside the
        traced function updates ``scale`` in the graph itself)."""
        ts = self.trace_scale
        if ts is None or ts.device != self.scale.device:
            return self.scale
        state = get_autocast_state()
        return ts if state.enabled and state.records is None else self.scale

    # -- state ------------------------------------------------------------------------------------
    def bind_state(self, scale: torch.Tensor, amax_history: torch.Tensor) -> None:
        """Adopt externally owned tensors (e.g. a module's buffers after ``module.to(device)``)."""
        if scale.dtype != torch.float32 or scale.dim() != 0:
            raise ValueError("Float8Quantizer.bind_state: scale must be an FP32 0-dim tensor")
        if amax_history.dtype != torch.float32 or tuple(amax_history.shape) != tuple(self.amax_history.shape):
            raise ValueError(f"Float8Quantizer.bind_state: amax_history must be FP32 of shape "
                             f"{tuple(self.amax_history.shape)}")
        if scale.device != amax_history.device:
            raise ValueError("Float8Quantizer.bind_state: scale and amax_history must share a device")
        self.scale = scale
        self.amax_history = amax_history

    def to(self, device) -> "Float8Quantizer":
        """Move the state to ``device`` (this rebinds; re-register buffers afterwards)."""
        self.scale = self.scale.to(device)
        self.amax_history = self.amax_history.to(device)
        return self

    def state_dict(self) -> Dict[str, Any]:
        return {"scale": self.scale, "amax_history": self.amax_history}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for key in ("scale", "amax_history"):
            if key not in state:
                raise ValueError(f"Float8Quantizer.load_state_dict: missing {key!r}")
        if tuple(state["amax_history"].shape) != tuple(self.amax_history.shape):
            raise ValueError(f"Float8Quantizer.load_state_dict: amax_history has shape "
                             f"{tuple(state['amax_history'].shape)}, expected {tuple(self.amax_history.shape)}")
        self.scale.copy_(state["scale"].reshape(()))
        self.amax_history.copy_(state["amax_history"])
        self.sync_trace_scale()

    # -- work -------------------------------------------------------------------------------------
    def _check_device(self, x: torch.Tensor) -> None:
        if x.device != self.scale.device:
            raise ValueError(f"Float8Quantizer: input is on {x.device} but the scaling state is on "
                             f"{self.scale.device}; move the state with .to(device) or bind_state()")

    def _slot0(self) -> torch.Tensor:
        """``amax_history[0]``, the view made once per history tensor and storage (a view costs about a
        microsecond; the history is rebound by ``.to()``/``bind_state`` and a module's ``_apply``)."""
        h = self.amax_history
        cached = self.__dict__.get("_slot0_of")
        if cached is not None and cached[0] is h and cached[1] == h.data_ptr():
            return cached[2]
        slot = h[0]
        self._slot0_of = (h, h.data_ptr(), slot)
        return slot

    def record_amax(self, amax: torch.Tensor) -> None:
        """amax_history[0] = max(amax_history[0], amax), in place (NaN propagates)."""
        slot = self.amax_history[0] if torch.compiler.is_compiling() else self._slot0()
        if amax.device != slot.device:
            amax = amax.to(slot.device)
        torch.maximum(slot, amax, out=slot)  # one kernel, in place

    def quantize(self, x: torch.Tensor) -> Float8Tensor:
        return self._quantize(x, self.spec.rowwise, self.spec.columnwise)

    def _act_state_ok(self, x: torch.Tensor) -> bool:
        s, h = self.scale, self.amax_history
        return s.dtype == torch.float32 and s.ndim == 0 and s.device == x.device and h.dtype == torch.float32

    def _act_cast_args(self, x: torch.Tensor) -> dict:
        return {"scale": self.scale, "record": self._slot0()}  # (the plain cast's own scale and history slot)

    def _traced_act_cast(self, x: torch.Tensor, activation: str) -> tuple:
        from ..ops import cuda_fp8_act

        s = self.spec
        return cuda_fp8_act.delayed_act_cast_op(x, self._scale_for_trace(), self.amax_history, self.fmt, s.rowwise,
                                                s.columnwise, activation)

    def quantize_rowwise(self, x: torch.Tensor) -> Tuple[Float8Tensor, torch.Tensor]:
        """(eager) :meth:`quantize` making the rowwise copy alone, and a copy of the scale it used (the state's
        scale is rewritten at the autocast exit, before the backward): :meth:`quantize_columnwise` makes the
        columnwise copy from the same ``x`` later, with the same bytes (a weight's copy for dgrad, made in
        the backward instead of held from the forward: ``QuantizedModule.weight_columnwise_copy``)."""
        if torch.compiler.is_compiling():
            x2 = checked_2d(x, "Float8Quantizer.quantize")
            op = _TRACED_CASTS[3]
            if op is not None and x2.is_cuda and self.amax_history.dtype == torch.float32:
                # the scale copy as an output of the recording cast: saved for the backward, never recomputed
                # there from the scale input (rewritten in place by the autocast exit before the backward)
                data, scale_inv, amax, scale = op(x2, self._scale_for_trace(), self.amax_history, self.fmt)
                return Float8Tensor(data, scale_inv, amax, self.fmt, x.dtype, x.shape), scale
            return self._quantize(x, True, False), state_snapshot(self._scale_for_trace(), x2)
        scale = self.scale.clone()  # (in stream order before any update, as the cast reads it)
        return self._quantize(x, True, False), scale

    def _quantize(self, x: torch.Tensor, rowwise: bool, columnwise: bool) -> Float8Tensor:
        x2 = checked_2d(x, "Float8Quantizer.quantize")
        if x.device != self.scale.device:
            self._check_device(x)
        if torch.compiler.is_compiling():
            spec = self.spec
            op = _TRACED_CASTS[0]
            if op is not None and x2.is_cuda and self.amax_history.dtype == torch.float32:
                # one op: the cast reads the scale when it runs and records the amax into the history
                return _wrap_traced(op(x2, self._scale_for_trace(), self.amax_history, self.fmt, rowwise, columnwise),
                                    x, self.fmt, spec, rowwise, columnwise)
            # The kernel reads the scale in stream order, before any later in-place update: no copy
            # needed eagerly. A traced graph copies it (see state_snapshot; from trace_scale, the copy an
            # activation-checkpointing recompute can make again in the backward).
            res = ops.fp8_quantize(x2, state_snapshot(self._scale_for_trace(), x2), self.fmt, rowwise=rowwise,
                                   columnwise=columnwise)
            slot = self.amax_history[0]
            torch.maximum(slot, res.amax, out=slot)
            return _wrap_traced(res, x, self.fmt, spec, rowwise, columnwise)
        fn = resolved("fp8_quantize", x2)
        slot = self._slot0()
        if fn is _cuda_quantize() and slot.dtype == torch.float32 and _RECORDING[0]():
            # the CUDA cast records the amax into amax_history[0] itself (one launch, not two)
            scale = self.scale
            if scale.dtype == torch.float32 and scale.ndim == 0:
                out = _PLANNED[0](x2, _cast_plan(self, rowwise, columnwise, False), scale, slot)
                if out is not None:
                    return _wrap_planned(out, x, self.fmt)
            return _wrap(_RECORDING[1](x2, self.scale, self.fmt, rowwise, columnwise, slot), x, self.fmt)
        res = fn(x2, self.scale, self.fmt, rowwise=rowwise, columnwise=columnwise)
        torch.maximum(slot, res.amax, out=slot)  # record_amax: the amax is on the history's device
        return _wrap(res, x, self.fmt)

    def quantize_with_bias_grad(self, x: torch.Tensor, bias_dtype: torch.dtype) -> Tuple[Float8Tensor, torch.Tensor]:
        """:meth:`quantize` and the bias gradient of the 2-D ``x``; on CUDA the cast makes the column sums
        in its own pass and records the amax as :meth:`quantize` does (the same bits as the two apart)."""
        if torch.compiler.is_compiling():
            op = _TRACED_CASTS[1]
            if op is not None and x.ndim == 2 and x.is_cuda and self.amax_history.dtype == torch.float32:
                out = op(x, self.scale, self.amax_history, self.fmt, self.spec.rowwise, self.spec.columnwise,
                         bias_dtype)
                return _wrap_traced(out, x, self.fmt, self.spec), out[4]
        elif x.ndim == 2:
            fn = resolved("fp8_quantize", x)
            slot = self._slot0()
            if fn is _cuda_quantize() and slot.dtype == torch.float32 and _FUSED_DBIAS[0]():
                if x.device != self.scale.device:
                    self._check_device(x)
                spec = self.spec
                scale = self.scale
                if scale.dtype == torch.float32 and scale.ndim == 0:
                    out = _PLANNED[0](x, _cast_plan(self, spec.rowwise, spec.columnwise, False), scale, slot,
                                      bias_dtype)
                    if out is not None:
                        return _wrap_planned(out, x, self.fmt), out[5]
                res, db = _FUSED_DBIAS[1](x, self.scale, self.fmt, spec.rowwise, spec.columnwise, slot, bias_dtype)
                return _wrap(res, x, self.fmt), db
        return super().quantize_with_bias_grad(x, bias_dtype)

    def compute_scale(self) -> torch.Tensor:
        """The scale :meth:`update_scale` would set (steps 0-2), without touching the state."""
        return self._scale_from(self.amax_history.nan_to_num(0.0, 0.0, 0.0))

    def _scale_from(self, h: torch.Tensor) -> torch.Tensor:
        amax_ref = h.max() if self.spec.amax_compute_algo == "max" else h[0]
        # torch.full fills on the device: no blocking host-to-device copy (which would sync the stream)
        fmax = torch.full((), self.fmt_max, dtype=torch.float32, device=h.device)
        div = torch.full((), 2.0 ** self.spec.margin, dtype=torch.float32, device=h.device)
        new = (fmax / amax_ref) / div
        new = torch.where(torch.isinf(new), torch.full_like(new, formats.FP32_MAX), new)
        return torch.where(amax_ref > 0, new, self.scale)  # amax_ref is finite (step 0)

    def update_scale(self) -> None:
        h = self.amax_history
        watch = getattr(self, "_watch", None)
        if watch is None or watch.flags.device != h.device:
            watch = self._watch = NonfiniteWatch(1, h.device)
        torch.logical_or(watch.flags, torch.isfinite(h).all().logical_not().reshape(1), out=watch.flags)
        clean = h.nan_to_num(0.0, 0.0, 0.0)
        self.scale.copy_(self._scale_from(clean))
        if h.numel() > 1:
            h.copy_(torch.roll(clean, -1, 0))
        h[0].zero_()  # `h[0] = 0.0` copies a host scalar: a stream sync on CUDA
        watch.report([self])


_BITS_OF = {torch.bfloat16: (torch.int16, 0x7FFF), torch.float16: (torch.int16, 0x7FFF),
            torch.float32: (torch.int32, 0x7FFFFFFF)}


def graph_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as FP32, in graph ops that torch.compile can fuse into the kernel that produced ``x``. Taken over
    the bits of the stored values (|x| orders as the integer x & 0x7F..F, NaN above Inf): a fused producer must
    round to x's dtype to bitcast, so the reduction sees the values the cast will read (a float ``abs().amax()``
    fused into e.g. a GELU kernel may see its FP32 intermediates instead). Exact, as the eager amax kernel."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    bits, mask = _BITS_OF[x.dtype]
    return (x.view(bits) & mask).amax().view(x.dtype).to(torch.float32)


class Float8CurrentScalingQuantizer(_ColumnwiseRecast, _FusedActivation, Quantizer):
    """FP8 current scaling: the scale comes from this tensor's own amax (``ops.fp8_current_scaling_quantize``).

    ``quantize(x, amax=...)`` takes an amax computed elsewhere (e.g. MAX-reduced across ranks); the
    scale is then derived from it with the same rule and the tensor records that amax.
    """

    #: Under torch.compile on CUDA, compute the amax in the graph (:func:`graph_amax`) and cast with the op that
    #: takes it (the kernel derives the scale from it: the same bytes as eager), so that Inductor can fuse the
    #: amax into the kernel that produced ``x`` instead of an amax pass of its own. Off: measured slower (compiled
    #: current scaling at hidden 2048 on an H100, 15.76 -> 16.40 ms per step; benchmarks/RESULTS.md session 27);
    #: ``benchmarks/bench_model.py --fp8-compile-visible-amax`` runs the compiled rows with it.
    compile_visible_amax: bool = False
    fuse_activation = False  # (see _FusedActivation: both passes would evaluate the activation)

    def __init__(self, spec: QuantizerSpec) -> None:
        super().__init__(spec)
        if spec.scaling is not ScalingKind.CURRENT:
            raise ValueError(f"Float8CurrentScalingQuantizer is for current scaling, got a "
                             f"{spec.scaling.value} spec")
        self.fmt = fp8_fmt_of_spec(spec, "Float8CurrentScalingQuantizer")

    def scale_from_amax(self, amax: torch.Tensor) -> torch.Tensor:
        return current_scale(amax, formats.FP8_MAX[self.fmt], use_power_2_scales=self.spec.use_power_2_scales,
                             amax_epsilon=self.spec.amax_epsilon)

    def _act_state_ok(self, x: torch.Tensor) -> bool:
        return True

    def _act_cast_args(self, x: torch.Tensor) -> dict:
        return {"use_power_2_scales": self.spec.use_power_2_scales, "amax_epsilon": self.spec.amax_epsilon}

    def _traced_act_cast(self, x: torch.Tensor, activation: str) -> tuple:
        from ..ops import cuda_fp8_act

        s = self.spec
        return cuda_fp8_act.current_act_cast_op(x, self.fmt, s.use_power_2_scales, s.amax_epsilon, s.rowwise,
                                                s.columnwise, activation)

    def quantize(self, x: torch.Tensor, amax: Optional[torch.Tensor] = None) -> Float8Tensor:
        x2 = checked_2d(x, "Float8CurrentScalingQuantizer.quantize")
        s = self.spec
        if amax is None:
            if torch.compiler.is_compiling():
                if self._visible_amax(x2):
                    return self._cast_visible_amax(x, x2, s.rowwise, s.columnwise)[0]
                res = ops.fp8_current_scaling_quantize(x2, self.fmt, use_power_2_scales=s.use_power_2_scales,
                                                       amax_epsilon=s.amax_epsilon, rowwise=s.rowwise,
                                                       columnwise=s.columnwise)
                return _wrap_traced(res, x, self.fmt, s)
            fn = resolved("fp8_current_scaling_quantize", x2)
            if _cuda_quantize() is not None and fn is _FUSED_DBIAS[3] and _PLANNED:
                out = _PLANNED[0](x2, _cast_plan(self, s.rowwise, s.columnwise, True))
                if out is not None:
                    return _wrap_planned(out, x, self.fmt)
            res = fn(x2, self.fmt, use_power_2_scales=s.use_power_2_scales, amax_epsilon=s.amax_epsilon,
                     rowwise=s.rowwise, columnwise=s.columnwise)
            return _wrap(res, x, self.fmt)
        if not isinstance(amax, torch.Tensor) or amax.dtype != torch.float32 or amax.numel() != 1:
            raise TypeError("Float8CurrentScalingQuantizer.quantize: amax must be an FP32 tensor with one element")
        amax = amax.reshape(()).to(x.device)
        res = ops.fp8_quantize(x2, self.scale_from_amax(amax), self.fmt, rowwise=s.rowwise,
                               columnwise=s.columnwise)
        return Float8Tensor(res.data, res.scale_inv, amax.clone(), self.fmt, x.dtype, x.shape, data_t=res.data_t)

    def __call__(self, x: torch.Tensor, amax: Optional[torch.Tensor] = None) -> Float8Tensor:
        return self.quantize(x, amax=amax)

    def _visible_amax(self, x2: torch.Tensor) -> bool:
        """(traced) Whether this cast takes its amax from the graph (see :attr:`compile_visible_amax`)."""
        return self.compile_visible_amax and x2.is_cuda and _FROM_AMAX[0] is not None  # (set by load_cuda_casts)

    def _cast_visible_amax(self, x: torch.Tensor, x2: torch.Tensor, rowwise: bool, columnwise: bool,
                           bias_dtype: Optional[torch.dtype] = None) -> tuple:
        """(traced) (Float8Tensor, scale[, db]): the amax as graph ops (:func:`graph_amax`: eager's value), the
        cast by the op that derives the scale from it."""
        s = self.spec
        amax = graph_amax(x2)
        if bias_dtype is None:
            data, data_t, scale_inv, scale = _FROM_AMAX[0](x2, amax, self.fmt, s.use_power_2_scales, s.amax_epsilon,
                                                           rowwise, columnwise)
            return _wrap_traced((data, data_t, scale_inv, amax), x, self.fmt, s, rowwise, columnwise), scale
        data, data_t, scale_inv, scale, db = _FROM_AMAX[1](x2, amax, self.fmt, s.use_power_2_scales, s.amax_epsilon,
                                                           rowwise, columnwise, bias_dtype)
        return _wrap_traced((data, data_t, scale_inv, amax), x, self.fmt, s, rowwise, columnwise), scale, db

    def quantize_rowwise(self, x: torch.Tensor) -> Tuple[Float8Tensor, torch.Tensor]:
        """(eager) :meth:`quantize` making the rowwise copy alone, and the scale it computed:
        :meth:`quantize_columnwise` makes the columnwise copy from the same ``x`` later, with the same bytes."""
        x2 = checked_2d(x, "Float8CurrentScalingQuantizer.quantize")
        s = self.spec
        if torch.compiler.is_compiling():
            if self._visible_amax(x2):
                return self._cast_visible_amax(x, x2, True, False)
            res = ops.fp8_current_scaling_quantize(x2, self.fmt, use_power_2_scales=s.use_power_2_scales,
                                                   amax_epsilon=s.amax_epsilon, rowwise=True, columnwise=False)
            return _wrap_traced(res, x, self.fmt, s, True, False), res.scale
        fn = resolved("fp8_current_scaling_quantize", x2)
        if _cuda_quantize() is not None and fn is _FUSED_DBIAS[3] and _PLANNED:
            out = _PLANNED[0](x2, _cast_plan(self, True, False, True))
            if out is not None:
                return _wrap_planned(out, x, self.fmt), out[4]
        res = fn(x2, self.fmt, use_power_2_scales=s.use_power_2_scales, amax_epsilon=s.amax_epsilon,
                 rowwise=True, columnwise=False)
        return _wrap(res, x, self.fmt), res.scale

    def quantize_with_bias_grad(self, x: torch.Tensor, bias_dtype: torch.dtype) -> Tuple[Float8Tensor, torch.Tensor]:
        """:meth:`quantize` and the bias gradient of the 2-D ``x``; on CUDA the cast pass (the second of
        current scaling's two) makes the column sums (the same bits as the two apart)."""
        if torch.compiler.is_compiling():
            if x.ndim == 2 and self._visible_amax(x):
                q, _, db = self._cast_visible_amax(x, x, self.spec.rowwise, self.spec.columnwise, bias_dtype)
                return q, db
            op = _TRACED_CASTS[2]
            if op is not None and x.ndim == 2 and x.is_cuda:
                s = self.spec
                out = op(x, self.fmt, s.use_power_2_scales, s.amax_epsilon, s.rowwise, s.columnwise, bias_dtype)
                return _wrap_traced(out, x, self.fmt, s), out[4]
        elif x.ndim == 2 and _cuda_quantize() is not None \
                and resolved("fp8_current_scaling_quantize", x) is _FUSED_DBIAS[3] and _FUSED_DBIAS[0]():
            s = self.spec
            if _PLANNED:
                out = _PLANNED[0](x, _cast_plan(self, s.rowwise, s.columnwise, True), bias_dtype=bias_dtype)
                if out is not None:
                    return _wrap_planned(out, x, self.fmt), out[5]
            res, db = _FUSED_DBIAS[2](x, self.fmt, s.use_power_2_scales, s.amax_epsilon, s.rowwise, s.columnwise,
                                      bias_dtype)
            return _wrap(res, x, self.fmt), db
        return super().quantize_with_bias_grad(x, bias_dtype)

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state:
            raise ValueError(f"Float8CurrentScalingQuantizer has no state; got keys {sorted(state)}")


allow_in_weights_only_load(Float8Tensor, _rebuild_float8_tensor)

__all__ = ["Float8CurrentScalingQuantizer", "Float8Quantizer", "Float8Tensor", "NonFiniteAmaxWarning",
           "NonfiniteWatch", "flatten_2d"]
