"""The FP8 path of GroupedLinear: per-tensor (delayed or current) scaling on every operand.

What one training step costs on a GPU is mostly host time when the experts' GEMMs are short, so this
path does the least work per expert that the numerics allow, and no copies:

* each expert's activation, weight and grad_output is cast ONCE by the cast kernel with both copies
  (rowwise for fprop/dgrad, the transposed columnwise copy for wgrad: ``ops.fp8_quantize`` /
  ``ops.fp8_current_scaling_quantize`` with ``rowwise=True, columnwise=True``), reading its rows of
  the input buffer in place (row slices of a contiguous tensor are contiguous);
* delayed scaling records the amaxes of all experts with one ``_foreach_maximum_`` per operand;
* every GEMM is one ``torch._scaled_mm`` per expert (per-tensor scales, Hopper's K-major operands)
  writing straight into its rows of the output (``out=``), so no concatenation. One
  ``torch._scaled_grouped_mm`` would need the weights stacked (a copy of all of them per step) and
  per-row scale vectors; per-expert ``_scaled_mm`` at MoE sizes runs as fast without the copies.

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


class _Cast:
    """One expert's operand: rowwise data, columnwise data (transposed), scale_inv (0-dim FP32)."""

    __slots__ = ("data", "data_t", "scale_inv")

    def __init__(self, data: torch.Tensor, data_t: torch.Tensor, scale_inv: torch.Tensor) -> None:
        self.data, self.data_t, self.scale_inv = data, data_t, scale_inv


def _kernel_lane(x: torch.Tensor):
    """(delayed cast, current cast) taking and returning plain tensors: the CUDA kernels' eager entry
    points for a CUDA input (the public ops validate every argument on every call, which is host time
    spent once per expert and operand; here the arguments are known good: contiguous row slices of
    one checked input, the quantizers' own FP32 scales), else None (the dispatched ops run)."""
    if not x.is_cuda or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    from ..ops import backend
    if backend.cuda_impl("fp8_quantize") is None:
        return None
    from ..ops import cuda_fp8
    return cuda_fp8._fp8_quantize_impl, cuda_fp8._fp8_current_impl


def _slot0(q: Any) -> torch.Tensor:
    """``q.amax_history[0]`` as a view, made once per history tensor (a view costs microseconds of host
    time; a rebound history, e.g. after ``module.to()``, gets a new one)."""
    cached = getattr(q, "_fpr_slot0", None)
    if cached is None or cached[0] is not q.amax_history:
        cached = (q.amax_history, q.amax_history[0])
        q._fpr_slot0 = cached
    return cached[1]


def _cast_all(quantizers: List[Any], parts: Sequence[torch.Tensor], live: Sequence[bool], group: Any,
              backward: bool) -> List[Optional[_Cast]]:
    """Cast ``parts[g]`` by ``quantizers[g]`` (both copies) where ``live[g]``; record delayed amaxes."""
    spec = quantizers[0].spec
    fmt = quantizers[0].fmt
    out: List[Optional[_Cast]] = [None] * len(parts)
    lane = _kernel_lane(parts[0])
    if spec.scaling is ScalingKind.DELAYED:
        slots, amaxes = [], []
        record = reducer.record_backward if backward else reducer.record_forward
        for g, (q, p) in enumerate(zip(quantizers, parts)):
            if not live[g]:
                continue
            if lane is not None:
                data, data_t, scale_inv, amax = lane[0](p.contiguous(), q.scale, fmt, True, True)
            else:
                res = ops.fp8_quantize(p, q.scale, fmt, rowwise=True, columnwise=True)
                data, data_t, scale_inv, amax = res.data, res.data_t, res.scale_inv, res.amax
            out[g] = _Cast(data, data_t, scale_inv)
            slots.append(_slot0(q))
            amaxes.append(amax)
            record(q, group)
        if slots:  # amax_history[0] = max(amax_history[0], amax) for every expert: one kernel
            torch._foreach_maximum_(slots, amaxes)
    else:
        p2, eps = bool(spec.use_power_2_scales), float(spec.amax_epsilon)
        for g, p in enumerate(parts):
            if not live[g]:
                continue
            if lane is not None:
                data, data_t, scale_inv, _, _ = lane[1](p.contiguous(), fmt, p2, eps, True, True)
            else:
                res = ops.fp8_current_scaling_quantize(p, fmt, use_power_2_scales=p2, amax_epsilon=eps,
                                                       rowwise=True, columnwise=True)
                data, data_t, scale_inv = res.data, res.data_t, res.scale_inv
            out[g] = _Cast(data, data_t, scale_inv)
    return out


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
        weights, biases = params[:num], params[num:]
        n = weights[0].shape[0]
        group = sets[0].amax_reduction_group
        x = x.contiguous()
        live = [m > 0 for m in splits]
        xc = _cast_all([qs.activation for qs in sets], _row_slices(x, splits), live, group, False)
        wc = _cast_all([qs.weight for qs in sets], weights, [True] * num, group, False)
        y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
        first = next((g for g in range(num) if live[g]), None)
        native = first is not None and _native(xc[first].data, wc[first].data)
        for g, y_g in enumerate(_row_slices(y, splits)):
            if live[g]:
                _gemm_into(y_g, xc[g].data, xc[g].scale_inv, wc[g].data, wc[g].scale_inv, x.dtype, native,
                           bias=biases[g], fast_accum=True)
        ctx.sets, ctx.splits = sets, splits
        # the backward reads only the columnwise copies of x and the weights
        ctx.saved = ([None if c is None else (c.data_t, c.scale_inv) for c in xc],
                     [(c.data_t, c.scale_inv) for c in wc])
        ctx.meta = (x.shape[1], n, x.dtype, [w.dtype for w in weights],
                    [None if b is None else b.dtype for b in biases])
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        sets, splits = ctx.sets, ctx.splits
        x_cols, w_cols = ctx.saved
        k, n, x_dtype, w_dtypes, b_dtypes = ctx.meta
        num = len(splits)
        need = ctx.needs_input_grad
        need_dw = [need[3 + g] for g in range(num)]
        live = [m > 0 for m in splits]
        dy = dy.contiguous()
        dy_parts = _row_slices(dy, splits)
        dx = None
        dws: List[Optional[torch.Tensor]] = [None] * num
        if need[0] or any(need_dw):
            dyc = _cast_all([qs.grad_output for qs in sets], dy_parts, live, sets[0].amax_reduction_group,
                            True)
            first = next((g for g in range(num) if live[g]), None)
            native = first is not None and _native(dyc[first].data, w_cols[first][0])
            native_w = first is not None and _native(dyc[first].data_t, x_cols[first][0])
            if need[0]:
                dx = torch.empty(dy.shape[0], k, dtype=x_dtype, device=dy.device)
                for g, dx_g in enumerate(_row_slices(dx, splits)):
                    if live[g]:
                        _gemm_into(dx_g, dyc[g].data, dyc[g].scale_inv, w_cols[g][0], w_cols[g][1], x_dtype,
                                   native)
            for g in range(num):
                if not need_dw[g]:
                    continue
                if live[g]:
                    dws[g] = _gemm_into(None, dyc[g].data_t, dyc[g].scale_inv, x_cols[g][0], x_cols[g][1],
                                        w_dtypes[g], native_w)
                else:
                    dws[g] = torch.zeros(n, k, dtype=w_dtypes[g], device=dy.device)
        dbs: List[Optional[torch.Tensor]] = [None] * num
        for g in range(num):
            if b_dtypes[g] is not None and need[3 + num + g]:
                dbs[g] = dy_parts[g].float().sum(0).to(b_dtypes[g])
        ctx.saved = None
        return (dx, None, None, *dws, *dbs)
