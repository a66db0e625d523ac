"""The quantize + GEMM autograd core every module shares: a pure function of ``(x, weight, bias, GemmQuantizers)``.

:func:`quantized_linear` / :class:`QuantizedLinearFunction` quantize the operands by role, run fprop, and in the
backward dgrad and wgrad, as the operand table says. They do no communication, so tensor-parallel wrappers
(Megatron column/row splits, sequence parallel) call them on their local shards and do their all-gathers /
reduce-scatters outside. :class:`GemmQuantizers` is the three operand quantizers of one GEMM (built from
``recipe.plan(role)``); the weight goes through the module's weight cache (``weight_cache.py``) and its
columnwise copy for dgrad is saved or made in the backward (``weight_columnwise.py``). The module mixin that
owns the quantizers and their state is ``base.py``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch

from .. import ops
from ..autocast import AutocastState
from ..ops.activations import ELEMENTWISE as _ACTIVATIONS
from ..gemm import gemm
from ..quantizers.base import QuantizedTensor, shallow_copy
from ..quantizers.factory import make_quantizer
from ..quantizers.roles import (BackwardOverride, ModuleKind, QuantizerRole, QuantizerSpec, ScalingKind,
                                TensorKind)
from ..recipes.env import GEMMS
from . import replay
from .amax_reduction import reducer
from .weight_cache import AUTO, WeightCache
from .weight_columnwise import COPY_POLICIES, DeferredColumnwise, check_policy, quantize_weight_rowwise, recasts

__all__ = ["backward_operands", "check_input_dtype", "GemmQuantizers", "pad_tokens", "token_multiple",
           "QuantizedLinearFunction", "quantized_linear", "quantize_operand", "quantize_weight",
           "torch_autocast_dtype", "torch_autocast_forward", "torch_autocast_backward", "amp_cast",
           "columnwise_only", "start_backward"]

_OPERANDS = (TensorKind.ACTIVATION, TensorKind.WEIGHT, TensorKind.GRAD_OUTPUT)
_ACTIVATION, _WEIGHT, _GRAD_OUTPUT = _OPERANDS
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------------------------
# the quantizers of one GEMM
# ----------------------------------------------------------------------------------------------


@dataclass
class GemmQuantizers:
    """The three operand quantizers of one linear GEMM (None = that operand stays high precision).

    Per call, not per recipe: ``flush_forward`` (quantized under a module's own ``recipe`` outside
    any autocast: the backward flushes the pending forward amaxes, as an autocast exit would),
    ``record`` (the call's checkpoint record, held by the autograd node that holds this set) and
    ``replay`` (a checkpoint recompute: forward amaxes are not recorded)."""

    specs: Dict[TensorKind, QuantizerSpec]
    quantizers: Dict[TensorKind, Optional[Any]]
    amax_reduction_group: Any = None
    backward_override: Optional[BackwardOverride] = None
    flush_forward: bool = False
    record: Optional[Any] = None
    replay: bool = False
    # a checkpoint recompute: whether the original call made the weight's columnwise copy in the backward
    weight_recast: Optional[bool] = None
    # whether the (fprop, dgrad, wgrad) FP8 GEMMs accumulate in the tensor cores' fast mode (the recipe's
    # fast_accumulation; TE's and torchao's default: fprop only)
    fast_accum: Tuple[bool, bool, bool] = (True, False, False)
    # derived from the specs once (per-call variants share them): see token_multiple and
    # _check_nvfp4_shapes
    token_multiple: int = field(default=1, init=False, repr=False, compare=False)
    nvfp4_checks: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.token_multiple = _token_multiple(self.specs)
        self.nvfp4_checks = _nvfp4_checks(self.specs)

    @classmethod
    def from_recipe(cls, recipe: Any, module: ModuleKind, gemm_index: int = 0,
                    amax_reduction_group: Any = None, name: Optional[str] = None) -> "GemmQuantizers":
        specs: Dict[TensorKind, QuantizerSpec] = {}
        quantizers: Dict[TensorKind, Optional[Any]] = {}
        for tensor in _OPERANDS:
            spec = recipe.plan(QuantizerRole(module, tensor, gemm_index, name))
            specs[tensor] = spec
            q = quantizers[tensor] = make_quantizer(spec)
            # x and dy feed this call's GEMMs alone, one call at a time (a weight's copy may be cached or
            # all-gathered; a grouped layer's experts are all cast before their GEMMs run)
            if q is not None and tensor is not TensorKind.WEIGHT and module is not ModuleKind.GROUPED_LINEAR:
                q.serve_module_gemms()
        override = next((s.backward_override for s in specs.values() if s.backward_override), None)
        out = cls(specs, quantizers, amax_reduction_group, override)
        fast = getattr(recipe, "fast_accumulation", None)  # (FP8 recipes; the others keep the default)
        if fast is not None:
            out.fast_accum = tuple(g in fast for g in GEMMS)
        return out

    def variant(self, quantizers: Optional[Dict[TensorKind, Optional[Any]]] = None, **fields: Any) -> "GemmQuantizers":
        """A set sharing these specs (and quantizers, unless given) with some per-call fields changed
        (a copy of the fields, the derived ones included: nothing is recomputed per call)."""
        new = object.__new__(GemmQuantizers)
        new.__dict__.update(self.__dict__)
        if quantizers is not None:
            new.quantizers = quantizers
        for k, v in fields.items():
            setattr(new, k, v)
        return new

    @property
    def activation(self) -> Optional[Any]:
        return self.quantizers[TensorKind.ACTIVATION]

    @property
    def weight(self) -> Optional[Any]:
        return self.quantizers[TensorKind.WEIGHT]

    @property
    def grad_output(self) -> Optional[Any]:
        return self.quantizers[TensorKind.GRAD_OUTPUT]


def check_input_dtype(owner: str, x: torch.Tensor, recipe_name: str = "") -> None:
    """Quantized GEMMs take FP32, BF16 or FP16 input: say so before any cast could hide it."""
    if x.dtype not in _INPUT_DTYPES:
        under = f" under {recipe_name}" if recipe_name else ""
        raise TypeError(f"{owner}: input dtype {str(x.dtype).replace('torch.', '')} is not supported{under}; "
                        "allowed: float32, bfloat16, float16")


def quantize_operand(quantizer: Optional[Any], x: torch.Tensor, group: Any = None, *,
                     backward: bool = False, record: bool = True) -> Any:
    """``quantizer(x)`` (or ``x`` itself for a high-precision operand); a delayed-scaling quantizer is
    handed to the amax reducer, so its amax is reduced and its scale updated after this pass
    (``record=False``: a checkpoint recompute, whose amax was recorded by the original forward)."""
    if quantizer is None:
        return x
    spec = quantizer.spec
    # (a plain tensor or Parameter has no such attribute: skip the failing lookup, a microsecond per call)
    prequantized = getattr(x, "fp_recipes_prequantized", None) \
        if spec.role.tensor is TensorKind.WEIGHT and type(x) not in _PLAIN_TENSORS else None
    if prequantized is not None and torch.compiler.is_compiling():
        # The gathered quantized tensor is Python state that changes with every all-gather: a graph
        # would keep the one it saw. Leave the graph here: this call runs eagerly (with fullgraph=True,
        # an error); see docs/modules.md, torch.compile.
        from torch._dynamo import graph_break

        graph_break("fp_recipes: a weight from FSDP2's quantized all-gather is used eagerly")
    if prequantized is not None:
        # A weight FSDP2 all-gathered already quantized (integrations/fsdp.py): its shard was
        # quantized by this quantizer before the all-gather with the whole weight's amax (recorded
        # in the history for delayed scaling), so the gathered tensor is this quantizer's output.
        q = prequantized(quantizer)
    else:
        if spec.rht_columnwise and spec.columnwise and x.dtype != torch.bfloat16:
            # The Hadamard transform's contract is defined on BF16 input (NUMERICS.md, RHT). (The message
            # names the role: built only for a dtype that fails, not per cast.)
            if x.dtype not in _INPUT_DTYPES:
                check_input_dtype(f"quantize ({spec.role})", x)
            x = x.to(torch.bfloat16)
        q = quantizer.quantize(x)
    if record and spec.scaling is ScalingKind.DELAYED:
        if backward:
            reducer.record_backward(quantizer, group)
        else:
            reducer.record_forward(quantizer, group)
    return q


def quantize_weight(quantizer: Optional[Any], weight: torch.Tensor, group: Any = None, *, record: bool = True,
                    cache: Optional[WeightCache] = None, mode: str = AUTO) -> Any:
    """:func:`quantize_operand` for a weight, through the module's :class:`WeightCache` when it has one
    (``mode``: see ``weight_cache.py``). A forward that reuses a cached copy casts nothing but still
    records a delayed-scaling weight's amax (the amax of the cached weight, kept with the copy) and
    hands the quantizer to the reducer, so the history and the scale updates are those of a forward
    that quantized again. A checkpoint recompute (``record=False``) reuses but does not store."""
    if cache is None or quantizer is None:
        return quantize_operand(quantizer, weight, group, record=record)
    # (cacheable(quantizer, weight), inline)
    if (type(weight) not in _PLAIN_TENSORS and getattr(weight, "fp_recipes_prequantized", None) is not None) \
            or getattr(quantizer.spec, "stochastic_rounding", False):
        return quantize_operand(quantizer, weight, group, record=record)
    own = type(cache) is WeightCache  # (else a wrapper with lookup/store only: graphs.py's _HoldingCache)
    hit = cache.lookup_one(quantizer, weight, mode, record) if own else cache.lookup((quantizer,), (weight,), mode)
    if hit is None:
        q = quantize_operand(quantizer, weight, group, record=record)
        if record:
            if own:
                cache.store_one(quantizer, weight, q, mode)
            else:
                cache.store((quantizer,), (weight,), q)
        return q
    if record and quantizer.spec.scaling is ScalingKind.DELAYED:
        quantizer.record_amax(hit.amax)
        reducer.record_forward(quantizer, group)
    return hit


_DIMS = ((TensorKind.ACTIVATION, (0, 1)), (TensorKind.WEIGHT, (2, 1)), (TensorKind.GRAD_OUTPUT, (0, 2)))


def _nvfp4_checks(specs: Dict[TensorKind, QuantizerSpec]) -> tuple:
    """(tensor, (rows, cols) as indices into (m, k, n), spec) of every NVFP4 operand."""
    return tuple((tensor, dims, specs[tensor]) for tensor, dims in _DIMS
                 if specs[tensor].scaling is ScalingKind.NVFP4)


def _token_multiple(specs: Dict[TensorKind, QuantizerSpec]) -> int:
    for tensor in (TensorKind.ACTIVATION, TensorKind.GRAD_OUTPUT):
        spec = specs[tensor]
        if spec.scaling is ScalingKind.NVFP4 and (spec.columnwise or spec.block_2d):
            return 16
    return 1


def _check_nvfp4_shapes(qs: GemmQuantizers, m: int, k: int, n: int) -> None:
    """NVFP4 needs 16-element blocks along every dimension it quantizes; say which one is off."""
    checks = qs.nvfp4_checks
    if not checks:
        return
    mkn = (m, k, n)
    for tensor, (r, c), spec in checks:
        rows, cols = mkn[r], mkn[c]
        bad = []
        if spec.rowwise and cols % 16:
            bad.append(f"its last dim ({cols})")
        if (spec.columnwise or spec.block_2d) and rows % 16:
            bad.append(f"its first dim ({rows})")
        if bad:
            raise ValueError(
                f"NVFP4 quantization of the {tensor.value} ({rows}x{cols}) needs {' and '.join(bad)} to "
                "be a multiple of 16 (16-element blocks). Pad the tokens / features, or use an FP8 recipe")


# ----------------------------------------------------------------------------------------------
# the autograd core
# ----------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------
# torch.autocast: its dtype is the activation/output dtype
# ----------------------------------------------------------------------------------------------
#
# Hugging Face's Trainer (bf16=True), accelerate and most RL trainers keep FP32 master weights and run
# the model under torch.autocast(dtype=bfloat16), where torch.nn.Linear returns BF16. The quantized
# Functions do what TransformerEngine does there: the input is cast to the autocast dtype, the
# high-precision operands (bias, a weight the recipe keeps unquantized, a high-precision backward's
# weight) are used in that dtype, quantized weights are quantized from the master weight, and the
# output is in that dtype. The gradient w.r.t. the input comes back in the input's dtype, weight and
# bias gradients in the parameters' dtype. Inside, autocast is off: the quantized GEMMs and their exact
# emulations pick their own precision (autocast would run the FP32 emulation matmuls in BF16).


def torch_autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype torch.autocast runs this thread's ops in on ``device_type`` (None: autocast off)."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
    except RuntimeError:  # a device type autocast does not know (meta): never enabled
        return None
    return torch.get_autocast_dtype(device_type)


def torch_autocast_forward(forward):
    """Decorates the ``forward(ctx, x, ...)`` of a quantized autograd Function: checks torch.autocast
    once per call, records its dtype as ``ctx.amp_dtype`` (None outside autocast; the backward may
    run on another thread, where autocast is not visible) and runs the body with autocast off."""

    @functools.wraps(forward)
    def wrapped(ctx, x, *args):
        device_type = x.device.type
        try:  # (torch_autocast_dtype, inline: one call fewer per forward)
            enabled = torch.is_autocast_enabled(device_type)
        except RuntimeError:  # a device type autocast does not know (meta): never enabled
            enabled = False
        if not enabled:
            ctx.amp_dtype = None
            return forward(ctx, x, *args)
        ctx.amp_dtype = torch.get_autocast_dtype(device_type)
        with torch.autocast(device_type, enabled=False):
            return forward(ctx, x, *args)
    return wrapped


def torch_autocast_backward(backward):
    """Decorates the ``backward(ctx, dy)`` of a quantized autograd Function: a backward called inside
    an autocast region inherits it (on every thread), but its dtypes were fixed by the forward (ctx):
    run with autocast off."""

    @functools.wraps(backward)
    def wrapped(ctx, dy, *args):
        device_type = dy.device.type
        try:  # (torch_autocast_dtype, inline)
            enabled = torch.is_autocast_enabled(device_type)
        except RuntimeError:
            enabled = False
        if not enabled:
            return backward(ctx, dy, *args)
        with torch.autocast(device_type, enabled=False):
            return backward(ctx, dy, *args)
    return wrapped


def amp_cast(t: Optional[torch.Tensor], dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    """``t`` in the autocast dtype (``t`` itself when there is none, or it is None)."""
    return t if t is None or dtype is None else t.to(dtype)


def backward_operands(qs: GemmQuantizers, x: torch.Tensor, weight: torch.Tensor, qx: Any,
                      qw: Any, amp_dtype: Optional[torch.dtype] = None) -> Tuple[Any, Any]:
    """What the dgrad/wgrad GEMMs read for x and W, by ``backward_override``: the quantized tensors
    (default), the original high-precision tensors (the weight in the torch.autocast dtype when there
    is one, as x already is), or the dequantized forward operands."""
    override = qs.backward_override
    if override is BackwardOverride.HIGH_PRECISION:
        return x, amp_cast(weight, amp_dtype)
    if override is BackwardOverride.DEQUANTIZED:
        # (no reshape, a view op, of a dequantized operand that has its shape already)
        xd = qx if isinstance(qx, torch.Tensor) else qx.dequantize(torch.float32)
        if xd is not qx and xd.shape != x.shape:
            xd = xd.reshape(x.shape)
        wd = qw if isinstance(qw, torch.Tensor) else qw.dequantize(torch.float32)
        if wd is not qw and wd.shape != weight.shape:
            wd = wd.reshape(weight.shape)
        return xd, wd
    return columnwise_only(qx), columnwise_only(qw)


def columnwise_only(q: Any) -> Any:
    """The backward GEMMs read only the columnwise copy of x and W: keep just that one (halves the
    saved activation memory). Anything without a columnwise copy is kept whole."""
    name = type(q).__name__
    if name not in ("Float8Tensor", "NVFP4Tensor") or q.data_t is None or q.data is None:
        if name == "NVFP4Tensor" and (q.gemm_unit is not None or q.gemm_unit_t is not None):
            q = shallow_copy(q)  # kept whole, but never with the forward GEMM's BF16 operand
            q.gemm_unit = q.gemm_unit_t = None
        return q
    # the same (already validated) fields without the rowwise copy: no constructor checks per call
    new = shallow_copy(q)
    new.data = None
    if name == "NVFP4Tensor":
        new.scale = new.amax = None
        new.gemm_unit = new.gemm_unit_t = None  # the GEMM caches go too, as a constructed copy has none
    return new


class QuantizedLinearFunction(torch.autograd.Function):
    """y = x @ W^T + b with quantized operands; x is 2-D (tokens, in_features)."""

    @staticmethod
    @torch_autocast_forward
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                qs: GemmQuantizers, cache: Optional[WeightCache] = None, mode: str = AUTO,
                weight_copy: str = "auto", activation: Optional[str] = None) -> torch.Tensor:
        m, k = x.shape
        n = weight.shape[0]
        group = qs.amax_reduction_group
        if qs.nvfp4_checks:
            _check_nvfp4_shapes(qs, m, k, n)
        record = not qs.replay
        amp = ctx.amp_dtype
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)  # of the gradients
        quantizers = qs.quantizers
        wq = quantizers[_WEIGHT]
        aq = quantizers[_ACTIVATION]
        pre = fused = None  # input_activation: the input before it (saved for its backward); applied in the cast?
        if activation is not None:
            pre = x
            fused = m != 0 and aq is not None and qs.backward_override is None and (amp is None or x.dtype == amp) \
                and aq.fuses_activation(activation, x)
            if not fused:  # (the activation's own op, on the input as the caller holds it: then as without one)
                x = _ACTIVATIONS[activation].forward(x)
        b = bias
        if amp is not None:
            x, b = amp_cast(x, amp), amp_cast(bias, amp)
        if fused:
            qx = aq.quantize_activation(x, activation)
            if record and aq.spec.scaling is ScalingKind.DELAYED:
                reducer.record_forward(aq, group)
        elif m == 0 or aq is None:
            qx = x
        else:
            spec = aq.spec
            if spec.rht_columnwise and spec.columnwise and x.dtype != torch.bfloat16:
                qx = quantize_operand(aq, x, group, record=record)
            else:  # (quantize_operand, inline: an activation is never a prequantized weight)
                qx = aq.quantize(x)
                if record and spec.scaling is ScalingKind.DELAYED:
                    reducer.record_forward(aq, group)
        w_later = None  # the weight's columnwise copy for dgrad, when made in the backward (weight_columnwise.py)
        recast = qs.weight_recast  # (a recompute repeats its original call's choice)
        if recast is None:
            recast = weight_copy != "save" and qs.backward_override is None and recasts(weight_copy, wq, weight, m)
        if recast:
            qw, w_later = quantize_weight_rowwise(
                wq, weight, group, record=record, cache=cache, mode=mode, forced=qs.weight_recast is not None,
                full=lambda: quantize_weight(wq, weight, group, record=record, cache=cache, mode=mode))
        else:
            qw = quantize_weight(wq, weight if wq is not None else amp_cast(weight, amp), group,
                                 record=record, cache=cache, mode=mode)
        if qs.record is not None:  # what a checkpoint recompute of this call repeats
            qs.record.weight_recast[id(qs.quantizers)] = w_later is not None
        if m == 0:
            y = torch.zeros(0, n, dtype=x.dtype, device=x.device)
        else:
            y = gemm(qx, qw, out_dtype=x.dtype, bias=b, use_fast_accum=qs.fast_accum[0])
        ctx.qs = qs
        ctx.shapes = (m, k, n)
        ctx.compute_dtype = x.dtype
        ctx.has_bias = bias is not None
        if qs.backward_override is None:  # (backward_operands, inline)
            x_op, w_op = columnwise_only(qx), columnwise_only(qw if w_later is None else w_later)
        else:
            x_op, w_op = backward_operands(qs, x, weight, qx, qw, amp)
        # Every tensor the backward reads goes through save_for_backward (the quantized operands as
        # their component tensors): freed after a backward that does not retain the graph, kept for
        # retain_graph=True, dropped and recomputed by activation checkpointing.
        ctx.activation = activation
        extra = () if pre is None else (pre,)  # (last: the backward takes it off first)
        if type(x_op).__name__ in _SPLIT_TYPES and type(w_op).__name__ in _SPLIT_TYPES:
            # (replay.pack for two quantized tensors that split themselves, inline; the same shells)
            xt, xs = x_op.split_saved()
            wt, ws = w_op.split_saved()
            n_x = len(xt)
            ctx.shells = [("custom", xs, n_x), ("custom", ws, len(wt))]
            ctx.split_at = n_x
            ctx.save_for_backward(*xt, *wt, *extra)
        else:
            tensors, ctx.shells = replay.pack((x_op, w_op))
            ctx.split_at = None
            ctx.save_for_backward(*tensors, *extra)
        return y

    @staticmethod
    @torch_autocast_backward
    def backward(ctx, dy: torch.Tensor):
        qs: GemmQuantizers = ctx.qs
        m, k, n = ctx.shapes
        in_dtype, w_dtype, b_dtype = ctx.dtypes
        x_dtype = ctx.compute_dtype
        n_x = ctx.split_at
        saved = ctx.saved_tensors
        activation, pre = ctx.activation, None
        if activation is not None:
            saved, pre = saved[:-1], saved[-1]
        if n_x is None:
            x_op, w_op = replay.unpack(ctx.shells, saved)
        else:  # (replay.unpack of the two shells the forward made, inline)
            x_shell, w_shell = ctx.shells
            x_op = x_shell[1].with_saved_tensors(list(saved[:n_x]))
            w_op = w_shell[1].with_saved_tensors(list(saved[n_x:]))
        if type(w_op) is DeferredColumnwise:
            w_op = None if not ctx.needs_input_grad[0] else w_op.columnwise()  # (only dgrad reads it)
        if qs.record is not None or qs.flush_forward:  # (else start_backward does nothing)
            start_backward(qs, dy)
        need_dx, need_dw, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], \
            ctx.has_bias and ctx.needs_input_grad[2]
        dy = dy.contiguous()
        dx = dw = db = None
        if m == 0:
            dx = torch.zeros(0, k, dtype=in_dtype, device=dy.device) if need_dx else None
            dw = torch.zeros(n, k, dtype=w_dtype, device=dy.device) if need_dw else None
            db = torch.zeros(n, dtype=b_dtype, device=dy.device) if need_db else None
            return dx, dw, db, None, None, None, None, None
        gq = qs.quantizers[_GRAD_OUTPUT]
        if gq is None or not (need_dx or need_dw):
            qdy = dy
        else:
            spec = gq.spec
            if spec.rht_columnwise and spec.columnwise and dy.dtype != torch.bfloat16:
                qdy = quantize_operand(gq, dy, qs.amax_reduction_group, backward=True)
            else:  # (quantize_operand, inline)
                if need_db:  # the bias gradient out of the cast's own pass over dy where the kernel can
                    qdy, db = gq.quantize_with_bias_grad(dy, b_dtype)
                else:
                    qdy = gq.quantize(dy)
                if spec.scaling is ScalingKind.DELAYED:
                    reducer.record_backward(gq, qs.amax_reduction_group)
        if need_dx:
            dx = gemm(qdy, w_op, transpose_b=True, out_dtype=x_dtype, use_fast_accum=qs.fast_accum[1])
            # dgrad was the weight copy's only reader: one recast for this backward is freed here, before wgrad
            # allocates dW (the step's peak is often there: a wide FC1's copy and dW are the largest tensors)
            w_op = None
            if dx.dtype != in_dtype:  # computed in the torch.autocast dtype: back to the input's
                dx = dx.to(in_dtype)
            if activation is not None:  # through the activation: the backward autograd records for its op,
                # written over the dgrad output (ours alone): this backward still holds the saved operands, so a
                # second tensor of dx's size here would raise the step's peak above the unfused modules'
                dx = _ACTIVATIONS[activation].backward_(dx, pre)
        if need_dw:
            if need_dx and isinstance(qdy, QuantizedTensor):
                # wgrad reads dy's columnwise copy only: the rowwise one goes before dW is allocated (dy's own
                # high-precision tensor is the engine's until this backward returns)
                qdy.release_rowwise()
            dw = gemm(qdy, x_op, transpose_a=True, transpose_b=True, out_dtype=w_dtype, use_fast_accum=qs.fast_accum[2])
        if need_db and db is None:
            # FP32 column sums of dy in the fixed order of ops.bias_grad (the order the fused casts use)
            db = ops.bias_grad(dy, b_dtype)
        return dx, dw, db, None, None, None, None, None


def start_backward(qs: GemmQuantizers, anchor: Optional[torch.Tensor] = None) -> None:
    """At the start of a call's backward: its checkpoint record is done; a call quantized under a
    module's own recipe (no autocast, so no autocast exit) flushes the pending forward amaxes here,
    once per forward pass (the first backward to run finds them, the others find none)."""
    if torch.compiler.is_compiling():
        if qs.flush_forward:
            # a backward graph cannot see the reducer's Python state: the op flushes when it runs
            from .amax_reduction import traced_flush_forward

            traced_flush_forward(qs, anchor)
        return
    if qs.record is not None:
        qs.record.done = True
    if qs.flush_forward and reducer.pending_forward():

        with torch.inference_mode(False):
            reducer.on_outermost_exit(AutocastState(True, None, qs.amax_reduction_group, 0))


#: the quantized tensor types whose ``split_saved``/``with_saved_tensors`` the Function calls directly
_SPLIT_TYPES = ("Float8Tensor", "NVFP4Tensor", "DeferredColumnwise")



def token_multiple(qs: GemmQuantizers) -> int:
    """The multiple the token count must have: 16 when an NVFP4 activation or grad_output is blocked
    along the tokens (columnwise copy for wgrad, or 2-D tiles), else 1 (computed once per set)."""
    return qs.token_multiple


def pad_tokens(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero rows appended up to a multiple (autograd-aware). Zero tokens change no amax and add
    nothing to wgrad; their outputs are sliced off, so their gradients are zero."""
    extra = (-x.shape[0]) % multiple
    return torch.nn.functional.pad(x, (0, 0, 0, extra)) if extra else x


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     qs: Optional[GemmQuantizers], weight_cache: Optional[WeightCache] = None,
                     cache_mode: str = AUTO, weight_columnwise_copy: str = "auto",
                     input_activation: Optional[str] = None) -> torch.Tensor:
    """``F.linear`` with the operands quantized by ``qs`` (None: exactly ``F.linear``).

    Any leading dims of ``x`` are flattened into tokens and restored; a token count that NVFP4 cannot
    block is zero-padded for the GEMMs and the padding sliced off again. This is the entry point for
    tensor-parallel wrappers: it communicates nothing. ``weight_cache``/``cache_mode``: reuse the
    quantized weight (``QuantizedModule.weight_cache_for``; None: quantize it).
    ``weight_columnwise_copy``: where dgrad's copy of the weight comes from (``weight_columnwise.py``).
    ``input_activation``: ``F.linear(activation(x), ...)`` for an element-wise activation of ``ops.activations``
    (an MLP's FC2 given FC1's output), applied in the input's cast where its quantizer can
    (``Quantizer.fuses_activation``), else by its own op; the same bytes and gradients either way."""
    if input_activation is not None and input_activation not in _ACTIVATIONS:
        raise ValueError(f"linear: input_activation={input_activation!r} is not supported; allowed: "
                         f"{', '.join(_ACTIVATIONS)} (element-wise; a gated one runs before the layer)")
    if qs is None:
        if input_activation is not None:
            x = _ACTIVATIONS[input_activation].forward(x)
        return torch.nn.functional.linear(x, weight, bias)
    if x.dtype not in _INPUT_DTYPES:
        check_input_dtype("linear", x)
    if x.shape[-1] != weight.shape[1]:
        _feature_mismatch(x, weight)
    x2 = x if x.ndim == 2 else x.reshape(-1, x.shape[-1])
    tokens = x2.shape[0]
    if qs.token_multiple != 1:  # (token_multiple(qs), read directly)
        x2 = pad_tokens(x2, qs.token_multiple)
    if weight_columnwise_copy not in COPY_POLICIES:
        check_policy(weight_columnwise_copy)
    y = QuantizedLinearFunction.apply(x2, weight, bias, qs, weight_cache, cache_mode, weight_columnwise_copy,
                                      input_activation)
    if x.ndim == 2 and y.shape[0] == tokens:
        return y
    return _fresh_view(y[:tokens] if y.shape[0] != tokens else y, (*x.shape[:-1], weight.shape[0]))


def _feature_mismatch(x: torch.Tensor, weight: torch.Tensor) -> None:
    raise ValueError(f"linear: input has {x.shape[-1]} features, weight expects {weight.shape[1]} "
                     f"(weight shape {tuple(weight.shape)})")


def _fresh_view(y: torch.Tensor, shape: Tuple[int, ...]) -> torch.Tensor:
    """``y`` (contiguous) in ``shape``, sharing its storage but not a view to autograd, as
    ``F.linear``'s output is not: FSDP2 hooks a module output's ``grad_fn``, and an in-place op on a
    view (``out += residual``) would replace it and skip the backward all-gather (FSDP2 warns "returned
    a view tensor"). ``aten._unsafe_view`` is how ``torch.matmul`` folds its N-D results; nothing saves
    ``y`` for the backward, so an in-place op on the result is safe."""
    return torch.ops.aten._unsafe_view(y, shape)
