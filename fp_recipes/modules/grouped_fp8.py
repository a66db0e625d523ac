"""The FP8 fast path of GroupedLinear: few launches per step, whatever the number of experts.

The generic path quantizes every expert's activation and grad_output separately (a handful of
launches and Python calls per expert and operand), which leaves a GPU idle behind the host when
the experts' GEMMs are short. Here:

* the activations of all experts are quantized by ONE grouped op (``ops.fp8_grouped_quantize``, each
  expert with its own scale), and so are the grad_outputs; delayed-scaling amaxes are recorded for
  all experts by one ``_foreach_maximum_``; current scaling takes its per-expert amaxes from one
  ``ops.fp8_grouped_amax``;
* the wgrad operands (x^T, dy^T) are byte transposes of each expert's rows of those buffers
  (per-tensor scaling makes the columnwise copy a byte transpose, exact);
* the GEMMs read views of these buffers (no concatenation); fprop can be one
  ``torch._scaled_grouped_mm`` (see ``fp_recipes.gemm.GROUPED_FP8_BACKEND``).

Numerically it is the generic path: every expert's bytes and scales are those of quantizing that
expert alone (the grouped op's contract), and every GEMM is ``gemm_fp8_fp8`` on the same values.
"""

from __future__ import annotations

import itertools
from typing import Any, List, Optional, Sequence

import torch

from .. import formats, ops
from .. import gemm as G
from ..ops.ref_fp8 import current_scale
from ..quantizers.roles import ScalingKind, TensorKind
from .amax_reduction import reducer
from .base import GemmQuantizers, quantize_operand

__all__ = ["fast_path_eligible", "GroupedFP8Function"]

_FP8_SCALINGS = (ScalingKind.DELAYED, ScalingKind.CURRENT)
_KEYS = ("fmt", "scaling", "use_power_2_scales", "amax_epsilon")


def fast_path_eligible(sets: Sequence[GemmQuantizers]) -> bool:
    """FP8 per-tensor scaling on every operand of every expert, one format/rule per role, no
    backward_override."""
    for tensor in (TensorKind.ACTIVATION, TensorKind.WEIGHT, TensorKind.GRAD_OUTPUT):
        specs = [qs.specs[tensor] for qs in sets]
        if any(s.scaling not in _FP8_SCALINGS or s.backward_override is not None for s in specs):
            return False
        first = tuple(getattr(specs[0], k) for k in _KEYS)
        if any(tuple(getattr(s, k) for k in _KEYS) != first for s in specs[1:]):
            return False
    return True


def _offsets(splits: Sequence[int], cols: int, device: torch.device) -> torch.Tensor:
    """(G+1,) int64 element offsets, built on the host and copied without a stream sync."""
    host = torch.tensor([0, *itertools.accumulate(m * cols for m in splits)], dtype=torch.int64)
    return host.to(device, non_blocking=True) if device.type == "cuda" else host


def _grouped_quantize(quantizers: List[Any], x: torch.Tensor, splits: Sequence[int], group: Any,
                      backward: bool):
    """(fp8 data shaped like x, scale_inv (G,), amax (G,)) with expert g quantized by quantizers[g]."""
    spec = quantizers[0].spec
    fmt = quantizers[0].fmt
    offsets = _offsets(splits, x.shape[1], x.device)
    if spec.scaling is ScalingKind.DELAYED:
        scales = torch.stack([q.scale for q in quantizers])
        res = ops.fp8_grouped_quantize(x, offsets, scales, fmt)
        torch._foreach_maximum_([q.amax_history[0:1] for q in quantizers], list(res.amax.split(1)))
        record = reducer.record_backward if backward else reducer.record_forward
        for q, m in zip(quantizers, splits):
            if m:  # like the generic path: an expert without rows did not quantize anything
                record(q, group)
    else:
        amax = ops.fp8_grouped_amax(x, offsets)
        scales = current_scale(amax, formats.FP8_MAX[fmt], use_power_2_scales=spec.use_power_2_scales,
                               amax_epsilon=spec.amax_epsilon)
        res = ops.fp8_grouped_quantize(x, offsets, scales, fmt)
    return res.data, res.scale_inv, res.amax


def _aligned_scalars(v: torch.Tensor) -> List[torch.Tensor]:
    """One separately allocated 0-dim tensor per entry of ``v``: cuBLASLt rejects FP8 scale pointers
    into the middle of a vector (CUBLAS_STATUS_NOT_SUPPORTED on an H200 for ``v[g]`` views at 4-byte
    offsets); its own allocation is what the per-expert path passes, and that works."""
    return [t.clone() for t in v.unbind(0)]


def _row_views(data: torch.Tensor, splits: Sequence[int]) -> List[torch.Tensor]:
    return list(torch.split(data, list(splits), dim=0))


class GroupedFP8Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, splits: tuple, sets: List[GemmQuantizers], *params):
        num = len(splits)
        weights, biases = params[:num], params[num:]
        n = weights[0].shape[0]
        group = sets[0].amax_reduction_group
        x = x.contiguous()
        xq, x_si, _ = _grouped_quantize([qs.activation for qs in sets], x, splits, group, False)
        x_si = _aligned_scalars(x_si)
        qws = [quantize_operand(qs.weight, w, qs.amax_reduction_group) for qs, w in zip(sets, weights)]
        live = [g for g in range(num) if splits[g]]
        x_rows = _row_views(xq, splits)
        a_ops = [G._Fp8Operand(x_rows[g], x_si[g]) for g in live]
        b_ops = [G._Fp8Operand(qws[g].data, qws[g].scale_inv) for g in live]
        y = None
        if live and all(b is None for b in biases) and G.GROUPED_FP8_BACKEND != "loop":
            # rows of empty experts are absent from the concatenated output anyway; with every expert
            # live the quantized buffer itself is the grouped GEMM's A (no concatenation)
            y = G._scaled_grouped_fprop(a_ops, b_ops, x.dtype, a_buffer=xq if len(live) == num else None)
        if y is None:
            outs = []
            for g in range(num):
                if splits[g]:
                    outs.append(G.gemm_fp8_fp8(G._Fp8Operand(x_rows[g], x_si[g]), b_ops[live.index(g)],
                                               out_dtype=x.dtype, bias=biases[g], use_fast_accum=True))
            y = torch.cat(outs) if outs else torch.zeros(0, n, dtype=x.dtype, device=x.device)
        ctx.sets, ctx.splits = sets, splits
        ctx.saved = (xq, x_si, [G._Fp8Operand(q.t_data(), q.scale_inv) for q in qws])
        ctx.meta = (x.shape[1], n, x.dtype, [w.dtype for w in weights], [None if b is None else b.dtype for b in biases])
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        sets, splits = ctx.sets, ctx.splits
        xq, x_si, w_cols = ctx.saved
        k, n, x_dtype, w_dtypes, b_dtypes = ctx.meta
        num = len(splits)
        need = ctx.needs_input_grad
        dy = dy.contiguous()
        group = sets[0].amax_reduction_group
        dyq, dy_si, _ = _grouped_quantize([qs.grad_output for qs in sets], dy, splits, group, True)
        dy_si = _aligned_scalars(dy_si)
        dy_rows = _row_views(dyq, splits)
        dx = None
        if need[0]:
            outs = [G.gemm_fp8_fp8(G._Fp8Operand(dy_rows[g], dy_si[g]), w_cols[g], out_dtype=x_dtype)
                    for g in range(num) if splits[g]]
            dx = torch.cat(outs) if outs else torch.zeros(0, k, dtype=x_dtype, device=dy.device)
        dws: List[Optional[torch.Tensor]] = [None] * num
        if any(need[3:3 + num]):
            # columnwise copies: byte transposes (exact for per-tensor scales), one contiguous tensor per
            # expert, the layout the per-expert path gives cuBLASLt
            dy_t = [r.t().contiguous() for r in dy_rows]
            x_t = [r.t().contiguous() for r in _row_views(xq, splits)]
            for g in range(num):
                if not need[3 + g]:
                    continue
                if splits[g]:
                    dws[g] = G.gemm_fp8_fp8(G._Fp8Operand(dy_t[g], dy_si[g]), G._Fp8Operand(x_t[g], x_si[g]),
                                            out_dtype=w_dtypes[g])
                else:
                    dws[g] = torch.zeros(n, k, dtype=w_dtypes[g], device=dy.device)
        dbs: List[Optional[torch.Tensor]] = [None] * num
        dy_parts = torch.split(dy, list(splits))
        for g in range(num):
            if b_dtypes[g] is not None and need[3 + num + g]:
                dbs[g] = dy_parts[g].float().sum(0).to(b_dtypes[g])
        ctx.saved = None
        return (dx, None, None, *dws, *dbs)

