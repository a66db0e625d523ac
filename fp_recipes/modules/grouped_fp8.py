"""The FP8 path of GroupedLinear: per-tensor (delayed or current) scaling on every operand.

What one training step costs on a GPU is mostly host time when the experts' GEMMs are short, so this
path does the least work per expert that the numerics allow, and no copies:

* each operand (activations, weights, grad_output) of ALL experts is cast in ONE multi-tensor cast
  (``ops.cuda_fp8.fp8_multi_cast_buffers`` on CUDA, the twin ``ops.fp8_multi_quantize`` /
  ``ops.fp8_multi_current_scaling_quantize`` elsewhere: one kernel launch for delayed scaling, two for
  current scaling, whatever the number of experts) writing both copies (rowwise for fprop/dgrad, the
  transposed columnwise copy for wgrad) into one buffer each, reading each expert's rows of the input
  in place, and every expert's scale_inv at a 16-byte aligned address (cuBLASLt's requirement);
* delayed scaling records the amaxes of all experts with one ``_foreach_maximum_`` per operand (the
  scale update after the forward and the backward is one launch too: ``amax_reduction``);
* each pass's per-expert GEMMs (per-tensor scales, Hopper's K-major operands) are ONE host call into
  cuBLASLt with cached descriptors and algorithms (:mod:`fp_recipes.gemm.cublaslt`) on addresses into those
  buffers (no tensor view per expert), writing straight into each expert's rows of the output, so no
  concatenation; where that is unavailable, one ``torch._scaled_mm`` per expert.
  ``torch._scaled_grouped_mm`` would need the weights stacked (a copy of all of them per step) and
  per-row scale vectors, and measured slower on Hopper.

Numerically it is the generic path (``_GroupedLinearFunction``): the same quantizations (the same
ops on the same rows with the same scales) and, per expert, the same ``gemm_fp8_fp8`` GEMM (which
is also what runs here for shapes cuBLASLt cannot take directly and on CPU). Tested bit for bit on
CPU (tests/test_modules_linear.py).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any, Callable, List, Optional, Sequence

import torch

from .. import ops
from ..gemm import cublaslt
from ..gemm.fp8 import fp8_native_gemm_available, gemm_fp8_fp8
from ..gemm.operands import Fp8Operand
from . import replay
from ..quantizers.roles import ScalingKind, TensorKind
from .amax_reduction import reducer
from .base import GemmQuantizers, amp_cast, start_backward, torch_autocast_backward, torch_autocast_forward
from .weight_cache import WeightCache

__all__ = ["fast_path_eligible", "GroupedFP8Function"]

_FP8_SCALINGS = (ScalingKind.DELAYED, ScalingKind.CURRENT)
_KEYS = ("fmt", "scaling", "use_power_2_scales", "amax_epsilon", "rowwise", "columnwise")


def fast_path_eligible(sets: Sequence[GemmQuantizers]) -> bool:
    """FP8 per-tensor scaling on every operand of every expert, one format/rule per role, both copies
    (rowwise and columnwise) planned, no backward_override."""
    for tensor in (TensorKind.ACTIVATION, TensorKind.WEIGHT, TensorKind.GRAD_OUTPUT):
        specs = [qs.specs[tensor] for qs in sets]
        if any(s.scaling not in _FP8_SCALINGS or s.backward_override is not None for s in specs):
            return False
        if any(qs.quantizers[tensor] is None for qs in sets):
            return False
        first = tuple(getattr(specs[0], k) for k in _KEYS)
        if any(tuple(getattr(s, k) for k in _KEYS) != first for s in specs[1:]):
            return False
        if not (specs[0].rowwise and specs[0].columnwise):
            return False
    return True


class _Casts:
    """One operand of every expert as one multi-tensor cast wrote it.

    On CUDA (:func:`cuda_fp8.fp8_multi_cast_buffers`): the rowwise data of all members in one
    (total, cols) buffer, the transposed copies (cols, rows_g) one after another in one flat buffer, and
    the FP32 scalars in one vector with member g's scale_inv at ``[4 g]`` (a 16-byte aligned address:
    cuBLASLt refuses scale pointers into a packed vector). The GEMMs take addresses (integer arithmetic,
    no tensor per member); tensor views are made only for GEMMs that take the portable path.
    Elsewhere the reference twin's per-member views are kept as they are."""

    __slots__ = ("data_buf", "data_t_buf", "f32", "dtype", "rows", "cols", "starts", "_views")

    def __init__(self, data_buf: Optional[torch.Tensor], data_t_buf: Optional[torch.Tensor], f32: torch.Tensor,
                 dtype: torch.dtype, rows: Sequence[int], cols: int, starts: Sequence[int],
                 views: Optional[tuple] = None) -> None:
        self.data_buf, self.data_t_buf, self.f32, self.dtype = data_buf, data_t_buf, f32, dtype
        self.rows, self.cols, self.starts = rows, cols, starts
        self._views = views  # reference path: (data views, data_t views, scale_inv (G,))

    @property
    def addressable(self) -> bool:
        """Made by the CUDA multi-cast (buffers with addresses), not by the reference twin."""
        return self._views is None

    def data(self, g: int) -> torch.Tensor:
        if self._views is not None:
            return self._views[0][g]
        return self.data_buf[self.starts[g]:self.starts[g + 1]]

    def data_t(self, g: int) -> torch.Tensor:
        if self._views is not None:
            return self._views[1][g]
        s, e = self.starts[g] * self.cols, self.starts[g + 1] * self.cols
        return self.data_t_buf[s:e].view(self.cols, self.rows[g])

    def scale_inv(self, g: int) -> torch.Tensor:
        return self._views[2][g] if self._views is not None else self.f32[4 * g]

    def amaxes(self) -> List[torch.Tensor]:
        g = len(self.rows)
        return list(self.f32[4 * g:5 * g].unbind(0))

    def data_ptrs(self, gs: Sequence[int]) -> List[int]:
        base, c = self.data_buf.data_ptr(), self.cols  # FP8: one byte per element
        return [base + self.starts[g] * c for g in gs]

    def data_t_ptrs(self, gs: Sequence[int]) -> List[int]:
        base, c = self.data_t_buf.data_ptr(), self.cols
        return [base + self.starts[g] * c for g in gs]

    def scale_ptrs(self, gs: Sequence[int]) -> List[int]:
        base = self.f32.data_ptr()
        return [base + 16 * g for g in gs]

    def split_saved(self) -> "tuple[list, _Casts]":
        """(its tensors, a shell without them) for ``ctx.save_for_backward`` (see ``replay.pack``)."""
        views = self._views
        tensors = [self.data_buf, self.data_t_buf, self.f32]
        shape = None
        if views is not None:
            shape = (views[0] is not None, len(views[1]))
            tensors += (list(views[0]) if views[0] is not None else []) + list(views[1]) + [views[2]]
        shell = _Casts(None, None, None, self.dtype, self.rows, self.cols, self.starts)
        shell._views = shape  # the structure of the views, rebuilt by with_saved_tensors
        return tensors, shell

    def with_saved_tensors(self, tensors: list) -> "_Casts":
        shape = self._views
        views = None
        if shape is not None:
            has_rowwise, g = shape
            rest = tensors[3:]
            data = rest[:g] if has_rowwise else None
            rest = rest[g:] if has_rowwise else rest
            views = (data, rest[:g], rest[g])
        return _Casts(tensors[0], tensors[1], tensors[2], self.dtype, self.rows, self.cols, self.starts, views)

    def copy(self) -> "_Casts":
        """A shallow copy (the same tensors), which :meth:`release_rowwise` can trim on its own."""
        return _Casts(self.data_buf, self.data_t_buf, self.f32, self.dtype, self.rows, self.cols, self.starts,
                      self._views)

    def release_rowwise(self) -> None:
        """Drop the rowwise copy (the backward needs only the transposed one)."""
        self.data_buf = None
        if self._views is not None:
            self._views = (None, self._views[1], self._views[2])


def _cuda_lane(x: torch.Tensor):
    """The CUDA multi-cast's buffer-level entry point (no per-member views: the module's GEMMs take
    addresses) for a CUDA input with the extension, else None (the dispatched ops run)."""
    if not x.is_cuda or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    from ..ops import backend
    if backend.cuda_impl("fp8_multi_quantize") is None:
        return None
    from ..ops import cuda_fp8
    return cuda_fp8.fp8_multi_cast_buffers


def _slot0(q: Any) -> torch.Tensor:
    """``q.amax_history[0]`` as a view, made once per history tensor (a view costs microseconds of host
    time; a rebound history, e.g. after ``module.to()``, gets a new one)."""
    cached = getattr(q, "_fpr_slot0", None)
    if cached is None or cached[0] is not q.amax_history:
        cached = (q.amax_history, q.amax_history[0])
        q._fpr_slot0 = cached
    return cached[1]


def _kernel_ready(parts: Sequence[torch.Tensor], quantizers: List[Any], delayed: bool) -> bool:
    """What the multi-cast kernel takes on trust: members of one dtype and device, each contiguous,
    and (delayed scaling) FP32 scales on that device. Anything else (an expert's weight cast or moved
    on its own, say) goes through the dispatched ops, which check, copy or say what is wrong."""
    x0 = parts[0]
    dtype, device = x0.dtype, x0.device
    if any(p.dtype != dtype or p.device != device or not p.is_contiguous() for p in parts):
        return False
    return not delayed or all(q.scale.device == device and q.scale.dtype == torch.float32 for q in quantizers)


def _fp8_dtype(fmt: str) -> torch.dtype:
    return torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2


def _cast_all(quantizers: List[Any], parts: Sequence[torch.Tensor], group: Any, backward: bool,
              splits: Optional[Sequence[int]] = None, record: bool = True) -> _Casts:
    """Cast every ``parts[g]`` by ``quantizers[g]`` (both copies) in one multi-tensor cast (one kernel
    launch for delayed scaling, two for current scaling, whatever the number of experts); record the
    delayed amaxes. Members with no rows are cast too (empty data, a valid scale_inv), but, as in the
    generic path, a delayed quantizer whose member is empty (``splits[g] == 0``) saw no tensor this
    step: it is not recorded for the scale update. ``record=False`` (a checkpoint recompute) records
    nothing."""
    spec = quantizers[0].spec
    fmt = quantizers[0].fmt
    delayed = spec.scaling is ScalingKind.DELAYED
    lane = _cuda_lane(parts[0]) if _kernel_ready(parts, quantizers, delayed) else None
    rows, cols = [p.shape[0] for p in parts], parts[0].shape[1]
    if lane is not None:
        data, data_t, f32, starts = lane(
            parts, fmt, scales=[q.scale for q in quantizers] if delayed else None,
            power_2=bool(spec.use_power_2_scales), amax_epsilon=float(spec.amax_epsilon))
        casts = _Casts(data, data_t, f32, data.dtype, rows, cols, starts)
    else:
        if delayed:
            res = ops.fp8_multi_quantize(parts, [q.scale for q in quantizers], fmt, rowwise=True, columnwise=True)
        else:
            res = ops.fp8_multi_current_scaling_quantize(parts, fmt, use_power_2_scales=bool(spec.use_power_2_scales),
                                                         amax_epsilon=float(spec.amax_epsilon), rowwise=True,
                                                         columnwise=True)
        casts = _Casts(None, None, res.amax, _fp8_dtype(fmt), rows, cols, list(accumulate(rows, initial=0)),
                       (res.data, res.data_t, res.scale_inv))
    if delayed and record:
        # amax_history[0] = max(amax_history[0], amax) for every expert: one kernel
        amaxes = casts.amaxes() if lane is not None else list(casts.f32.unbind(0))
        torch._foreach_maximum_([_slot0(q) for q in quantizers], amaxes)
        seen = quantizers if splits is None else [q for q, m in zip(quantizers, splits) if m > 0]
        (reducer.record_backward_many if backward else reducer.record_forward_many)(seen, group)
    return casts


USE_CUBLASLT = True  # grouped GEMMs through fp_recipes.gemm.cublaslt when available (benchmarks switch it off)


class _Side:
    """One GEMM operand of every expert in a pass: which copy of which cast."""

    __slots__ = ("casts", "transposed")

    def __init__(self, casts: _Casts, transposed: bool) -> None:
        self.casts, self.transposed = casts, transposed

    def tensor(self, g: int) -> torch.Tensor:
        return self.casts.data_t(g) if self.transposed else self.casts.data(g)

    def ptrs(self, gs: Sequence[int]) -> List[int]:
        return self.casts.data_t_ptrs(gs) if self.transposed else self.casts.data_ptrs(gs)


def _gemms(gs: Sequence[int], out: Callable[[int], torch.Tensor], out_ptrs: Callable[[], List[int]],
           a: _Side, b: _Side, m: Sequence[int], n: Sequence[int], k: Sequence[int], out_dtype: torch.dtype,
           device: torch.device, biases: Optional[Sequence[Optional[torch.Tensor]]] = None,
           fast_accum: bool = False) -> None:
    """For every expert g in ``gs``: ``out(g) = A_g @ B_g^T * sa_g * sb_g (+ bias_g)``, A_g (m, k) and
    B_g (n, k) the chosen copies of the two casts (m, n, k given per listed expert).

    On CUDA with cuBLASLt: one host call for the whole list, on addresses (:func:`cublaslt.fp8_gemms_ptr`);
    the GEMMs it cannot take, and everything elsewhere, go through :func:`_gemm_into` one by one."""
    if not gs:
        return
    todo: Sequence[int] = gs
    fp8_a, fp8_b = a.casts.dtype, b.casts.dtype
    native = device.type == "cuda" and fp8_native_gemm_available(device, fp8_a, fp8_b)
    bias_ok = biases is None or all(biases[g] is None or biases[g].dtype == out_dtype for g in gs)
    if native and USE_CUBLASLT and bias_ok and a.casts.addressable and b.casts.addressable and \
            cublaslt.available():
        bias_ptrs = None if biases is None else [0 if biases[g] is None else biases[g].data_ptr() for g in gs]
        skipped = cublaslt.fp8_gemms_ptr(
            a.ptrs(gs), a.casts.scale_ptrs(gs), b.ptrs(gs), b.casts.scale_ptrs(gs), out_ptrs(), m, n, k,
            fp8_a, fp8_b, out_dtype, device, bias=bias_ptrs, bias_dtype=out_dtype if bias_ptrs else None,
            fast_accum=fast_accum)
        todo = [gs[i] for i in skipped]
    for g in todo:
        _gemm_into(out(g), a.tensor(g), a.casts.scale_inv(g), b.tensor(g), b.casts.scale_inv(g), out_dtype,
                   native, bias=None if biases is None else biases[g], fast_accum=fast_accum)


_SCALED_MM_OUT_OK = True  # torch._scaled_mm(..., out=) works here (set False after a failure)


def _gemm_into(out: Optional[torch.Tensor], a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor,
               sb: torch.Tensor, out_dtype: torch.dtype, native: bool, bias: Optional[torch.Tensor] = None,
               fast_accum: bool = False) -> torch.Tensor:
    """``a @ b^T * sa * sb (+ bias)`` (both contraction-last), written into ``out`` when given.

    cuBLASLt takes the operands as they are when K and N are multiples of 16 and a bias (if any) can
    be fused; otherwise (and on CPU) ``gemm_fp8_fp8`` pads or emulates, exactly as the generic path."""
    global _SCALED_MM_OUT_OK
    if native:
        # cuBLASLt (behind torch._scaled_mm) refuses operand and scale pointers that are not 16-byte
        # aligned (CUBLAS_STATUS_NOT_SUPPORTED), and gemm_fp8_fp8 passes a contiguous view through as
        # it is. Views into the multi-cast buffers can be misaligned here: a wgrad operand starts at
        # starts[g] * cols bytes (e.g. cols = 24 after an expert of 1 row), and the reference twin's
        # scale_inv is a packed (G,) vector. A fresh copy is aligned (only GEMMs off the cuBLASLt list
        # get here).
        a, sa, b, sb = _aligned16(a), _aligned16(sa), _aligned16(b), _aligned16(sb)
    if native and a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0 and \
            (bias is None or (bias.dtype == out_dtype and out_dtype in (torch.bfloat16, torch.float16))):
        if out is not None and _SCALED_MM_OUT_OK:
            try:
                torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, bias=bias, out_dtype=out_dtype,
                                 use_fast_accum=fast_accum, out=out)
                return out
            except (RuntimeError, TypeError):
                _SCALED_MM_OUT_OK = False  # no usable out= variant in this torch: copy instead
        res = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, bias=bias, out_dtype=out_dtype,
                               use_fast_accum=fast_accum)
    else:
        res = gemm_fp8_fp8(Fp8Operand(a, sa), Fp8Operand(b, sb), out_dtype=out_dtype, bias=bias,
                           use_fast_accum=fast_accum)
    if out is not None:
        out.copy_(res)
        return out
    return res


def _aligned16(t: torch.Tensor) -> torch.Tensor:
    """``t`` if its data starts at a 16-byte aligned address, else an aligned copy."""
    return t if t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)


def _row_slices(t: torch.Tensor, splits: Sequence[int]) -> List[torch.Tensor]:
    return list(torch.split(t, list(splits), dim=0))


def _weight_casts(quantizers: List[Any], weights: Sequence[torch.Tensor], group: Any, record: bool,
                  cache: Optional[WeightCache], mode: str) -> _Casts:
    """The experts' weight casts: one multi-tensor cast, or the module's cached one while the weights are
    unchanged (weight_cache.py). A reuse still records every delayed-scaling weight amax (one kernel,
    as the cast does) and hands the quantizers to the reducer."""
    if cache is None:
        return _cast_all(quantizers, weights, group, False, None, record)
    wc = cache.lookup(quantizers, weights, mode)
    if wc is None:
        wc = _cast_all(quantizers, weights, group, False, None, record)
        if record:
            cache.store(quantizers, weights, wc)
    elif record and quantizers[0].spec.scaling is ScalingKind.DELAYED:
        amaxes = wc.amaxes() if wc.addressable else list(wc.f32.unbind(0))
        torch._foreach_maximum_([_slot0(q) for q in quantizers], amaxes)
        reducer.record_forward_many(quantizers, group)
    return wc


_PARAMS = 5  # apply(x, splits, sets, cache, mode, *weights, *biases): where the parameters start


class GroupedFP8Function(torch.autograd.Function):
    @staticmethod
    @torch_autocast_forward
    def forward(ctx, x: torch.Tensor, splits: tuple, sets: List[GemmQuantizers], cache: Optional[WeightCache],
                mode: str, *params):
        num = len(splits)
        weights, biases = list(params[:num]), list(params[num:])
        n = weights[0].shape[0]
        k = x.shape[1]
        group = sets[0].amax_reduction_group
        record = not sets[0].replay
        # torch.autocast (see base.py): x and the biases in its dtype; weights quantized from the masters
        in_dtype, b_dtypes = x.dtype, [None if b is None else b.dtype for b in biases]
        x = amp_cast(x, ctx.amp_dtype).contiguous()
        biases = [amp_cast(b, ctx.amp_dtype) for b in biases]
        xc = _cast_all([qs.activation for qs in sets], _row_slices(x, splits), group, False, splits, record)
        wc = _weight_casts([qs.weight for qs in sets], weights, group, record, cache, mode)
        y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
        live = [g for g in range(num) if splits[g] > 0]
        starts, esize = xc.starts, y.element_size()
        _gemms(live, lambda g: y[starts[g]:starts[g + 1]],
               lambda: [y.data_ptr() + starts[g] * n * esize for g in live],
               _Side(xc, False), _Side(wc, False), [splits[g] for g in live], [n] * len(live), [k] * len(live),
               x.dtype, x.device, biases=None if all(b is None for b in biases) else biases, fast_accum=True)
        ctx.sets, ctx.splits = sets, splits
        # the backward reads only the columnwise copies of x and the weights (a cached weight cast keeps
        # both: the next micro-batch's forward reads its rowwise copy)
        xc.release_rowwise()
        wc = wc.copy()
        wc.release_rowwise()
        # saved tensors: freed after a backward that does not retain the graph (they can be most of a
        # step's memory), kept for retain_graph=True, recomputed under activation checkpointing
        tensors, ctx.shells = replay.pack((xc, wc))
        ctx.save_for_backward(*tensors)
        ctx.meta = (k, n, x.dtype, [w.dtype for w in weights], b_dtypes, in_dtype)
        return y

    @staticmethod
    @torch_autocast_backward
    def backward(ctx, dy: torch.Tensor):
        sets, splits = ctx.sets, ctx.splits
        xc, wc = replay.unpack(ctx.shells, ctx.saved_tensors)
        start_backward(sets[0])
        k, n, x_dtype, w_dtypes, b_dtypes, in_dtype = ctx.meta
        num = len(splits)
        need = ctx.needs_input_grad
        need_dw = [need[_PARAMS + g] for g in range(num)]
        live = [g for g in range(num) if splits[g] > 0]
        dy = dy.contiguous()
        dy_parts = _row_slices(dy, splits)
        dx = None
        dws: List[Optional[torch.Tensor]] = [None] * num
        if need[0] or any(need_dw):
            dyc = _cast_all([qs.grad_output for qs in sets], dy_parts, sets[0].amax_reduction_group, True, splits)
            starts = dyc.starts
            if need[0]:
                dx = torch.empty(dy.shape[0], k, dtype=x_dtype, device=dy.device)
                esize = dx.element_size()
                _gemms(live, lambda g: dx[starts[g]:starts[g + 1]],
                       lambda: [dx.data_ptr() + starts[g] * k * esize for g in live],
                       _Side(dyc, False), _Side(wc, True), [splits[g] for g in live], [k] * len(live),
                       [n] * len(live), x_dtype, dy.device)
                if dx.dtype != in_dtype:  # computed in the torch.autocast dtype: back to the input's
                    dx = dx.to(in_dtype)
            # one tensor per expert: autograd hands a fresh gradient to .grad as it is, but copies a
            # view of a shared buffer
            for g in range(num):
                if need_dw[g]:
                    dws[g] = (torch.empty(n, k, dtype=w_dtypes[g], device=dy.device) if splits[g] > 0
                              else torch.zeros(n, k, dtype=w_dtypes[g], device=dy.device))
            by_dtype: dict = {}
            for g in live:  # one GEMM list per weight dtype (the output dtype of the list)
                if need_dw[g]:
                    by_dtype.setdefault(w_dtypes[g], []).append(g)
            for w_dtype, gs in by_dtype.items():
                _gemms(gs, lambda g: dws[g], lambda: [dws[g].data_ptr() for g in gs],
                       _Side(dyc, True), _Side(xc, True), [n] * len(gs), [k] * len(gs), [splits[g] for g in gs],
                       w_dtype, dy.device)
        dbs: List[Optional[torch.Tensor]] = [None] * num
        for g in range(num):
            if b_dtypes[g] is not None and need[_PARAMS + num + g]:
                dbs[g] = dy_parts[g].float().sum(0).to(b_dtypes[g])
        return (dx, None, None, None, None, *dws, *dbs)
