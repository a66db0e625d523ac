"""The FP8 path of GroupedLinear: per-tensor (delayed or current) scaling on every operand.

What one training step costs on a GPU is mostly host time when the experts' GEMMs are short, so this
path does the least work per expert that the numerics allow, and no copies:

* each operand (activations, weights, grad_output) of ALL experts is cast in ONE multi-tensor cast
  (``ops.fp8_multi_quantize`` / ``ops.fp8_multi_current_scaling_quantize``: one kernel launch for
  delayed scaling, two for current scaling, whatever the number of experts) writing both copies
  (rowwise for fprop/dgrad, the transposed columnwise copy for wgrad), reading each expert's rows of
  the input buffer in place (row slices of a contiguous tensor are contiguous);
* delayed scaling records the amaxes of all experts with one ``_foreach_maximum_`` per operand;
* each pass's per-expert GEMMs (per-tensor scales, Hopper's K-major operands) are ONE host call into
  cuBLASLt with cached descriptors and algorithms (:mod:`fp_recipes.gemm_lt`), writing straight into
  each expert's rows of the output, so no concatenation; where that is unavailable, one
  ``torch._scaled_mm`` per expert. ``torch._scaled_grouped_mm`` would need the weights stacked (a copy
  of all of them per step) and per-row scale vectors, and measured slower on Hopper.

Numerically it is the generic path (``_GroupedLinearFunction``): the same quantizations (the same
ops on the same rows with the same scales) and, per expert, the same ``gemm_fp8_fp8`` GEMM (which
is also what runs here for shapes cuBLASLt cannot take directly and on CPU). Tested bit for bit on
CPU (tests/test_modules_linear.py).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

from .. import ops
from .. import gemm as G
from .. import gemm_lt
from ..quantizers.roles import ScalingKind, TensorKind
from .amax_reduction import reducer
from .base import GemmQuantizers

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
    """One operand of every expert: per-member rowwise data, columnwise (transposed) data and 0-dim
    scale_inv views (None for a member that was not cast)."""

    __slots__ = ("data", "data_t", "scale_inv")

    def __init__(self, data: List[Optional[torch.Tensor]], data_t: List[Optional[torch.Tensor]],
                 scale_inv: List[Optional[torch.Tensor]]) -> None:
        self.data, self.data_t, self.scale_inv = data, data_t, scale_inv


def _kernel_lane(x: torch.Tensor):
    """(delayed multi-cast, current multi-cast) taking and returning plain tensors: the CUDA kernels'
    eager entry points for a CUDA input (the public ops validate every argument on every call, which is
    host time; here the arguments are known good: contiguous row slices of one checked input or the
    module's own weights, the quantizers' own FP32 scales), else None (the dispatched ops run)."""
    if not x.is_cuda or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    from ..ops import backend
    if backend.cuda_impl("fp8_multi_quantize") is None:
        return None
    from ..ops import cuda_fp8
    return cuda_fp8._fp8_multi_quantize_impl, cuda_fp8._fp8_multi_current_impl


def _slot0(q: Any) -> torch.Tensor:
    """``q.amax_history[0]`` as a view, made once per history tensor (a view costs microseconds of host
    time; a rebound history, e.g. after ``module.to()``, gets a new one)."""
    cached = getattr(q, "_fpr_slot0", None)
    if cached is None or cached[0] is not q.amax_history:
        cached = (q.amax_history, q.amax_history[0])
        q._fpr_slot0 = cached
    return cached[1]


def _cast_all(quantizers: List[Any], parts: Sequence[torch.Tensor], group: Any, backward: bool,
              splits: Optional[Sequence[int]] = None) -> _Casts:
    """Cast every ``parts[g]`` by ``quantizers[g]`` (both copies) in one multi-tensor cast (one kernel
    launch for delayed scaling, two for current scaling, whatever the number of experts); record the
    delayed amaxes. Members with no rows are cast too (empty data, a valid scale_inv), but, as in the
    generic path, a delayed quantizer whose member is empty (``splits[g] == 0``) saw no tensor this
    step: it is not recorded for the scale update."""
    spec = quantizers[0].spec
    fmt = quantizers[0].fmt
    lane = _kernel_lane(parts[0])
    if spec.scaling is ScalingKind.DELAYED:
        scales = [q.scale for q in quantizers]
        if lane is not None:
            data, data_t, scale_inv, amax = lane[0](parts, scales, fmt, True, True)[:4]
        else:
            res = ops.fp8_multi_quantize(parts, scales, fmt, rowwise=True, columnwise=True)
            data, data_t, scale_inv, amax = res.data, res.data_t, res.scale_inv, res.amax
        # amax_history[0] = max(amax_history[0], amax) for every expert: one kernel
        torch._foreach_maximum_([_slot0(q) for q in quantizers], list(amax.unbind(0)))
        seen = quantizers if splits is None else [q for q, m in zip(quantizers, splits) if m > 0]
        (reducer.record_backward_many if backward else reducer.record_forward_many)(seen, group)
    else:
        p2, eps = bool(spec.use_power_2_scales), float(spec.amax_epsilon)
        if lane is not None:
            data, data_t, scale_inv = lane[1](parts, fmt, p2, eps, True, True)[:3]
        else:
            res = ops.fp8_multi_current_scaling_quantize(parts, fmt, use_power_2_scales=p2, amax_epsilon=eps,
                                                         rowwise=True, columnwise=True)
            data, data_t, scale_inv = res.data, res.data_t, res.scale_inv
    # the GEMMs need each scale at a 16-byte aligned address (cuBLASLt); the cast wrote them packed
    return _Casts(list(data), list(data_t), gemm_lt.aligned_scalars(scale_inv))


USE_CUBLASLT = True  # grouped GEMMs through fp_recipes.gemm_lt when available (benchmarks switch it off)


def _gemms(out: Sequence[torch.Tensor], a: Sequence[torch.Tensor], sa: Sequence[torch.Tensor],
           b: Sequence[torch.Tensor], sb: Sequence[torch.Tensor], out_dtype: torch.dtype, native: bool,
           bias: Optional[Sequence[Optional[torch.Tensor]]] = None, fast_accum: bool = False) -> None:
    """``out[i] = a[i] @ b[i]^T * sa[i] * sb[i] (+ bias[i])`` for every i (every ``out[i]`` non-empty).

    On CUDA with cuBLASLt available: one host call for all of them (:mod:`fp_recipes.gemm_lt`); the
    GEMMs it cannot take (and everything elsewhere) go through :func:`_gemm_into` one by one."""
    todo: Sequence[int] = range(len(out))
    if native and USE_CUBLASLT and gemm_lt.available() and \
            (bias is None or all(t is None or t.dtype == out_dtype for t in bias)):
        todo = gemm_lt.fp8_gemms(a, sa, b, sb, out, bias=bias, fast_accum=fast_accum)
    for i in todo:
        _gemm_into(out[i], a[i], sa[i], b[i], sb[i], out_dtype, native,
                   bias=None if bias is None else bias[i], fast_accum=fast_accum)


_SCALED_MM_OUT_OK = True  # torch._scaled_mm(..., out=) works here (set False after a failure)


def _native(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch._scaled_mm can run this FP8 pair here (CUDA sm_89+, not E5M2 x E5M2); checked once per
    GEMM kind and step, not per expert."""
    return a.is_cuda and G.fp8_native_gemm_available(a.device, a.dtype, b.dtype)


def _gemm_into(out: Optional[torch.Tensor], a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor,
               sb: torch.Tensor, out_dtype: torch.dtype, native: bool, bias: Optional[torch.Tensor] = None,
               fast_accum: bool = False) -> torch.Tensor:
    """``a @ b^T * sa * sb (+ bias)`` (both contraction-last), written into ``out`` when given.

    cuBLASLt takes the operands as they are when K and N are multiples of 16 and a bias (if any) can
    be fused; otherwise (and on CPU) ``gemm_fp8_fp8`` pads or emulates, exactly as the generic path."""
    global _SCALED_MM_OUT_OK
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
        res = G.gemm_fp8_fp8(G._Fp8Operand(a, sa), G._Fp8Operand(b, sb), out_dtype=out_dtype, bias=bias,
                             use_fast_accum=fast_accum)
    if out is not None:
        out.copy_(res)
        return out
    return res


def _row_slices(t: torch.Tensor, splits: Sequence[int]) -> List[torch.Tensor]:
    return list(torch.split(t, list(splits), dim=0))


class GroupedFP8Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, splits: tuple, sets: List[GemmQuantizers], *params):
        num = len(splits)
        weights, biases = list(params[:num]), list(params[num:])
        n = weights[0].shape[0]
        group = sets[0].amax_reduction_group
        x = x.contiguous()
        xc = _cast_all([qs.activation for qs in sets], _row_slices(x, splits), group, False, splits)
        wc = _cast_all([qs.weight for qs in sets], weights, group, False)
        y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
        live = [g for g in range(num) if splits[g] > 0]
        if live:
            native = _native(xc.data[live[0]], wc.data[live[0]])
            y_parts = _row_slices(y, splits)
            _gemms([y_parts[g] for g in live], [xc.data[g] for g in live], [xc.scale_inv[g] for g in live],
                   [wc.data[g] for g in live], [wc.scale_inv[g] for g in live], x.dtype, native,
                   bias=None if all(b is None for b in biases) else [biases[g] for g in live], fast_accum=True)
        ctx.sets, ctx.splits = sets, splits
        # the backward reads only the columnwise copies of x and the weights
        ctx.saved = (xc.data_t, xc.scale_inv, wc.data_t, wc.scale_inv)
        ctx.meta = (x.shape[1], n, x.dtype, [w.dtype for w in weights],
                    [None if b is None else b.dtype for b in biases])
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        sets, splits = ctx.sets, ctx.splits
        x_t, x_sinv, w_t, w_sinv = ctx.saved
        k, n, x_dtype, w_dtypes, b_dtypes = ctx.meta
        num = len(splits)
        need = ctx.needs_input_grad
        need_dw = [need[3 + g] for g in range(num)]
        live = [g for g in range(num) if splits[g] > 0]
        dy = dy.contiguous()
        dy_parts = _row_slices(dy, splits)
        dx = None
        dws: List[Optional[torch.Tensor]] = [None] * num
        if need[0] or any(need_dw):
            dyc = _cast_all([qs.grad_output for qs in sets], dy_parts, sets[0].amax_reduction_group, True,
                            splits)
            if need[0]:
                dx = torch.empty(dy.shape[0], k, dtype=x_dtype, device=dy.device)
                if live:
                    dx_parts = _row_slices(dx, splits)
                    _gemms([dx_parts[g] for g in live], [dyc.data[g] for g in live],
                           [dyc.scale_inv[g] for g in live], [w_t[g] for g in live], [w_sinv[g] for g in live],
                           x_dtype, _native(dyc.data[live[0]], w_t[live[0]]))
            wanted = [g for g in range(num) if need_dw[g]]
            for g in wanted:
                dws[g] = (torch.empty(n, k, dtype=w_dtypes[g], device=dy.device) if splits[g] > 0
                          else torch.zeros(n, k, dtype=w_dtypes[g], device=dy.device))
            live_w = [g for g in wanted if splits[g] > 0]
            if live_w:
                by_dtype: dict = {}
                for g in live_w:  # one GEMM list per weight dtype (the output dtype of the list)
                    by_dtype.setdefault(w_dtypes[g], []).append(g)
                native_w = _native(dyc.data_t[live_w[0]], x_t[live_w[0]])
                for w_dtype, gs in by_dtype.items():
                    _gemms([dws[g] for g in gs], [dyc.data_t[g] for g in gs], [dyc.scale_inv[g] for g in gs],
                           [x_t[g] for g in gs], [x_sinv[g] for g in gs], w_dtype, native_w)
        dbs: List[Optional[torch.Tensor]] = [None] * num
        for g in range(num):
            if b_dtypes[g] is not None and need[3 + num + g]:
                dbs[g] = dy_parts[g].float().sum(0).to(b_dtypes[g])
        ctx.saved = None
        return (dx, None, None, *dws, *dbs)
