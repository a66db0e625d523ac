"""Grouped FP8 per-tensor quantization: many tensors (MoE experts) in one buffer, one op call.

A :class:`GroupedTensor` is one fp8 buffer plus element offsets; member i is the flat slice
``[offsets[i], offsets[i+1])`` with its own shape, ``scale_inv[i]`` and ``amax[i]``. Each member is
bit-identical to quantizing that tensor alone with its own scale (the grouped op's contract), so
``member(i)`` returns an ordinary :class:`~fp_recipes.quantizers.float8.Float8Tensor` view (no copy).
Members may be empty (0 rows). Only the rowwise buffer is stored: a member's columnwise copy is its
byte transpose (``member(i).t_data()``), which is exact for per-tensor scaling.

:func:`fp8_multi_cast` is the other grouped FP8 quantization, the one ``GroupedLinear`` uses for its
operands: G separate 2-D members (one per expert), BOTH copies (rowwise for fprop/dgrad, the
transposed copy for wgrad) in one multi-tensor cast (one kernel launch for delayed scaling, two for
current scaling, whatever G), kept as an :class:`Fp8MultiCast` whose GEMMs take addresses into its
buffers (:func:`fp_recipes.gemm.grouped.grouped_gemm`).
"""

from __future__ import annotations

import math
from itertools import accumulate, repeat
from operator import attrgetter, eq, is_
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from .. import ops
from ._tensor_io import (STATE_VERSION, StatePickle, check_state, register_weights_only_types,
                         dtype_from_name, dtype_name, resolve_out_dtype)
from .base import QuantizedTensor, Quantizer, check_input
from .float8 import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor, fp8_fmt_of_spec
from .roles import QuantizerSpec, ScalingKind

_FMT_OF_DTYPE = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def offsets_from_numels(numels: Sequence[int], device=None) -> torch.Tensor:
    """(G+1,) int64 element offsets [0, n0, n0+n1, ...]."""
    out = [0]
    for n in numels:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=torch.int64, device=device)


def split_sizes(m_splits: Union[Sequence[int], torch.Tensor]) -> List[int]:
    """Row counts given as a sequence of ints or a tensor, as host ints."""
    return [int(v) for v in (m_splits.tolist() if isinstance(m_splits, torch.Tensor) else m_splits)]


def offsets_from_m_splits(m_splits: Sequence[int], n: int, device=None) -> torch.Tensor:
    """Offsets of a row-split (sum(m), n) tensor: cumsum(m) * n with a leading 0."""
    return offsets_from_numels([int(m) * n for m in m_splits], device)


class GroupedTensor(StatePickle, QuantizedTensor):
    """G FP8 per-tensor members in one buffer (see the module docstring).

    ``data``: fp8 buffer (1-D, or the 2-D (sum(m), N) row-split input); ``offsets``: int64 (G+1,);
    ``scale_inv``/``amax``: FP32 (G,); ``member_shapes``: the logical shape of each member.
    ``shape`` is the buffer's shape.
    """

    kind = "grouped_float8"

    def __init__(self, data: torch.Tensor, offsets: torch.Tensor, scale_inv: torch.Tensor, amax: torch.Tensor,
                 member_shapes: Sequence, fmt: str, orig_dtype: torch.dtype) -> None:
        if _FMT_OF_DTYPE.get(data.dtype) != fmt:
            raise TypeError(f"GroupedTensor: data dtype {data.dtype} does not hold fmt {fmt!r}")
        shapes = [torch.Size(s) for s in member_shapes]
        if any(len(s) == 0 for s in shapes):
            raise ValueError("GroupedTensor: members must have at least one dim")
        g = len(shapes)
        numels = [s.numel() for s in shapes]
        if sum(numels) != data.numel():
            raise ValueError(f"GroupedTensor: member shapes hold {sum(numels)} elements but the buffer has "
                             f"{data.numel()}")
        if tuple(offsets.shape) != (g + 1,) or offsets.dtype != torch.int64:
            raise ValueError(f"GroupedTensor: offsets must be int64 of shape {(g + 1,)}")
        if offsets.cpu().tolist() != offsets_from_numels(numels).tolist():
            raise ValueError("GroupedTensor: offsets do not match the member shapes")
        for name, t in (("scale_inv", scale_inv), ("amax", amax)):
            if t.dtype != torch.float32 or tuple(t.shape) != (g,):
                raise ValueError(f"GroupedTensor: {name} must be FP32 of shape {(g,)}")
        self.data = data
        self.offsets = offsets
        self.scale_inv = scale_inv
        self.amax = amax
        self.member_shapes = shapes
        self.fmt = fmt
        self.orig_dtype = orig_dtype
        self._starts = offsets_from_numels(numels).tolist()  # host copy: slicing never syncs

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def num_members(self) -> int:
        return len(self.member_shapes)

    def __len__(self) -> int:
        return self.num_members

    def member(self, i: int) -> Float8Tensor:
        """Member i as a Float8Tensor sharing this buffer's storage."""
        if not -self.num_members <= i < self.num_members:
            raise IndexError(f"GroupedTensor has {self.num_members} members, no member {i}")
        i %= self.num_members
        shape = self.member_shapes[i]
        flat = self.data.reshape(-1)[self._starts[i]:self._starts[i + 1]]
        rows = math.prod(shape[:-1])
        return Float8Tensor(flat.view(rows, shape[-1]), self.scale_inv[i], self.amax[i], self.fmt,
                            self.orig_dtype, shape)

    def members(self) -> List[Float8Tensor]:
        return [self.member(i) for i in range(self.num_members)]

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The whole buffer dequantized (one grouped op), in the buffer's shape."""
        return ops.fp8_grouped_dequantize(self.data, self.offsets, self.scale_inv,
                                          resolve_out_dtype(dtype, self.orig_dtype))

    def dequantize_members(self, dtype: Optional[torch.dtype] = None) -> List[torch.Tensor]:
        flat = self.dequantize(dtype).reshape(-1)
        return [flat[self._starts[i]:self._starts[i + 1]].view(s) for i, s in enumerate(self.member_shapes)]

    def to(self, device) -> "GroupedTensor":
        return GroupedTensor(self.data.to(device), self.offsets.to(device), self.scale_inv.to(device),
                             self.amax.to(device), self.member_shapes, self.fmt, self.orig_dtype)

    def state_dict(self) -> Dict[str, Any]:
        return {"kind": self.kind, "version": STATE_VERSION, "data": self.data, "offsets": self.offsets,
                "scale_inv": self.scale_inv, "amax": self.amax,
                "member_shapes": [list(s) for s in self.member_shapes], "fmt": self.fmt,
                "orig_dtype": dtype_name(self.orig_dtype)}

    @classmethod
    def from_state_dict(cls, state: Dict[str, Any]) -> "GroupedTensor":
        check_state(state, cls.kind, ("data", "offsets", "scale_inv", "amax", "member_shapes", "fmt",
                                      "orig_dtype"))
        return cls(state["data"], state["offsets"], state["scale_inv"], state["amax"], state["member_shapes"],
                   state["fmt"], dtype_from_name(state["orig_dtype"]))

    def __repr__(self) -> str:
        empty = sum(1 for s in self.member_shapes if s.numel() == 0)
        return (f"GroupedTensor(members={self.num_members} ({empty} empty), buffer={tuple(self.shape)}, "
                f"fmt={self.fmt}, orig_dtype={dtype_name(self.orig_dtype)}, device={self.device})")


FP8MemberQuantizer = Union[Float8Quantizer, Float8CurrentScalingQuantizer]


class GroupedQuantizer(Quantizer):
    """One FP8 quantizer per member (delayed or current scaling, all from one spec), applied in one
    grouped op call.

    ``GroupedQuantizer(spec, num_members)`` builds the members; ``GroupedQuantizer.from_quantizers``
    wraps existing ones (e.g. a module's per-expert quantizers). Delayed: member i uses its own
    ``scale`` and records ``amax[i]`` into its own history slot 0; :meth:`update_scale` updates each.
    Current: the per-member amaxes come from one ``fp8_grouped_amax`` pass, the scales from the same rule
    as :class:`Float8CurrentScalingQuantizer`, then one ``fp8_grouped_quantize``.
    """

    def __init__(self, spec: QuantizerSpec, num_members: int, *,
                 quantizers: Optional[Sequence[FP8MemberQuantizer]] = None) -> None:
        super().__init__(spec)
        if spec.scaling not in (ScalingKind.DELAYED, ScalingKind.CURRENT):
            raise ValueError(f"GroupedQuantizer supports FP8 delayed or current scaling, got {spec.scaling.value}")
        self.fmt = fp8_fmt_of_spec(spec, "GroupedQuantizer")
        if not isinstance(num_members, int) or num_members < 1:
            raise ValueError(f"GroupedQuantizer: num_members must be an int >= 1, got {num_members!r}")
        cls = Float8Quantizer if spec.scaling is ScalingKind.DELAYED else Float8CurrentScalingQuantizer
        if quantizers is None:
            quantizers = [cls(spec) for _ in range(num_members)]
        quantizers = list(quantizers)
        if len(quantizers) != num_members:
            raise ValueError(f"GroupedQuantizer: got {len(quantizers)} quantizers for {num_members} members")
        for q in quantizers:
            if type(q) is not cls or q.fmt != self.fmt:
                raise ValueError(f"GroupedQuantizer: every member must be a {cls.__name__} for fmt {self.fmt}")
            if cls is Float8CurrentScalingQuantizer and (
                    q.spec.use_power_2_scales != spec.use_power_2_scales or q.spec.amax_epsilon != spec.amax_epsilon):
                raise ValueError("GroupedQuantizer: current-scaling members must share use_power_2_scales and "
                                 "amax_epsilon")
        self.quantizers: List[FP8MemberQuantizer] = quantizers
        self.delayed = cls is Float8Quantizer

    @classmethod
    def from_quantizers(cls, quantizers: Sequence[FP8MemberQuantizer]) -> "GroupedQuantizer":
        if not quantizers:
            raise ValueError("GroupedQuantizer.from_quantizers: need at least one quantizer")
        return cls(quantizers[0].spec, len(quantizers), quantizers=quantizers)

    @property
    def num_members(self) -> int:
        return len(self.quantizers)

    # -- work -------------------------------------------------------------------------------------
    def _buffer(self, x, m_splits):
        what = "GroupedQuantizer.quantize"
        if isinstance(x, (list, tuple)):
            if m_splits is not None:
                raise ValueError(f"{what}: m_splits is only for a single row-split 2-D tensor, not a list")
            if len(x) != self.num_members:
                raise ValueError(f"{what}: got {len(x)} tensors for {self.num_members} members")
            for i, t in enumerate(x):
                check_input(t, f"{what} member {i}")
                if t.dtype != x[0].dtype or t.device != x[0].device:
                    raise ValueError(f"{what}: all members must share dtype and device; member {i} is "
                                     f"{t.dtype} on {t.device}, member 0 {x[0].dtype} on {x[0].device}")
            shapes = [t.shape for t in x]
            buf = torch.cat([t.reshape(-1) for t in x])
            return buf, shapes, x[0].dtype
        check_input(x, what, min_dim=2)
        if x.dim() != 2:
            raise ValueError(f"{what}: a single tensor must be 2-D (sum(m_splits), N), got {tuple(x.shape)}")
        if m_splits is None:
            raise ValueError(f"{what}: a single 2-D tensor needs m_splits (rows per member)")
        m = split_sizes(m_splits)
        if len(m) != self.num_members:
            raise ValueError(f"{what}: m_splits has {len(m)} entries for {self.num_members} members")
        if any(v < 0 for v in m) or sum(m) != x.shape[0]:
            raise ValueError(f"{what}: m_splits must be >= 0 and sum to the row count {x.shape[0]}, got {m}")
        return x.contiguous(), [torch.Size((v, x.shape[1])) for v in m], x.dtype

    def quantize(self, x: Union[torch.Tensor, Sequence[torch.Tensor]],
                 m_splits: Optional[Sequence[int]] = None) -> GroupedTensor:
        """Quantize a list of tensors (any shapes, one per member) or a (sum(m), N) tensor split by rows."""
        buf, shapes, orig_dtype = self._buffer(x, m_splits)
        offsets = offsets_from_numels([s.numel() for s in shapes], buf.device)
        if self.delayed:
            for i, q in enumerate(self.quantizers):
                if q.scale.device != buf.device:
                    raise ValueError(f"GroupedQuantizer: member {i} scaling state is on {q.scale.device} but "
                                     f"the input is on {buf.device}")
            scales = torch.stack([q.scale for q in self.quantizers])
        else:
            # the members share fmt, use_power_2_scales and amax_epsilon (checked in __init__)
            scales = self.quantizers[0].scale_from_amax(ops.fp8_grouped_amax(buf, offsets))
        res = ops.fp8_grouped_quantize(buf, offsets, scales, self.fmt)
        if self.delayed:
            for i, q in enumerate(self.quantizers):
                q.record_amax(res.amax[i])
        return GroupedTensor(res.data, offsets, res.scale_inv, res.amax, shapes, self.fmt, orig_dtype)

    def __call__(self, x, m_splits=None) -> GroupedTensor:
        return self.quantize(x, m_splits=m_splits)

    def update_scale(self) -> None:
        """Delayed scaling: each member's :meth:`Float8Quantizer.update_scale`; no-op for current."""
        if self.delayed:
            for q in self.quantizers:
                q.update_scale()

    def to(self, device) -> "GroupedQuantizer":
        if self.delayed:
            for q in self.quantizers:
                q.to(device)
        return self

    def state_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for i, q in enumerate(self.quantizers):
            for k, v in q.state_dict().items():
                out[f"{i}.{k}"] = v
        return out

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        expected = set(self.state_dict())
        if set(state) != expected:
            raise ValueError(f"GroupedQuantizer.load_state_dict: keys differ; missing "
                             f"{sorted(expected - set(state))}, unexpected {sorted(set(state) - expected)}")
        for i, q in enumerate(self.quantizers):
            prefix = f"{i}."
            q.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})



# -- the multi-cast: both copies of G members in one launch (GroupedLinear's FP8 operands) ----------

_MULTI_KEYS = ("fmt", "scaling", "use_power_2_scales", "amax_epsilon", "rowwise", "columnwise")


def fp8_multi_cast_fits(specs: Sequence[QuantizerSpec]) -> bool:
    """Whether :func:`fp8_multi_cast` can quantize members planned by ``specs``: FP8 per-tensor scaling
    (delayed or current), one format and rule for all, both copies, no backward_override."""
    first = tuple(getattr(specs[0], k) for k in _MULTI_KEYS)
    return specs[0].scaling in (ScalingKind.DELAYED, ScalingKind.CURRENT) and \
        specs[0].rowwise and specs[0].columnwise and \
        all(s.backward_override is None and tuple(getattr(s, k) for k in _MULTI_KEYS) == first for s in specs)


class Fp8MultiCast:
    """One operand of every member as one multi-tensor cast wrote it.

    On CUDA (:func:`cuda_fp8.fp8_multi_cast_buffers`): the rowwise data of all members in one
    (total, cols) buffer, the transposed copies one after another in one flat buffer, and the FP32
    scalars in one vector with member g's scale_inv at ``[4 g]`` (a 16-byte aligned address: cuBLASLt
    refuses scale pointers into a packed vector). The GEMMs take addresses (integer arithmetic, no tensor
    per member); tensor views are made only for GEMMs that take the portable path. Elsewhere the
    reference twin's per-member views are kept as they are (``f32`` is then its (G,) amaxes).

    ``t_layout``: ``(ld_t, t_starts)`` of :func:`cuda_fp8.padded_t_layout`: member g's transposed copy is
    (cols, ld_t[g]) from ``t_starts[g]``, zeros past its rows[g] columns, so that a GEMM contracting over
    the rows (wgrad) can take K = ld_t[g] (:meth:`data_t_padded`); None: dense, (cols, rows_g) from
    ``starts[g] * cols``."""

    __slots__ = ("data_buf", "data_t_buf", "f32", "dtype", "rows", "cols", "starts", "_views", "t_layout")

    def __init__(self, data_buf: Optional[torch.Tensor], data_t_buf: Optional[torch.Tensor], f32: torch.Tensor,
                 dtype: torch.dtype, rows: Sequence[int], cols: int, starts: Sequence[int],
                 views: Optional[tuple] = None, t_layout: Optional[tuple] = None) -> None:
        self.data_buf, self.data_t_buf, self.f32, self.dtype = data_buf, data_t_buf, f32, dtype
        self.rows, self.cols, self.starts = rows, cols, starts
        self._views = views  # reference path: (data views, data_t views, scale_inv (G,))
        self.t_layout = t_layout

    @property
    def addressable(self) -> bool:
        """Made by the CUDA multi-cast (buffers with addresses), not by the reference twin."""
        return self._views is None

    @property
    def device(self) -> torch.device:
        return self.f32.device

    def data(self, g: int) -> torch.Tensor:
        if self._views is not None:
            return self._views[0][g]
        return self.data_buf[self.starts[g]:self.starts[g + 1]]

    def data_t(self, g: int) -> torch.Tensor:
        """Member g's transposed copy (cols, rows_g) (a column slice of the padded block, if padded)."""
        if self._views is not None:
            return self._views[1][g]
        if self.t_layout is not None:
            return self.data_t_padded(g)[:, :self.rows[g]]
        s, e = self.starts[g] * self.cols, self.starts[g + 1] * self.cols
        return self.data_t_buf[s:e].view(self.cols, self.rows[g])

    def data_t_padded(self, g: int) -> torch.Tensor:
        """Member g's transposed copy with its zero padding, (cols, ld_t[g]) contiguous: the operand of a
        GEMM contracting over the rows (the same product, K a multiple of 16). Needs ``t_layout``."""
        ld_t, t_starts = self.t_layout
        return self.data_t_buf[t_starts[g]:t_starts[g + 1]].view(self.cols, ld_t[g])

    def scale_inv(self, g: int) -> torch.Tensor:
        return self._views[2][g] if self._views is not None else self.f32[4 * g]

    def amaxes(self) -> List[torch.Tensor]:
        if self._views is not None:
            return list(self.f32.unbind(0))
        g = len(self.rows)
        return list(self.f32[4 * g:5 * g].unbind(0))

    def record_amaxes(self, quantizers: Sequence[Any]) -> None:
        """Delayed scaling: ``amax_history[0] = max(amax_history[0], amax)`` of every member, one kernel."""
        torch._foreach_maximum_([q._slot0() for q in quantizers], self.amaxes())

    def data_ptrs(self, gs: Sequence[int]) -> List[int]:
        base, c = self.data_buf.data_ptr(), self.cols  # FP8: one byte per element
        return [base + self.starts[g] * c for g in gs]

    def data_t_ptrs(self, gs: Sequence[int]) -> List[int]:
        base, c = self.data_t_buf.data_ptr(), self.cols
        if self.t_layout is not None:
            t_starts = self.t_layout[1]
            return [base + t_starts[g] for g in gs]
        return [base + self.starts[g] * c for g in gs]

    def scale_ptrs(self, gs: Sequence[int]) -> List[int]:
        base = self.f32.data_ptr()
        return [base + 16 * g for g in gs]

    def columnwise_only(self) -> "Fp8MultiCast":
        """A copy (the same tensors) without the rowwise copy: all the backward GEMMs read."""
        views = None if self._views is None else (None, self._views[1], self._views[2])
        return Fp8MultiCast(None, self.data_t_buf, self.f32, self.dtype, self.rows, self.cols, self.starts, views,
                            self.t_layout)

    def split_saved(self) -> "tuple[list, Fp8MultiCast]":
        """(its tensors, a shell without them) for ``ctx.save_for_backward`` (see ``replay.pack``)."""
        views = self._views
        tensors = [self.data_buf, self.data_t_buf, self.f32]
        shell = Fp8MultiCast(None, None, None, self.dtype, self.rows, self.cols, self.starts, None, self.t_layout)
        if views is not None:
            tensors += (list(views[0]) if views[0] is not None else []) + list(views[1]) + [views[2]]
            shell._views = (views[0] is not None, len(views[1]))  # their structure, for with_saved_tensors
        return tensors, shell

    def with_saved_tensors(self, tensors: list) -> "Fp8MultiCast":
        views = None
        if self._views is not None:
            has_rowwise, g = self._views
            rest = tensors[3:]
            data = rest[:g] if has_rowwise else None
            rest = rest[g:] if has_rowwise else rest
            views = (data, rest[:g], rest[g])
        return Fp8MultiCast(tensors[0], tensors[1], tensors[2], self.dtype, self.rows, self.cols, self.starts, views,
                            self.t_layout)


_SCALE = attrgetter("scale")
_HISTORY = attrgetter("amax_history")
_DEVICE = attrgetter("device")
_DTYPE = attrgetter("dtype")
_DATA_PTR = torch.Tensor.data_ptr


def _kernel_ready(parts: Sequence[torch.Tensor], quantizers: Sequence[Any], delayed: bool) -> bool:
    """What the multi-cast kernel takes on trust: members of one dtype and device, each contiguous,
    and (delayed scaling) FP32 scales on that device. Anything else (an expert's weight cast or moved
    on its own, say) goes through the dispatched ops, which check, copy or say what is wrong.
    (The checks iterate in C: map over attribute getters, no Python frame per member.)"""
    dtype, device = parts[0].dtype, parts[0].device
    if not (all(map(is_, map(_DTYPE, parts), repeat(dtype))) and all(map(eq, map(_DEVICE, parts), repeat(device)))
            and all(map(torch.Tensor.is_contiguous, parts))):
        return False
    return not delayed or _scales_ready(list(map(_SCALE, quantizers)), device)


def _scales_ready(scales: Sequence[torch.Tensor], device: torch.device) -> bool:
    return all(map(eq, map(_DEVICE, scales), repeat(device))) and \
        all(map(is_, map(_DTYPE, scales), repeat(torch.float32)))


def _cuda_lane(x: torch.Tensor):
    """The CUDA multi-cast's buffer-level entry points (``ops/cuda_fp8.py``: ``fp8_multi_cast_buffers``
    and ``fp8_multi_cast_rows``; no per-member views: the GEMMs take addresses) for a CUDA input with
    the extension, else None (the dispatched ops run). None while torch.compile traces: these entry points take
    raw addresses, which a traced (fake) tensor does not have; the dispatched ops trace as ops."""
    if not x.is_cuda or x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or \
            torch.compiler.is_compiling():
        return None
    from ..ops import backend
    if backend.cuda_impl("fp8_multi_quantize") is None:
        return None
    from ..ops import cuda_fp8
    return cuda_fp8


def _record_slots(quantizers: Sequence[Any], device: torch.device) -> List[int]:
    """The addresses of the members' ``amax_history[0]`` for the multi-cast kernel to record into (one
    launch: no amax views, no ``_foreach_maximum_``), or [] where it cannot: an extension without the
    recording casts, or a history that is not FP32 on the input's device (then
    :meth:`Fp8MultiCast.record_amaxes` records). ``amax_history[0]`` starts where the history does
    (its data_ptr), so no slot view is needed."""
    from ..ops import cuda_fp8

    if not cuda_fp8.can_record_amax():
        return []
    hists = list(map(_HISTORY, quantizers))
    if not all(map(is_, map(_DTYPE, hists), repeat(torch.float32))) or \
            not all(map(eq, map(_DEVICE, hists), repeat(device))):
        return []
    return list(map(_DATA_PTR, hists))


def fp8_multi_cast(quantizers: Sequence[FP8MemberQuantizer], parts: Union[torch.Tensor, Sequence[torch.Tensor]], *,
                   record: bool = True, rows: Optional[Sequence[int]] = None) -> Fp8MultiCast:
    """Cast every ``parts[g]`` (2-D, one cols) by ``quantizers[g]`` (one spec that
    :func:`fp8_multi_cast_fits`), both copies, in one multi-tensor cast; delayed scaling records every
    member's amax into its history (members with no rows too: an amax of 0; ``record=False``: none).
    Each member is bit-identical to ``quantizers[g].quantize(parts[g])``.

    ``rows``: ``parts`` is ONE contiguous 2-D tensor whose consecutive row blocks of these sizes are the
    members (``parts.split(rows)``, without making those views on the CUDA lane: the member addresses
    are arithmetic)."""
    spec, fmt = quantizers[0].spec, quantizers[0].fmt
    delayed = spec.scaling is ScalingKind.DELAYED
    if rows is not None:  # one tensor, split by rows
        x, rows = parts, list(rows)
        ready = x.is_contiguous() and (not delayed or _scales_ready(list(map(_SCALE, quantizers)), x.device))
        lane = _cuda_lane(x) if ready else None
        if lane is None:
            parts = x.split(rows)
        device, cols = x.device, x.shape[1]
    else:
        lane = _cuda_lane(parts[0]) if _kernel_ready(parts, quantizers, delayed) else None
        rows, cols, device = [p.shape[0] for p in parts], parts[0].shape[1], parts[0].device
    if lane is not None:
        records = _record_slots(quantizers, device) if delayed and record else ()
        scales = list(map(_DATA_PTR, map(_SCALE, quantizers))) if delayed else None
        power_2, eps = bool(spec.use_power_2_scales), float(spec.amax_epsilon)
        if isinstance(parts, torch.Tensor):
            data, data_t, f32, starts, t_layout = lane.fp8_multi_cast_rows(
                parts, rows, fmt, scales=scales, power_2=power_2, amax_epsilon=eps, records=records)
        else:
            data, data_t, f32, starts, t_layout = lane.fp8_multi_cast_buffers(
                parts, fmt, scales=scales, power_2=power_2, amax_epsilon=eps, records=records)
        casts = Fp8MultiCast(data, data_t, f32, data.dtype, rows, cols, starts, None, t_layout)
        if records:
            return casts  # the kernel recorded every member's amax into its history
    else:
        if delayed:
            res = ops.fp8_multi_quantize(parts, [q.scale for q in quantizers], fmt, rowwise=True, columnwise=True)
        else:
            res = ops.fp8_multi_current_scaling_quantize(parts, fmt, use_power_2_scales=bool(spec.use_power_2_scales),
                                                         amax_epsilon=float(spec.amax_epsilon), rowwise=True,
                                                         columnwise=True)
        dtype = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
        casts = Fp8MultiCast(None, None, res.amax, dtype, rows, cols, list(accumulate(rows, initial=0)),
                             (res.data, res.data_t, res.scale_inv))
    if delayed and record:
        casts.record_amaxes(quantizers)
    return casts


register_weights_only_types()  # this type and every other quantized tensor type

__all__ = ["Fp8MultiCast", "GroupedQuantizer", "GroupedTensor", "fp8_multi_cast", "fp8_multi_cast_fits",
           "offsets_from_m_splits", "offsets_from_numels"]
