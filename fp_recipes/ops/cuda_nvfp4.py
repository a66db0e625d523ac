"""CUDA implementations of the NVFP4 ops: the ``fp_recipes._C`` kernels as ``torch.library`` custom ops.

Each public function here has the exact signature and result type of its reference twin in
:mod:`fp_recipes.ops.ref_nvfp4` and reproduces its bytes (data, scales, amaxes); it is registered
with :func:`fp_recipes.ops.backend.register_cuda_impl` so that ``fp_recipes.ops.nvfp4_quantize(x)``
runs it for CUDA tensors. The custom ops (namespace ``fp_recipes``) have fake (meta) kernels, so
``torch.compile(fullgraph=True)`` traces through them.

Why the split between the public wrapper and the custom op: the op takes only what a schema can hold
(a 64-bit seed travels as two 32-bit halves, absent outputs come back as empty tensors), while the
wrapper validates with the reference's own messages and rebuilds the ``NVFP4Quantized`` tuple.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import backend
from .ref_nvfp4 import (BLOCK, NVFP4Quantized, _check_options, _check_x,
                        check_nvfp4_dequantize_args)

__all__ = ["nvfp4_amax", "nvfp4_row_amax", "nvfp4_quantize", "nvfp4_dequantize"]

# fp_recipes::DType codes (csrc/common.h).
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_FOS_OFF, _FOS_STRICT, _FOS_FAST = 0, 1, 2
_MASK32 = 0xFFFFFFFF


def _ext():
    ext = backend.extension()
    if ext is None:
        raise RuntimeError(f"fp_recipes: the CUDA extension is not available ({backend.extension_error()})")
    return ext


def _launch_ctx(x: torch.Tensor) -> tuple[int, int]:
    """(stream handle, device index) of the current torch stream on x's device."""
    return backend.current_stream(x.device), x.device.index


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


def _require_cuda(x: torch.Tensor, what: str) -> None:
    if not x.is_cuda:
        raise ValueError(f"{what}: the CUDA kernel needs a CUDA tensor, got one on {x.device}")


def _require_contiguous(x: torch.Tensor, what: str) -> None:
    if not x.is_contiguous():
        raise ValueError(f"{what}: the CUDA kernel needs a contiguous (row-major) tensor; got strides "
                         f"{tuple(x.stride())} for shape {tuple(x.shape)} (call .contiguous() first)")


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """Kernels load 16 bytes at a time: a tensor whose storage offset breaks the alignment is copied
    (inside the custom ops, where tensors are real: data_ptr() does not trace)."""
    return x if x.numel() == 0 or x.data_ptr() % 16 == 0 else x.clone()


_EMPTY_SHAPE = (0,)


def _empty_u8(device: torch.device) -> torch.Tensor:
    return torch.empty(_EMPTY_SHAPE, dtype=torch.uint8, device=device)


def _empty_f32(device: torch.device) -> torch.Tensor:
    return torch.empty(_EMPTY_SHAPE, dtype=torch.float32, device=device)


def _empty_e4m3(device: torch.device) -> torch.Tensor:
    return torch.empty(_EMPTY_SHAPE, dtype=torch.float8_e4m3fn, device=device)


# ---- custom ops --------------------------------------------------------------------------------

@torch.library.custom_op("fp_recipes::nvfp4_amax", mutates_args=())
def _amax_op(x: torch.Tensor) -> torch.Tensor:
    _require_cuda(x, "nvfp4_amax")
    _require_contiguous(x, "nvfp4_amax")
    x = _aligned(x)
    out = torch.empty((), dtype=torch.float32, device=x.device)
    m, n = x.shape
    stream, dev = _launch_ctx(x)
    _ext().nvfp4_amax(_ptr(x), _DTYPE_CODES[x.dtype], m, n, out.data_ptr(), 0, stream, dev)
    return out


@_amax_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("fp_recipes::nvfp4_row_amax", mutates_args=())
def _row_amax_op(x: torch.Tensor) -> torch.Tensor:
    _require_cuda(x, "nvfp4_row_amax")
    _require_contiguous(x, "nvfp4_row_amax")
    x = _aligned(x)
    m, n = x.shape
    out = torch.empty((m,), dtype=torch.float32, device=x.device)
    stream, dev = _launch_ctx(x)
    _ext().nvfp4_row_amax(_ptr(x), _DTYPE_CODES[x.dtype], m, n, _ptr(out), 0, stream, dev)
    return out


@_row_amax_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0],), dtype=torch.float32)


def _output_shapes(m: int, n: int, rowwise: bool, columnwise: bool, row_scaled: bool):
    """Shapes of (data, scale, amax, data_t, scale_t, amax_t); absent outputs are (0,)."""
    none = _EMPTY_SHAPE
    return (
        (m, n // 2) if rowwise else none,
        (m, n // BLOCK) if rowwise else none,
        ((m,) if row_scaled else ()) if rowwise else none,
        (n, m // 2) if columnwise else none,
        (n, m // BLOCK) if columnwise else none,
        () if columnwise else none,
    )


@torch.library.custom_op("fp_recipes::nvfp4_quantize", mutates_args=())
def _quantize_op(x: torch.Tensor, amax: Optional[torch.Tensor], rowwise: bool, columnwise: bool,
                 block_2d: bool, row_scaled: bool, four_over_six: bool, e4m3_max: int, mse: bool,
                 err_fast_math: bool, rht: bool, stochastic_rounding: bool, seed_lo: int, seed_hi: int,
                 offset_lo: int, offset_hi: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    what = "nvfp4_quantize"
    _require_cuda(x, what)
    _require_contiguous(x, what)
    x = _aligned(x)
    m, n = x.shape
    dev_t = x.device
    stream, dev = _launch_ctx(x)
    ext = _ext()
    code = _DTYPE_CODES[x.dtype]

    # ---- amaxes: the rowwise (global or per-row) amax, and the columnwise one (post-RHT when rht)
    row_am: Optional[torch.Tensor] = None  # (M,) when row_scaled
    g_am: Optional[torch.Tensor] = None  # 0-dim per-tensor amax of x
    t_am: Optional[torch.Tensor] = None  # 0-dim columnwise amax
    if row_scaled:
        if amax is not None:
            row_am = amax.reshape(m).to(torch.float32).contiguous().clone()
            if columnwise:
                t_am = row_am.amax() if m else torch.zeros((), dtype=torch.float32, device=dev_t)
        else:
            row_am = torch.empty((m,), dtype=torch.float32, device=dev_t)
            if columnwise:
                t_am = torch.empty((), dtype=torch.float32, device=dev_t)
            ext.nvfp4_row_amax(_ptr(x), code, m, n, _ptr(row_am), _ptr(t_am), stream, dev)
    else:
        need_g = rowwise or block_2d or (columnwise and not rht)
        if amax is not None:
            g_am = amax.reshape(()).to(torch.float32).clone()
            if rht:
                t_am = torch.empty((), dtype=torch.float32, device=dev_t)
                ext.nvfp4_amax(_ptr(x), code, m, n, 0, t_am.data_ptr(), stream, dev)
        else:
            g_am = torch.empty((), dtype=torch.float32, device=dev_t) if need_g else None
            t_am = torch.empty((), dtype=torch.float32, device=dev_t) if rht else None
            ext.nvfp4_amax(_ptr(x), code, m, n, 0 if g_am is None else g_am.data_ptr(),
                           0 if t_am is None else t_am.data_ptr(), stream, dev)
        if columnwise and not rht:
            t_am = g_am.clone() if rowwise else g_am

    shapes = _output_shapes(m, n, rowwise, columnwise, row_scaled)
    data = torch.empty(shapes[0], dtype=torch.uint8, device=dev_t)
    scale = torch.empty(shapes[1], dtype=torch.float8_e4m3fn, device=dev_t)
    data_t = torch.empty(shapes[3], dtype=torch.uint8, device=dev_t)
    scale_t = torch.empty(shapes[4], dtype=torch.float8_e4m3fn, device=dev_t)
    rowwise_amax = row_am if row_scaled else g_am
    fos = _FOS_OFF if not four_over_six else (_FOS_FAST if err_fast_math else _FOS_STRICT)
    if m * n:
        ext.nvfp4_quantize(
            _ptr(x), code, m, n,
            _ptr(data) if rowwise else 0, _ptr(scale) if rowwise else 0,
            _ptr(rowwise_amax) if (rowwise or block_2d) else 0, row_scaled,
            _ptr(data_t) if columnwise else 0, _ptr(scale_t) if columnwise else 0,
            _ptr(t_am) if columnwise else 0,
            rht, block_2d, fos, mse, float(e4m3_max), stochastic_rounding,
            (seed_hi << 32) | seed_lo, (offset_hi << 32) | offset_lo, stream, dev)
    out_amax = rowwise_amax if rowwise else _empty_f32(dev_t)
    out_amax_t = t_am if columnwise else _empty_f32(dev_t)
    if rowwise and columnwise and out_amax_t is out_amax:
        out_amax_t = out_amax_t.clone()
    return data, scale, out_amax, data_t, scale_t, out_amax_t


@_quantize_op.register_fake
def _(x, amax, rowwise, columnwise, block_2d, row_scaled, four_over_six, e4m3_max, mse, err_fast_math,
      rht, stochastic_rounding, seed_lo, seed_hi, offset_lo, offset_hi):
    m, n = x.shape
    shapes = _output_shapes(m, n, rowwise, columnwise, row_scaled)
    dtypes = (torch.uint8, torch.float8_e4m3fn, torch.float32) * 2
    return tuple(x.new_empty(s, dtype=d) for s, d in zip(shapes, dtypes))


@torch.library.custom_op("fp_recipes::nvfp4_dequantize", mutates_args=())
def _dequantize_op(data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, e4m3_max: int,
                   row_scaled: bool, out_dtype: torch.dtype) -> torch.Tensor:
    what = "nvfp4_dequantize"
    for name, t in (("data", data), ("scale", scale), ("amax", amax)):
        _require_cuda(t, f"{what} ({name})")
        _require_contiguous(t, f"{what} ({name})")
    rows, half = data.shape
    out = torch.empty((rows, half * 2), dtype=out_dtype, device=data.device)
    if out.numel():
        stream, dev = _launch_ctx(data)
        _ext().nvfp4_dequantize(_ptr(data), _ptr(scale), _ptr(amax), row_scaled, rows, half * 2,
                                float(e4m3_max), _ptr(out), _DTYPE_CODES[out_dtype], stream, dev)
    return out


@_dequantize_op.register_fake
def _(data, scale, amax, e4m3_max, row_scaled, out_dtype):
    rows, half = data.shape
    return data.new_empty((rows, half * 2), dtype=out_dtype)


# ---- public implementations (same signatures as the reference twins) ---------------------------

@backend.register_cuda_impl("nvfp4_amax")
def nvfp4_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as FP32 0-dim (NaN anywhere -> NaN); see ref_nvfp4.nvfp4_amax."""
    _check_x(x, "nvfp4_amax")
    _require_cuda(x, "nvfp4_amax")
    return _amax_op(x.contiguous())


@backend.register_cuda_impl("nvfp4_row_amax")
def nvfp4_row_amax(x: torch.Tensor) -> torch.Tensor:
    """Per-row max |x| as FP32 (M,); see ref_nvfp4.nvfp4_row_amax."""
    _check_x(x, "nvfp4_row_amax")
    _require_cuda(x, "nvfp4_row_amax")
    return _row_amax_op(x.contiguous())


@backend.register_cuda_impl("nvfp4_quantize")
def nvfp4_quantize(x: torch.Tensor, *, amax: Optional[torch.Tensor] = None, rowwise: bool = True,
                   columnwise: bool = False, block_2d: bool = False, row_scaled: bool = False,
                   four_over_six: bool = False, e4m3_max: int = 448, err_mode: str = "MAE",
                   err_fast_math: bool = False, rht: bool = False, stochastic_rounding: bool = False,
                   seed: int = 0, offset: int = 0) -> NVFP4Quantized:
    """The CUDA twin of ref_nvfp4.nvfp4_quantize: same arguments, same checks, same bytes."""
    _check_options(x, amax, rowwise, columnwise, block_2d, row_scaled, four_over_six, e4m3_max, err_mode,
                   rht, stochastic_rounding, seed, offset)
    _require_cuda(x, "nvfp4_quantize")
    if amax is not None:
        amax = amax.contiguous()
    res = _quantize_op(x.contiguous(), amax, bool(rowwise), bool(columnwise), bool(block_2d),
                       bool(row_scaled), bool(four_over_six), int(e4m3_max), err_mode == "MSE",
                       bool(err_fast_math), bool(rht), bool(stochastic_rounding), seed & _MASK32, seed >> 32,
                       offset & _MASK32, offset >> 32)
    data, scale, out_amax, data_t, scale_t, amax_t = res
    if not rowwise:
        data = scale = out_amax = None
    if not columnwise:
        data_t = scale_t = amax_t = None
    return NVFP4Quantized(data, scale, out_amax, data_t, scale_t, amax_t)


@backend.register_cuda_impl("nvfp4_dequantize")
def nvfp4_dequantize(data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, *, e4m3_max: int = 448,
                     row_scaled: bool = False, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The CUDA twin of ref_nvfp4.nvfp4_dequantize."""
    what = "nvfp4_dequantize"
    check_nvfp4_dequantize_args(data, scale, amax, e4m3_max, row_scaled, out_dtype)
    _require_cuda(data, what)
    return _dequantize_op(data.contiguous(), scale.contiguous(), amax.contiguous(), int(e4m3_max),
                          bool(row_scaled), out_dtype)
