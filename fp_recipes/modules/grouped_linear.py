"""``fp_recipes.GroupedLinear``: ``num_gemms`` independent linears over row-splits of one input (MoE).

``forward(x, m_splits)``: rows ``[sum(m_splits[:g]), sum(m_splits[:g+1]))`` of ``x`` go through expert
``g``. Each expert has its own quantizers (role ``grouped_linear[g].*``), so FP8 scales and NVFP4
global amaxes are per expert, and the GEMMs apply them per expert (never one shared scale). Any
number of experts, and experts with zero rows, are fine."""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from ..gemm import gemm, grouped_gemm
from ..quantizers.grouped import split_sizes
from ..quantizers.roles import ModuleKind
from . import replay
from .base import (GemmQuantizers, QuantizedModule, _check_nvfp4_shapes, amp_cast, backward_operands,
                   pad_tokens, quantize_operand, quantize_weight, start_backward, token_multiple,
                   torch_autocast_backward, torch_autocast_forward)
from .weight_cache import WeightCache
from .grouped_fp8 import GroupedFP8Function, fast_path_eligible
from .linear import _factory, check_features, new_linear_parameters

__all__ = ["GroupedLinear"]

# FP8 per-tensor recipes run through modules/grouped_fp8.py (one cast per expert and operand with
# both copies, per-expert GEMMs written into their output rows: the least host work and no copies).
# It is tested bit-identical to the generic path below on CPU. Set False to force the generic path.
FP8_FAST_PATH = True


_PARAMS = 5  # apply(x, m_splits, sets, cache, mode, *weights, *biases): where the parameters start


class _GroupedLinearFunction(torch.autograd.Function):
    @staticmethod
    @torch_autocast_forward
    def forward(ctx, x: torch.Tensor, m_splits: tuple, sets: List[GemmQuantizers], cache: Optional[WeightCache],
                mode: str, *params):
        num = len(m_splits)
        weights, biases = params[:num], params[num:]
        k = x.shape[1]
        n = weights[0].shape[0]
        amp = ctx.amp_dtype  # torch.autocast: see base.py
        in_dtype = x.dtype
        x = amp_cast(x, amp)
        biases_c = [amp_cast(b, amp) for b in biases]
        xs = torch.split(x, list(m_splits), dim=0)
        qxs, qws, x_ops, w_ops = [], [], [], []
        for g in range(num):
            qs = sets[g]
            _check_nvfp4_shapes(qs, m_splits[g], k, n)
            record = not qs.replay
            qx = quantize_operand(qs.activation, xs[g], qs.amax_reduction_group, record=record) \
                if m_splits[g] else xs[g]
            w = weights[g] if qs.weight is not None else amp_cast(weights[g], amp)
            qw = quantize_weight(qs.weight, w, qs.amax_reduction_group, record=record, cache=cache, mode=mode)
            qxs.append(qx)
            qws.append(qw)
            x_op, w_op = backward_operands(qs, xs[g], weights[g], qx, qw, amp)
            x_ops.append(x_op)
            w_ops.append(w_op)
        live = [g for g in range(num) if m_splits[g] > 0]
        if live:
            y = grouped_gemm([qxs[g] for g in live], [qws[g] for g in live], out_dtype=x.dtype,
                             biases=[biases_c[g] for g in live], use_fast_accum=True)
        else:
            y = torch.zeros(0, n, dtype=x.dtype, device=x.device)
        ctx.sets = sets
        ctx.m_splits = m_splits
        # saved tensors: freed after a backward that does not retain the graph, dropped and recomputed
        # under activation checkpointing
        tensors, ctx.shells = replay.pack(x_ops + w_ops)
        ctx.save_for_backward(*tensors)
        ctx.meta = (k, n, x.dtype, [w.dtype for w in weights], [None if b is None else b.dtype for b in biases],
                    in_dtype)
        return y

    @staticmethod
    @torch_autocast_backward
    def backward(ctx, dy: torch.Tensor):
        sets, m_splits = ctx.sets, ctx.m_splits
        num = len(m_splits)
        ops_ = replay.unpack(ctx.shells, ctx.saved_tensors)
        x_ops, w_ops = ops_[:num], ops_[num:]
        start_backward(sets[0], dy)
        k, n, x_dtype, w_dtypes, b_dtypes, in_dtype = ctx.meta
        need = ctx.needs_input_grad
        need_dx = need[0]
        dy = dy.contiguous()
        dys = torch.split(dy, list(m_splits), dim=0)
        live = [g for g in range(num) if m_splits[g] > 0]
        qdys = {g: quantize_operand(sets[g].grad_output, dys[g], sets[g].amax_reduction_group,
                                    backward=True) for g in live}
        dx = None
        if need_dx:
            if live:
                dx = grouped_gemm([qdys[g] for g in live], [w_ops[g] for g in live], transpose_b=True,
                                  out_dtype=x_dtype)
            else:
                dx = torch.zeros(0, k, dtype=x_dtype, device=dy.device)
            if dx.dtype != in_dtype:  # computed in the torch.autocast dtype: back to the input's
                dx = dx.to(in_dtype)
        dws: List[Optional[torch.Tensor]] = []
        dbs: List[Optional[torch.Tensor]] = []
        for g in range(num):
            dw = db = None
            if need[_PARAMS + g]:
                if m_splits[g]:
                    dw = gemm(qdys[g], x_ops[g], transpose_a=True, transpose_b=True, out_dtype=w_dtypes[g])
                else:
                    dw = torch.zeros(n, k, dtype=w_dtypes[g], device=dy.device)
            if b_dtypes[g] is not None and need[_PARAMS + num + g]:
                db = dys[g].float().sum(0).to(b_dtypes[g])
            dws.append(dw)
            dbs.append(db)
        return (dx, None, None, None, None, *dws, *dbs)


class GroupedLinear(QuantizedModule):
    """``num_gemms`` linears of the same shape, applied to consecutive row-splits of the input.

    Parameters are ``weight0..weight{G-1}`` and ``bias0..bias{G-1}`` (TransformerEngine's names).
    Outside autocast the result equals a loop of ``torch.nn.functional.linear`` exactly."""

    module_kind = ModuleKind.GROUPED_LINEAR

    def __init__(self, num_gemms: int, in_features: int, out_features: int, bias: bool = True,
                 params_dtype: Optional[torch.dtype] = None, device=None) -> None:
        super().__init__()
        if num_gemms <= 0:
            raise ValueError(f"GroupedLinear: num_gemms must be positive, got {num_gemms}")
        check_features("GroupedLinear", in_features, out_features)
        self._num_gemms = num_gemms
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = bias
        kw = _factory(params_dtype, device)
        for g in range(num_gemms):
            w, b = new_linear_parameters(in_features, out_features, bias, kw)
            self.register_parameter(f"weight{g}", w)
            self.register_parameter(f"bias{g}", b)

    @property
    def num_gemms(self) -> int:
        return self._num_gemms

    def weights(self) -> List[torch.Tensor]:
        return [getattr(self, f"weight{g}") for g in range(self._num_gemms)]

    def biases(self) -> List[Optional[torch.Tensor]]:
        return [getattr(self, f"bias{g}") for g in range(self._num_gemms)]

    def _check_splits(self, x: torch.Tensor, m_splits: Sequence[int]) -> tuple:
        splits = tuple(split_sizes(m_splits))
        if len(splits) != self._num_gemms:
            raise ValueError(f"GroupedLinear: got {len(splits)} m_splits for {self._num_gemms} GEMMs")
        if any(m < 0 for m in splits):
            raise ValueError(f"GroupedLinear: m_splits must be >= 0, got {list(splits)}")
        if sum(splits) != x.shape[0]:
            raise ValueError(f"GroupedLinear: m_splits sum to {sum(splits)} but the input has "
                             f"{x.shape[0]} rows (shape {tuple(x.shape)})")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"GroupedLinear: input has {x.shape[-1]} features, expected {self.in_features}")
        return splits

    def forward(self, x: torch.Tensor, m_splits: Sequence[int],
                is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """``is_first_microbatch``: as for :class:`~fp_recipes.Linear` (the experts' quantized weights'
        cache)."""
        if x.dim() != 2:
            raise ValueError(f"GroupedLinear: expected a 2-D input (tokens, in_features), got shape "
                             f"{tuple(x.shape)}")
        splits = self._check_splits(x, m_splits)
        sets = self.gemm_quantizers()
        self.check_input(x, sets)
        weights, biases = self.weights(), self.biases()
        if sets is None:
            outs = [F.linear(xg, w, b) for xg, w, b in zip(torch.split(x, list(splits)), weights, biases)]
            return torch.cat(outs, dim=0)
        # traced by torch.compile: the generic path (the fast path's multi-tensor casts and cuBLASLt
        # launches are host-side work that a graph replaces; both compute the same bits on CPU)
        cache, mode = self.weight_cache_for(is_first_microbatch)
        if FP8_FAST_PATH and not torch.compiler.is_compiling() and self._fp8_path_ok(sets):
            return GroupedFP8Function.apply(x, splits, sets, cache, mode, *weights, *biases)
        multiple = max(token_multiple(qs) for qs in sets)
        if multiple == 1 or all(m % multiple == 0 for m in splits):
            return _GroupedLinearFunction.apply(x, splits, sets, cache, mode, *weights, *biases)
        # NVFP4 blocks the tokens of each expert in 16s: pad every expert's rows, slice them off after
        parts = torch.split(x, list(splits))
        padded = [pad_tokens(p, multiple) for p in parts]
        y = _GroupedLinearFunction.apply(torch.cat(padded), tuple(p.shape[0] for p in padded), sets, cache, mode,
                                         *weights, *biases)
        outs = torch.split(y, [p.shape[0] for p in padded])
        return torch.cat([o[:m] for o, m in zip(outs, splits)])

    def _fp8_path_ok(self, sets: List[GemmQuantizers]) -> bool:
        """fast_path_eligible(sets), computed once per recipe's quantizer sets (it reads every spec;
        per-call variants of one recipe's sets share its specs)."""
        cached = getattr(self, "_fp8_path_cache", None)
        if cached is None or cached[0] is not sets[0].specs:
            cached = (sets[0].specs, fast_path_eligible(sets))
            self._fp8_path_cache = cached
        return cached[1]

    def extra_repr(self) -> str:
        return (f"num_gemms={self._num_gemms}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.use_bias}")
