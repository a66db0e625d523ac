"""``fp_recipes.GroupedLinear``: ``num_gemms`` independent linears over row-splits of one input (MoE).

``forward(x, m_splits)``: rows ``[sum(m_splits[:g]), sum(m_splits[:g+1]))`` of ``x`` go through expert
``g``. Each expert has its own quantizers (role ``grouped_linear[g].*``), so FP8 scales and NVFP4
global amaxes are per expert, and the GEMMs apply them per expert (never one shared scale). Any
number of experts, and experts with zero rows, are fine."""

from __future__ import annotations

from itertools import compress
from operator import attrgetter, itemgetter
from typing import List, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from .. import ops
from ..gemm import grouped_gemm
from ..quantizers.grouped import _cuda_lane, fp8_multi_cast, fp8_multi_cast_fits, split_sizes
from ..quantizers.roles import ModuleKind, ScalingKind, TensorKind
from . import replay
from .amax_reduction import reducer
from .base import QuantizedModule
from .linear_function import (GemmQuantizers, _check_nvfp4_shapes, amp_cast, backward_operands, pad_tokens,
                              quantize_operand, quantize_weight, start_backward, token_multiple,
                              torch_autocast_backward, torch_autocast_forward)
from .weight_cache import WeightCache
from .linear import _factory, check_features, new_linear_parameters

__all__ = ["GroupedLinear"]

# FP8 per-tensor recipes (delayed or current scaling, one rule per operand, no backward_override) cast
# each operand of ALL experts in one multi-tensor cast (quantizers/grouped.py: fp8_multi_cast, both
# copies, one kernel launch for delayed scaling, two for current, whatever the number of experts), and
# the grouped GEMMs then take addresses into its buffers (gemm/grouped.py: one cuBLASLt call per pass,
# written into the output rows). A MoE layer's step is bound by host time; this is the least host work
# per expert. The same bits as one quantization per expert (tested on CPU). Not traced by torch.compile
# (host-side work that a graph replaces). Set False to quantize expert by expert.
MULTI_CAST = True

_PARAMS = 6  # apply(x, m_splits, sets, cache, mode, multi, *weights, *biases): where the parameters start
_ROLES = (TensorKind.ACTIVATION, TensorKind.WEIGHT, TensorKind.GRAD_OUTPUT)
_QUANTIZERS = attrgetter("quantizers")
_GETTERS = {t: itemgetter(t) for t in _ROLES}


def _role_quantizers(sets: Sequence[GemmQuantizers], role: TensorKind, fast: bool) -> list:
    """Every expert's quantizer of one role, ``[qs.quantizers[role] for qs in sets]``; iterated in C where
    ``fast`` (the eager multi path: no Python frame per expert). torch.compile cannot trace operator's
    getters; the traced path is never the multi path."""
    if fast:
        return list(map(_GETTERS[role], map(_QUANTIZERS, sets)))
    return [qs.quantizers[role] for qs in sets]


def _quantize_experts(multi: bool, quantizers: list, parts: Union[torch.Tensor, Sequence[torch.Tensor]],
                      splits: Optional[Sequence[int]], group, *, backward: bool = False, record: bool = True):
    """One operand of every expert: an Fp8MultiCast (``multi``), else a list (one quantization per expert
    with rows; an expert without rows keeps its empty slice). ``parts``: one tensor per expert, or
    (``multi`` with ``splits``) the whole (sum(splits), cols) tensor, which the multi-cast splits by
    address arithmetic (no view per expert). A delayed quantizer whose expert got no rows
    (``splits[g] == 0``; ``splits=None``: every expert, the weights) saw no tensor this step: it is not
    handed to the reducer. ``record=False``: a checkpoint recompute, which records nothing."""
    if not multi:
        return [quantize_operand(q, p, group, backward=backward, record=record) if m else p
                for q, p, m in zip(quantizers, parts, splits)]
    casts = fp8_multi_cast(quantizers, parts, record=record, rows=splits)
    if record and quantizers[0].spec.scaling is ScalingKind.DELAYED:
        seen = quantizers if splits is None else list(compress(quantizers, splits))  # splits[g] > 0
        (reducer.record_backward_many if backward else reducer.record_forward_many)(seen, group)
    return casts


def _quantize_weights(multi: bool, quantizers: list, weights: Sequence[torch.Tensor], group, record: bool,
                      cache: Optional[WeightCache], mode: str, amp: Optional[torch.dtype]):
    """The experts' weights, through the module's weight cache (weight_cache.py): per expert, or (``multi``)
    the one multi-cast of all of them, kept whole. A reuse still records every delayed-scaling weight amax
    and hands the quantizers to the reducer, as a cast would."""
    if not multi:
        return [quantize_weight(q, w if q is not None else amp_cast(w, amp), group, record=record, cache=cache,
                                mode=mode) for q, w in zip(quantizers, weights)]
    hit = None if cache is None else cache.lookup(quantizers, weights, mode, record)
    if hit is None:
        casts = _quantize_experts(True, quantizers, weights, None, group, record=record)
        if cache is not None and record:
            cache.store(quantizers, weights, casts, mode)
        return casts
    if record and quantizers[0].spec.scaling is ScalingKind.DELAYED:
        hit.record_amaxes(quantizers)
        reducer.record_forward_many(quantizers, group)
    return hit


def _bias_grads(dy: torch.Tensor, dys: Optional[Sequence[torch.Tensor]], m_splits: Sequence[int],
                dtypes: Sequence[Optional[torch.dtype]], need: Sequence[bool]) -> List[Optional[torch.Tensor]]:
    """Each expert's bias gradient: ``ops.bias_grad`` of its rows of ``dy`` (FP32 column sums in a fixed
    order, rounded to the bias dtype), the bits a Linear on the expert's rows computes; on CUDA one call
    for all experts (``cuda_fp8.bias_grads_rows``: one workspace, raw row addresses, no views).
    ``dys``: the experts' views of ``dy`` if the caller made them (else made here where needed)."""
    wanted = [dt if dt is not None and need[g] else None for g, dt in enumerate(dtypes)]
    lane = _cuda_lane(dy)
    if lane is not None and dy.is_contiguous():
        return lane.bias_grads_rows(dy, m_splits, wanted)
    if dys is None:
        dys = torch.split(dy, list(m_splits), dim=0)
    return [ops.bias_grad(dys[g], dt) if dt is not None else None for g, dt in enumerate(wanted)]


_LIVE: dict = {}  # m_splits -> the experts with rows (a tuple of ints: immutable, shared by every call)


def _live(m_splits: tuple) -> tuple:
    """The experts with rows, ``[g for g, m in enumerate(m_splits) if m > 0]``, computed once per split."""
    live = _LIVE.get(m_splits)
    if live is None:
        if len(_LIVE) >= 4096:  # token routing varies per step: keep it bounded
            _LIVE.clear()
        live = _LIVE[m_splits] = tuple(g for g, m in enumerate(m_splits) if m > 0)
    return live


class _GroupedLinearFunction(torch.autograd.Function):
    @staticmethod
    @torch_autocast_forward
    def forward(ctx, x: torch.Tensor, m_splits: tuple, sets: List[GemmQuantizers], cache: Optional[WeightCache],
                mode: str, multi: bool, *params):
        num = len(m_splits)
        weights, biases = params[:num], params[num:]
        k, n = x.shape[1], weights[0].shape[0]
        group, record, amp = sets[0].amax_reduction_group, not sets[0].replay, ctx.amp_dtype
        if not multi:  # (the multi-cast takes FP8 per-tensor recipes only: no NVFP4 shapes to check)
            for qs, m in zip(sets, m_splits):
                _check_nvfp4_shapes(qs, m, k, n)
        ctx.meta = (k, n, [w.dtype for w in weights], [None if b is None else b.dtype for b in biases], x.dtype)
        # torch.autocast (see base.py): x and the biases in its dtype; quantized weights from the masters
        x = amp_cast(x, amp).contiguous()
        # the multi-cast takes x whole (its experts' rows by address); the per-expert path, views
        xs = x if multi else torch.split(x, list(m_splits), dim=0)
        qx = _quantize_experts(multi, _role_quantizers(sets, TensorKind.ACTIVATION, multi), xs, m_splits, group, record=record)
        qw = _quantize_weights(multi, _role_quantizers(sets, TensorKind.WEIGHT, multi), weights, group, record, cache, mode, amp)
        live = _live(m_splits) if multi else [g for g in range(num) if m_splits[g] > 0]
        y = grouped_gemm(qx, qw, out_dtype=x.dtype, biases=biases if amp is None else [amp_cast(b, amp) for b in biases],
                         use_fast_accum=sets[0].fast_accum[0], groups=live) if live else x.new_zeros(0, n)
        ctx.sets, ctx.m_splits, ctx.multi, ctx.compute_dtype = sets, m_splits, multi, x.dtype
        # what the backward GEMMs read (the columnwise copies, or by backward_override), as saved
        # tensors: freed after a backward that does not retain the graph (they can be most of a step's
        # memory), kept for retain_graph=True, dropped and recomputed under activation checkpointing
        if multi:
            operands = (qx.columnwise_only(), qw.columnwise_only())
        else:
            pairs = [backward_operands(qs, xs[g], weights[g], qx[g], qw[g], amp) for g, qs in enumerate(sets)]
            operands = [p[0] for p in pairs] + [p[1] for p in pairs]
        tensors, ctx.shells = replay.pack(operands)
        ctx.save_for_backward(*tensors)
        return y

    @staticmethod
    @torch_autocast_backward
    def backward(ctx, dy: torch.Tensor):
        sets, m_splits, multi = ctx.sets, ctx.m_splits, ctx.multi
        num = len(m_splits)
        operands = replay.unpack(ctx.shells, ctx.saved_tensors)
        x_op, w_op = operands if multi else (operands[:num], operands[num:])
        start_backward(sets[0], dy)
        k, n, w_dtypes, b_dtypes, in_dtype = ctx.meta
        need = ctx.needs_input_grad
        need_dw = need[_PARAMS:_PARAMS + num]
        live = _live(m_splits) if multi else [g for g in range(num) if m_splits[g] > 0]
        dy = dy.contiguous()
        # the multi-cast takes dy whole; views per expert only where they are read
        need_db = need[_PARAMS + num:]
        dys = None if multi else torch.split(dy, list(m_splits), dim=0)  # (multi: the cast takes dy whole)
        dx, dws = None, [None] * num
        if need[0] or any(need_dw):
            qdy = _quantize_experts(multi, _role_quantizers(sets, TensorKind.GRAD_OUTPUT, multi), dy if multi else dys, m_splits,
                                    sets[0].amax_reduction_group, backward=True)
            if need[0]:
                dx = grouped_gemm(qdy, w_op, transpose_b=True, out_dtype=ctx.compute_dtype, groups=live,
                                  use_fast_accum=sets[0].fast_accum[1]) \
                    if live else dy.new_zeros(0, k, dtype=ctx.compute_dtype)
                if dx.dtype != in_dtype:  # computed in the torch.autocast dtype: back to the input's
                    dx = dx.to(in_dtype)
            dws = grouped_gemm(qdy, x_op, transpose_a=True, transpose_b=True, out_dtype=w_dtypes, concat=False,
                               groups=[g for g in live if need_dw[g]], use_fast_accum=sets[0].fast_accum[2])
            for g in range(num):  # an expert without rows: a zero gradient
                if need_dw[g] and dws[g] is None:
                    dws[g] = torch.zeros(n, k, dtype=w_dtypes[g], device=dy.device)
        return (dx, None, None, None, None, None, *dws,
                *(_bias_grads(dy, dys, m_splits, b_dtypes, need_db) if any(need_db) else [None] * num))


class GroupedLinear(QuantizedModule):
    """``num_gemms`` linears of the same shape, applied to consecutive row-splits of the input.

    Parameters are ``weight0..weight{G-1}`` and ``bias0..bias{G-1}`` (TransformerEngine's names).
    Outside autocast the result equals a loop of ``torch.nn.functional.linear`` exactly."""

    module_kind = ModuleKind.GROUPED_LINEAR
    _recasts_weight_copies = False  # (the experts' casts: one multi-tensor cast, saved whole)

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

    def _weights_biases(self) -> tuple:
        """(:meth:`weights`, :meth:`biases`) as tuples, read from ``_parameters`` by one C-level getter
        (``getattr(self, f"weight{g}")`` runs Module.__getattr__ in Python per parameter); through
        :meth:`weights`/:meth:`biases` where a parameter is not in ``_parameters``."""
        if torch.compiler.is_compiling():  # (dynamo cannot trace operator.itemgetter)
            return tuple(self.weights()), tuple(self.biases())
        get = self.__dict__.get("_param_getters")
        if get is None:
            g = self._num_gemms
            get = self.__dict__["_param_getters"] = (
                itemgetter(*[f"weight{i}" for i in range(g)]), itemgetter(*[f"bias{i}" for i in range(g)]))
        params = self._parameters
        try:
            if self._num_gemms == 1:
                return (get[0](params),), (get[1](params),)
            return get[0](params), get[1](params)
        except KeyError:  # a parameter moved out of _parameters (torch.nn.utils.parametrize, say)
            return tuple(self.weights()), tuple(self.biases())

    def _check_splits(self, x: torch.Tensor, m_splits: Sequence[int]) -> tuple:
        splits = tuple(split_sizes(m_splits))
        if len(splits) != self._num_gemms:
            raise ValueError(f"GroupedLinear: got {len(splits)} m_splits for {self._num_gemms} GEMMs")
        if splits and min(splits) < 0:
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
        weights, biases = self._weights_biases()
        if sets is None:
            outs = [F.linear(xg, w, b) for xg, w, b in zip(torch.split(x, list(splits)), weights, biases)]
            return torch.cat(outs, dim=0)
        cache, mode = self.weight_cache_for(is_first_microbatch)
        multi = MULTI_CAST and not torch.compiler.is_compiling() and self._multi_cast_fits(sets)
        # (FP8 per-tensor recipes, the multi-cast's, block no tokens)
        multiple = 1 if multi else max(token_multiple(qs) for qs in sets)
        if multiple == 1 or all(m % multiple == 0 for m in splits):
            return _GroupedLinearFunction.apply(x, splits, sets, cache, mode, multi, *weights, *biases)
        # NVFP4 blocks the tokens of each expert in 16s: pad every expert's rows, slice them off after
        padded = [pad_tokens(p, multiple) for p in torch.split(x, list(splits))]
        y = _GroupedLinearFunction.apply(torch.cat(padded), tuple(p.shape[0] for p in padded), sets, cache, mode,
                                         multi, *weights, *biases)
        outs = torch.split(y, [p.shape[0] for p in padded])
        return torch.cat([o[:m] for o, m in zip(outs, splits)])

    def _multi_cast_fits(self, sets: List[GemmQuantizers]) -> bool:
        """Whether every operand's experts fit one multi-cast (fp8_multi_cast_fits), computed once per
        recipe's quantizer sets (per-call variants of one recipe's sets share its specs)."""
        cached = self.__dict__.get("_multi_cast_cache")
        if cached is None or cached[0] is not sets[0].specs:
            cached = (sets[0].specs, all(fp8_multi_cast_fits([qs.specs[t] for qs in sets]) for t in _ROLES))
            self.__dict__["_multi_cast_cache"] = cached
        return cached[1]

    def extra_repr(self) -> str:
        return (f"num_gemms={self._num_gemms}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.use_bias}")
