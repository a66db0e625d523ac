"""CUDA implementations of the FP8 per-tensor, grouped FP8 and per-token ops (kernels in ``fp_recipes._C``).

Two layers per op:

* a custom op ``torch.ops.fp_recipes.<name>`` (defined by ``op_library.py``) with a fake (meta) implementation, so
  ``torch.compile`` traces through it (fullgraph) without running it. It takes only tensors and plain
  values, returns only tensors (an unwanted copy comes back as an empty tensor), requires contiguous CUDA
  inputs and raises a clear error otherwise;
* the implementation registered for :mod:`fp_recipes.ops` dispatch (``@register_cuda_impl``), with the
  reference twin's exact signature and NamedTuple result. It validates with the twin's own checks, so a
  bad argument fails the same way on every backend.

Kernels run on the current stream of the input's device. Results are byte-identical to the twins in
:mod:`fp_recipes.ops.ref_fp8` / :mod:`fp_recipes.ops.ref_per_token` (tests/test_cuda_fp8_kernels.py).
"""

from __future__ import annotations

import contextlib
import weakref
from itertools import accumulate
from typing import Optional, Sequence

import torch

from .. import _extension
from . import backend, workspace
from .op_library import define_op, register_fake
from .ref_fp8 import (
    FP8GroupedQuantized,
    FP8MultiQuantized,
    FP8Quantized,
    _check_offsets,
    check_amax_input,
    check_bias_grad_args,
    check_current_scaling_args,
    check_fp8_dequantize_args,
    check_fp8_quantize_args,
    check_grouped_amax_args,
    check_grouped_dequantize_args,
    check_grouped_quantize_args,
    check_multi_current_args,
    check_multi_quantize_args,
)
from .ref_per_token import PerTokenQuantized, check_cast_back_args, check_per_token_cast_args

# Dtype codes: the DType table of csrc/common.h.
DTYPE_CODE = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 4,
    torch.uint8: 5,
}
FP8_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_OUT_CODE = {fmt: DTYPE_CODE[dtype] for fmt, dtype in FP8_DTYPE.items()}  # (an FP8 format's dtype code)
PER_TOKEN_FMT_CODE = {"e5m6": 0, "e4m3": 1}

_EMPTY_SHAPE = (0,)
_DATA_PTR = torch.Tensor.data_ptr  # for map(): the members' addresses without a Python frame per member


# ---- helpers -------------------------------------------------------------------------------------

def _ext():
    ext = backend.extension()
    if ext is None:
        raise RuntimeError(f"fp_recipes: the CUDA extension fp_recipes._C is not available "
                           f"({backend.extension_error()}); rebuild with nvcc on PATH")
    return ext


def _require_cuda(op: str, **tensors: torch.Tensor) -> torch.device:
    """All tensors on one CUDA device and contiguous; returns that device."""
    device = None
    for name, t in tensors.items():
        if not t.is_cuda:
            raise ValueError(f"fp_recipes::{op} is the CUDA kernel, but {name} is on {t.device}; call "
                             f"fp_recipes.ops.{op}, which runs the reference for CPU tensors")
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(f"fp_recipes::{op}: {name} is on {t.device} but the other inputs are on {device}")
        if not t.is_contiguous():
            raise ValueError(f"fp_recipes::{op}: {name} must be contiguous (got strides {t.stride()} for "
                             f"shape {tuple(t.shape)}); call .contiguous() first")
    assert device is not None
    return device


_SAME_DEVICE = contextlib.nullcontext()  # reusable: entering it does nothing


def _is_current(device: torch.device) -> bool:
    """Whether ``device`` (of a tensor a launch reads) is the current device. A CUDA tensor exists, so
    CUDA is initialised: the raw query skips ``torch.cuda.current_device()``'s lazy-init check."""
    return device.index is None or device.index == torch._C._cuda_getDevice()


def _on(device: torch.device):
    """The device's context only when it is not already current (the switch costs microseconds)."""
    if _is_current(device):
        return _SAME_DEVICE
    return torch.cuda.device(device)


def _launch(device: torch.device, kernel, *args) -> None:
    """``kernel(*args)`` with ``device`` current, for the per-step casts: the context is entered only
    when another device is current (a context manager costs two calls even when it does nothing)."""
    if _is_current(device):
        kernel(*args)
        return
    with torch.cuda.device(device):
        kernel(*args)


def _cast_ptrs(x: torch.Tensor, data: Optional[torch.Tensor], data_t: Optional[torch.Tensor]) -> tuple:
    """The addresses of a cast's input and its copies (0 for an unwanted copy, and for all three when
    ``x`` is empty: the copies hold as many elements as ``x``)."""
    if x.numel() == 0:
        return 0, 0, 0
    return x.data_ptr(), 0 if data is None else data.data_ptr(), 0 if data_t is None else data_t.data_ptr()


def _call(op, impl, *args):
    """Eager calls skip the dispatcher (its overhead is comparable to a small kernel); traced code
    (torch.compile) sees the custom op."""
    if torch.compiler.is_compiling() or not args[0].is_cuda:  # traced, or meta/fake tensors
        return op(*args)
    return impl(*args)


def _stream(device: torch.device) -> int:
    return backend.current_stream(device)


def _amax_ws(device: torch.device, stream: int) -> int:
    """The stream's amax workspace for a memset-free cast (ops/workspace.py), or 0 where the extension
    predates it or the stream is being captured into a CUDA graph (the launcher then memsets the amax)."""
    ok = _AMAX_WS_OK
    if not ok:
        ok.append(bool(getattr(backend.extension(), "fp8_amax_workspace", False)))
    if not ok[0]:
        return 0
    return workspace.amax_ws(device, stream)


_AMAX_WS_OK: list = []  # [whether the loaded extension's FP8 casts take amax_ws], set on first use


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


def _contiguous(t: torch.Tensor, op: str, name: str) -> torch.Tensor:
    """The dispatched ops accept any layout, like their twins; a copy is made (and said once)."""
    if t.is_contiguous():
        return t
    backend.warn_once(f"noncontig:{op}:{name}",
                      f"fp_recipes.ops.{op}: {name} is not contiguous; copying it first (pass contiguous "
                      "tensors to avoid the extra pass)")
    return t.contiguous()


def _aligned(t: torch.Tensor) -> torch.Tensor:
    return t if t.data_ptr() % 16 == 0 else t.clone()


# Offsets tensors already validated, keyed by id() with a weak reference to the tensor and the version
# counter / element count they were checked against: an unchanged offsets tensor reused for many calls
# (the MoE case: quantize, amax, dequantize with the same splits) costs one device-to-host check, not
# one per call. (A WeakKeyDictionary cannot be used: it compares tensors with ==.)
_validated_offsets: dict = {}


def _validated_groups(offsets: torch.Tensor, numel: int, ref: torch.Tensor, what: str) -> int:
    key = (offsets._version, numel, offsets.data_ptr(), offsets.numel())
    hit = _validated_offsets.get(id(offsets))
    if hit is not None and hit[0]() is offsets and hit[1] == key:
        return hit[2]
    g = _check_offsets(offsets, numel, ref, what)  # one small device-to-host copy, like the twin
    ident = id(offsets)
    wr = weakref.ref(offsets, lambda _r, ident=ident: _validated_offsets.pop(ident, None))
    _validated_offsets[ident] = (wr, key, g)
    return g


def _scalar(device: torch.device) -> torch.Tensor:
    return torch.empty((), dtype=torch.float32, device=device)


def _fp8_copies(x: torch.Tensor, fmt: str, rowwise: bool, columnwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The (M, N) rowwise and (N, M) columnwise outputs of casting 2-D ``x`` (real or fake); an unwanted
    copy is an empty tensor."""
    m, n = x.shape
    dt = FP8_DTYPE[fmt]
    data = x.new_empty((m, n), dtype=dt) if rowwise else x.new_empty(_EMPTY_SHAPE, dtype=dt)
    data_t = x.new_empty((n, m), dtype=dt) if columnwise else x.new_empty(_EMPTY_SHAPE, dtype=dt)
    return data, data_t


def _cast_back_shape(data: torch.Tensor, fmt: str) -> tuple[int, int]:
    """(tokens, hidden) of per-token ``data``: packed E5M6 holds 8 values in 12 bytes."""
    return data.shape[0], data.shape[1] * 2 // 3 if fmt == "e5m6" else data.shape[1]


# ---- custom ops: FP8 per tensor ------------------------------------------------------------------

def _fp8_amax_impl(x: torch.Tensor) -> torch.Tensor:
    device = _require_cuda("fp8_amax", x=x)
    amax = _scalar(device)
    with _on(device):
        _ext().fp8_amax(_ptr(x), DTYPE_CODE[x.dtype], x.numel(), amax.data_ptr(), _stream(device))
    return amax


_fp8_amax_op = define_op("fp8_amax", _fp8_amax_impl)


@register_fake(_fp8_amax_op)
def _(x):
    return x.new_empty((), dtype=torch.float32)


def _fp8_copies_or_none(x: torch.Tensor, fmt: str, rowwise: bool,
                        columnwise: bool) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The eager launch's outputs: the (M, N) rowwise and (N, M) columnwise copies, None when unwanted
    (no empty placeholder tensors: each allocation is host time)."""
    m, n = x.shape
    dt = FP8_DTYPE[fmt]
    return (x.new_empty((m, n), dtype=dt) if rowwise else None,
            x.new_empty((n, m), dtype=dt) if columnwise else None)


def _enqueue_delayed(x_ptr: int, in_code: int, m: int, n: int, scale_ptr: int, out_code: int, data_ptr: int,
                     data_t_ptr: int, scale_inv_ptr: int, amax_ptr: int, record_ptr: int, stream: int,
                     bias: Optional[tuple] = None) -> None:
    """The one kernel call of a given-scale (delayed) cast: plain, recording into ``record_ptr`` (0: none), or
    with the bias gradient (``bias`` = (partials, db, db dtype code) addresses and code). No amax workspace:
    the amax comes from the kernel that writes the copies, where the workspace's last-block handshake cost
    more than the memset it saves (csrc/fp8_kernels.h)."""
    args = (x_ptr, in_code, m, n, scale_ptr, out_code, data_ptr, data_t_ptr, scale_inv_ptr, amax_ptr)
    ext = _ext()
    if bias is not None:
        ext.fp8_quantize_dbias(*args, record_ptr, *bias, stream)
    elif record_ptr:
        ext.fp8_quantize_record(*args, record_ptr, stream)
    else:
        ext.fp8_quantize(*args, stream)


def _enqueue_current(x_ptr: int, in_code: int, m: int, n: int, out_code: int, pow2: bool, eps: float, data_ptr: int,
                     data_t_ptr: int, scale_ptr: int, scale_inv_ptr: int, amax_ptr: int, stream: int, ws: int,
                     bias: Optional[tuple] = None) -> None:
    """The kernel calls of a current-scaling cast (amax, then the cast; ``bias`` as in
    :func:`_enqueue_delayed`); ``ws``: the stream's amax workspace (:func:`_amax_ws`)."""
    args = (x_ptr, in_code, m, n, out_code, pow2, eps, data_ptr, data_t_ptr, scale_ptr, scale_inv_ptr, amax_ptr)
    if bias is None:
        _ext().fp8_current_scaling_quantize(*args, stream, ws)
    else:
        _ext().fp8_current_scaling_quantize_dbias(*args, *bias, stream, ws)


def _bias_ptrs(bias: Optional[tuple]) -> Optional[tuple]:
    """(partials, db, db dtype code) of the (partials, db) tensors of :func:`_bias_outputs`, or None."""
    if bias is None:
        return None
    partials, db = bias
    return _ptr(partials), _ptr(db), DTYPE_CODE[db.dtype]


def _fp8_quantize_launch(x: torch.Tensor, scale: torch.Tensor, fmt: str, rowwise: bool, columnwise: bool,
                         record: Optional[torch.Tensor] = None, bias: Optional[tuple] = None):
    """The eager cast: (data or None, data_t or None, scale_inv, amax). ``record``: see
    :func:`fp8_quantize_recording`; ``bias``: the (partials, db) of :func:`_bias_outputs`, filled by the
    same pass (:func:`fp8_quantize_dbias`)."""
    device = _require_cuda("fp8_quantize", x=x, scale=scale)
    m, n = x.shape
    data, data_t = _fp8_copies_or_none(x, fmt, rowwise, columnwise)
    scale_inv, amax = _scalar(device), _scalar(device)
    x_ptr, data_ptr, data_t_ptr = _cast_ptrs(x, data, data_t)
    _launch(device, _enqueue_delayed, x_ptr, DTYPE_CODE[x.dtype], m, n, scale.data_ptr(), DTYPE_CODE[FP8_DTYPE[fmt]],
            data_ptr, data_t_ptr, scale_inv.data_ptr(), amax.data_ptr(), _ptr(record), _stream(device),
            _bias_ptrs(bias))
    return data, data_t, scale_inv, amax


# ---- a quantizer's eager casts, planned once per input shape -------------------------------------------
# A cast on the step's host path: what the general wrappers work out per call (argument checks, dtype codes,
# output shapes) is done once per quantizer and input shape; the FP32 outputs (scale_inv, amax and current
# scaling's scale) are views of one allocation (an allocation costs several views' host time on a GPU host).

_MAX_LAUNCHES = 32  # input shapes kept per plan (a model has a handful; more: the general path)


class CastPlan:
    """One FP8 quantizer's cast options (its format, which copies, its scaling rule), checked once, and
    per (input shape, dtype, device) the resolved launch. :func:`fp8_cast_planned` makes the launches,
    arguments and bytes of :func:`fp8_current_scaling_quantize` (``current``) or
    :func:`fp8_quantize_recording` (delayed)."""

    __slots__ = ("fmt", "rowwise", "columnwise", "current", "pow2", "eps", "launches", "out_code")

    def __init__(self, fmt: str, rowwise: bool, columnwise: bool, current: bool, use_power_2_scales: bool = False,
                 amax_epsilon: float = 0.0) -> None:
        if fmt not in FP8_DTYPE or not (rowwise or columnwise):
            raise ValueError(f"CastPlan: fmt must be one of {sorted(FP8_DTYPE)} with at least one copy, got "
                             f"fmt={fmt!r} rowwise={rowwise} columnwise={columnwise}")
        if current and not (float(amax_epsilon) >= 0.0):
            raise ValueError(f"CastPlan: amax_epsilon must be >= 0, got {amax_epsilon!r}")
        self.fmt, self.rowwise, self.columnwise, self.current = fmt, bool(rowwise), bool(columnwise), bool(current)
        self.pow2, self.eps = bool(use_power_2_scales), float(amax_epsilon)
        self.launches: dict = {}
        self.out_code = DTYPE_CODE[FP8_DTYPE[fmt]]


class _CastLaunch:
    """A plan's cast of one input shape, dtype and device: output shapes and codes, resolved once."""

    __slots__ = ("m", "n", "in_code", "out_code", "fp8", "data_shape", "data_t_shape", "index")

    def __init__(self, plan: CastPlan, x: torch.Tensor) -> None:
        m, n = x.shape
        self.m, self.n = m, n
        self.in_code = DTYPE_CODE[x.dtype]
        self.fp8 = FP8_DTYPE[plan.fmt]
        self.out_code = DTYPE_CODE[self.fp8]
        self.data_shape, self.data_t_shape = (m, n), (n, m)
        self.index = x.device.index


def fp8_cast_planned(x: torch.Tensor, plan: CastPlan, scale: Optional[torch.Tensor] = None,
                     record: Optional[torch.Tensor] = None, bias_dtype: Optional[torch.dtype] = None) -> Optional[tuple]:
    """An eager quantizer's cast of the 2-D float tensor ``x`` (the quantizer checked it and found the CUDA casts
    for it): ``(data, data_t,
    scale_inv, amax, scale)`` with unwanted copies None; delayed scaling (``plan.current`` False) takes the FP32
    ``scale`` and the history slot ``record`` the kernel max-merges the amax into, both on x's device (the
    quantizer's own state). ``bias_dtype``: also x's bias gradient from the same pass (the bytes of
    ``ops.bias_grad``), appended to the tuple. None where the general path must run (a non-contiguous or empty
    ``x``, another device current, an extension without the recording cast or the amax workspace).

    With the torch-linked host path (``_extension.fast_ops``: FP_RECIPES_TORCH_OPS) the whole call is one C++
    call making the same launches with the same arguments."""
    fast = _extension.fast_ops() if x.is_cuda else None
    if fast is not None:
        return fast.fp8_cast(x, plan.out_code, plan.rowwise, plan.columnwise, plan.current, plan.pow2, plan.eps,
                             scale, record, bias_dtype)
    key = (x.shape, x.dtype, x.device)
    launch = plan.launches.get(key)
    if launch is None:
        if not (x.dtype in _FLOAT_INPUTS and x.ndim == 2 and x.numel()) or \
                len(plan.launches) >= _MAX_LAUNCHES or not _planned_casts_available():
            return None
        launch = plan.launches[key] = _CastLaunch(plan, x)
    if not x.is_contiguous() or (launch.index is not None and launch.index != torch._C._cuda_getDevice()):
        return None
    dev = x.device
    data = torch.empty(launch.data_shape, dtype=launch.fp8, device=dev) if plan.rowwise else None
    data_t = torch.empty(launch.data_t_shape, dtype=launch.fp8, device=dev) if plan.columnwise else None
    stream = _stream(dev)
    data_ptr = 0 if data is None else data.data_ptr()
    data_t_ptr = 0 if data_t is None else data_t.data_ptr()
    db = bias = None
    if bias_dtype is not None:
        if bias_dtype not in _FLOAT_INPUTS:
            return None
        partials = torch.empty((-(-launch.m // _BIAS_TILE_ROWS), launch.n), dtype=torch.float32, device=dev)
        db = torch.empty((launch.n,), dtype=bias_dtype, device=dev)
        bias = (partials.data_ptr(), db.data_ptr(), DTYPE_CODE[bias_dtype])
    if plan.current:  # [scale_inv, amax, scale]
        buf = torch.empty((3,), dtype=torch.float32, device=dev)
        scale_inv, amax, scale = buf.unbind()
        base = buf.data_ptr()
        _enqueue_current(x.data_ptr(), launch.in_code, launch.m, launch.n, launch.out_code, plan.pow2, plan.eps,
                         data_ptr, data_t_ptr, base + 8, base, base + 4, stream, _amax_ws(dev, stream), bias)
    else:  # [scale_inv, amax]
        buf = torch.empty((2,), dtype=torch.float32, device=dev)
        scale_inv, amax = buf.unbind()
        base = buf.data_ptr()
        _enqueue_delayed(x.data_ptr(), launch.in_code, launch.m, launch.n, scale.data_ptr(), launch.out_code, data_ptr,
                         data_t_ptr, base, base + 4, record.data_ptr(), stream, bias)
    return (data, data_t, scale_inv, amax, scale) if db is None else (data, data_t, scale_inv, amax, scale, db)


def _planned_casts_available() -> bool:
    """The extension has what the planned casts call (the recording cast, the amax workspace)."""
    return can_record_amax() and bool(getattr(backend.extension(), "fp8_amax_workspace", False))


def can_record_amax() -> bool:
    """Whether the loaded extension has the casts that record into a history slot (one built before them
    has not: the quantizer then records with a torch.maximum)."""
    ext = backend.extension()
    return ext is not None and hasattr(ext, "fp8_quantize_record")


def fp8_quantize_recording(x: torch.Tensor, scale: torch.Tensor, fmt: str, rowwise: bool, columnwise: bool,
                           record: torch.Tensor) -> FP8Quantized:
    """:func:`fp8_quantize` (eager, CUDA) that also does ``torch.maximum(record, amax, out=record)`` inside
    the cast kernel: ``record`` is a delayed-scaling ``amax_history[0]`` (an FP32 device value on x's
    device), so recording the amax costs no launch of its own (issue 14). The caller checks that the
    extension has it (:func:`can_record_amax`) and that ``record`` is an FP32 value on ``scale``'s device."""
    x, fmt = _cast_input(x, scale, fmt, rowwise, columnwise)
    data, data_t, scale_inv, amax = _fp8_quantize_launch(x, scale, fmt, bool(rowwise), bool(columnwise), record)
    return FP8Quantized(data=data if rowwise else None, data_t=data_t if columnwise else None,
                        scale_inv=scale_inv, amax=amax, scale=scale)


def _with_placeholders(x: torch.Tensor, fmt: str, out: tuple) -> tuple:
    """A custom op returns tensors only: an unwanted copy comes back as an empty tensor."""
    dt = FP8_DTYPE[fmt]
    return tuple(x.new_empty(_EMPTY_SHAPE, dtype=dt) if t is None else t for t in out[:2]) + tuple(out[2:])


def _fp8_quantize_impl(x: torch.Tensor, scale: torch.Tensor, fmt: str, rowwise: bool,
                     columnwise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _with_placeholders(x, fmt, _fp8_quantize_launch(x, scale, fmt, rowwise, columnwise))


_fp8_quantize_op = define_op("fp8_quantize", _fp8_quantize_impl)


@register_fake(_fp8_quantize_op)
def _(x, scale, fmt, rowwise, columnwise):
    data, data_t = _fp8_copies(x, fmt, rowwise, columnwise)
    return data, data_t, x.new_empty((), dtype=torch.float32), x.new_empty((), dtype=torch.float32)


def _fp8_current_launch(x: torch.Tensor, fmt: str, use_power_2_scales: bool, amax_epsilon: float, rowwise: bool,
                        columnwise: bool, bias: Optional[tuple] = None):
    """The eager cast: (data or None, data_t or None, scale_inv, amax, scale). ``bias``: as
    :func:`_fp8_quantize_launch`'s."""
    device = _require_cuda("fp8_current_scaling_quantize", x=x)
    m, n = x.shape
    data, data_t = _fp8_copies_or_none(x, fmt, rowwise, columnwise)
    scale_inv, amax, scale = _scalar(device), _scalar(device), _scalar(device)
    x_ptr, data_ptr, data_t_ptr = _cast_ptrs(x, data, data_t)
    stream = _stream(device)
    _launch(device, _enqueue_current, x_ptr, DTYPE_CODE[x.dtype], m, n, DTYPE_CODE[FP8_DTYPE[fmt]],
            bool(use_power_2_scales), float(amax_epsilon), data_ptr, data_t_ptr, scale.data_ptr(), scale_inv.data_ptr(),
            amax.data_ptr(), stream, _amax_ws(device, stream), _bias_ptrs(bias))
    return data, data_t, scale_inv, amax, scale


def _op_cast_in_cpp(x: torch.Tensor, fmt: str, rowwise: bool, columnwise: bool, current: bool, pow2: bool,
                    eps: float, scale: Optional[torch.Tensor], record: Optional[torch.Tensor],
                    bias_dtype: Optional[torch.dtype]) -> Optional[tuple]:
    """A traced cast op's launches as one C++ call (the torch-linked host path, ``_extension.fast_ops``): the same
    launches and bytes as the Python branch, without its wrapper layers, which a compiled step pays per op.
    ``(data, data_t, scale_inv, amax, scale, db or None)`` in the op's form, or None where the Python branch runs
    (the host path off, or an input the C++ call leaves to it)."""
    fast = _extension.fast_ops() if x.is_cuda else None
    if fast is None or fmt not in _OUT_CODE or not (rowwise or columnwise) or not eps >= 0.0:
        return None  # (the options the Python branch's checks raise on reach it)
    return fast.fp8_cast_op(x, _OUT_CODE[fmt], bool(rowwise), bool(columnwise), current, bool(pow2), float(eps),
                            scale, record, bias_dtype)


def _fp8_current_impl(x: torch.Tensor, fmt: str, use_power_2_scales: bool, amax_epsilon: float, rowwise: bool,
                    columnwise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                               torch.Tensor]:
    out = _op_cast_in_cpp(x, fmt, rowwise, columnwise, True, use_power_2_scales, amax_epsilon, None, None, None)
    if out is not None:
        return out[:5]
    return _with_placeholders(x, fmt, _fp8_current_launch(x, fmt, use_power_2_scales, amax_epsilon, rowwise,
                                                          columnwise))


_fp8_current_op = define_op("fp8_current_scaling_quantize", _fp8_current_impl)


@register_fake(_fp8_current_op)
def _(x, fmt, use_power_2_scales, amax_epsilon, rowwise, columnwise):
    data, data_t = _fp8_copies(x, fmt, rowwise, columnwise)
    s = [x.new_empty((), dtype=torch.float32) for _ in range(3)]
    return data, data_t, s[0], s[1], s[2]


# ---- custom ops: a quantizer's whole cast in traced code (torch.compile) ---------------------------
# One op per cast, as the eager path makes one launch: each op a compiled graph calls costs host time.

def _delayed_cast(x: torch.Tensor, scale: torch.Tensor, history: torch.Tensor, fmt: str, rowwise: bool,
                  columnwise: bool, bias_dtype: Optional[torch.dtype]) -> tuple:
    """(data, data_t, scale_inv, amax[, db]): :func:`fp8_quantize_recording` (the amax recorded into
    ``history[0]`` by the kernel), or given ``bias_dtype`` :func:`fp8_quantize_dbias`, as an op's tensors."""
    if not (history.is_cuda and history.dtype == torch.float32 and history.device == x.device
            and history.is_contiguous() and history.numel()):
        raise ValueError(f"fp_recipes::fp8_delayed_cast: history must be a non-empty contiguous FP32 tensor on "
                         f"{x.device}, got {history.dtype} of shape {tuple(history.shape)} on {history.device}")
    if scale.dtype == torch.float32 and scale.ndim == 0 and scale.device == x.device:
        out = _op_cast_in_cpp(x, fmt, rowwise, columnwise, False, False, 0.0, scale, history, bias_dtype)
        if out is not None:
            return out[:4] if bias_dtype is None else (*out[:4], out[5])
    if bias_dtype is None:
        return _with_placeholders(x, fmt, fp8_quantize_recording(x, scale, fmt, rowwise, columnwise, history)[:4])
    res, db = fp8_quantize_dbias(x, scale, fmt, rowwise, columnwise, history, bias_dtype)
    return (*_with_placeholders(x, fmt, res[:4]), db)


def _fp8_delayed_cast_impl(x: torch.Tensor, scale: torch.Tensor, history: torch.Tensor, fmt: str, rowwise: bool,
                           columnwise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A delayed-scaling quantizer's traced cast: :func:`fp8_quantize` of the 2-D ``x`` with ``scale`` and
    its amax recorded into ``history[0]`` by the kernel. The scale is read when the op runs, so the graph
    needs no snapshot of it."""
    return _delayed_cast(x, scale, history, fmt, rowwise, columnwise, None)


def _fp8_delayed_cast_dbias_impl(x: torch.Tensor, scale: torch.Tensor, history: torch.Tensor, fmt: str,
                                 rowwise: bool, columnwise: bool, bias_dtype: torch.dtype
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_fp8_delayed_cast_impl` and the bias gradient of the same pass (:func:`fp8_quantize_dbias`)."""
    return _delayed_cast(x, scale, history, fmt, rowwise, columnwise, bias_dtype)


def _fp8_delayed_rowwise_cast_impl(x: torch.Tensor, scale: torch.Tensor, history: torch.Tensor,
                                   fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data, scale_inv, amax, scale used): :func:`_fp8_delayed_cast_impl`'s rowwise copy alone and a copy of
    the scale it read, for the weight's columnwise copy the backward makes (modules/weight_columnwise.py). An
    output of this op (which records into the history) is saved for the backward, never recomputed there from
    the scale, which the autocast exit rewrites in place before the backward runs."""
    data, _, scale_inv, amax = _delayed_cast(x, scale, history, fmt, True, False, None)
    return data, scale_inv, amax, scale.clone()


fp8_delayed_cast_op = define_op("fp8_delayed_cast", _fp8_delayed_cast_impl, mutates_args=("history",))
fp8_delayed_rowwise_cast_op = define_op("fp8_delayed_rowwise_cast", _fp8_delayed_rowwise_cast_impl,
                                        mutates_args=("history",))
fp8_delayed_cast_dbias_op = define_op("fp8_delayed_cast_dbias", _fp8_delayed_cast_dbias_impl,
                                      mutates_args=("history",))


def traced_cast_impls() -> dict:
    """The traced cast ops' Python implementations by op name: what ``_torch_ops.register_traced_ops`` registers
    C++ CUDA kernels for, each running its Python implementation where the C++ call declines
    (``gemm/fp8.py`` ``register_traced_kernels``)."""
    return {"fp8_delayed_cast": _fp8_delayed_cast_impl, "fp8_delayed_cast_dbias": _fp8_delayed_cast_dbias_impl,
            "fp8_delayed_rowwise_cast": _fp8_delayed_rowwise_cast_impl,
            "fp8_current_scaling_quantize": _fp8_current_impl,
            "fp8_current_cast_dbias": _fp8_current_cast_dbias_impl}


def _cast_fakes(x: torch.Tensor, fmt: str, rowwise: bool, columnwise: bool) -> tuple:
    data, data_t = _fp8_copies(x, fmt, rowwise, columnwise)
    return data, data_t, x.new_empty((), dtype=torch.float32), x.new_empty((), dtype=torch.float32)


@register_fake(fp8_delayed_cast_op)
def _(x, scale, history, fmt, rowwise, columnwise):
    return _cast_fakes(x, fmt, rowwise, columnwise)


@register_fake(fp8_delayed_rowwise_cast_op)
def _(x, scale, history, fmt):
    data, _, scale_inv, amax = _cast_fakes(x, fmt, True, False)
    return data, scale_inv, amax, torch.empty_like(scale)


@register_fake(fp8_delayed_cast_dbias_op)
def _(x, scale, history, fmt, rowwise, columnwise, bias_dtype):
    return (*_cast_fakes(x, fmt, rowwise, columnwise), x.new_empty((x.shape[1],), dtype=bias_dtype))


def _fp8_current_cast_dbias_impl(x: torch.Tensor, fmt: str, use_power_2_scales: bool, amax_epsilon: float,
                                 rowwise: bool, columnwise: bool, bias_dtype: torch.dtype
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A current-scaling quantizer's traced cast with the bias gradient of its pass
    (:func:`fp8_current_scaling_quantize_dbias`): (data, data_t, scale_inv, amax, db)."""
    out = _op_cast_in_cpp(x, fmt, rowwise, columnwise, True, use_power_2_scales, amax_epsilon, None, None, bias_dtype)
    if out is not None:
        return (*out[:4], out[5])
    res, db = fp8_current_scaling_quantize_dbias(x, fmt, use_power_2_scales, amax_epsilon, rowwise, columnwise,
                                                 bias_dtype)
    return (*_with_placeholders(x, fmt, res[:4]), db)


fp8_current_cast_dbias_op = define_op("fp8_current_cast_dbias", _fp8_current_cast_dbias_impl)


@register_fake(fp8_current_cast_dbias_op)
def _(x, fmt, use_power_2_scales, amax_epsilon, rowwise, columnwise, bias_dtype):
    return (*_cast_fakes(x, fmt, rowwise, columnwise), x.new_empty((x.shape[1],), dtype=bias_dtype))


def can_cast_from_amax() -> bool:
    """Whether the loaded extension has current scaling's cast from a given amax (``fp8_cast_from_amax``)."""
    ext = backend.extension()
    return ext is not None and hasattr(ext, "fp8_cast_from_amax")


def _cast_from_amax(x: torch.Tensor, amax: torch.Tensor, fmt: str, use_power_2_scales: bool, amax_epsilon: float,
                    rowwise: bool, columnwise: bool, bias_dtype: Optional[torch.dtype]) -> tuple:
    """(data, data_t, scale_inv, scale[, db]) of current scaling with ``amax`` given (the scale rule and bytes of
    :func:`fp8_current_scaling_quantize` for that amax), unwanted copies as empty placeholders."""
    if not x.is_contiguous():
        x = _contiguous(x, "fp8_cast_from_amax", "x")
    device = _require_cuda("fp8_cast_from_amax", x=x, amax=amax)
    if amax.dtype != torch.float32 or amax.numel() != 1:
        raise ValueError(f"fp_recipes::fp8_cast_from_amax: amax must be one FP32 value, got {amax.dtype} of "
                         f"shape {tuple(amax.shape)}")
    m, n = x.shape
    data, data_t = _fp8_copies_or_none(x, fmt, rowwise, columnwise)
    scale_inv, scale = _scalar(device), _scalar(device)
    x_ptr, data_ptr, data_t_ptr = _cast_ptrs(x, data, data_t)
    partials = db = None
    if bias_dtype is not None:
        check_bias_grad_args(x, bias_dtype)
        partials, db = _bias_outputs(x, bias_dtype)
    _launch(device, _ext().fp8_cast_from_amax, x_ptr, DTYPE_CODE[x.dtype], m, n, DTYPE_CODE[FP8_DTYPE[fmt]],
            bool(use_power_2_scales), float(amax_epsilon), data_ptr, data_t_ptr, scale.data_ptr(),
            scale_inv.data_ptr(), amax.data_ptr(), _stream(device), _ptr(partials), _ptr(db),
            -1 if db is None else DTYPE_CODE[db.dtype])
    out = (*_with_placeholders(x, fmt, (data, data_t)), scale_inv, scale)
    return out if db is None else (*out, db)


def _fp8_current_cast_from_amax_impl(x: torch.Tensor, amax: torch.Tensor, fmt: str, use_power_2_scales: bool,
                                     amax_epsilon: float, rowwise: bool, columnwise: bool
                                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A current-scaling quantizer's traced cast whose amax the graph computed (``x.abs().amax()``, which
    torch.compile can fuse into the kernel that produced x): (data, data_t, scale_inv, scale)."""
    return _cast_from_amax(x, amax, fmt, use_power_2_scales, amax_epsilon, rowwise, columnwise, None)


def _fp8_current_cast_from_amax_dbias_impl(x: torch.Tensor, amax: torch.Tensor, fmt: str, use_power_2_scales: bool,
                                           amax_epsilon: float, rowwise: bool, columnwise: bool,
                                           bias_dtype: torch.dtype
                                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                      torch.Tensor]:
    """:func:`_fp8_current_cast_from_amax_impl` and the bias gradient of the same pass: (..., db)."""
    return _cast_from_amax(x, amax, fmt, use_power_2_scales, amax_epsilon, rowwise, columnwise, bias_dtype)


fp8_current_cast_from_amax_op = define_op("fp8_current_cast_from_amax", _fp8_current_cast_from_amax_impl)
fp8_current_cast_from_amax_dbias_op = define_op("fp8_current_cast_from_amax_dbias",
                                                _fp8_current_cast_from_amax_dbias_impl)


@register_fake(fp8_current_cast_from_amax_op)
def _(x, amax, fmt, use_power_2_scales, amax_epsilon, rowwise, columnwise):
    return _cast_fakes(x, fmt, rowwise, columnwise)


@register_fake(fp8_current_cast_from_amax_dbias_op)
def _(x, amax, fmt, use_power_2_scales, amax_epsilon, rowwise, columnwise, bias_dtype):
    return (*_cast_fakes(x, fmt, rowwise, columnwise), x.new_empty((x.shape[1],), dtype=bias_dtype))


def _fp8_dequantize_impl(data: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    device = _require_cuda("fp8_dequantize", data=data, scale_inv=scale_inv)
    out = torch.empty(data.shape, dtype=out_dtype, device=device)
    with _on(device):
        _ext().fp8_dequantize(_ptr(data), DTYPE_CODE[data.dtype], data.numel(), scale_inv.data_ptr(), _ptr(out),
                              DTYPE_CODE[out_dtype], _stream(device))
    return out


_fp8_dequantize_op = define_op("fp8_dequantize", _fp8_dequantize_impl)


@register_fake(_fp8_dequantize_op)
def _(data, scale_inv, out_dtype):
    return data.new_empty(data.shape, dtype=out_dtype)


# ---- custom ops: grouped -------------------------------------------------------------------------

def _fp8_grouped_quantize_impl(x: torch.Tensor, offsets: torch.Tensor, scales: torch.Tensor,
                             fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    device = _require_cuda("fp8_grouped_quantize", x=x, offsets=offsets, scales=scales)
    g = _validated_groups(offsets, x.numel(), x, "fp8_grouped_quantize")
    dt = FP8_DTYPE[fmt]
    data = torch.empty(x.shape, dtype=dt, device=device)
    scale_inv = torch.empty((g,), dtype=torch.float32, device=device)
    amax = torch.empty((g,), dtype=torch.float32, device=device)
    with _on(device):
        _ext().fp8_grouped_quantize(_ptr(x), DTYPE_CODE[x.dtype], x.numel(), offsets.data_ptr(), g,
                                    _ptr(scales), DTYPE_CODE[dt], _ptr(data), _ptr(scale_inv), _ptr(amax),
                                    _stream(device))
    return data, scale_inv, amax


_fp8_grouped_quantize_op = define_op("fp8_grouped_quantize", _fp8_grouped_quantize_impl)


@register_fake(_fp8_grouped_quantize_op)
def _(x, offsets, scales, fmt):
    g = scales.shape[0]
    return (x.new_empty(x.shape, dtype=FP8_DTYPE[fmt]), x.new_empty((g,), dtype=torch.float32),
            x.new_empty((g,), dtype=torch.float32))


def _fp8_grouped_amax_impl(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    device = _require_cuda("fp8_grouped_amax", x=x, offsets=offsets)
    g = _validated_groups(offsets, x.numel(), x, "fp8_grouped_amax")
    amax = torch.empty((g,), dtype=torch.float32, device=device)
    with _on(device):
        _ext().fp8_grouped_amax(_ptr(x), DTYPE_CODE[x.dtype], x.numel(), offsets.data_ptr(), g, _ptr(amax),
                                _stream(device))
    return amax


_fp8_grouped_amax_op = define_op("fp8_grouped_amax", _fp8_grouped_amax_impl)


@register_fake(_fp8_grouped_amax_op)
def _(x, offsets):
    return x.new_empty((offsets.shape[0] - 1,), dtype=torch.float32)


def _fp8_grouped_dequantize_impl(data: torch.Tensor, offsets: torch.Tensor, scale_inv: torch.Tensor,
                               out_dtype: torch.dtype) -> torch.Tensor:
    device = _require_cuda("fp8_grouped_dequantize", data=data, offsets=offsets, scale_inv=scale_inv)
    g = _validated_groups(offsets, data.numel(), data, "fp8_grouped_dequantize")
    out = torch.empty(data.shape, dtype=out_dtype, device=device)
    with _on(device):
        _ext().fp8_grouped_dequantize(_ptr(data), DTYPE_CODE[data.dtype], data.numel(), offsets.data_ptr(), g,
                                      _ptr(scale_inv), _ptr(out), DTYPE_CODE[out_dtype], _stream(device))
    return out


_fp8_grouped_dequantize_op = define_op("fp8_grouped_dequantize", _fp8_grouped_dequantize_impl)


@register_fake(_fp8_grouped_dequantize_op)
def _(data, offsets, scale_inv, out_dtype):
    return data.new_empty(data.shape, dtype=out_dtype)


# ---- custom ops: multi-tensor (G separate tensors, one launch) ------------------------------------
# The custom ops return the two output buffers whole (outputs of a custom op may not alias each other);
# the per-member views are taken outside, by _multi_result. Eager callers that want views use
# _fp8_multi_quantize_impl / _fp8_multi_current_impl (no validation beyond what the kernel's launcher
# checks); the GroupedLinear hot path uses fp8_multi_cast_buffers (no views at all: its GEMMs take
# addresses). One launch (delayed) or two (current) either way.

def _multi_buffers(xs, fmt: str, rowwise: bool, columnwise: bool, total: int, cols: int,
                   t_numel: Optional[int] = None):
    """The (total, cols) rowwise buffer and the flat transposed buffer of ``t_numel`` elements (default
    total * cols: the dense layout), each empty when unwanted."""
    x0, dt = xs[0], FP8_DTYPE[fmt]
    data = x0.new_empty((total, cols) if rowwise else _EMPTY_SHAPE, dtype=dt)
    data_t = x0.new_empty((total * cols if t_numel is None else t_numel,) if columnwise else _EMPTY_SHAPE, dtype=dt)
    return data, data_t


T_ROW_MULTIPLE = 16  # the grouped layer's transposed copies: rows padded to this (cuBLASLt FP8 needs K % 16 == 0)


def padded_t_layout(rows: Sequence[int], cols: int) -> tuple[list, list]:
    """The layout of the grouped layer's transposed copies (``fp8_multi_cast_rows`` / ``_buffers``):
    ``(ld_t, t_starts)``. Member g's copy is (cols, ld_t[g]) row-major with ``ld_t[g]`` = rows[g]
    rounded up to 16 and zeros in columns [rows[g], ld_t[g]), from element ``t_starts[g]`` of one flat
    buffer (``t_starts[-1]``: its size). Why: the wgrad GEMM of expert g contracts over its rows, and
    cuBLASLt FP8 takes K only as a multiple of 16 with 16-byte aligned operands; with this layout both
    operands (x's and dy's copies: the same rows) are K = ld_t[g] (the zeros add nothing) and every
    member starts 16-byte aligned, so every expert stays on the one cuBLASLt list call and every store of
    the cast kernel is a 16-byte vector, whatever the router's row counts."""
    ld_t = [r + (-r) % T_ROW_MULTIPLE for r in rows]
    return ld_t, list(accumulate(map(cols.__mul__, ld_t), initial=0))


def _multi_pointers(rows: list, cols: int, data: torch.Tensor, data_t: torch.Tensor, rowwise: bool,
                    columnwise: bool):
    """Per-member output addresses in the two buffers (plain int arithmetic; FP8 is one byte)."""
    starts = list(accumulate(rows, initial=0))[:-1]
    out = [data.data_ptr() + s * cols for s in starts] if rowwise and data.numel() else []
    out_t = [data_t.data_ptr() + s * cols for s in starts] if columnwise and data_t.numel() else []
    return out, out_t


def _multi_scalars(x0: torch.Tensor, g: int, separate: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """scale_inv, amax, scale (G,) FP32: one allocation on the eager path; three where they are the
    outputs of a custom op (which may not alias each other)."""
    if separate:
        return tuple(x0.new_empty((g,), dtype=torch.float32) for _ in range(3))  # type: ignore[return-value]
    f32 = x0.new_empty((3, g), dtype=torch.float32)
    return f32[0], f32[1], f32[2]


def _multi_launch(xs, rows: list, cols: int, fp8_dtype: torch.dtype, out: list, out_t: list,
                  scales: Optional[Sequence[torch.Tensor]], power_2: bool, eps: float, scale: int, scale_inv: int,
                  amax: int, scale_inv_stride: int = 1, records: Sequence[int] = (),
                  x_ptrs: Optional[list] = None, ld_t: Sequence[int] = ()) -> None:
    """The one place the multi-tensor casts are launched: delayed scaling when ``scales`` (one FP32 device
    scalar per member, or a list of their addresses) is given, else current scaling;
    ``scale``/``scale_inv``/``amax`` are addresses of the (G,) FP32 outputs (scale_inv with the given
    stride, in floats). ``records`` (delayed scaling, one address per member or none): FP32
    ``amax_history[0]`` slots the kernel max-merges each amax into. ``x_ptrs``: the members' addresses
    when the caller computed them (``xs`` then only gives the dtype and device). ``ld_t`` (one per member
    or none: dense): the row strides of the transposed copies, zero-padded past each member's rows."""
    x0 = xs[0]
    if x_ptrs is None:
        x_ptrs = list(map(_DATA_PTR, xs))
    with _on(x0.device):
        if scales is not None:
            if scales and not isinstance(scales[0], int):
                scales = list(map(_DATA_PTR, scales))
            args = (x_ptrs, rows, cols, DTYPE_CODE[x0.dtype], out, out_t, scales,
                    DTYPE_CODE[fp8_dtype], scale, scale_inv, amax, _stream(x0.device), scale_inv_stride)
            if ld_t:
                _ext().fp8_multi_quantize(*args, list(records), list(ld_t))
            else:
                _ext().fp8_multi_quantize(*args, list(records)) if records else _ext().fp8_multi_quantize(*args)
        else:
            args = (x_ptrs, rows, cols, DTYPE_CODE[x0.dtype], out, out_t, DTYPE_CODE[fp8_dtype], bool(power_2),
                    float(eps), scale, scale_inv, amax, _stream(x0.device), scale_inv_stride)
            if ld_t:
                _ext().fp8_multi_current_scaling_quantize(*args, list(ld_t))
            else:
                _ext().fp8_multi_current_scaling_quantize(*args)


def _multi_cast(xs, fmt: str, rowwise: bool, columnwise: bool, separate: bool,
                scales: Optional[Sequence[torch.Tensor]] = None, power_2: bool = False, eps: float = 0.0):
    """The multi-tensor cast into (data, data_t, scale_inv, amax, scale) buffers (see _multi_launch)."""
    rows, cols = [x.shape[0] for x in xs], xs[0].shape[1]
    data, data_t = _multi_buffers(xs, fmt, rowwise, columnwise, sum(rows), cols)
    scale_inv, amax, scale = _multi_scalars(xs[0], len(rows), separate)
    out, out_t = _multi_pointers(rows, cols, data, data_t, rowwise, columnwise)
    _multi_launch(xs, rows, cols, data.dtype, out, out_t, scales, power_2, eps, scale.data_ptr(),
                  scale_inv.data_ptr(), amax.data_ptr())
    return data, data_t, scale_inv, amax, scale


def _fp8_multi_quantize_buffers(xs: list[torch.Tensor], scales: list[torch.Tensor], fmt: str, rowwise: bool,
                                columnwise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                           torch.Tensor]:
    _require_cuda("fp8_multi_quantize", **{f"xs[{i}]": x for i, x in enumerate(xs)},
                  **{f"scales[{i}]": s for i, s in enumerate(scales)})
    return _multi_cast(xs, fmt, rowwise, columnwise, True, scales=scales)


def _fp8_multi_current_buffers(xs: list[torch.Tensor], fmt: str, use_power_2_scales: bool, amax_epsilon: float,
                               rowwise: bool, columnwise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                         torch.Tensor, torch.Tensor]:
    _require_cuda("fp8_multi_current_scaling_quantize", **{f"xs[{i}]": x for i, x in enumerate(xs)})
    return _multi_cast(xs, fmt, rowwise, columnwise, True, power_2=use_power_2_scales, eps=amax_epsilon)


def _multi_fake(xs, fmt, rowwise, columnwise):
    rows = sum(x.shape[0] for x in xs)
    data, data_t = _multi_buffers(xs, fmt, rowwise, columnwise, rows, xs[0].shape[1])
    g = len(xs)
    return data, data_t, *(xs[0].new_empty((g,), dtype=torch.float32) for _ in range(3))


_fp8_multi_quantize_op = define_op("fp8_multi_quantize", _fp8_multi_quantize_buffers)


@register_fake(_fp8_multi_quantize_op)
def _(xs, scales, fmt, rowwise, columnwise):
    return _multi_fake(xs, fmt, rowwise, columnwise)


_fp8_multi_current_op = define_op("fp8_multi_current_scaling_quantize", _fp8_multi_current_buffers)


@register_fake(_fp8_multi_current_op)
def _(xs, fmt, use_power_2_scales, amax_epsilon, rowwise, columnwise):
    return _multi_fake(xs, fmt, rowwise, columnwise)


def _multi_result(xs, buffers, rowwise: bool, columnwise: bool) -> FP8MultiQuantized:
    """Per-member views of the two buffers (FP8MultiQuantized's layout)."""
    data, data_t, scale_inv, amax, scale = buffers
    rows = [x.shape[0] for x in xs]
    g = len(rows)
    if rowwise:
        data_views = list(data.split(rows))
    else:
        data_views = [None] * g
    if columnwise:
        cols = xs[0].shape[1]
        data_t_views = [v.view(cols, r) for v, r in zip(data_t.split([r * cols for r in rows]), rows)]
    else:
        data_t_views = [None] * g
    return FP8MultiQuantized(data=data_views, data_t=data_t_views, scale_inv=scale_inv, amax=amax, scale=scale)


def fp8_multi_cast_rows(x: torch.Tensor, rows: Sequence[int], fmt: str, *, scales: Optional[Sequence] = None,
                        power_2: bool = False, amax_epsilon: float = 0.0, records: Sequence[int] = ()):
    """:func:`fp8_multi_cast_buffers` of the consecutive row blocks of ONE contiguous 2-D CUDA tensor
    (member g: rows ``[starts[g], starts[g+1])`` of ``x``, ``sum(rows) == x.shape[0]``): the members'
    addresses are ``x``'s plus integer offsets, so no per-member view is made (the grouped layer's
    activations and output gradients). ``scales`` (delayed scaling): one FP32 device scalar per member,
    or their addresses. The same launch, arguments and result as ``fp8_multi_cast_buffers(x.split(rows))``.
    Arguments are trusted."""
    cols, g = x.shape[1], len(rows)
    starts = list(accumulate(rows, initial=0))
    total = starts[-1]
    ld_t, t_starts = layout = padded_t_layout(rows, cols)
    data, data_t = _multi_buffers((x,), fmt, True, True, total, cols, t_starts[-1])
    f32 = x.new_empty((6 * g,), dtype=torch.float32)
    # an empty member view's data_ptr() is 0: so is its address here
    base, row_bytes = x.data_ptr(), cols * x.element_size()
    x_ptrs = [base + s * row_bytes if r else 0 for s, r in zip(starts, rows)] if cols else [0] * g
    if total * cols:
        db, dtb = data.data_ptr(), data_t.data_ptr()
        out, out_t = [db + s * cols for s in starts[:-1]], [dtb + s for s in t_starts[:-1]]
    else:
        out, out_t = [], []
    fb = f32.data_ptr()
    _multi_launch((x,), list(rows), cols, data.dtype, out, out_t, scales, power_2, amax_epsilon, fb + 20 * g, fb,
                  fb + 16 * g, scale_inv_stride=4, records=records, x_ptrs=x_ptrs, ld_t=ld_t if out_t else ())
    return data, data_t, f32, starts, layout


def fp8_multi_cast_buffers(xs: Sequence[torch.Tensor], fmt: str, *, scales: Optional[Sequence[torch.Tensor]] = None,
                           power_2: bool = False, amax_epsilon: float = 0.0, records: Sequence[int] = ()):
    """The multi-tensor cast for callers that take addresses (the grouped FP8 layer's GEMMs): both
    copies of every member into three fresh buffers, no per-member tensor views (each view costs host
    time). Delayed scaling when ``scales`` is given (one FP32 device scalar per member), else current
    scaling. Arguments are trusted (contiguous 2-D CUDA tensors of one dtype/cols, a non-empty list).

    Returns ``(data, data_t, f32, starts, (ld_t, t_starts))``: ``data`` (total, cols) holds member g's
    rows from ``starts[g]``; ``data_t`` (t_starts[-1],) holds member g's transposed block (cols, ld_t[g])
    from ``t_starts[g]``, its rows zero-padded to a multiple of 16 (:func:`padded_t_layout`); ``f32``
    (6 G,) FP32 holds member g's scale_inv at ``[4 g]`` (16-byte aligned, as cuBLASLt requires of scale
    pointers), its amax at ``[4 G + g]`` and scale at ``[5 G + g]``.
    ``records`` (delayed scaling): the addresses of the members' FP32 ``amax_history[0]``, each updated
    as ``torch.maximum(slot, amax_g)`` by the cast kernel itself (empty: none)."""
    rows, cols, g = [x.shape[0] for x in xs], xs[0].shape[1], len(xs)
    starts = list(accumulate(rows, initial=0))
    ld_t, t_starts = layout = padded_t_layout(rows, cols)
    data, data_t = _multi_buffers(xs, fmt, True, True, starts[-1], cols, t_starts[-1])
    f32 = xs[0].new_empty((6 * g,), dtype=torch.float32)
    out = [data.data_ptr() + s * cols for s in starts[:-1]] if data.numel() else []
    out_t = [data_t.data_ptr() + s for s in t_starts[:-1]] if data_t.numel() else []
    fb = f32.data_ptr()
    _multi_launch(xs, rows, cols, data.dtype, out, out_t, scales, power_2, amax_epsilon, fb + 20 * g, fb, fb + 16 * g,
                  scale_inv_stride=4, records=records, ld_t=ld_t if out_t else ())
    return data, data_t, f32, starts, layout


def _fp8_multi_quantize_impl(xs: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], fmt: str, rowwise: bool,
                             columnwise: bool) -> FP8MultiQuantized:
    """Eager, validation-light entry point with per-member views: xs contiguous 2-D CUDA tensors of one
    dtype/device/cols (a non-empty list), scales FP32 scalars on that device, fmt 'e4m3' or 'e5m2'."""
    return _multi_result(xs, _multi_cast(xs, fmt, rowwise, columnwise, False, scales=scales), rowwise, columnwise)


def _fp8_multi_current_impl(xs: Sequence[torch.Tensor], fmt: str, power_2: bool, eps: float, rowwise: bool,
                            columnwise: bool) -> FP8MultiQuantized:
    """Eager, validation-light entry point of current scaling (see _fp8_multi_quantize_impl)."""
    return _multi_result(xs, _multi_cast(xs, fmt, rowwise, columnwise, False, power_2=power_2, eps=eps),
                         rowwise, columnwise)


def _contiguous_members(xs: Sequence[torch.Tensor], op: str) -> list[torch.Tensor]:
    out = list(xs)
    for i, x in enumerate(out):
        if not x.is_contiguous():
            out[i] = _contiguous(x, op, f"xs[{i}]")
    return out


# ---- custom ops: per token -----------------------------------------------------------------------

def _per_token_shapes(t: int, h: int, fmt: str, block: int, scale_format: str):
    data_shape, data_dtype = ((t, h * 3 // 2), torch.uint8) if fmt == "e5m6" else ((t, h), torch.float8_e4m3fn)
    scale_dtype = torch.uint8 if scale_format == "ue8m0" else torch.float32
    return data_shape, data_dtype, (t, h // block), scale_dtype


def _per_token_cast_impl(x: torch.Tensor, fmt: str, round_sf: bool, scale_format: str,
                       block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    device = _require_cuda("per_token_cast", x=x)
    t, h = x.shape
    ds, dd, ss, sd = _per_token_shapes(t, h, fmt, block_size, scale_format)
    data = torch.empty(ds, dtype=dd, device=device)
    scales = torch.empty(ss, dtype=sd, device=device)
    with _on(device):
        _ext().per_token_cast(_ptr(x), DTYPE_CODE[x.dtype], t, h, PER_TOKEN_FMT_CODE[fmt], bool(round_sf),
                              scale_format == "ue8m0", block_size, _ptr(data), _ptr(scales), _stream(device))
    return data, scales


_per_token_cast_op = define_op("per_token_cast", _per_token_cast_impl)


@register_fake(_per_token_cast_op)
def _(x, fmt, round_sf, scale_format, block_size):
    t, h = x.shape
    ds, dd, ss, sd = _per_token_shapes(t, h, fmt, block_size, scale_format)
    return x.new_empty(ds, dtype=dd), x.new_empty(ss, dtype=sd)


def _cast_back_impl(data: torch.Tensor, scales: torch.Tensor, fmt: str, out_dtype: torch.dtype, scale_format: str,
                  block_size: int) -> torch.Tensor:
    device = _require_cuda("cast_back", data=data, scales=scales)
    data = _aligned(data)
    t, h = _cast_back_shape(data, fmt)
    out = torch.empty((t, h), dtype=out_dtype, device=device)
    with _on(device):
        _ext().per_token_cast_back(_ptr(data), _ptr(scales), PER_TOKEN_FMT_CODE[fmt], scale_format == "ue8m0", t, h,
                                   block_size, _ptr(out), DTYPE_CODE[out_dtype], _stream(device))
    return out


_cast_back_op = define_op("cast_back", _cast_back_impl)


@register_fake(_cast_back_op)
def _(data, scales, fmt, out_dtype, scale_format, block_size):
    return data.new_empty(_cast_back_shape(data, fmt), dtype=out_dtype)


# ---- the implementations fp_recipes.ops dispatches to (the twins' signatures) ----------------------

_FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)


def _plain_cast_args(x, fmt, rowwise, columnwise) -> bool:
    """A quantizer's own call (a 2-D float tensor, a normalised fmt, a copy to make), accepted in a few
    attribute reads: the cast runs once per operand per step, and the full checks are a dozen calls.
    Anything else goes through the twin's checks, which raise its errors."""
    return (isinstance(x, torch.Tensor) and x.dtype in _FLOAT_INPUTS and x.ndim == 2 and type(fmt) is str
            and fmt in FP8_DTYPE and bool(rowwise or columnwise))


def _plain_quantize_args(x, scale, fmt, rowwise, columnwise) -> bool:
    """:func:`_plain_cast_args` and an FP32 0-dim scale on ``x``'s device (what the twin accepts)."""
    return (_plain_cast_args(x, fmt, rowwise, columnwise) and isinstance(scale, torch.Tensor)
            and scale.dtype == torch.float32 and scale.ndim == 0 and scale.device == x.device)


def _cast_input(x: torch.Tensor, scale: torch.Tensor, fmt: str, rowwise: bool, columnwise: bool,
                what: str = "fp8_quantize") -> tuple[torch.Tensor, str]:
    """(x contiguous, fmt) for a given-scale cast: the twin's checks unless the arguments are the plain
    ones (the quick test costs less than the checks on the per-step path)."""
    if not _plain_quantize_args(x, scale, fmt, rowwise, columnwise):
        fmt = check_fp8_quantize_args(x, scale, fmt, rowwise, columnwise)
    if not x.is_contiguous():
        x = _contiguous(x, what, "x")
    return x, fmt


@backend.register_cuda_impl("fp8_amax")
def fp8_amax(x: torch.Tensor) -> torch.Tensor:
    check_amax_input(x)
    return _call(_fp8_amax_op, _fp8_amax_impl, _contiguous(x, "fp8_amax", "x"))


@backend.register_cuda_impl("fp8_quantize")
def fp8_quantize(x: torch.Tensor, scale: torch.Tensor, fmt: str, *, rowwise: bool = True,
                 columnwise: bool = False) -> FP8Quantized:
    x, fmt = _cast_input(x, scale, fmt, rowwise, columnwise)
    data, data_t, scale_inv, amax = _call(_fp8_quantize_op, _fp8_quantize_launch, x, scale, fmt, bool(rowwise),
                                          bool(columnwise))
    return FP8Quantized(data=data if rowwise else None, data_t=data_t if columnwise else None,
                        scale_inv=scale_inv, amax=amax, scale=scale)


@backend.register_cuda_impl("fp8_current_scaling_quantize")
def fp8_current_scaling_quantize(x: torch.Tensor, fmt: str, *, use_power_2_scales: bool = False,
                                 amax_epsilon: float = 0.0, rowwise: bool = True,
                                 columnwise: bool = False) -> FP8Quantized:
    what = "fp8_current_scaling_quantize"
    if not (_plain_cast_args(x, fmt, rowwise, columnwise) and type(amax_epsilon) is float
            and amax_epsilon >= 0.0):
        fmt = check_current_scaling_args(x, fmt, amax_epsilon, rowwise, columnwise)
    if not x.is_contiguous():
        x = _contiguous(x, what, "x")
    data, data_t, scale_inv, amax, scale = _call(_fp8_current_op, _fp8_current_launch, x, fmt,
                                                 bool(use_power_2_scales), float(amax_epsilon), bool(rowwise),
                                                 bool(columnwise))
    return FP8Quantized(data=data if rowwise else None, data_t=data_t if columnwise else None,
                        scale_inv=scale_inv, amax=amax, scale=scale)


# ---- bias gradient: alone, and fused into the casts of a grad_output --------------------------------

_BIAS_TILE_ROWS = 64  # ref_fp8.BIAS_GRAD_TILE_ROWS: one row of partial sums per 64-row tile


def _bias_outputs(x: torch.Tensor, out_dtype: torch.dtype) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """The (tiles, N) FP32 workspace of the tile sums (None when empty) and the (N,) result."""
    m, n = x.shape
    tiles = -(-m // _BIAS_TILE_ROWS)
    partials = x.new_empty((tiles, n), dtype=torch.float32) if tiles * n else None
    return partials, x.new_empty((n,), dtype=out_dtype)


def _bias_grad_impl(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    device = _require_cuda("bias_grad", x=x)
    m, n = x.shape
    partials, db = _bias_outputs(x, out_dtype)
    _launch(device, _ext().bias_grad, _ptr(x), DTYPE_CODE[x.dtype], m, n, _ptr(partials), _ptr(db),
            DTYPE_CODE[out_dtype], _stream(device))
    return db


_bias_grad_op = define_op("bias_grad", _bias_grad_impl)


@register_fake(_bias_grad_op)
def _(x, out_dtype):
    return x.new_empty((x.shape[1],), dtype=out_dtype)


@backend.register_cuda_impl("bias_grad")
def bias_grad(x: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    check_bias_grad_args(x, out_dtype)
    return _call(_bias_grad_op, _bias_grad_impl, _contiguous(x, "bias_grad", "x"), out_dtype)


def bias_grads_rows(dy: torch.Tensor, rows: Sequence[int], dtypes: Sequence[Optional[torch.dtype]]) -> list:
    """(eager, CUDA) :func:`bias_grad` of each row block ``dy[o_g : o_g + rows[g]]`` of the contiguous 2-D
    ``dy`` whose ``dtypes[g]`` is not None (None elsewhere): a grouped layer's per-expert bias gradients,
    the same bits, with one workspace and one check for all (two launches per expert)."""
    check_bias_grad_args(dy, torch.float32)
    device = _require_cuda("bias_grad", x=dy)
    n = dy.shape[1]
    ext, stream, code = _ext(), _stream(device), DTYPE_CODE[dy.dtype]
    tiles = [-(-m // _BIAS_TILE_ROWS) if dt is not None else 0 for m, dt in zip(rows, dtypes)]
    partials = dy.new_empty((max(1, sum(tiles)) * n,), dtype=torch.float32)
    base, width, out = dy.data_ptr(), n * dy.element_size(), []
    p_ptr, row0 = partials.data_ptr(), 0
    for m, dt, t in zip(rows, dtypes, tiles):
        if dt is None:
            out.append(None)
        else:
            if dt not in (torch.float32, torch.float16, torch.bfloat16):
                check_bias_grad_args(dy, dt)
            db = dy.new_empty((n,), dtype=dt)
            _launch(device, ext.bias_grad, base + row0 * width if m else 0, code, m, n, p_ptr if t else 0,
                    db.data_ptr() if n else 0, DTYPE_CODE[dt], stream)
            p_ptr += t * n * 4
            out.append(db)
        row0 += m
    return out


def can_fuse_bias_grad() -> bool:
    """Whether the loaded extension has the casts with a fused bias gradient (one built before them has
    not: the quantizers then cast and run :func:`bias_grad` separately)."""
    ext = backend.extension()
    return ext is not None and hasattr(ext, "fp8_quantize_dbias") and hasattr(ext, "bias_grad")


def fp8_quantize_dbias(x: torch.Tensor, scale: torch.Tensor, fmt: str, rowwise: bool, columnwise: bool,
                       record: Optional[torch.Tensor], bias_dtype: torch.dtype) -> tuple[FP8Quantized, torch.Tensor]:
    """(eager, CUDA) :func:`fp8_quantize` of ``x`` and its bias gradient (:func:`bias_grad`'s bits, out
    of the cast's own pass over x: the tile sums, then one reduction launch). ``record``: as
    :func:`fp8_quantize_recording`, or None. The caller checks :func:`can_fuse_bias_grad`."""
    x, fmt = _cast_input(x, scale, fmt, rowwise, columnwise)
    check_bias_grad_args(x, bias_dtype)
    bias = _bias_outputs(x, bias_dtype)
    data, data_t, scale_inv, amax = _fp8_quantize_launch(x, scale, fmt, bool(rowwise), bool(columnwise), record,
                                                         bias)
    return FP8Quantized(data=data, data_t=data_t, scale_inv=scale_inv, amax=amax, scale=scale), bias[1]


def fp8_current_scaling_quantize_dbias(x: torch.Tensor, fmt: str, use_power_2_scales: bool, amax_epsilon: float,
                                       rowwise: bool, columnwise: bool,
                                       bias_dtype: torch.dtype) -> tuple[FP8Quantized, torch.Tensor]:
    """(eager, CUDA) :func:`fp8_current_scaling_quantize` of ``x`` and its bias gradient, the tile sums
    made by the cast pass (see :func:`fp8_quantize_dbias`)."""
    if not (_plain_cast_args(x, fmt, rowwise, columnwise) and type(amax_epsilon) is float and amax_epsilon >= 0.0):
        fmt = check_current_scaling_args(x, fmt, amax_epsilon, rowwise, columnwise)
    check_bias_grad_args(x, bias_dtype)
    if not x.is_contiguous():
        x = _contiguous(x, "fp8_current_scaling_quantize", "x")
    bias = _bias_outputs(x, bias_dtype)
    data, data_t, scale_inv, amax, scale = _fp8_current_launch(x, fmt, bool(use_power_2_scales), float(amax_epsilon),
                                                               bool(rowwise), bool(columnwise), bias)
    return FP8Quantized(data=data, data_t=data_t, scale_inv=scale_inv, amax=amax, scale=scale), bias[1]


@backend.register_cuda_impl("fp8_dequantize")
def fp8_dequantize(data: torch.Tensor, scale_inv: torch.Tensor,
                   out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    what = "fp8_dequantize"
    check_fp8_dequantize_args(data, scale_inv, out_dtype)
    return _call(_fp8_dequantize_op, _fp8_dequantize_impl, _contiguous(data, what, "data"), scale_inv, out_dtype)


# The grouped wrappers leave the offsets' values to the custom op, which checks them once per offsets
# tensor (_validated_groups) instead of one device-to-host copy per call.

@backend.register_cuda_impl("fp8_grouped_quantize")
def fp8_grouped_quantize(x: torch.Tensor, offsets: torch.Tensor, scales: torch.Tensor,
                         fmt: str) -> FP8GroupedQuantized:
    what = "fp8_grouped_quantize"
    fmt, _ = check_grouped_quantize_args(x, offsets, scales, fmt, offset_values=False)
    data, scale_inv, amax = _call(_fp8_grouped_quantize_op, _fp8_grouped_quantize_impl, 
        x, _contiguous(offsets, what, "offsets"), _contiguous(scales, what, "scales"), fmt)
    return FP8GroupedQuantized(data=data, scale_inv=scale_inv, amax=amax)


@backend.register_cuda_impl("fp8_grouped_amax")
def fp8_grouped_amax(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    what = "fp8_grouped_amax"
    check_grouped_amax_args(x, offsets, offset_values=False)
    return _call(_fp8_grouped_amax_op, _fp8_grouped_amax_impl, x, _contiguous(offsets, what, "offsets"))


@backend.register_cuda_impl("fp8_grouped_dequantize")
def fp8_grouped_dequantize(data: torch.Tensor, offsets: torch.Tensor, scale_inv: torch.Tensor,
                           out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    what = "fp8_grouped_dequantize"
    check_grouped_dequantize_args(data, offsets, scale_inv, out_dtype, offset_values=False)
    return _call(_fp8_grouped_dequantize_op, _fp8_grouped_dequantize_impl, 
        data, _contiguous(offsets, what, "offsets"), _contiguous(scale_inv, what, "scale_inv"), out_dtype)


@backend.register_cuda_impl("fp8_multi_quantize")
def fp8_multi_quantize(xs: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], fmt: str, *, rowwise: bool = True,
                       columnwise: bool = False) -> FP8MultiQuantized:
    what = "fp8_multi_quantize"
    fmt = check_multi_quantize_args(xs, scales, fmt, rowwise, columnwise)
    xs = _contiguous_members(xs, what)
    rowwise, columnwise = bool(rowwise), bool(columnwise)
    if torch.compiler.is_compiling() or not xs[0].is_cuda:  # traced, or meta/fake (or CPU: refused there)
        buffers = _fp8_multi_quantize_op(xs, list(scales), fmt, rowwise, columnwise)
    else:
        buffers = _multi_cast(xs, fmt, rowwise, columnwise, False, scales=scales)
    return _multi_result(xs, buffers, rowwise, columnwise)


@backend.register_cuda_impl("fp8_multi_current_scaling_quantize")
def fp8_multi_current_scaling_quantize(xs: Sequence[torch.Tensor], fmt: str, *, use_power_2_scales: bool = False,
                                       amax_epsilon: float = 0.0, rowwise: bool = True,
                                       columnwise: bool = False) -> FP8MultiQuantized:
    what = "fp8_multi_current_scaling_quantize"
    fmt = check_multi_current_args(xs, fmt, amax_epsilon, rowwise, columnwise)
    xs = _contiguous_members(xs, what)
    args = (fmt, bool(use_power_2_scales), float(amax_epsilon), bool(rowwise), bool(columnwise))
    if torch.compiler.is_compiling() or not xs[0].is_cuda:
        buffers = _fp8_multi_current_op(list(xs), *args)
    else:
        buffers = _multi_cast(xs, fmt, args[3], args[4], False, power_2=args[1], eps=args[2])
    return _multi_result(xs, buffers, bool(rowwise), bool(columnwise))


def _per_token_limits() -> dict:
    ext = backend.extension()
    if ext is None:
        return {True: 0, False: 0}
    return {True: ext.per_token_max_hidden(True), False: ext.per_token_max_hidden(False)}


# Read once at import (not inside traced code): the largest hidden size the per-token kernel takes.
_PER_TOKEN_MAX_HIDDEN = _per_token_limits()


def _per_token_kernel_fits(h: int, block: int) -> bool:
    unit8 = h % 8 == 0 and block % 8 == 0
    return h <= _PER_TOKEN_MAX_HIDDEN[unit8] and h // block <= 12288


@backend.register_cuda_impl("per_token_cast")
def per_token_cast(x: torch.Tensor, fmt: str, *, round_sf: bool = False, scale_format: str = "fp32",
                   block_size: Optional[int] = None) -> PerTokenQuantized:
    what = "per_token_cast"
    fmt, block = check_per_token_cast_args(x, fmt, round_sf, scale_format, block_size)
    if not _per_token_kernel_fits(x.shape[1], block):
        from . import ref_per_token

        backend.warn_once(f"per-token-size:{x.shape[1]}:{block}",
                          f"fp_recipes.ops.per_token_cast: hidden {x.shape[1]} with block {block} is beyond the "
                          "CUDA kernel's limits; running the pure-torch reference")
        return ref_per_token.per_token_cast(x, fmt, round_sf=round_sf, scale_format=scale_format,
                                            block_size=block_size)
    data, scales = _call(_per_token_cast_op, _per_token_cast_impl, _contiguous(x, what, "x"), fmt, bool(round_sf),
                                                       scale_format, block)
    return PerTokenQuantized(data=data, scales=scales)


@backend.register_cuda_impl("cast_back")
def cast_back(data: torch.Tensor, scales: torch.Tensor, fmt: str, *, out_dtype: torch.dtype = torch.bfloat16,
              scale_format: str = "fp32", block_size: Optional[int] = None) -> torch.Tensor:
    what = "cast_back"
    fmt, _, _, block = check_cast_back_args(data, scales, fmt, out_dtype, scale_format, block_size)
    return _call(_cast_back_op, _cast_back_impl, _contiguous(data, what, "data"), _contiguous(scales, what, "scales"),
                                          fmt, out_dtype, scale_format, block)


__all__ = [
    "cast_back",
    "fp8_amax",
    "fp8_current_scaling_quantize",
    "fp8_dequantize",
    "fp8_grouped_amax",
    "fp8_grouped_dequantize",
    "fp8_grouped_quantize",
    "fp8_multi_current_scaling_quantize",
    "fp8_multi_quantize",
    "fp8_quantize",
    "per_token_cast",
]
