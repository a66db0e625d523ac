"""The quantize + GEMM autograd core shared by every module, and the per-module quantizer state.

Two layers:

* :func:`quantized_linear` / :class:`QuantizedLinearFunction` -- a pure function of
  ``(x, weight, bias, GemmQuantizers)``: quantize the operands by role, run fprop, and in the backward
  dgrad and wgrad, as the operand table says. It does no communication, so tensor-parallel wrappers
  (Megatron column/row splits, sequence parallel) call it on their local shards and do their
  all-gathers / reduce-scatters outside it.
* :class:`QuantizedModule` -- an ``nn.Module`` mixin that builds its quantizers from
  ``recipe.plan(role)`` for each role of each of its GEMMs (one set per recipe used), keeps
  delayed-scaling state (amax history, scale) as module buffers so it is in ``state_dict``, keeps
  NVFP4 stochastic-rounding state (seed, offset) in the module's extra state, and hands
  delayed-scaling quantizers to the amax reducer (one all-reduce after the forward, one after the
  backward).

A module quantizes under the recipe of this thread's innermost ``fp_recipes.autocast``; outside any
autocast, under its own ``recipe`` attribute when set; otherwise it calls ``torch.nn.functional``
directly, so outputs and gradients are exactly torch's. What a forward quantized with is captured:
its backward and any activation-checkpointing recompute of it use that (``replay.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import _trace_ids, ops
from ..gemm import gemm
from ..quantizers.base import shallow_copy
from ..quantizers.factory import make_quantizer
from ..quantizers.float8 import load_cuda_casts
from ..quantizers.roles import (BackwardOverride, ModuleKind, QuantizerRole, QuantizerSpec,
                                ScalingKind, TensorKind)
from . import replay
from . import state as qstate
from ..autocast import AutocastState, _local as _autocast_tls, _resolve_recipe, get_autocast_state
from .amax_reduction import reducer
from .weight_cache import AUTO, WeightCache, cache_mode, cacheable
from .weight_columnwise import COPY_POLICIES, DeferredColumnwise, check_policy, quantize_weight_rowwise, recasts

__all__ = ["backward_operands", "check_input_dtype", "GemmQuantizers", "pad_tokens", "token_multiple",
           "QuantizedLinearFunction", "QuantizedModule", "quantized_linear", "quantize_operand",
           "torch_autocast_dtype", "torch_autocast_forward", "torch_autocast_backward", "amp_cast"]

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
            quantizers[tensor] = make_quantizer(spec)
        override = next((s.backward_override for s in specs.values() if s.backward_override), None)
        return cls(specs, quantizers, amax_reduction_group, override)

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
                weight_copy: str = "auto") -> torch.Tensor:
        m, k = x.shape
        n = weight.shape[0]
        group = qs.amax_reduction_group
        if qs.nvfp4_checks:
            _check_nvfp4_shapes(qs, m, k, n)
        record = not qs.replay
        amp = ctx.amp_dtype
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)  # of the gradients
        b = bias
        if amp is not None:
            x, b = amp_cast(x, amp), amp_cast(bias, amp)
        quantizers = qs.quantizers
        wq = quantizers[_WEIGHT]
        aq = quantizers[_ACTIVATION]
        if m == 0 or aq is None:
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
            if qs.record is not None:
                qs.record.weight_recast[id(qs.quantizers)] = w_later is not None
        else:
            if qs.record is not None and qs.weight_recast is None:
                qs.record.weight_recast[id(qs.quantizers)] = False
            qw = quantize_weight(wq, weight if wq is not None else amp_cast(weight, amp), group,
                                 record=record, cache=cache, mode=mode)
        if m == 0:
            y = torch.zeros(0, n, dtype=x.dtype, device=x.device)
        else:
            y = gemm(qx, qw, out_dtype=x.dtype, bias=b, use_fast_accum=True)
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
        if type(x_op).__name__ in _SPLIT_TYPES and type(w_op).__name__ in _SPLIT_TYPES:
            # (replay.pack for two quantized tensors that split themselves, inline; the same shells)
            xt, xs = x_op.split_saved()
            wt, ws = w_op.split_saved()
            n_x = len(xt)
            ctx.shells = [("custom", xs, n_x), ("custom", ws, len(wt))]
            ctx.split_at = n_x
            ctx.save_for_backward(*xt, *wt)
        else:
            tensors, ctx.shells = replay.pack((x_op, w_op))
            ctx.split_at = None
            ctx.save_for_backward(*tensors)
        return y

    @staticmethod
    @torch_autocast_backward
    def backward(ctx, dy: torch.Tensor):
        qs: GemmQuantizers = ctx.qs
        m, k, n = ctx.shapes
        in_dtype, w_dtype, b_dtype = ctx.dtypes
        x_dtype = ctx.compute_dtype
        n_x = ctx.split_at
        if n_x is None:
            x_op, w_op = replay.unpack(ctx.shells, ctx.saved_tensors)
        else:  # (replay.unpack of the two shells the forward made, inline)
            saved = ctx.saved_tensors
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
            return dx, dw, db, None, None, None, None
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
            dx = gemm(qdy, w_op, transpose_b=True, out_dtype=x_dtype)
            if dx.dtype != in_dtype:  # computed in the torch.autocast dtype: back to the input's
                dx = dx.to(in_dtype)
        if need_dw:
            dw = gemm(qdy, x_op, transpose_a=True, transpose_b=True, out_dtype=w_dtype)
        if need_db and db is None:
            # FP32 column sums of dy in the fixed order of ops.bias_grad (the order the fused casts use)
            db = ops.bias_grad(dy, b_dtype)
        return dx, dw, db, None, None, None, None


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

# Linear's shortcut (QuantizedModule._linear_shortcut): the C calls it makes instead of Python helpers
_LINEAR_APPLY = torch._C._FunctionBase.__dict__["apply"].__get__(None, QuantizedLinearFunction)
_functorch_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
_graph_task_id = torch._C._current_graph_task_id
_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_grad_enabled = torch.is_grad_enabled
_inference_mode = torch.is_inference_mode_enabled
#: the QuantizedModule methods the shortcut inlines
_SHORTCUT_INLINES = ("gemm_quantizers", "check_input", "weight_cache_for", "_linear_shortcut")


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
                     cache_mode: str = AUTO, weight_columnwise_copy: str = "auto") -> torch.Tensor:
    """``F.linear`` with the operands quantized by ``qs`` (None: exactly ``F.linear``).

    Any leading dims of ``x`` are flattened into tokens and restored; a token count that NVFP4 cannot
    block is zero-padded for the GEMMs and the padding sliced off again. This is the entry point for
    tensor-parallel wrappers: it communicates nothing. ``weight_cache``/``cache_mode``: reuse the
    quantized weight (``QuantizedModule.weight_cache_for``; None: quantize it).
    ``weight_columnwise_copy``: where dgrad's copy of the weight comes from (``weight_columnwise.py``)."""
    if qs is None:
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
    y = QuantizedLinearFunction.apply(x2, weight, bias, qs, weight_cache, cache_mode, weight_columnwise_copy)
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


# ----------------------------------------------------------------------------------------------
# module mixin: quantizer sets per recipe, state in state_dict
# ----------------------------------------------------------------------------------------------

_STATE_PREFIX = qstate.PREFIX
_buffer_name = qstate.buffer_name


def _delayed_attrs(q: Any) -> Tuple[str, ...]:
    return tuple(a for a in ("scale", "amax_history") if isinstance(getattr(q, a, None), torch.Tensor))


class _RecipeSets:
    """One recipe's quantizer sets (built on its first use, kept while other recipes are used)."""

    __slots__ = ("recipe", "sets", "module_sets", "has_tensors")

    def __init__(self, recipe: Any, sets: List[GemmQuantizers]) -> None:
        self.recipe = recipe
        self.sets = sets
        # the same quantizers, for calls under the module's own recipe (no autocast around them)
        self.module_sets = [qs.variant(flush_forward=True) for qs in sets]
        self.has_tensors = any(_delayed_attrs(q) for qs in sets for q in qs.quantizers.values() if q is not None)

    def quantizers(self):
        for g, qs in enumerate(self.sets):
            for tensor, q in qs.quantizers.items():
                if q is not None:
                    yield g, tensor, q


class QuantizedModule(torch.nn.Module):
    """Mixin for modules whose GEMMs are quantized under :func:`fp_recipes.autocast`.

    Subclasses set ``module_kind`` and ``num_gemms`` and call :meth:`gemm_quantizers` in forward.

    * Recipe: this thread's innermost ``fp_recipes.autocast`` decides (``enabled=False``: no
      quantization); outside any autocast, ``self.recipe`` (default None: plain torch), with
      ``self.amax_reduction_group`` (see :meth:`set_recipe`).
    * One quantizer set per recipe used, built on first use and kept: a call under another recipe
      (an NVFP4 probe inside delayed-scaling training) leaves every other recipe's state as it was.
    * Checkpointed state (``state_dict``): the delayed-scaling buffers ``qstate_*`` of the *state
      recipe* (the last recipe used that has delayed-scaling state; else the last recipe used), the
      SR seeds/offsets of that recipe's quantizers and the recipe's identity (extra state)."""

    module_kind: ModuleKind = ModuleKind.LINEAR
    #: whether :meth:`_linear_shortcut` may stand in for the methods it inlines (a subclass that
    #: overrides one of them takes the general path)
    _shortcut_ok = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._shortcut_ok = all(getattr(cls, name) is getattr(QuantizedModule, name) for name in _SHORTCUT_INLINES)

    def __init__(self) -> None:
        super().__init__()
        _trace_ids.register(self)  # (torch < 2.13: _prepare_for_trace_by_id finds the module by id)
        # Stochastic-rounding seeds come from torch's default generator, like weight init: the same
        # torch.manual_seed builds the same random streams (deepcopy and state_dict keep them).
        self._sr_seed = int(torch.randint(0, 2**62, (), dtype=torch.int64).item())
        self.recipe: Any = None
        self.amax_reduction_group: Any = None
        self._by_recipe: Dict[Any, _RecipeSets] = {}
        self._last: Optional[Tuple[Any, bool, List[GemmQuantizers]]] = None  # the fast path's cache
        self._quantizer_sets: Optional[List[GemmQuantizers]] = None
        self._state_recipe: Optional[_RecipeSets] = None
        self._state_buffer_names: List[str] = []
        self._pending: Optional[Dict[str, Any]] = None  # loaded state waiting for its recipe
        self._records = replay.RecordQueue()
        self._loading = False
        # torch.compile: (recipe, sets) prepared for tracing [under an autocast, under the module recipe]:
        # by a trace (_traced_sets), and by init_quantizer_state (_compile_ready, read first by a trace)
        self._traced_sets: List[Optional[Tuple[Any, List[GemmQuantizers]]]] = [None, None]
        self._compile_ready: List[Optional[Tuple[Any, List[GemmQuantizers]]]] = [None, None]
        # quantized weights reused while the weights are unchanged (weight_cache.py)
        self.cache_quantized_weights = True
        self._weight_cache = WeightCache()
        self._weight_columnwise_copy = "auto"
        self._sharded_params = False  # a parameter was replaced by a DTensor (FSDP2, tensor parallel)

    @property
    def num_gemms(self) -> int:
        return 1

    @property
    def weight_columnwise_copy(self) -> str:
        """Where dgrad's columnwise FP8 copy of a weight comes from: ``"save"`` (cast in the forward and held
        until the backward), ``"recast"`` (cast in the backward from the weight, the same bytes: less memory,
        one more read of the weight) or ``"auto"`` (default: recast when the layer has more outputs than the
        call has tokens). See ``modules/weight_columnwise.py``."""
        return self.__dict__.get("_weight_columnwise_copy", "auto")

    @weight_columnwise_copy.setter
    def weight_columnwise_copy(self, value: str) -> None:
        self.__dict__["_weight_columnwise_copy"] = check_policy(value, type(self).__name__,
                                                                self._recasts_weight_copies)

    #: whether this module kind can make its weights' columnwise copies in the backward (weight_columnwise.py)
    _recasts_weight_copies = True

    def __setattr__(self, name: str, value: Any) -> None:
        # FSDP2 (fully_shard) replaces the parameters by sharded DTensors, and swaps in the unsharded
        # parameter for each forward and backward, refilled in place by every all-gather without a
        # version bump: the automatic weight cache cannot see those refills, so it stays off here
        if isinstance(value, torch.Tensor) and type(value).__name__ == "DTensor":
            self.__dict__["_sharded_params"] = True
        super().__setattr__(name, value)

    def train(self, mode: bool = True) -> "QuantizedModule":
        if not mode:
            self.clear_weight_cache()
        return super().train(mode)

    def clear_weight_cache(self) -> None:
        """Drop the cached quantized weights (the next forward quantizes the weights again)."""
        cache = self.__dict__.get("_weight_cache")
        if cache is not None:
            cache.clear()

    def weight_cache_for(self, is_first_microbatch: Optional[bool] = None) -> Tuple[Optional[WeightCache], str]:
        """(the weight cache for this call or None, its mode) from TransformerEngine's
        ``is_first_microbatch`` (None: automatic; True: quantize and cache; False: reuse). None
        outside training mode (the module then keeps no copy), under ``torch.inference_mode()`` and
        torch.compile, with ``cache_quantized_weights = False``, and in automatic mode once a parameter
        was sharded (FSDP2): see ``weight_cache.py``."""
        mode = AUTO if is_first_microbatch is None else cache_mode(is_first_microbatch)
        if torch.compiler.is_compiling():
            return None, mode
        cache = self.__dict__.get("_weight_cache")
        if cache is None:
            return None, mode
        if not self.training or not self.cache_quantized_weights or torch.is_inference_mode_enabled():
            cache.clear()
            return None, mode
        if mode == AUTO and self._sharded_params:
            return None, mode
        return cache, mode

    @property
    def quantizer_sets(self) -> Optional[List[GemmQuantizers]]:
        """The quantizers of the last recipe used (None before the first quantized forward)."""
        return self._quantizer_sets

    def recipe_state(self, recipe: Any) -> Optional[object]:
        """This module's quantizers and scaling state for ``recipe`` (an opaque handle, None before its
        first use): a holder of the handle can tell later whether the state was rebuilt
        (``reset_quantizer_state()``), as ``make_graphed_callables`` does."""
        return self._by_recipe.get(recipe)

    def set_recipe(self, recipe: Any, amax_reduction_group: Any = None) -> "QuantizedModule":
        """Quantize with ``recipe`` whenever this thread is inside no ``fp_recipes.autocast`` (an
        explicit autocast, enabled or not, overrides it). Delayed-scaling forward amaxes are then
        reduced over ``amax_reduction_group`` and the scales updated when the backward of that
        forward starts (there is no autocast exit to do it). ``None`` turns it off."""
        if recipe is not None:

            recipe = _resolve_recipe(recipe)
        self.recipe = recipe
        self.amax_reduction_group = amax_reduction_group
        return self

    # ------------------------------------------------------------------ per call
    def _call_recipe(self, state: Optional[AutocastState]) -> tuple:
        """(recipe, module_mode, amax reduction group) of this call: inside an autocast (``state`` with a
        depth) its recipe (None when disabled) and group, else the module's own (``module_mode``)."""
        if state is not None and state.depth:
            return (state.recipe if state.enabled else None), False, state.amax_reduction_group
        return self.recipe, True, self.amax_reduction_group

    def gemm_quantizers(self) -> Optional[List[GemmQuantizers]]:
        """The quantizers for this call (None: no quantization, plain torch).

        A recompute under activation checkpointing gets what its original forward used."""
        if torch.compiler.is_compiling():
            return self._traced_gemm_quantizers()
        if self._records and replay.in_backward():
            record = self._records.pop()
            if record is not None:
                return replay.replay_sets(record, lambda qs, quantizers: qs.variant(
                    quantizers, replay=True, record=None, weight_recast=record.weight_recast.get(id(qs.quantizers))))
        recipe, module_mode, group = self._call_recipe(get_autocast_state())
        if recipe is None:
            sets = None
        else:
            last = self._last
            if last is not None and last[0] is recipe and last[1] is module_mode:
                sets = last[2]
            else:
                sets = self._sets_for(recipe, module_mode)
            if sets[0].amax_reduction_group is not group:
                for qs in sets:
                    qs.amax_reduction_group = group
        if replay.may_be_recomputed(self.training):
            record = replay.CallRecord(sets)
            if sets is not None:
                # this call's own set objects hold the record (through the autograd node's ctx)
                sets = [qs.variant(record=record) for qs in sets]
            self._records.push(record, weak=torch.is_grad_enabled() and sets is not None)
        return sets

    def _linear_shortcut(self, x: torch.Tensor, is_first_microbatch: Optional[bool], norm: bool = False) -> Any:
        """The forward of a Linear (``norm``: a LayerNormLinear, ``(out, ln_out)``) in the common eager
        case, with what :meth:`gemm_quantizers`, :meth:`check_input`, :meth:`weight_cache_for` and
        :func:`quantized_linear` do inlined; None, having done nothing, when a condition fails (the
        caller then takes the general path, which decides everything afresh):

        * not traced by torch.compile (the one compile check of an eager call);
        * this class and instance use the base class's ``gemm_quantizers``, ``check_input`` and
          ``weight_cache_for`` (``make_graphed_callables`` sets its own on the instance), and the
          parameters are registered ones named ``weight`` and ``bias``;
        * no checkpoint recompute (no record waiting, or not inside a backward) and no record to make
          (grad enabled with no saved-tensors hook, or grad disabled outside a training module /
          inside inference mode): see ``replay.py``;
        * no recipe (plain ``F.linear``), or a recipe to quantize with whose sets the previous call
          found (``self._last``: the same recipe object, under an autocast or the module's own recipe
          alike; cleared by a load waiting for its recipe and by ``reset_quantizer_state``), and an
          FP32/BF16/FP16 input."""
        if not self._shortcut_ok or torch.compiler.is_compiling():
            return None
        d = self.__dict__
        if "gemm_quantizers" in d or "weight_cache_for" in d or "check_input" in d or "_weight_cache" not in d:
            return None
        if self._records._items and _graph_task_id() != -1:
            return None
        stack = _autocast_tls.stack
        recipe, module_mode, group = self._call_recipe(stack[-1] if stack else None)
        if _grad_enabled():
            if _top_hooks(False) is not None:
                return None
        elif self.training and not _inference_mode():
            return None
        params = self._parameters
        if "weight" not in params or "bias" not in params:
            return None
        weight = params["weight"]
        bias = params["bias"]
        if recipe is None:  # plain torch
            if norm:
                ln_out = x = self.normalize(x)
                return torch.nn.functional.linear(x, weight, bias), ln_out
            return torch.nn.functional.linear(x, weight, bias)
        last = self._last
        if last is None or last[0] is not recipe or last[1] is not module_mode or weight is None \
                or x.dtype not in _INPUT_DTYPES or x.ndim == 0:
            return None
        sets = last[2]
        qs = sets[0]
        if qs.amax_reduction_group is not group:
            for s in sets:
                s.amax_reduction_group = group
        # (weight_cache_for)
        mode = AUTO if is_first_microbatch is None else cache_mode(is_first_microbatch)
        cache = d["_weight_cache"]
        if cache is not None:
            if not self.training or not self.cache_quantized_weights or _inference_mode():
                cache.clear()
                cache = None
            elif mode == AUTO and self._sharded_params:
                cache = None
        if norm:
            ln_out = x = self.normalize(x)
        # (quantized_linear)
        if x.shape[-1] != weight.shape[1]:
            _feature_mismatch(x, weight)
        ndim = x.ndim
        x2 = x if ndim == 2 else x.reshape(-1, x.shape[-1])
        tokens = x2.shape[0]
        if qs.token_multiple != 1:
            x2 = pad_tokens(x2, qs.token_multiple)
        copy_policy = self.weight_columnwise_copy
        if _functorch_active():
            y = QuantizedLinearFunction.apply(x2, weight, bias, qs, cache, mode, copy_policy)
        else:  # what Function.apply runs then (QuantizedLinearFunction defines no setup_context)
            y = _LINEAR_APPLY(_unwrap_if_dead(x2), _unwrap_if_dead(weight),
                              None if bias is None else _unwrap_if_dead(bias), qs, cache, mode, copy_policy)
        if ndim != 2 or y.shape[0] != tokens:
            y = _fresh_view(y[:tokens] if y.shape[0] != tokens else y, (*x.shape[:-1], weight.shape[0]))
        return (y, ln_out) if norm else y

    def _traced_gemm_quantizers(self) -> Optional[List[GemmQuantizers]]:
        """:meth:`gemm_quantizers` as torch.compile traces it.

        The quantizer sets are built (or found) by :func:`_prepare_for_trace`, which runs eagerly
        while the graph is traced (building creates state tensors and registers buffers, which a
        graph cannot do), then read back through the module so the graph guards on them: another
        recipe, a reset state or a rebuilt set compiles again. No checkpoint record is made:
        torch.compile's own activation checkpointing recomputes inside the graph, where the state
        updates are not repeated."""

        recipe, module_mode, group = self._call_recipe(get_autocast_state())
        if recipe is None:
            return None
        _require_compile_support()
        slot = 1 if module_mode else 0
        entry = self._compile_ready[slot]
        if entry is None or entry[0] is not recipe:
            # Not made ready by init_quantizer_state: prepare now. The graph then holds this module's
            # identity (torch.compile guards on the prepare's arguments); a module made ready before
            # tracing shares its graph with every module of the same shape (see init_quantizer_state).
            if _ID_CONSTANTS:
                # older Dynamo hands a constant function only constants: the objects by id (_trace_ids)
                _prepare_for_trace_by_id(id(self), id(recipe), module_mode)
            else:
                _prepare_for_trace(self, recipe, module_mode)
            entry = self._traced_sets[slot]  # first read in this trace: what prepare wrote
            if entry is None or entry[0] is not recipe:
                raise RuntimeError("fp_recipes: quantizer sets were not prepared for tracing")
        sets = entry[1]
        for qs in sets:
            if qs.amax_reduction_group is not group:
                qs.amax_reduction_group = group
        return sets

    def check_input(self, x: torch.Tensor, sets: Optional[List[GemmQuantizers]]) -> None:
        """FP32/BF16/FP16 input when quantizing (before any cast could hide a wrong dtype)."""
        if sets is not None and x.dtype not in _INPUT_DTYPES:
            recipe = self._quantizer_recipe_name()
            check_input_dtype(type(self).__name__, x, recipe)

    def _quantizer_recipe_name(self) -> str:
        last = self._last
        return type(last[0]).__name__ if last is not None else ""

    # ------------------------------------------------------------------ building
    def _sets_for(self, recipe: Any, module_mode: bool) -> List[GemmQuantizers]:
        entry = self._by_recipe.get(recipe)
        if entry is None:
            entry = self._build(recipe)
        if self._pending is not None:
            self._apply_pending(entry)
        if entry is not self._state_recipe and (entry.has_tensors or self._state_recipe is None
                                                or not self._state_recipe.has_tensors):
            self._make_state_recipe(entry)
        sets = entry.module_sets if module_mode else entry.sets
        self._quantizer_sets = entry.sets
        self._last = (recipe, module_mode, sets)
        return sets

    def _build(self, recipe: Any) -> _RecipeSets:
        device = self._param_device()
        # built outside inference mode: state created by a first forward under torch.inference_mode()
        # must stay usable for training
        with torch.inference_mode(False):
            sets = [GemmQuantizers.from_recipe(recipe, self.module_kind, g) for g in range(self.num_gemms)]
            for g, qs in enumerate(sets):
                for tensor, q in qs.quantizers.items():
                    if q is None:
                        continue
                    if hasattr(q, "seed") and isinstance(getattr(q, "seed"), int):
                        # distinct, reproducible SR streams per module, GEMM and operand
                        q.seed = (self._sr_seed + 4 * g + _OPERANDS.index(tensor) + 1) % 2**64
                    if device is not None:
                        for attr in _delayed_attrs(q):
                            buf = getattr(q, attr)
                            if buf.device != device:
                                setattr(q, attr, buf.to(device))
        entry = _RecipeSets(recipe, sets)
        self._by_recipe[recipe] = entry
        return entry

    def _make_state_recipe(self, entry: _RecipeSets) -> None:
        """Register ``entry``'s delayed-scaling tensors as the ``qstate_*`` buffers."""
        for name in self._state_buffer_names:
            self._buffers.pop(name, None)
        self._state_buffer_names = []
        for g, tensor, q in entry.quantizers():
            for attr in _delayed_attrs(q):
                name = _buffer_name(tensor, g, attr)
                self.register_buffer(name, getattr(q, attr), persistent=True)
                self._state_buffer_names.append(name)
        self._state_recipe = entry

    def init_quantizer_state(self, recipe: Any) -> "QuantizedModule":
        """Build ``recipe``'s quantizer state now, as the first forward under it would (nothing is
        quantized or recorded), so ``state_dict()`` already has that state's keys.

        ``torch.distributed.checkpoint.load`` fills only the keys the destination state dict has: a
        fresh model would otherwise silently skip the checkpoint's delayed-scaling buffers and fail
        on the structure of its extra state. Call it on every module before ``dcp.load``."""

        recipe = _resolve_recipe(recipe)
        if recipe is not None:
            self._sets_for(recipe, False)
            # ready for torch.compile too: a graph traced through one module then serves every module
            # of the same shape (blocks compiled one by one share their graph)
            _prepare_for_trace(self, recipe, False, ready=True)
            if self.recipe is recipe:
                _prepare_for_trace(self, recipe, True, ready=True)
        return self

    def reset_quantizer_state(self) -> None:
        """Forget every recipe's quantizer state and any loaded state not applied yet (fresh start)."""
        for name in self._state_buffer_names:
            self._buffers.pop(name, None)
        self._state_buffer_names = []
        self._by_recipe = {}
        self._last = None
        self._quantizer_sets = None
        self._state_recipe = None
        self._pending = None
        self._records.clear()
        self._traced_sets = [None, None]
        self._compile_ready = [None, None]
        self.clear_weight_cache()

    def _param_device(self) -> Optional[torch.device]:
        for p in self.parameters(recurse=False):
            return p.device
        return None

    def _iter_quantizers(self):
        if self._state_recipe is not None:
            yield from self._state_recipe.quantizers()

    # ------------------------------------------------------------------ state
    def _rebind_state_buffers(self) -> None:
        """Point each quantizer at its (possibly replaced) buffer, e.g. after ``module.to()``."""
        for g, tensor, q in self._iter_quantizers():
            for attr in _delayed_attrs(q):
                name = _buffer_name(tensor, g, attr)
                buf = self._buffers.get(name)
                if buf is None:
                    continue
                if buf.dtype != torch.float32:  # model.half()/.bfloat16(): scaling state stays FP32
                    buf = self._buffers[name] = buf.float()
                if buf is not getattr(q, attr):
                    setattr(q, attr, buf)

    def _apply(self, fn, *args, **kwargs):
        self.clear_weight_cache()
        out = super()._apply(fn, *args, **kwargs)
        self._rebind_state_buffers()
        # the other recipes' state (not buffers now) moves along
        for entry in self._by_recipe.values():
            if entry is self._state_recipe:
                continue
            for _, _, q in entry.quantizers():
                for attr in _delayed_attrs(q):
                    t = fn(getattr(q, attr))
                    setattr(q, attr, t if t.dtype == torch.float32 else t.float())
        return out

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        state["_records"] = replay.RecordQueue()  # per-graph bookkeeping: not copied
        # a copy is prepared for tracing afresh (its quantizers get their own handles)
        state["_traced_sets"] = [None, None]
        state["_compile_ready"] = [None, None]
        state["_weight_cache"] = WeightCache()  # copies of this module's weights, not of the copy's
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        _trace_ids.register(self)  # a copy (deepcopy, pickle) is traced by id like the original

    def get_extra_state(self) -> Any:
        pending = self._pending
        if pending is not None:
            return {"version": qstate.EXTRA_VERSION, "recipe": pending["identity"],
                    "recipe_repr": pending["repr"], "recipe_config": pending["config"],
                    "quantizer_state": dict(pending["plain"])}
        entry = self._state_recipe
        if entry is None:
            return {"version": qstate.EXTRA_VERSION, "recipe": None, "quantizer_state": {}}
        plain_state: Dict[str, Dict[str, Any]] = {}
        for g, tensor, q in entry.quantizers():
            plain = {k: v for k, v in _quantizer_state(q).items() if not isinstance(v, torch.Tensor)}
            if plain:
                plain_state[f"{tensor.value}{g}"] = plain
        return {"version": qstate.EXTRA_VERSION, "recipe": qstate.identity(entry.recipe),
                "recipe_repr": repr(entry.recipe), "recipe_config": entry.recipe.to_config(),
                "quantizer_state": plain_state}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._pending is not None:  # loaded, not applied yet: that is this module's state
            for name in self._state_buffer_names:
                destination.pop(prefix + name, None)
            for name, t in self._pending["tensors"].items():
                destination[prefix + name] = t if keep_vars else t.detach()

    def set_extra_state(self, state: Any) -> None:
        if self._loading:  # handled (validated first) by _load_from_state_dict
            return
        errors: List[str] = []
        self._load_quantizer_state({}, state, errors, type(self).__name__)
        if errors:
            raise RuntimeError("\n".join(errors))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # Everything is validated before anything is copied: a failed load changes nothing here.
        self.clear_weight_cache()
        where = f"{type(self).__name__} {prefix[:-1] or '(root)'}"
        n_errors = len(error_msgs)
        for name, p in list(self._parameters.items()) + [(n, b) for n, b in self._buffers.items()
                                                         if n not in self._state_buffer_names]:
            key = prefix + name
            if p is not None and key in state_dict and isinstance(state_dict[key], torch.Tensor) \
                    and tuple(state_dict[key].shape) != tuple(p.shape):
                error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                                  f"{tuple(state_dict[key].shape)} from checkpoint, the shape in current "
                                  f"model is {tuple(p.shape)}.")
        state_keys = [k for k in state_dict if k.startswith(prefix + _STATE_PREFIX) and "." not in k[len(prefix):]]
        tensors = {k[len(prefix):]: state_dict[k] for k in state_keys
                   if qstate.parse_name(k[len(prefix):], self.num_gemms)}
        if strict:
            # a misspelt or foreign qstate_* key is an error (its state would be lost), and the load
            # then fails as a whole: copy nothing
            bad = [k for k in state_keys if k[len(prefix):] not in tensors]
            if bad:
                unexpected_keys.extend(bad)
                return
        extra = state_dict.get(prefix + "_extra_state")
        plan = self._load_quantizer_state(tensors, extra, error_msgs, where, dry_run=True)
        if len(error_msgs) > n_errors:
            return
        # torch loads parameters and other buffers; the qstate_* buffers are ours
        hidden = {n: self._buffers.pop(n) for n in self._state_buffer_names if n in self._buffers}
        self._loading = True
        try:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                          unexpected_keys, error_msgs)
        finally:
            self._loading = False
            self._buffers.update(hidden)
        if len(error_msgs) > n_errors:
            return
        # valid state names are ours; misspelt or foreign qstate_* keys stay unexpected (strict fails)
        for key in [k for k in unexpected_keys if k[len(prefix):] in tensors and k.startswith(prefix)]:
            unexpected_keys.remove(key)
        # checkpoints without quantizer state (e.g. from torch.nn.Linear) load too
        for key in [k for k in missing_keys if k == prefix + "_extra_state"]:
            missing_keys.remove(key)
        plan()

    def _load_quantizer_state(self, tensors: Dict[str, torch.Tensor], extra: Any, errors: List[str],
                              where: str, dry_run: bool = False):
        """Validate ``tensors`` (qstate_* by name) and ``extra`` against this module; append messages to
        ``errors``; return a function that applies them (now, or pending until their recipe is used)."""
        extra = extra if isinstance(extra, dict) else {}
        ident = extra.get("recipe")
        plain = dict(extra.get("quantizer_state", {}) or {})
        repr_ = extra.get("recipe_repr")
        config = extra.get("recipe_config")
        if not tensors and not plain:
            return lambda: None
        current = self._state_recipe
        now = current is not None and (qstate.identity(current.recipe) == ident if ident is not None
                                       else current.has_tensors or not tensors)
        if now:
            expected = qstate.expected_shapes(current.recipe, self.module_kind, self.num_gemms)
            errors.extend(qstate.shape_errors(tensors, expected, where))
        elif current is not None and ident is not None and ident.get("recipe") == type(current.recipe).__name__:
            # the same kind of recipe with another state shape: it cannot be this module's state
            errors.append(f"{where}: the checkpoint's quantizer state was saved under "
                          f"{qstate.describe(ident, repr_)}, which does not fit this module's "
                          f"{current.recipe!r} (different amax_history_len?)")
        elif ident is not None:
            recipe = qstate.recipe_from_extra(extra)
            if recipe is not None:
                expected = qstate.expected_shapes(recipe, self.module_kind, self.num_gemms)
                errors.extend(qstate.shape_errors(tensors, expected, where))
        copies = {k: v.detach().clone() for k, v in tensors.items()}

        def apply() -> None:
            if now:
                _copy_state(current, copies, plain)
            else:
                self._pending = {"identity": ident, "repr": repr_, "config": config, "tensors": copies,
                                 "plain": plain}
                self._last = None  # the next forward checks the pending state against its recipe
        if not dry_run and not errors:
            apply()
        return apply

    def _apply_pending(self, entry: _RecipeSets) -> None:
        """Loaded state meets the first recipe used after the load: its own, or an error naming both."""
        pending = self._pending
        ident = pending["identity"]
        saved = qstate.describe(ident, pending["repr"])
        hint = ("; run it under the checkpoint's recipe, or call reset_quantizer_state() to start "
                "this recipe's state afresh")
        if ident is not None and ident != qstate.identity(entry.recipe):
            raise ValueError(f"{type(self).__name__}: the loaded checkpoint holds quantizer state of "
                             f"{saved}, but this module now runs under {entry.recipe!r}{hint}")
        expected = qstate.expected_shapes(entry.recipe, self.module_kind, self.num_gemms)
        errors = qstate.shape_errors(pending["tensors"], expected, type(self).__name__)
        if errors:
            raise ValueError("\n".join(errors) + f" (the module runs under {entry.recipe!r}){hint}")
        _copy_state(entry, pending["tensors"], pending["plain"])
        self._pending = None


def _prepare_for_trace(module: QuantizedModule, recipe: Any, module_mode: bool, ready: bool = False) -> None:
    """Runs eagerly while torch.compile traces ``module``'s forward (marked as a constant function:
    torch.compile calls it with the real objects, guarding on their identity): build or find the
    quantizer sets of ``recipe``, as the eager path would, and make them known to the ops a traced
    backward calls."""
    from ..ops import backend
    from .amax_reduction import register_traced

    # The first load of the extension and of the CUDA op modules takes a lock, which a trace cannot
    # enter (a model compiled before any eager quantized call failed there on the GPU): load them now.
    backend.registered_cuda_ops()
    load_cuda_casts()
    sets = module._sets_for(recipe, module_mode)
    for qs in sets:
        register_traced(qs)
        for q in qs.quantizers.values():
            if q is not None and getattr(q.spec, "stochastic_rounding", False) and hasattr(q, "use_sr_tensors"):
                q.use_sr_tensors()  # the graph reads the SR seed and counter when it runs
    if any(spec.scaling is ScalingKind.NVFP4 for qs in sets for spec in qs.specs.values()):
        # the emulated NVFP4 GEMM caches a decode table per device and dtype on first use; a graph
        # cannot create it (a tensor made in the graph and kept in a global dict): create it now
        from ..gemm import nvfp4_emulated

        device = module._param_device() or torch.device("cpu")
        for dtype in (torch.float32, torch.bfloat16):
            nvfp4_emulated._byte_pair_table(device, dtype)
    slot = 1 if module_mode else 0
    attr = "_compile_ready" if ready else "_traced_sets"
    current = getattr(module, attr)[slot]
    if current is None or current[0] is not recipe or current[1] is not sets:
        entries = list(getattr(module, attr))
        entries[slot] = (recipe, sets)
        setattr(module, attr, entries)


# The oldest torch whose Dynamo traces the path (tested: 2.11 and 2.13). Before 2.13 it reads no
# ``obj.__dict__`` (quantizers/base.py: shallow_copy) and passes only constants to a constant function
# (_prepare_for_trace_by_id).
COMPILE_MIN_TORCH = (2, 11)
_TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
_ID_CONSTANTS = _TORCH_VERSION < (2, 13)


def _prepare_for_trace_by_id(module_id: int, recipe_id: int, module_mode: bool) -> None:
    """:func:`_prepare_for_trace` for a Dynamo that passes only constants to a constant function."""
    _prepare_for_trace(_trace_ids.lookup(module_id), _trace_ids.lookup(recipe_id), module_mode)


_prepare_for_trace_by_id._dynamo_marked_constant = True  # type: ignore[attr-defined]


def compile_supported() -> bool:
    """Whether this torch can compile fp_recipes modules under a recipe (torch >= 2.11)."""
    return _TORCH_VERSION >= COMPILE_MIN_TORCH


def _require_compile_support() -> None:
    """The first thing a traced forward runs (a constant function: eager, at trace time): on a torch
    too old to trace the rest of the path, the user learns why instead of a Dynamo internal error."""
    if not compile_supported():
        raise RuntimeError(
            f"fp_recipes: torch.compile of fp_recipes modules under a recipe needs torch >= "
            f"{'.'.join(map(str, COMPILE_MIN_TORCH))} (this is torch {torch.__version__}, whose Dynamo cannot "
            "trace the quantized tensors); run the model eagerly, or compile only the parts outside "
            "fp_recipes modules")


# what torch.compiler.assume_constant_result sets (without importing torch._dynamo at import time)
_require_compile_support._dynamo_marked_constant = True  # type: ignore[attr-defined]
_prepare_for_trace._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _copy_state(entry: _RecipeSets, tensors: Dict[str, torch.Tensor], plain: Dict[str, Dict[str, Any]]) -> None:
    with torch.no_grad():
        for g, tensor, q in entry.quantizers():
            for attr in _delayed_attrs(q):
                src = tensors.get(_buffer_name(tensor, g, attr))
                if src is not None:
                    getattr(q, attr).copy_(src)
            key = f"{tensor.value}{g}"
            if key in plain:
                _load_extra(q, plain[key])


def _quantizer_state(q: Any) -> Dict[str, Any]:
    if hasattr(q, "state_dict"):
        try:
            return dict(q.state_dict())
        except NotImplementedError:
            return {}
    return {}


def _load_extra(q: Any, plain: Dict[str, Any]) -> None:
    """Restore non-tensor quantizer state (NVFP4 SR seed/offset) without touching tensor state."""
    for key, value in plain.items():
        if hasattr(q, key) and not isinstance(getattr(q, key), torch.Tensor):
            setattr(q, key, value)
