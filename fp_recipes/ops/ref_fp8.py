"""Reference twins of the FP8 per-tensor kernels (single tensor and grouped). The numeric contract.

Operation order (each step FP32, round to nearest even, no fused multiply-add):

* ``amax = max |x|`` over the tensor, taken on the FP32 values (exact whatever the input dtype); a NaN
  anywhere makes the amax NaN; an empty tensor has amax 0.
* ``data = saturate_RN(RN(fp32(x) * scale))`` with :func:`fp_recipes.formats.fp8_encode` (finite
  overflow and +-Inf -> +-max, NaN -> 0x7F).
* ``scale_inv = RN(1 / scale)`` (a zero scale gives +Inf, as IEEE division does).
* dequantize: ``out_dtype(RN(fp32(data) * scale_inv))``.

The columnwise copy ``data_t`` is the byte transpose of ``data``: with one scale for the whole tensor,
quantizing ``x.T`` gives exactly the transposed bytes.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from .. import formats

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class FP8Quantized(NamedTuple):
    """Result of :func:`fp8_quantize` / :func:`fp8_current_scaling_quantize`.

    data: (M, N) fp8 or None; data_t: (N, M) fp8 contiguous or None; scale_inv, amax, scale: FP32 0-dim.
    ``scale`` is the scale that was applied (the given one, or the computed one for current scaling).
    """

    data: Optional[torch.Tensor]
    data_t: Optional[torch.Tensor]
    scale_inv: torch.Tensor
    amax: torch.Tensor
    scale: torch.Tensor


class FP8GroupedQuantized(NamedTuple):
    """Result of :func:`fp8_grouped_quantize`: data (x's shape, fp8), scale_inv (G,), amax (G,) FP32."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    amax: torch.Tensor


class FP8MultiQuantized(NamedTuple):
    """Result of :func:`fp8_multi_quantize` / :func:`fp8_multi_current_scaling_quantize` over G tensors.

    data: per member the (rows_g, cols) fp8 copy, or None when not rowwise; the members are views of ONE
    (sum(rows), cols) buffer, in order. data_t: per member the (cols, rows_g) fp8 copy, or None when not
    columnwise; views of ONE flat buffer holding the members' (cols, rows_g) blocks one after another.
    scale_inv, amax, scale: (G,) FP32, entry g for member g (delayed: scale is the given scales gathered;
    current: the computed scales).
    """

    data: list
    data_t: list
    scale_inv: torch.Tensor
    amax: torch.Tensor
    scale: torch.Tensor


# ---- validation (shared with ref_per_token) -------------------------------------------------------

def _dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def check_fmt(fmt: str, allowed: tuple, what: str) -> str:
    if not isinstance(fmt, str) or fmt.lower() not in allowed:
        raise ValueError(f"{what}: fmt must be one of {', '.join(repr(a) for a in allowed)}; got {fmt!r}")
    return fmt.lower()


def check_float_input(x: torch.Tensor, what: str, *, dims: tuple = (2,)) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{what}: x has dtype {_dtype_name(x.dtype)}; allowed: float32, float16, bfloat16")
    if x.dim() not in dims:
        want = " or ".join(f"{d}-D" for d in dims)
        raise ValueError(f"{what}: x must be {want} (flatten leading dims first), got shape {tuple(x.shape)}")


def check_out_dtype(out_dtype: torch.dtype, what: str) -> None:
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"{what}: out_dtype must be float32, float16 or bfloat16, got {out_dtype}")


def _check_fp32(t: torch.Tensor, name: str, what: str, ref: torch.Tensor, shape: tuple) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: {name} must be an FP32 tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{what}: {name} must be float32, got {_dtype_name(t.dtype)}")
    if t.device != ref.device:
        raise ValueError(f"{what}: {name} is on {t.device} but the data is on {ref.device}; "
                         "they must be on the same device")
    if tuple(t.shape) != shape:
        raise ValueError(f"{what}: {name} must have shape {shape}, got {tuple(t.shape)}")
    return t


def _check_fp8_data(data: torch.Tensor, what: str) -> None:
    if not isinstance(data, torch.Tensor) or data.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        got = _dtype_name(data.dtype) if isinstance(data, torch.Tensor) else type(data).__name__
        raise TypeError(f"{what}: data must be float8_e4m3fn or float8_e5m2, got {got}")


# ---- single tensor -------------------------------------------------------------------------------

def check_amax_input(x: torch.Tensor) -> None:
    """fp8_amax's argument check (shared with the CUDA wrapper)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"fp8_amax: x must be a float32/float16/bfloat16 tensor, got "
                        f"{_dtype_name(x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__}")


def fp8_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as an FP32 0-dim tensor, taken on FP32 values; NaN propagates; empty -> 0."""
    check_amax_input(x)
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    a = x.to(torch.float32).abs()
    m = a.amax()
    if torch.compiler.is_compiling():  # traced: a select (a host read of the flag would break the graph)
        return torch.where(torch.isnan(a).any(), torch.full((), float("nan"), dtype=torch.float32,
                                                            device=x.device), m)
    if bool(torch.isnan(a).any()):  # amax does propagate NaN, but make the contract explicit
        m = torch.full((), float("nan"), dtype=torch.float32, device=x.device)
    return m


def _quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, fmt: str, rowwise: bool,
                         columnwise: bool) -> FP8Quantized:
    data = formats.fp8_encode(x.to(torch.float32) * scale, fmt)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    scale_inv = one / scale
    return FP8Quantized(
        data=data if rowwise else None,
        data_t=data.t().contiguous() if columnwise else None,
        scale_inv=scale_inv,
        amax=fp8_amax(x),
        scale=scale,
    )


def _check_copies(rowwise: bool, columnwise: bool, what: str) -> None:
    if not (rowwise or columnwise):
        raise ValueError(f"{what}: nothing to produce: rowwise and columnwise are both False")


def check_fp8_quantize_args(x: torch.Tensor, scale: torch.Tensor, fmt: str, rowwise: bool,
                            columnwise: bool) -> str:
    """fp8_quantize's argument checks (shared with the CUDA wrapper); returns the normalised fmt."""
    what = "fp8_quantize"
    check_float_input(x, what)
    fmt = check_fmt(fmt, ("e4m3", "e5m2"), what)
    _check_fp32(scale, "scale", what, x, ())
    _check_copies(rowwise, columnwise, what)
    return fmt


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor, fmt: str, *, rowwise: bool = True,
                 columnwise: bool = False) -> FP8Quantized:
    """Quantize 2-D ``x`` with a given per-tensor ``scale`` (FP32 0-dim): see the module docstring."""
    fmt = check_fp8_quantize_args(x, scale, fmt, rowwise, columnwise)
    return _quantize_with_scale(x, scale, fmt, rowwise, columnwise)


def current_scale(amax: torch.Tensor, fmt_max: float, *, use_power_2_scales: bool = False,
                  amax_epsilon: float = 0.0) -> torch.Tensor:
    """The current-scaling scale for an FP32 amax (0-dim or any shape), in this order:

    1. ``a = max(amax, amax_epsilon)`` (NaN stays NaN);
    2. ``a == 0`` or ``a`` not finite (Inf/NaN) -> scale 1 (the data then saturates / stays NaN);
    3. else ``scale = RN(fmt_max / a)``; if that overflows to +Inf (a tiny ``a``), scale = FLT_MAX;
    4. power of two: ``scale = 2^floor(log2 scale)``, i.e. the mantissa bits of the FP32 scale cleared
       (exact; scale is always a positive normal number here).
    """
    # torch.full fills on the device: no blocking host-to-device copy (a stream sync on CUDA)
    eps = torch.full((), float(amax_epsilon), dtype=torch.float32, device=amax.device)
    a = torch.where(torch.isnan(amax), amax, torch.maximum(amax, eps))
    fmax = torch.full((), fmt_max, dtype=torch.float32, device=amax.device)
    s = fmax / a
    s = torch.where(torch.isinf(s), torch.full_like(s, formats.FP32_MAX), s)
    s = torch.where((a == 0) | ~torch.isfinite(a), torch.ones_like(s), s)
    if use_power_2_scales:
        s = formats.fp32_from_bits(formats.fp32_bits(s) & 0x7F800000)
    return s


def check_current_scaling_args(x: torch.Tensor, fmt: str, amax_epsilon: float, rowwise: bool,
                               columnwise: bool) -> str:
    """fp8_current_scaling_quantize's argument checks (shared with the CUDA wrapper); returns the fmt."""
    what = "fp8_current_scaling_quantize"
    check_float_input(x, what)
    return _check_current_options(fmt, amax_epsilon, rowwise, columnwise, what)


def _check_current_options(fmt: str, amax_epsilon: float, rowwise: bool, columnwise: bool, what: str) -> str:
    """The option checks every current-scaling cast shares; returns the fmt."""
    fmt = check_fmt(fmt, ("e4m3", "e5m2"), what)
    _check_copies(rowwise, columnwise, what)
    if not (amax_epsilon >= 0.0):
        raise ValueError(f"{what}: amax_epsilon must be >= 0, got {amax_epsilon!r}")
    return fmt


def fp8_current_scaling_quantize(x: torch.Tensor, fmt: str, *, use_power_2_scales: bool = False,
                                 amax_epsilon: float = 0.0, rowwise: bool = True,
                                 columnwise: bool = False) -> FP8Quantized:
    """Current scaling: the scale comes from this tensor's own amax (:func:`current_scale`). The returned
    ``amax`` is the raw amax of ``x`` (before the epsilon floor); ``scale`` is the scale used."""
    fmt = check_current_scaling_args(x, fmt, amax_epsilon, rowwise, columnwise)
    amax = fp8_amax(x)
    scale = current_scale(amax, formats.FP8_MAX[fmt], use_power_2_scales=use_power_2_scales,
                          amax_epsilon=amax_epsilon)
    return _quantize_with_scale(x, scale, fmt, rowwise, columnwise)


def check_fp8_dequantize_args(data: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype) -> None:
    """fp8_dequantize's argument checks (shared with the CUDA wrapper)."""
    what = "fp8_dequantize"
    _check_fp8_data(data, what)
    _check_fp32(scale_inv, "scale_inv", what, data, ())
    check_out_dtype(out_dtype, what)


def fp8_dequantize(data: torch.Tensor, scale_inv: torch.Tensor,
                   out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``out_dtype(RN(fp32(data) * scale_inv))`` for fp8 ``data`` of any shape; scale_inv FP32 0-dim."""
    check_fp8_dequantize_args(data, scale_inv, out_dtype)
    return (formats.fp8_decode(data) * scale_inv).to(out_dtype)


# ---- grouped -------------------------------------------------------------------------------------

def _check_offsets_layout(offsets: torch.Tensor, ref: torch.Tensor, what: str) -> int:
    """Validate the dtype, device and shape of (G+1,) int64 element offsets (no device-to-host copy);
    returns G."""
    if not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int64:
        got = _dtype_name(offsets.dtype) if isinstance(offsets, torch.Tensor) else type(offsets).__name__
        raise TypeError(f"{what}: offsets must be an int64 tensor, got {got}")
    if offsets.device != ref.device:
        raise ValueError(f"{what}: offsets are on {offsets.device} but the data is on {ref.device}")
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"{what}: offsets must be 1-D with G+1 >= 1 entries, got shape {tuple(offsets.shape)}")
    return offsets.numel() - 1


def _check_offsets(offsets: torch.Tensor, numel: int, ref: torch.Tensor, what: str) -> int:
    """Validate (G+1,) int64 element offsets, values included; returns G."""
    g = _check_offsets_layout(offsets, ref, what)
    o = offsets.cpu()
    if int(o[0]) != 0:
        raise ValueError(f"{what}: offsets[0] must be 0, got {int(o[0])}")
    if o.numel() > 1 and bool((o[1:] < o[:-1]).any()):
        i = int(torch.nonzero(o[1:] < o[:-1])[0])
        raise ValueError(f"{what}: offsets must be non-decreasing; offsets[{i + 1}]={int(o[i + 1])} < "
                         f"offsets[{i}]={int(o[i])}")
    if int(o[-1]) != numel:
        raise ValueError(f"{what}: offsets[-1] must equal the number of elements {numel}, got {int(o[-1])}")
    return g


def _member_ids(offsets: torch.Tensor, numel: int) -> torch.Tensor:
    """Member index of every element of the flat buffer (int64, length numel)."""
    counts = (offsets[1:] - offsets[:-1])
    g = torch.arange(counts.numel(), device=offsets.device)
    return torch.repeat_interleave(g, counts, output_size=numel)


def _check_grouped_buffer(x: torch.Tensor, offsets: torch.Tensor, what: str, offset_values: bool) -> int:
    """A grouped op's buffer and offsets; returns G. ``offset_values=False`` leaves out the offsets'
    values (a device-to-host copy): the CUDA wrapper checks those once per offsets tensor, cached."""
    if not x.is_contiguous():
        raise ValueError(f"{what}: the buffer must be contiguous (it is read as one flat array)")
    if offset_values:
        return _check_offsets(offsets, x.numel(), x, what)
    return _check_offsets_layout(offsets, x, what)


def check_grouped_amax_args(x: torch.Tensor, offsets: torch.Tensor, *, offset_values: bool = True) -> int:
    """fp8_grouped_amax's argument checks (shared with the CUDA wrapper); returns G."""
    what = "fp8_grouped_amax"
    check_float_input(x, what, dims=(1, 2))
    return _check_grouped_buffer(x, offsets, what, offset_values)


def check_grouped_quantize_args(x: torch.Tensor, offsets: torch.Tensor, scales: torch.Tensor, fmt: str, *,
                                offset_values: bool = True) -> tuple[str, int]:
    """fp8_grouped_quantize's argument checks (shared with the CUDA wrapper); returns (fmt, G)."""
    what = "fp8_grouped_quantize"
    check_float_input(x, what, dims=(1, 2))
    fmt = check_fmt(fmt, ("e4m3", "e5m2"), what)
    g = _check_grouped_buffer(x, offsets, what, offset_values)
    _check_fp32(scales, "scales", what, x, (g,))
    return fmt, g


def check_grouped_dequantize_args(data: torch.Tensor, offsets: torch.Tensor, scale_inv: torch.Tensor,
                                  out_dtype: torch.dtype, *, offset_values: bool = True) -> int:
    """fp8_grouped_dequantize's argument checks (shared with the CUDA wrapper); returns G."""
    what = "fp8_grouped_dequantize"
    _check_fp8_data(data, what)
    if data.dim() not in (1, 2):
        raise ValueError(f"{what}: data must be 1-D or 2-D, got shape {tuple(data.shape)}")
    g = _check_grouped_buffer(data, offsets, what, offset_values)
    _check_fp32(scale_inv, "scale_inv", what, data, (g,))
    check_out_dtype(out_dtype, what)
    return g


def _segment_amax(flat: torch.Tensor, ids: torch.Tensor, g: int) -> torch.Tensor:
    """Per-member max |x| of a flat FP32 buffer (NaN propagates per member; empty member -> 0)."""
    a = flat.abs()
    amax = torch.zeros(g, dtype=torch.float32, device=flat.device)
    amax.scatter_reduce_(0, ids, torch.nan_to_num(a, nan=0.0, posinf=float("inf")), reduce="amax", include_self=True)
    nan_count = torch.zeros(g, dtype=torch.float32, device=flat.device)
    nan_count.index_add_(0, ids, torch.isnan(a).to(torch.float32))
    return torch.where(nan_count > 0, torch.full_like(amax, float("nan")), amax)


def fp8_grouped_amax(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per-member amax (G,) FP32 of a grouped buffer (the first pass of grouped current scaling);
    member i's entry equals :func:`fp8_amax` of that member alone."""
    g = check_grouped_amax_args(x, offsets)
    flat = x.reshape(-1).to(torch.float32)
    return _segment_amax(flat, _member_ids(offsets, flat.numel()), g)


def fp8_grouped_quantize(x: torch.Tensor, offsets: torch.Tensor, scales: torch.Tensor,
                         fmt: str) -> FP8GroupedQuantized:
    """Quantize G tensors stored back to back in one buffer, member i = flat elements
    [offsets[i], offsets[i+1]), each with its own scale. Per member, the bytes, amax and scale_inv are
    exactly those of :func:`fp8_quantize` on that member alone. Any G >= 0; empty members get amax 0."""
    fmt, g = check_grouped_quantize_args(x, offsets, scales, fmt)
    flat = x.reshape(-1).to(torch.float32)
    ids = _member_ids(offsets, flat.numel())
    data = formats.fp8_encode(flat * scales[ids], fmt).reshape(x.shape)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    scale_inv = one / scales
    amax = _segment_amax(flat, ids, g)
    return FP8GroupedQuantized(data=data, scale_inv=scale_inv, amax=amax)


def fp8_grouped_dequantize(data: torch.Tensor, offsets: torch.Tensor, scale_inv: torch.Tensor,
                           out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`fp8_grouped_quantize`: member i is ``out_dtype(RN(fp32(data) * scale_inv[i]))``."""
    check_grouped_dequantize_args(data, offsets, scale_inv, out_dtype)
    ids = _member_ids(offsets, data.numel())
    flat = formats.fp8_decode(data.reshape(-1))
    return (flat * scale_inv[ids]).to(out_dtype).reshape(data.shape)


# ---- multi-tensor (G separate tensors, one launch on CUDA) -----------------------------------------

def check_multi_inputs(xs: Sequence[torch.Tensor], what: str) -> None:
    """The inputs of the multi-tensor casts: a non-empty sequence of 2-D float tensors with the same
    number of columns, dtype and device (shared with the CUDA wrapper)."""
    if isinstance(xs, torch.Tensor) or not isinstance(xs, (list, tuple)):
        raise TypeError(f"{what}: xs must be a list or tuple of 2-D tensors (e.g. x.split(m_splits)), got "
                        f"{type(xs).__name__}")
    if len(xs) == 0:
        raise ValueError(f"{what}: xs is empty; pass at least one tensor (members may have 0 rows)")
    x0 = xs[0]
    for i, x in enumerate(xs):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what}: xs[{i}] must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{what}: xs[{i}] has dtype {_dtype_name(x.dtype)}; allowed: float32, float16, bfloat16")
        if x.dim() != 2:
            raise ValueError(f"{what}: xs[{i}] must be 2-D (rows, cols), got shape {tuple(x.shape)}")
        if i == 0:
            continue
        if x.dtype != x0.dtype:
            raise TypeError(f"{what}: all members must have one dtype; xs[{i}] is {_dtype_name(x.dtype)} but xs[0] "
                            f"is {_dtype_name(x0.dtype)}")
        if x.shape[1] != x0.shape[1]:
            raise ValueError(f"{what}: all members must have the same number of columns; xs[{i}] has "
                             f"{x.shape[1]} but xs[0] has {x0.shape[1]}")
        if x.device != x0.device:
            raise ValueError(f"{what}: all members must be on one device; xs[{i}] is on {x.device} but xs[0] is on "
                             f"{x0.device}")


def check_multi_quantize_args(xs: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], fmt: str, rowwise: bool,
                              columnwise: bool) -> str:
    """fp8_multi_quantize's argument checks (shared with the CUDA wrapper); returns the normalised fmt."""
    what = "fp8_multi_quantize"
    check_multi_inputs(xs, what)
    fmt = check_fmt(fmt, ("e4m3", "e5m2"), what)
    if isinstance(scales, torch.Tensor) or not isinstance(scales, (list, tuple)):
        raise TypeError(f"{what}: scales must be a list or tuple of FP32 scalar tensors (one per member), got "
                        f"{type(scales).__name__}")
    if len(scales) != len(xs):
        raise ValueError(f"{what}: {len(xs)} members but {len(scales)} scales; pass one scale per member")
    dev = xs[0].device
    for i, s in enumerate(scales):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"{what}: scales[{i}] must be an FP32 tensor, got {type(s).__name__}")
        if s.dtype != torch.float32:
            raise TypeError(f"{what}: scales[{i}] must be float32, got {_dtype_name(s.dtype)}")
        if s.numel() != 1:
            raise ValueError(f"{what}: scales[{i}] must be a 0-dim or 1-element tensor, got shape {tuple(s.shape)}")
        if s.device != dev:
            raise ValueError(f"{what}: scales[{i}] is on {s.device} but the data is on {dev}; they must be on the "
                             "same device")
    _check_copies(rowwise, columnwise, what)
    return fmt


def check_multi_current_args(xs: Sequence[torch.Tensor], fmt: str, amax_epsilon: float, rowwise: bool,
                             columnwise: bool) -> str:
    """fp8_multi_current_scaling_quantize's argument checks (shared with the CUDA wrapper); returns the fmt."""
    what = "fp8_multi_current_scaling_quantize"
    check_multi_inputs(xs, what)
    return _check_current_options(fmt, amax_epsilon, rowwise, columnwise, what)


def _assemble_multi(parts: list, xs: Sequence[torch.Tensor], rowwise: bool, columnwise: bool) -> FP8MultiQuantized:
    """Per-member FP8Quantized results -> FP8MultiQuantized with the one-buffer layout of the kernel."""
    rows = [x.shape[0] for x in xs]
    cols = xs[0].shape[1]
    data: list = [None] * len(xs)
    data_t: list = [None] * len(xs)
    if rowwise:
        data = list(torch.cat([q.data for q in parts], 0).split(rows))
    if columnwise:
        flat = torch.cat([q.data_t.reshape(-1) for q in parts])
        data_t = [v.view(cols, r) for v, r in zip(flat.split([r * cols for r in rows]), rows)]
    return FP8MultiQuantized(data=data, data_t=data_t,
                             scale_inv=torch.stack([q.scale_inv.reshape(()) for q in parts]),
                             amax=torch.stack([q.amax.reshape(()) for q in parts]),
                             scale=torch.stack([q.scale.reshape(()) for q in parts]))


def fp8_multi_quantize(xs: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], fmt: str, *,
                       rowwise: bool = True, columnwise: bool = False) -> FP8MultiQuantized:
    """Quantize G separate 2-D tensors (same cols, dtype, device; any rows, 0 included), member g with its
    own scale ``scales[g]`` (FP32, 0-dim or 1 element). Member g's bytes, scale_inv, amax are exactly
    :func:`fp8_quantize` of ``xs[g]`` alone; the outputs use the layout of :class:`FP8MultiQuantized`."""
    fmt = check_multi_quantize_args(xs, scales, fmt, rowwise, columnwise)
    parts = [_quantize_with_scale(x, s.reshape(()), fmt, rowwise, columnwise) for x, s in zip(xs, scales)]
    return _assemble_multi(parts, xs, rowwise, columnwise)


def fp8_multi_current_scaling_quantize(xs: Sequence[torch.Tensor], fmt: str, *, use_power_2_scales: bool = False,
                                       amax_epsilon: float = 0.0, rowwise: bool = True,
                                       columnwise: bool = False) -> FP8MultiQuantized:
    """Current scaling of G separate 2-D tensors: member g is exactly
    :func:`fp8_current_scaling_quantize` of ``xs[g]`` alone (its own amax and scale)."""
    fmt = check_multi_current_args(xs, fmt, amax_epsilon, rowwise, columnwise)
    parts = [fp8_current_scaling_quantize(x, fmt, use_power_2_scales=use_power_2_scales, amax_epsilon=amax_epsilon,
                                          rowwise=rowwise, columnwise=columnwise) for x in xs]
    return _assemble_multi(parts, xs, rowwise, columnwise)


# ---- bias gradient ------------------------------------------------------------------------------

#: the summation order of :func:`bias_grad`: rows in tiles of 64, each tile as four segments of 16 rows
BIAS_GRAD_TILE_ROWS = 64
BIAS_GRAD_SEGMENT_ROWS = 16


def check_bias_grad_args(x: torch.Tensor, out_dtype: torch.dtype) -> None:
    """bias_grad's argument check (shared with the CUDA wrapper)."""
    check_float_input(x, "bias_grad")
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"bias_grad: out_dtype must be float32, float16 or bfloat16, got {out_dtype}")


def bias_grad(x: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The column sums of a 2-D ``x`` (M, N) (the bias gradient of a Linear whose grad_output is ``x``) in
    a fixed order, so a kernel that fuses them into a cast can reproduce the bits:

    * rows past M up to a multiple of 64 count as +0.0; every add is FP32, round to nearest even;
    * per 64-row tile t and column n: ``S_q`` = the sequential sum of rows 16q .. 16q + 15 (q = 0..3,
      starting from row 16q's value), ``p[t][n] = ((S_0 + S_1) + S_2) + S_3``;
    * ``db[n] = (((p[0][n] + p[1][n]) + p[2][n]) + ...)`` over the tiles in order (0 when M == 0);
    * rounded once to ``out_dtype``.

    FP32 accumulation from the input's own values (no rounded copy of x), as ``x.sum(0, dtype=float32)``;
    the order differs from torch's reduction, so the last bits may differ from it. NaN/Inf propagate."""
    check_bias_grad_args(x, out_dtype)
    m, n = x.shape
    tiles = -(-m // BIAS_GRAD_TILE_ROWS)
    if tiles == 0 or n == 0:
        return torch.zeros(n, dtype=out_dtype, device=x.device)
    f = x.to(torch.float32)
    pad = tiles * BIAS_GRAD_TILE_ROWS - m
    if pad:
        f = torch.cat([f, f.new_zeros(pad, n)])
    seg = BIAS_GRAD_SEGMENT_ROWS
    f = f.view(tiles, BIAS_GRAD_TILE_ROWS // seg, seg, n)
    s = f[:, :, 0]
    for j in range(1, seg):
        s = s + f[:, :, j]
    p = ((s[:, 0] + s[:, 1]) + s[:, 2]) + s[:, 3]
    acc = p[0]
    for t in range(1, tiles):
        acc = acc + p[t]
    return acc.to(out_dtype)


# Ops only (the dispatcher wraps every name here); the result types are imported from this module.
__all__ = [
    "bias_grad",
    "fp8_amax",
    "fp8_current_scaling_quantize",
    "fp8_dequantize",
    "fp8_grouped_amax",
    "fp8_grouped_dequantize",
    "fp8_grouped_quantize",
    "fp8_multi_current_scaling_quantize",
    "fp8_multi_quantize",
    "fp8_quantize",
]
