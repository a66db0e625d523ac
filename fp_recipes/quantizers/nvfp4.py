"""NVFP4 quantized tensors and the quantizer that makes them (formulas: docs/nvfp4.md).

An :class:`NVFP4Tensor` carries everything a consumer needs: the packed E2M1 data and E4M3 block scales
of the rowwise copy (x as (M, K)) and/or of the columnwise copy (x^T as (K, M)), their FP32 global
amaxes, and the flags that change how the numbers are read (``row_scaled``, ``e4m3_max``,
``rht_columnwise``). Dequantize and GEMM read those flags from the tensor, never from a recipe.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Dict, Optional, Tuple

import torch

from .. import ops
from ..ops.ref_nvfp4 import BLOCK, E4M3_BOUNDS
from ._tensor_io import StatePickle, resolve_out_dtype
from ..ops.backend import resolved
from .base import QuantizedTensor, Quantizer, check_input, shallow_copy
from .roles import QFormat, QuantizerSpec, ScalingKind, TensorKind

_MASK64 = 2**64 - 1


def _bits64(value: int) -> int:
    """An int in [0, 2^64) as the int64 with the same bits."""
    return value - 2**64 if value >= 2**63 else value

__all__ = ["NVFP4Quantizer", "NVFP4Tensor"]

_STATE_VERSION = 1
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_SET = tuple(_DTYPES.values())  # `in` compares with ==, as dict.values() does


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


class NVFP4Tensor(StatePickle, QuantizedTensor):
    """NVFP4 data of a tensor of logical ``shape`` (..., K), flattened to x = (M, K), M = prod(leading).

    Rowwise copy: ``data`` uint8 (M, K/2), ``scale`` float8_e4m3fn (M, K/16), ``amax`` FP32 0-dim or (M,)
    when ``row_scaled``. Columnwise copy (quantization of x^T): ``data_t`` (K, M/2), ``scale_t`` (K, M/16),
    ``amax_t`` FP32 0-dim (always per tensor). When ``rht_columnwise`` the columnwise copy holds the
    random-Hadamard-transformed x^T (both wgrad operands are transformed, and the transform cancels in
    their product). Either copy may be None.

    Pickles (``pickle``, ``copy.deepcopy``, ``torch.save``/``torch.load``) through :meth:`state_dict`, the
    E4M3 scales as uint8 views of the same bytes, so a copy is bit-identical.

    ``gemm_unit`` / ``gemm_unit_t`` (None unless the CUDA quantizer wrote them): a cache of the emulated
    GEMM's BF16 unit operand of the rowwise / columnwise copy, exactly ``gemm.decode_nvfp4_unit(data,
    scale, torch.bfloat16)`` of that copy, which the GEMM then reads instead of decoding. A cache only:
    not part of the state, dropped by :meth:`to` and :meth:`drop_gemm_units`, never changes a number.
    """

    gemm_unit: Optional[torch.Tensor] = None
    gemm_unit_t: Optional[torch.Tensor] = None

    #: the instance attributes (shallow_copy in a trace by torch < 2.13)
    COPY_FIELDS = ("data", "scale", "amax", "data_t", "scale_t", "amax_t", "row_scaled", "e4m3_max",
                   "four_over_six", "rht_columnwise", "orig_dtype", "_shape", "gemm_unit", "gemm_unit_t")

    kind = "nvfp4"

    def __init__(self, data: Optional[torch.Tensor], scale: Optional[torch.Tensor], amax: Optional[torch.Tensor],
                 data_t: Optional[torch.Tensor], scale_t: Optional[torch.Tensor], amax_t: Optional[torch.Tensor],
                 row_scaled: bool, e4m3_max: int, four_over_six: bool, rht_columnwise: bool,
                 orig_dtype: torch.dtype, shape: torch.Size | tuple) -> None:
        self.data, self.scale, self.amax = data, scale, amax
        self.data_t, self.scale_t, self.amax_t = data_t, scale_t, amax_t
        self.row_scaled = bool(row_scaled)
        self.e4m3_max = int(e4m3_max)
        self.four_over_six = bool(four_over_six)
        self.rht_columnwise = bool(rht_columnwise)
        self.orig_dtype = orig_dtype
        self._shape = torch.Size(shape)
        self._validate()

    # ---- structure -----------------------------------------------------------------------------------
    def _validate(self) -> None:
        what = "NVFP4Tensor"
        if self.e4m3_max not in E4M3_BOUNDS:
            raise ValueError(f"{what}: e4m3_max must be 448 or 256, got {self.e4m3_max}")
        if self.orig_dtype not in _DTYPE_SET:
            raise ValueError(f"{what}: orig_dtype must be one of {sorted(_DTYPES)}, got {self.orig_dtype}")
        if len(self._shape) < 1:
            raise ValueError(f"{what}: shape must have at least one dim, got {tuple(self._shape)}")
        m, k = self.rows, self._shape[-1]
        row = (self.data is None) + (self.scale is None) + (self.amax is None)  # absent parts: 0 or 3
        col = (self.data_t is None) + (self.scale_t is None) + (self.amax_t is None)
        for name, absent in (("rowwise", row), ("columnwise", col)):
            if absent % 3:
                raise ValueError(f"{what}: the {name} copy is incomplete (data, scale and amax go together)")
        if self.data is None and self.data_t is None:
            raise ValueError(f"{what}: has neither a rowwise nor a columnwise copy")
        if self.data is not None:
            self._check_copy("rowwise", self.data, self.scale, self.amax, m, k,
                             (m,) if self.row_scaled else ())
        if self.data_t is not None:
            self._check_copy("columnwise", self.data_t, self.scale_t, self.amax_t, k, m, ())

    @staticmethod
    def _check_copy(name: str, data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, rows: int,
                    cols: int, amax_shape: tuple) -> None:
        what = f"NVFP4Tensor ({name} copy)"
        if data.dtype != torch.uint8 or tuple(data.shape) != (rows, cols // 2):
            raise ValueError(f"{what}: data must be uint8 {(rows, cols // 2)}, got {data.dtype} {tuple(data.shape)}")
        if scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != (rows, cols // BLOCK):
            raise ValueError(f"{what}: scale must be float8_e4m3fn {(rows, cols // BLOCK)} (unpadded), "
                             f"got {scale.dtype} {tuple(scale.shape)}")
        if amax.dtype != torch.float32 or tuple(amax.shape) != amax_shape:
            raise ValueError(f"{what}: amax must be float32 of shape {amax_shape}, got {amax.dtype} "
                             f"{tuple(amax.shape)}")

    @property
    def shape(self) -> torch.Size:
        return self._shape

    @property
    def rows(self) -> int:
        """M = prod(leading dims): the row count of the rowwise copy."""
        return math.prod(self._shape[:-1])

    @property
    def device(self) -> torch.device:
        return (self.data if self.data is not None else self.data_t).device

    @property
    def dtype(self) -> torch.dtype:
        return self.orig_dtype

    @property
    def has_rowwise(self) -> bool:
        return self.data is not None

    @property
    def has_columnwise(self) -> bool:
        return self.data_t is not None

    # ---- values --------------------------------------------------------------------------------------
    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The rowwise copy's values, in the logical ``shape``, as ``dtype`` (default: the original dtype)."""
        dtype = resolve_out_dtype(dtype, self.orig_dtype)
        if self.data is None:
            raise ValueError("NVFP4Tensor.dequantize: this tensor has no rowwise copy (it was quantized with "
                             "rowwise=False); use dequantize_columnwise() for the x^T copy")
        out = ops.nvfp4_dequantize(self.data, self.scale, self.amax, e4m3_max=self.e4m3_max,
                                   row_scaled=self.row_scaled, out_dtype=dtype)
        return out.reshape(self._shape)

    def dequantize_columnwise(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The columnwise copy's values as a (K, M) tensor: x^T, or RHT(x^T) when ``rht_columnwise``
        (what the wgrad GEMM consumes; compare with ``rht(x^T)`` rather than x^T in that case); ``dtype``
        defaults to the original dtype."""
        dtype = resolve_out_dtype(dtype, self.orig_dtype)
        if self.data_t is None:
            raise ValueError("NVFP4Tensor.dequantize_columnwise: this tensor has no columnwise copy (it was "
                             "quantized with columnwise=False)")
        return ops.nvfp4_dequantize(self.data_t, self.scale_t, self.amax_t, e4m3_max=self.e4m3_max,
                                    row_scaled=False, out_dtype=dtype)

    def drop_gemm_units(self) -> None:
        """Free the cached BF16 GEMM operands (the GEMM then decodes the packed copies itself)."""
        self.gemm_unit = self.gemm_unit_t = None

    def release_rowwise(self) -> None:
        self.gemm_unit = None
        if self.data_t is not None:  # (the columnwise copy has its own scale and amax: scale_t, amax_t)
            self.data = self.scale = self.amax = None

    def split_saved(self) -> "tuple[tuple, NVFP4Tensor]":
        """(its tensors, a shell without them), for ``ctx.save_for_backward`` (``modules/replay.pack``):
        the fields are known, so nothing is searched per call (the GEMM unit caches go with them)."""
        shell = shallow_copy(self)
        shell.data = shell.scale = shell.amax = shell.data_t = shell.scale_t = shell.amax_t = None
        shell.gemm_unit = shell.gemm_unit_t = None
        return (self.data, self.scale, self.amax, self.data_t, self.scale_t, self.amax_t, self.gemm_unit,
                self.gemm_unit_t), shell

    def with_saved_tensors(self, tensors) -> "NVFP4Tensor":
        """The inverse of :meth:`split_saved`, on the shell: a new tensor holding ``tensors``."""
        t = shallow_copy(self)
        t.data, t.scale, t.amax, t.data_t, t.scale_t, t.amax_t, t.gemm_unit, t.gemm_unit_t = tensors
        return t

    # ---- movement and serialization ------------------------------------------------------------------
    def _tensors(self) -> Dict[str, Optional[torch.Tensor]]:
        return {"data": self.data, "scale": self.scale, "amax": self.amax,
                "data_t": self.data_t, "scale_t": self.scale_t, "amax_t": self.amax_t}

    def to(self, device: torch.device | str) -> "NVFP4Tensor":
        moved = {k: (None if v is None else v.to(device)) for k, v in self._tensors().items()}
        return NVFP4Tensor(**moved, row_scaled=self.row_scaled, e4m3_max=self.e4m3_max,
                           four_over_six=self.four_over_six, rht_columnwise=self.rht_columnwise,
                           orig_dtype=self.orig_dtype, shape=self._shape)

    def state_dict(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {"kind": self.kind, "version": _STATE_VERSION}
        state.update(self._tensors())
        state.update(row_scaled=self.row_scaled, e4m3_max=self.e4m3_max, four_over_six=self.four_over_six,
                     rht_columnwise=self.rht_columnwise, orig_dtype=_dtype_name(self.orig_dtype),
                     shape=list(self._shape))
        return state

    @classmethod
    def from_state_dict(cls, state: Dict[str, Any]) -> "NVFP4Tensor":
        if state.get("kind") != cls.kind:
            raise ValueError(f"NVFP4Tensor.from_state_dict: not an NVFP4 tensor state (kind={state.get('kind')!r})")
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"NVFP4Tensor.from_state_dict: unsupported state version {state.get('version')!r}; "
                             f"this fp_recipes reads version {_STATE_VERSION}")
        known = {"kind", "version", "data", "scale", "amax", "data_t", "scale_t", "amax_t", "row_scaled",
                 "e4m3_max", "four_over_six", "rht_columnwise", "orig_dtype", "shape"}
        unknown = sorted(set(state) - known)
        if unknown:
            raise ValueError(f"NVFP4Tensor.from_state_dict: unknown fields {unknown} (written by a newer "
                             "version?); refusing to guess how they change the numbers")
        dt = _DTYPES.get(state["orig_dtype"])
        if dt is None:
            raise ValueError(f"NVFP4Tensor.from_state_dict: orig_dtype {state['orig_dtype']!r} is not one of "
                             f"{sorted(_DTYPES)}")
        return cls(state["data"], state["scale"], state["amax"], state["data_t"], state["scale_t"],
                   state["amax_t"], row_scaled=state["row_scaled"], e4m3_max=state["e4m3_max"],
                   four_over_six=state["four_over_six"], rht_columnwise=state["rht_columnwise"],
                   orig_dtype=dt, shape=tuple(state["shape"]))

    def __repr__(self) -> str:
        copies = "+".join(n for n, on in (("rowwise", self.has_rowwise), ("columnwise", self.has_columnwise)) if on)
        flags = [f"E={self.e4m3_max}"]
        if self.row_scaled:
            flags.append("row_scaled")
        if self.four_over_six:
            flags.append("4over6")
        if self.rht_columnwise and self.has_columnwise:
            flags.append("rht(columnwise)")
        return (f"NVFP4Tensor(shape={tuple(self._shape)}, orig_dtype={_dtype_name(self.orig_dtype)}, "
                f"copies={copies}, {', '.join(flags)}, device={self.device})")


class NVFP4Quantizer(Quantizer):
    """Quantizes to :class:`NVFP4Tensor` as its spec says (1-D or 2-D blocks, row-scaled, 4over6, RHT on
    the columnwise copy, stochastic rounding).

    Stochastic rounding state: ``seed`` (default: CRC32 of the role string, so different roles draw
    different streams; pass ``seed=`` to choose) and ``offset`` (starts at 0). After each stochastically
    rounded quantize the offset advances by the number of Philox counters one copy used (M*K/16), so
    repeated calls draw fresh numbers and a run restored from ``state_dict`` continues bit-identically.
    """

    #: gemm_units of new quantizers (benchmarks/bench_model.py --nvfp4-gemm-units sets it)
    default_gemm_units = "none"
    #: gemm_units of a Linear's activation and gradient quantizers (:meth:`serve_module_gemms`): the rowwise
    #: copy's unit operand, written by the cast. The tile kernels are bound by their instruction issue, so the
    #: extra stores overlap their arithmetic: on an H200 (16384 x 6144) +29 us for x's row unit in the RHT
    #: kernel where a decode pass costs ~66 us (benchmarks/NOTES_nvfp4.md, session 36). Rowwise only: the
    #: Linear frees it after dgrad, so no BF16 operand lives longer than the decoded one did (peak memory).
    module_gemm_units = "rowwise"
    #: Under torch.compile, a stochastically rounded cast is one op (``fp_recipes::nvfp4_quantize_sr_state``: the
    #: CUDA kernels on a GPU, reading the seed and counter tensors when the graph runs) rather than the pure-torch
    #: twin, whose Philox rounds Inductor compiles into many kernels. The same bytes either way (the twins' contract).
    traced_sr_as_op = True

    def __init__(self, spec: QuantizerSpec, *, seed: Optional[int] = None) -> None:
        if spec.scaling is not ScalingKind.NVFP4 or spec.fmt is not QFormat.NVFP4:
            raise ValueError(f"NVFP4Quantizer needs scaling=nvfp4 and fmt=nvfp4, got scaling={spec.scaling.value} "
                             f"fmt={spec.fmt.value} ({spec.role})")
        if not (spec.rowwise or spec.columnwise):
            raise ValueError(f"NVFP4Quantizer({spec.role}): spec asks for neither a rowwise nor a columnwise copy")
        conflicts = [
            (spec.four_over_six and spec.rht_columnwise, "four_over_six", "rht_columnwise"),
            (spec.four_over_six and spec.stochastic_rounding, "four_over_six", "stochastic_rounding"),
            (spec.row_scaled and spec.rht_columnwise, "row_scaled", "rht_columnwise"),
            (spec.row_scaled and spec.block_2d, "row_scaled", "block_2d"),
            (spec.row_scaled and spec.stochastic_rounding, "row_scaled", "stochastic_rounding"),
            (spec.rht_columnwise and spec.block_2d, "rht_columnwise", "block_2d"),
        ]
        for bad, a, b in conflicts:
            if bad:
                raise ValueError(f"NVFP4Quantizer({spec.role}): spec.{a}=True is incompatible with spec.{b}=True")
        super().__init__(spec)
        # Which BF16 unit GEMM operands the CUDA kernel writes next to the packed copies (cached on the
        # tensor, read by the emulated GEMM instead of a decode pass; the bytes of the copies are unchanged):
        # "none" (default), "rowwise", "auto" = the rowwise copy's and, for gradients only, the columnwise
        # copy's (activation and weight columnwise copies wait for the backward, where a BF16 cache would
        # hold 4x the packed bytes), "all". Default "none" (a cast whose output may be stored, cached or sent
        # must not carry a BF16 copy); a Linear's activation and gradient quantizers take module_gemm_units
        # (serve_module_gemms). "auto" there raised the h4096 model's peak above BF16's (NOTES_nvfp4.md, session 36).
        self.gemm_units = type(self).default_gemm_units
        self._seed_t: Optional[torch.Tensor] = None
        self._offset_t: Optional[torch.Tensor] = None
        # use_sr_device_state(): (seed, offset) as int64 (2,) on the inputs' device, and its offset element
        self._rng_d: Optional[torch.Tensor] = None
        self._rng_step: Optional[torch.Tensor] = None
        self._offset = 0
        seed = zlib.crc32(str(spec.role).encode()) if seed is None else int(seed)
        if not 0 <= seed < 2**64:
            raise ValueError(f"NVFP4Quantizer: seed must be in [0, 2^64), got {seed}")
        self._seed = seed
        self._plan: Optional[_QuantizePlan] = None  # of self.spec: see quantize()

    def serve_module_gemms(self) -> None:
        """A Linear's activation or gradient quantizer: its CUDA casts write :attr:`module_gemm_units`."""
        self.gemm_units = type(self).module_gemm_units

    def quantize(self, x: torch.Tensor, amax: Optional[torch.Tensor] = None) -> NVFP4Tensor:
        """Quantize ``x`` (..., K); ``amax`` overrides the global amax (0-dim, or (M,) when row_scaled),
        e.g. after a cross-rank MAX reduction."""
        compiling = torch.compiler.is_compiling()
        # traced code may not mutate the quantizer: a throwaway plan there, without the CUDA part
        plan = self._eager_plan() if not compiling else (
            self._plan if self._plan is not None and self._plan.spec is self.spec
            else _QuantizePlan(self.spec, eager=False))
        check_input(x, plan.what)
        x2 = x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x
        if compiling:
            return self._quantize_traced(x, x2, amax, plan)
        if plan.cuda is not None and resolved("nvfp4_quantize", x2) is plan.cuda.nvfp4_quantize:
            return self._quantize_cuda(x, x2, amax, plan)
        return self._quantize_ops(x, x2, amax, plan, self.seed, self.offset)

    def _make_plan(self) -> "_QuantizePlan":
        """This spec's options, resolved once (the spec is frozen: a new spec makes a new plan)."""
        self._plan = plan = _QuantizePlan(self.spec)
        return plan

    def _eager_plan(self) -> "_QuantizePlan":
        """The plan of the current spec (made on first use and after a spec change)."""
        plan = self._plan
        return plan if plan is not None and plan.spec is self.spec else self._make_plan()

    def _seed_offset(self) -> tuple:
        """The stochastic-rounding seed and offset as ints (the plain attributes unless tensors hold them)."""
        return (self._seed, self._offset) if self._seed_t is None and self._rng_d is None else (self.seed, self.offset)

    def _sr_key(self, plan: "_QuantizePlan", x: torch.Tensor) -> tuple:
        """(seed, offset, extra keywords) of an eager CUDA cast: with the device state, the kernels read the pair
        from it when they run (no host read), else the ints."""
        rng = self._rng_d
        if plan.stochastic_rounding:
            if rng is not None:
                return 0, 0, {"rng_state": rng}
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                # the ints would be constants of the graph: every replay would draw this cast's numbers again
                raise RuntimeError(
                    f"NVFP4Quantizer({self.spec.role}): a stochastically rounded cast is being captured in a CUDA "
                    "graph with its Philox counter on the host, so every replay would draw the same numbers. "
                    "Capture with fp_recipes.make_graphed_callables, call "
                    "fp_recipes.graphs.prepare_for_capture(model, recipe) before capturing yourself, or use "
                    "NVFP4BlockScaling(disable_stochastic_rounding=True)")
        return (*self._seed_offset(), {})

    def quantize_with_bias_grad(self, x: torch.Tensor, bias_dtype: torch.dtype) -> Tuple[NVFP4Tensor, torch.Tensor]:
        """:meth:`quantize` and ``ops.bias_grad(x, bias_dtype)``; on CUDA, where the quantization has a 1-D
        columnwise copy, the bias gradient comes from the same kernel (x is read once, not twice)."""
        if not torch.compiler.is_compiling() and x.ndim == 2:
            plan = self._eager_plan()
            if plan.cuda is not None and resolved("nvfp4_quantize", x) is plan.cuda.nvfp4_quantize:
                check_input(x, plan.what)
                seed, offset, rng = self._sr_key(plan, x)
                units = None if self.gemm_units == "none" else self._units_wanted(x)
                try:
                    fused = plan.cuda.nvfp4_quantize_planned_dbias(x, plan.cuda_plan, seed, offset, bias_dtype, units,
                                                                   **rng)
                except (ValueError, TypeError) as exc:
                    raise self._input_error(exc, x, x) from exc
                if fused is not None:
                    if plan.stochastic_rounding:
                        self._advance_offset(x)
                    return self._tensor_from(fused[0], x, plan), fused[1]
        return super().quantize_with_bias_grad(x, bias_dtype)

    def _quantize_cuda(self, x: torch.Tensor, x2: torch.Tensor, amax: Optional[torch.Tensor],
                       plan: "_QuantizePlan") -> NVFP4Tensor:
        """The eager CUDA cast: the kernel wrapper with the plan's checked options, and the tensor built
        from its own outputs without the constructor's checks."""
        seed, offset, rng = self._sr_key(plan, x)
        units = None if self.gemm_units == "none" else self._units_wanted(x2)
        try:
            res = plan.cuda.nvfp4_quantize_planned(x2, plan.cuda_plan, amax, seed, offset, units, **rng)
        except (ValueError, TypeError) as exc:
            raise self._input_error(exc, x, x2) from exc
        if plan.stochastic_rounding:
            self._advance_offset(x2)
        return self._tensor_from(res, x, plan)

    @staticmethod
    def _tensor_from(res: tuple, x: torch.Tensor, plan: "_QuantizePlan") -> NVFP4Tensor:
        # The tensor from the wrapper's own outputs, without the constructor's checks: the kernels made each
        # copy in its documented dtype and shape from x flattened to 2-D (the checks cost microseconds per
        # cast, on the step's host path). Traced code and the reference path construct.
        t = object.__new__(NVFP4Tensor)
        t.data, t.scale, t.amax, t.data_t, t.scale_t, t.amax_t, unit, unit_t = res
        t.row_scaled = plan.row_scaled
        t.e4m3_max = plan.e4m3_max
        t.four_over_six = plan.four_over_six
        t.rht_columnwise = plan.rht
        t.orig_dtype = x.dtype
        t._shape = x.shape
        if unit is not None or unit_t is not None:  # else the class's None
            t.gemm_unit, t.gemm_unit_t = unit, unit_t
        return t

    def _quantize_ops(self, x: torch.Tensor, x2: torch.Tensor, amax: Optional[torch.Tensor],
                      plan: "_QuantizePlan", seed: Any, offset: Any, traced_offset: bool = False) -> NVFP4Tensor:
        """Through ``fp_recipes.ops`` (the reference twin on the CPU), or the twin itself when traced with
        the stochastic-rounding tensors."""
        kwargs = dict(amax=amax, seed=seed, offset=offset, **plan.options)
        units = self._units_wanted(x2)
        unit = unit_t = None
        try:
            if units is not None:
                from ..ops import cuda_nvfp4

                q, unit, unit_t = cuda_nvfp4.nvfp4_quantize_with_units(
                    x2, unit_rowwise=units[0], unit_columnwise=units[1], **kwargs)
            elif traced_offset:
                # traced with the seed and counter as tensors, read when the graph runs
                from ..ops import cuda_nvfp4

                if self.traced_sr_as_op and (not x2.is_cuda or
                                             resolved("nvfp4_quantize", x2) is cuda_nvfp4.nvfp4_quantize):
                    del kwargs["stochastic_rounding"]
                    q = cuda_nvfp4.nvfp4_quantize_sr_from_state(x2, **kwargs)
                else:  # the pure-torch twin (byte-identical to the kernels)
                    from ..ops import reference

                    q = reference.nvfp4_quantize(x2, **kwargs)
            else:
                q = ops.nvfp4_quantize(x2, **kwargs)
        except (ValueError, TypeError) as exc:
            raise self._input_error(exc, x, x2) from exc
        if traced_offset:
            self._offset_t.add_(x2.numel() // BLOCK)  # int64 wraps as the 64-bit counter does
        elif plan.stochastic_rounding:
            self._advance_offset(x2)
        out = NVFP4Tensor(q.data, q.scale, q.amax, q.data_t, q.scale_t, q.amax_t, row_scaled=plan.row_scaled,
                          e4m3_max=plan.e4m3_max, four_over_six=plan.four_over_six, rht_columnwise=plan.rht,
                          orig_dtype=x.dtype, shape=x.shape)
        out.gemm_unit, out.gemm_unit_t = unit, unit_t
        return out

    def _quantize_traced(self, x: torch.Tensor, x2: torch.Tensor, amax: Optional[torch.Tensor],
                         plan: "_QuantizePlan") -> NVFP4Tensor:
        """Under torch.compile: the seed and counter as tensors read when the graph runs (stochastic
        rounding), else no per-layer constants."""
        if not plan.stochastic_rounding:
            # unused without stochastic rounding (and no per-layer constant in the graph)
            return self._quantize_ops(x, x2, amax, plan, 0, 0)
        if self._rng_d is not None:
            raise RuntimeError(f"NVFP4Quantizer({self.spec.role}): its stochastic-rounding state is on the device "
                               "for a CUDA graph of fp_recipes.make_graphed_callables; a module captured so cannot "
                               "also be traced by torch.compile")
        if self._offset_t is None:
            raise RuntimeError(f"NVFP4Quantizer({self.spec.role}): traced by torch.compile without its "
                               "stochastic-rounding tensors; call use_sr_tensors() before tracing (modules do)")
        # read when the graph runs (not constants: layers share graphs)
        return self._quantize_ops(x, x2, amax, plan, self._seed_t, self._offset_t, traced_offset=True)

    def _input_error(self, exc: Exception, x: torch.Tensor, x2: torch.Tensor) -> Exception:
        return type(exc)(f"NVFP4Quantizer({self.spec.role}) on input of shape {tuple(x.shape)} "
                         f"(flattened to {tuple(x2.shape)}): {exc}")

    def _advance_offset(self, x2: torch.Tensor) -> None:
        """After a stochastically rounded cast: the Philox counters one copy used (M*K/16)."""
        if self._rng_step is not None:
            self._rng_step.add_(x2.numel() // BLOCK)  # on the device, after the cast (int64 wraps as the counter)
        else:
            self.offset = (self.offset + x2.numel() // BLOCK) % 2**64

    # -- the stochastic-rounding state ----------------------------------------------------------
    @property
    def seed(self) -> int:
        """The Philox key of this quantizer's stochastic rounding, in [0, 2^64)."""
        if self._rng_d is not None:
            return self._device_values()[0]
        t = self._seed_t
        return self._seed if t is None else int(t) & _MASK64

    @seed.setter
    def seed(self, value: int) -> None:
        value = int(value)
        if not 0 <= value < 2**64:
            raise ValueError(f"NVFP4Quantizer: seed must be in [0, 2^64), got {value}")
        if self._rng_d is not None:
            self._set_device_values(value, self.offset)
        elif self._seed_t is None:
            self._seed = value
        else:
            self._seed_t.fill_(_bits64(value))

    @property
    def offset(self) -> int:
        """The Philox offset of the next stochastically rounded quantize, in [0, 2^64)."""
        if self._rng_d is not None:
            return self._device_values()[1]
        t = self._offset_t
        return self._offset if t is None else int(t) & _MASK64

    @offset.setter
    def offset(self, value: int) -> None:
        value = int(value) % 2**64
        if self._rng_d is not None:
            self._set_device_values(self.seed, value)
        elif self._offset_t is None:
            self._offset = value
        else:
            self._offset_t.fill_(_bits64(value))

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_plan", None)  # a cache (holding a module): rebuilt after unpickling
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state = dict(state)
        if "seed" in state:  # pickled by a version that kept plain ints
            state["_seed"] = state.pop("seed")
            state["_offset"] = state.pop("offset", 0)
        state.setdefault("_seed_t", None)
        state.setdefault("_offset_t", None)
        state.setdefault("_rng_d", None)
        state.setdefault("_rng_step", None)
        state["_plan"] = None  # rebuilt from the spec on the next quantize
        self.__dict__.update(state)

    def use_sr_tensors(self) -> None:
        """Keep the seed and the counter in CPU int64 0-dim tensors (their 64-bit patterns), from now
        on: a graph that torch.compile traces reads them (and advances the counter) when it runs, so
        neither is a constant of the graph, and eager calls read them on the host (no device sync).
        Modules call this when they are prepared for tracing. A no-op once the state is on the device
        (:meth:`use_sr_device_state`)."""
        if self._offset_t is None and self._rng_d is None:
            self._seed_t = torch.tensor(_bits64(self._seed), dtype=torch.int64)
            self._offset_t = torch.tensor(_bits64(self._offset), dtype=torch.int64)

    def use_sr_device_state(self, device: Any) -> torch.Tensor:
        """Keep the seed and the counter on ``device`` (an int64 (2,) tensor of their 64-bit patterns), from now on:
        the CUDA kernels read them when they run and the counter advances by a device add after each cast, so a
        CUDA graph (``fp_recipes.make_graphed_callables``) replays each cast with a fresh counter and leaves it
        where eager calls would. Reading ``seed``/``offset`` (``state_dict``) then waits for the device; under a
        capture it is an error. Returns the state tensor (the graph holds its address: it is written in place)."""
        device = torch.device(device)
        if self._rng_d is not None:
            if self._rng_d.device != device:
                raise ValueError(f"NVFP4Quantizer({self.spec.role}): its stochastic-rounding state is already on "
                                 f"{self._rng_d.device}, not {device}")
            return self._rng_d
        seed, offset = self._seed_offset()
        with torch.inference_mode(False):  # (a normal tensor: every later cast adds to it in place)
            self._rng_d = torch.tensor([_bits64(seed), _bits64(offset)], dtype=torch.int64, device=device)
            self._rng_step = self._rng_d[1]
        # the CPU tensors a torch.compile graph would read are dropped: a trace from now on is refused
        # (_quantize_traced), and a graph traced before re-traces (its guard on them fails) into that error
        self._seed_t = self._offset_t = None
        return self._rng_d

    def _device_values(self) -> Tuple[int, int]:
        rng = self._rng_d
        if rng.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"NVFP4Quantizer({self.spec.role}): its stochastic-rounding seed and offset live on "
                               "the device and cannot be read while a CUDA graph is being captured")
        seed, offset = rng.tolist()
        return seed & _MASK64, offset & _MASK64

    def _set_device_values(self, seed: int, offset: int) -> None:
        self._rng_d.copy_(torch.tensor([_bits64(seed), _bits64(offset)], dtype=torch.int64))

    def _units_wanted(self, x2: torch.Tensor) -> Optional[tuple]:
        """(rowwise, columnwise) unit operands to write, or None: not on CUDA with the unit kernels, under
        torch.compile, or nothing wanted."""
        mode = self.gemm_units
        if mode not in ("none", "rowwise", "auto", "all"):
            raise ValueError(f"NVFP4Quantizer.gemm_units must be 'none', 'rowwise', 'auto' or 'all', got {mode!r}")
        if mode == "none" or not x2.is_cuda or torch.compiler.is_compiling():
            return None
        from ..ops import cuda_nvfp4

        if not cuda_nvfp4.unit_operands_available():
            return None
        spec = self.spec
        col = spec.columnwise and (mode == "all" or (mode == "auto" and spec.role.tensor is TensorKind.GRAD_OUTPUT))
        row = spec.rowwise
        return (row, col) if (row or col) else None

    def __call__(self, x: torch.Tensor, amax: Optional[torch.Tensor] = None) -> NVFP4Tensor:
        return self.quantize(x, amax=amax)

    def state_dict(self) -> Dict[str, Any]:
        return {"seed": self.seed, "offset": self.offset}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        missing = {"seed", "offset"} - set(state)
        if missing:
            raise ValueError(f"NVFP4Quantizer.load_state_dict: missing {sorted(missing)}")
        self.seed, self.offset = int(state["seed"]), int(state["offset"])


class _QuantizePlan:
    """What one spec's casts need on every call, computed once: the op's options, the error-message
    prefix and, where the CUDA extension is loaded, the kernel wrapper's checked plan."""

    def __init__(self, spec: QuantizerSpec, eager: bool = True) -> None:
        self.spec = spec  # the plan's key: quantize() makes a new plan when the quantizer's spec changes
        self.what = f"NVFP4Quantizer({spec.role})"
        self.rht = bool(spec.rht_columnwise and spec.columnwise)
        self.row_scaled = bool(spec.row_scaled)
        self.e4m3_max = int(spec.e4m3_max)
        self.four_over_six = bool(spec.four_over_six)
        self.stochastic_rounding = spec.stochastic_rounding
        self.options = dict(rowwise=spec.rowwise, columnwise=spec.columnwise, block_2d=spec.block_2d,
                            row_scaled=spec.row_scaled, four_over_six=spec.four_over_six, e4m3_max=spec.e4m3_max,
                            err_mode=spec.err_mode, err_fast_math=spec.err_fast_math,
                            rht=spec.rht_columnwise and spec.columnwise,
                            stochastic_rounding=spec.stochastic_rounding)
        self.cuda: Any = None
        self.cuda_plan: Any = None
        if not eager:
            return
        from ..ops import backend

        if backend.extension() is not None:
            from ..ops import cuda_nvfp4

            self.cuda = cuda_nvfp4
            self.cuda_plan = cuda_nvfp4.QuantizePlan(**self.options)

