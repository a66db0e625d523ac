"""The quantize + GEMM autograd core shared by every module, and the per-module quantizer state.

Two layers:

* :func:`quantized_linear` / :class:`QuantizedLinearFunction` -- a pure function of
  ``(x, weight, bias, GemmQuantizers)``: quantize the operands by role, run fprop, and in the backward
  dgrad and wgrad, as the operand table says. It does no communication, so tensor-parallel wrappers
  (Megatron column/row splits, sequence parallel) call it on their local shards and do their
  all-gathers / reduce-scatters outside it.
* :class:`QuantizedModule` -- an ``nn.Module`` mixin that builds its quantizers from
  ``recipe.plan(role)`` for each role of each of its GEMMs, keeps delayed-scaling state (amax
  history, scale) as module buffers so it is in ``state_dict``, keeps NVFP4 stochastic-rounding
  state (seed, offset) in the module's extra state, and hands delayed-scaling quantizers to the
  amax reducer (one all-reduce after the forward, one after the backward).

Outside an enabled autocast the modules call ``torch.nn.functional`` directly, so their outputs and
gradients are exactly torch's.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..gemm import gemm
from ..quantizers.factory import make_quantizer
from ..quantizers.roles import (BackwardOverride, ModuleKind, QuantizerRole, QuantizerSpec,
                                ScalingKind, TensorKind)
from .amax_reduction import reducer

__all__ = ["backward_operands", "GemmQuantizers", "pad_tokens", "token_multiple", "QuantizedLinearFunction", "QuantizedModule", "quantized_linear",
           "quantize_operand"]

_OPERANDS = (TensorKind.ACTIVATION, TensorKind.WEIGHT, TensorKind.GRAD_OUTPUT)
_module_ids = itertools.count()


# ----------------------------------------------------------------------------------------------
# the quantizers of one GEMM
# ----------------------------------------------------------------------------------------------


@dataclass
class GemmQuantizers:
    """The three operand quantizers of one linear GEMM (None = that operand stays high precision)."""

    specs: Dict[TensorKind, QuantizerSpec]
    quantizers: Dict[TensorKind, Optional[Any]]
    amax_reduction_group: Any = None
    backward_override: Optional[BackwardOverride] = None

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

    @property
    def activation(self) -> Optional[Any]:
        return self.quantizers[TensorKind.ACTIVATION]

    @property
    def weight(self) -> Optional[Any]:
        return self.quantizers[TensorKind.WEIGHT]

    @property
    def grad_output(self) -> Optional[Any]:
        return self.quantizers[TensorKind.GRAD_OUTPUT]


def quantize_operand(quantizer: Optional[Any], x: torch.Tensor, group: Any = None, *,
                     backward: bool = False) -> Any:
    """``quantizer(x)`` (or ``x`` itself for a high-precision operand); a delayed-scaling quantizer is
    handed to the amax reducer, so its amax is reduced and its scale updated after this pass."""
    if quantizer is None:
        return x
    spec = quantizer.spec
    if spec.rht_columnwise and spec.columnwise and x.dtype != torch.bfloat16:
        # The Hadamard transform's contract is defined on BF16 input (NUMERICS.md, RHT).
        x = x.to(torch.bfloat16)
    q = quantizer.quantize(x)
    if spec.scaling is ScalingKind.DELAYED:
        if backward:
            reducer.record_backward(quantizer, group)
        else:
            reducer.record_forward(quantizer, group)
    return q


def _check_nvfp4_shapes(qs: GemmQuantizers, m: int, k: int, n: int) -> None:
    """NVFP4 needs 16-element blocks along every dimension it quantizes; say which one is off."""
    for tensor, (rows, cols) in ((TensorKind.ACTIVATION, (m, k)), (TensorKind.WEIGHT, (n, k)),
                                 (TensorKind.GRAD_OUTPUT, (m, n))):
        spec = qs.specs[tensor]
        if spec.scaling is not ScalingKind.NVFP4:
            continue
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


def backward_operands(qs: GemmQuantizers, x: torch.Tensor, weight: torch.Tensor, qx: Any,
                      qw: Any) -> Tuple[Any, Any]:
    """What the dgrad/wgrad GEMMs read for x and W, by ``backward_override``: the quantized tensors
    (default), the original high-precision tensors, or the dequantized forward operands."""
    override = qs.backward_override
    if override is BackwardOverride.HIGH_PRECISION:
        return x, weight
    if override is BackwardOverride.DEQUANTIZED:
        xd = qx if isinstance(qx, torch.Tensor) else qx.dequantize(torch.float32).reshape(x.shape)
        wd = qw if isinstance(qw, torch.Tensor) else qw.dequantize(torch.float32).reshape(weight.shape)
        return xd, wd
    return columnwise_only(qx), columnwise_only(qw)


def columnwise_only(q: Any) -> Any:
    """The backward GEMMs read only the columnwise copy of x and W: keep just that one (halves the
    saved activation memory). Anything without a columnwise copy is kept whole."""
    name = type(q).__name__
    if name == "Float8Tensor" and q.data_t is not None and q.data is not None:
        return type(q)(None, q.scale_inv, q.amax, q.fmt, q.orig_dtype, q.shape, data_t=q.data_t)
    if name == "NVFP4Tensor" and q.data_t is not None and q.data is not None:
        return type(q)(None, None, None, q.data_t, q.scale_t, q.amax_t, row_scaled=q.row_scaled,
                       e4m3_max=q.e4m3_max, four_over_six=q.four_over_six, rht_columnwise=q.rht_columnwise,
                       orig_dtype=q.orig_dtype, shape=q.shape)
    return q


class QuantizedLinearFunction(torch.autograd.Function):
    """y = x @ W^T + b with quantized operands; x is 2-D (tokens, in_features)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                qs: GemmQuantizers) -> torch.Tensor:
        m, k = x.shape
        n = weight.shape[0]
        group = qs.amax_reduction_group
        _check_nvfp4_shapes(qs, m, k, n)
        if m == 0:
            qx = x
        else:
            qx = quantize_operand(qs.activation, x, group)
        qw = quantize_operand(qs.weight, weight, group)
        if m == 0:
            y = torch.zeros(0, n, dtype=x.dtype, device=x.device)
        else:
            y = gemm(qx, qw, out_dtype=x.dtype, bias=bias, use_fast_accum=True)
        ctx.qs = qs
        ctx.shapes = (m, k, n)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.has_bias = bias is not None
        x_op, w_op = backward_operands(qs, x, weight, qx, qw)
        # Quantized tensors are plain Python objects: kept on ctx; torch tensors go through
        # save_for_backward (version checks, saved-tensor hooks).
        ctx.operands = tuple(None if isinstance(t, torch.Tensor) else t for t in (x_op, w_op))
        ctx.plain = [isinstance(t, torch.Tensor) for t in (x_op, w_op)]
        ctx.save_for_backward(*[t for t in (x_op, w_op) if isinstance(t, torch.Tensor)])
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        qs: GemmQuantizers = ctx.qs
        m, k, n = ctx.shapes
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        saved = list(ctx.saved_tensors)
        x_op, w_op = [saved.pop(0) if plain else q for plain, q in zip(ctx.plain, ctx.operands)]
        need_dx, need_dw, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], \
            ctx.has_bias and ctx.needs_input_grad[2]
        dy = dy.contiguous()
        dx = dw = db = None
        if m == 0:
            dx = torch.zeros(0, k, dtype=x_dtype, device=dy.device) if need_dx else None
            dw = torch.zeros(n, k, dtype=w_dtype, device=dy.device) if need_dw else None
            db = torch.zeros(n, dtype=b_dtype, device=dy.device) if need_db else None
            return dx, dw, db, None
        qdy = quantize_operand(qs.grad_output, dy, qs.amax_reduction_group, backward=True) \
            if (need_dx or need_dw) else dy
        if need_dx:
            dx = gemm(qdy, w_op, transpose_b=True, out_dtype=x_dtype)
        if need_dw:
            dw = gemm(qdy, x_op, transpose_a=True, transpose_b=True, out_dtype=w_dtype)
        if need_db:
            db = dy.float().sum(0).to(b_dtype)
        ctx.operands = None
        return dx, dw, db, None


def token_multiple(qs: GemmQuantizers) -> int:
    """The multiple the token count must have: 16 when an NVFP4 activation or grad_output is blocked
    along the tokens (columnwise copy for wgrad, or 2-D tiles), else 1."""
    for tensor in (TensorKind.ACTIVATION, TensorKind.GRAD_OUTPUT):
        spec = qs.specs[tensor]
        if spec.scaling is ScalingKind.NVFP4 and (spec.columnwise or spec.block_2d):
            return 16
    return 1


def pad_tokens(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero rows appended up to a multiple (autograd-aware). Zero tokens change no amax and add
    nothing to wgrad; their outputs are sliced off, so their gradients are zero."""
    extra = (-x.shape[0]) % multiple
    return torch.nn.functional.pad(x, (0, 0, 0, extra)) if extra else x


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     qs: Optional[GemmQuantizers]) -> torch.Tensor:
    """``F.linear`` with the operands quantized by ``qs`` (None: exactly ``F.linear``).

    Any leading dims of ``x`` are flattened into tokens and restored; a token count that NVFP4 cannot
    block is zero-padded for the GEMMs and the padding sliced off again. This is the entry point for
    tensor-parallel wrappers: it communicates nothing."""
    if qs is None:
        return torch.nn.functional.linear(x, weight, bias)
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: input has {x.shape[-1]} features, weight expects {weight.shape[1]} "
                         f"(weight shape {tuple(weight.shape)})")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    tokens = x2.shape[0]
    y = QuantizedLinearFunction.apply(pad_tokens(x2, token_multiple(qs)), weight, bias, qs)
    if y.shape[0] != tokens:
        y = y[:tokens]
    return y.reshape(*lead, weight.shape[0])


# ----------------------------------------------------------------------------------------------
# module mixin: quantizer sets per recipe, state in state_dict
# ----------------------------------------------------------------------------------------------

_STATE_PREFIX = "qstate_"


def _buffer_name(tensor: TensorKind, gemm_index: int, attr: str) -> str:
    return f"{_STATE_PREFIX}{tensor.value}{gemm_index}_{attr}"


def _delayed_attrs(q: Any) -> Tuple[str, ...]:
    return tuple(a for a in ("scale", "amax_history") if isinstance(getattr(q, a, None), torch.Tensor))


class QuantizedModule(torch.nn.Module):
    """Mixin for modules whose GEMMs are quantized under :func:`fp_recipes.autocast`.

    Subclasses set ``module_kind`` and ``num_gemms`` and call :meth:`gemm_quantizers` in forward.
    The quantizer set is built on first use of a recipe and rebuilt when the recipe changes (the
    delayed-scaling state then starts afresh: it belongs to that recipe's scales)."""

    module_kind: ModuleKind = ModuleKind.LINEAR

    def __init__(self) -> None:
        super().__init__()
        self._module_id = next(_module_ids)
        self._recipe: Any = None
        self._quantizer_sets: Optional[List[GemmQuantizers]] = None
        self._pending_buffers: Dict[str, torch.Tensor] = {}
        self._pending_extra: Dict[str, Dict[str, Any]] = {}
        self._state_buffer_names: List[str] = []
        self._in_forward_step = False

    @property
    def num_gemms(self) -> int:
        return 1

    @property
    def quantizer_sets(self) -> Optional[List[GemmQuantizers]]:
        """The quantizers of the last recipe used (None before the first forward under autocast)."""
        return self._quantizer_sets

    # ------------------------------------------------------------------ building
    def gemm_quantizers(self) -> Optional[List[GemmQuantizers]]:
        """The quantizers for the current autocast (None outside an enabled autocast)."""
        from ..autocast import get_autocast_state

        state = get_autocast_state()
        if not state.enabled or state.recipe is None:
            return None
        recipe = state.recipe
        if self._quantizer_sets is None or not (recipe is self._recipe or recipe == self._recipe):
            self._build(recipe)
        group = state.amax_reduction_group
        for qs in self._quantizer_sets:
            qs.amax_reduction_group = group
        return self._quantizer_sets

    def _build(self, recipe: Any) -> None:
        for name in self._state_buffer_names:
            self._buffers.pop(name, None)
        self._state_buffer_names = []
        sets = [GemmQuantizers.from_recipe(recipe, self.module_kind, g) for g in range(self.num_gemms)]
        device = self._param_device()
        for g, qs in enumerate(sets):
            for tensor, q in qs.quantizers.items():
                if q is None:
                    continue
                if hasattr(q, "seed") and isinstance(getattr(q, "seed"), int):
                    # Distinct, reproducible SR streams per module and operand.
                    q.seed = (self._module_id << 16) + g * 8 + _OPERANDS.index(tensor) + 1
                for attr in _delayed_attrs(q):
                    name = _buffer_name(tensor, g, attr)
                    buf = getattr(q, attr)
                    if device is not None and buf.device != device:
                        buf = buf.to(device)
                        setattr(q, attr, buf)
                    self.register_buffer(name, buf, persistent=True)
                    self._state_buffer_names.append(name)
        self._quantizer_sets = sets
        self._recipe = recipe
        self._apply_pending_state()

    def _param_device(self) -> Optional[torch.device]:
        for p in self.parameters(recurse=False):
            return p.device
        return None

    def _iter_quantizers(self):
        for g, qs in enumerate(self._quantizer_sets or []):
            for tensor, q in qs.quantizers.items():
                if q is not None:
                    yield g, tensor, q

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
        out = super()._apply(fn, *args, **kwargs)
        self._rebind_state_buffers()
        return out

    def _apply_pending_state(self) -> None:
        for g, tensor, q in self._iter_quantizers():
            for attr in _delayed_attrs(q):
                name = _buffer_name(tensor, g, attr)
                if name in self._pending_buffers:
                    src = self._pending_buffers.pop(name)
                    dst = getattr(q, attr)
                    if src.shape != dst.shape:
                        raise ValueError(
                            f"checkpoint state {name} has shape {tuple(src.shape)} but this recipe's "
                            f"quantizer has {tuple(dst.shape)} (different amax_history_len?)")
                    with torch.no_grad():
                        dst.copy_(src)
            key = f"{tensor.value}{g}"
            if key in self._pending_extra:
                _load_extra(q, self._pending_extra.pop(key))

    def get_extra_state(self) -> Any:
        extra: Dict[str, Dict[str, Any]] = dict(self._pending_extra)
        for g, tensor, q in self._iter_quantizers():
            plain = {k: v for k, v in _quantizer_state(q).items() if not isinstance(v, torch.Tensor)}
            if plain:
                extra[f"{tensor.value}{g}"] = plain
        return {"quantizer_state": extra}

    def set_extra_state(self, state: Any) -> None:
        if not state:
            return
        extra = dict(state.get("quantizer_state", {}))
        if self._quantizer_sets is None:
            self._pending_extra = extra
            return
        for g, tensor, q in self._iter_quantizers():
            key = f"{tensor.value}{g}"
            if key in extra:
                _load_extra(q, extra.pop(key))
        self._pending_extra = extra

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        # Quantizer state saved by a module that had already built its quantizers, loaded into one
        # that has not (yet): keep it until the first forward under the same recipe builds them.
        state_prefix = prefix + _STATE_PREFIX
        for key in [k for k in unexpected_keys if k.startswith(state_prefix)]:
            unexpected_keys.remove(key)
            self._pending_buffers[key[len(prefix):]] = state_dict[key].detach().clone()
        # Checkpoints without quantizer state (e.g. from torch.nn.Linear) load too.
        for key in [k for k in missing_keys if k.startswith(state_prefix) or k == prefix + "_extra_state"]:
            missing_keys.remove(key)
        if self._quantizer_sets is not None and self._pending_buffers:
            self._apply_pending_state()


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
