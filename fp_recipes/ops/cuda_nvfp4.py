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

import threading
import warnings
from typing import Callable, Dict, Optional, Tuple

import torch

from .. import _extension
from . import backend, ref_nvfp4, workspace
from .op_library import define_op, register_fake
from .ref_nvfp4 import (BLOCK, NVFP4Quantized, _check_amax_override, _check_options, _check_static_options,
                        _check_x, _check_x_for_options, check_nvfp4_dequantize_args)

__all__ = ["nvfp4_amax", "nvfp4_row_amax", "nvfp4_quantize", "nvfp4_dequantize", "nvfp4_quantize_with_units",
           "e2m1_encoding"]

# fp_recipes::DType codes (csrc/common.h).
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_FOS_OFF, _FOS_STRICT, _FOS_FAST = 0, 1, 2
_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF


def _ext():
    ext = backend.extension()
    if ext is None:
        raise RuntimeError(f"fp_recipes: the CUDA extension is not available ({backend.extension_error()})")
    return ext


def _stream_of(device: torch.device) -> int:
    """The handle of ``device``'s current torch stream (a seam: benchmarks/host_linear_cpu.py stubs it)."""
    return backend.current_stream(device)


def _launch_ctx(x: torch.Tensor) -> tuple[int, int]:
    """(stream handle, device index) of the current torch stream on x's device."""
    dev = x.device
    return _stream_of(dev), dev.index


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

# Memset-free amax: the per-(device, stream) workspace every eager amax launch on a stream uses and leaves
# zeroed (shared with the FP8 casts; none inside a CUDA-graph capture: ops/workspace.py)
_AMAX_WS = workspace.AMAX_WS
_amax_ws = workspace.amax_ws


def _empty_u8(device: torch.device) -> torch.Tensor:
    return torch.empty(_EMPTY_SHAPE, dtype=torch.uint8, device=device)


def _empty_f32(device: torch.device) -> torch.Tensor:
    return torch.empty(_EMPTY_SHAPE, dtype=torch.float32, device=device)


def _empty_e4m3(device: torch.device) -> torch.Tensor:
    return torch.empty(_EMPTY_SHAPE, dtype=torch.float8_e4m3fn, device=device)


# ---- custom ops --------------------------------------------------------------------------------

def _amax_op_impl(x: torch.Tensor) -> torch.Tensor:
    _require_cuda(x, "nvfp4_amax")
    _require_contiguous(x, "nvfp4_amax")
    x = _aligned(x)
    out = torch.empty((), dtype=torch.float32, device=x.device)
    m, n = x.shape
    stream, dev = _launch_ctx(x)
    _ext().nvfp4_amax(_ptr(x), _DTYPE_CODES[x.dtype], m, n, out.data_ptr(), 0, stream, dev,
                      ws=_amax_ws(x.device, stream))
    return out


_amax_op = define_op("nvfp4_amax", _amax_op_impl)


@register_fake(_amax_op)
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((), dtype=torch.float32)


def _row_amax_op_impl(x: torch.Tensor) -> torch.Tensor:
    _require_cuda(x, "nvfp4_row_amax")
    _require_contiguous(x, "nvfp4_row_amax")
    x = _aligned(x)
    m, n = x.shape
    out = torch.empty((m,), dtype=torch.float32, device=x.device)
    stream, dev = _launch_ctx(x)
    _ext().nvfp4_row_amax(_ptr(x), _DTYPE_CODES[x.dtype], m, n, _ptr(out), 0, stream, dev,
                          ws=_amax_ws(x.device, stream))
    return out


_row_amax_op = define_op("nvfp4_row_amax", _row_amax_op_impl)


@register_fake(_row_amax_op)
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


def _quantize_impl(x: torch.Tensor, amax: Optional[torch.Tensor], rowwise: bool, columnwise: bool,
                   block_2d: bool, row_scaled: bool, four_over_six: bool, e4m3_max: int, mse: bool,
                   err_fast_math: bool, rht: bool, stochastic_rounding: bool, seed_lo: int, seed_hi: int,
                   offset_lo: int, offset_hi: int, share_amax: bool = False,
                   units: Optional[list] = None, checked: bool = False, rng_state: Optional[torch.Tensor] = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One quantization: the kernels (:func:`_quantize_kernels`), or the reference twin on a device where
    the first-use E2M1 self-check found neither kernel encoding equal to the contract (:func:`e2m1_encoding`).
    ``share_amax`` (eager calls only: a custom op may not return aliased outputs): when both copies use x's
    own per-tensor amax, return that one tensor for both instead of a copy (one launch fewer). ``units``
    (eager only): ``[unit_rowwise, unit_columnwise]`` flags in, replaced by the BF16 unit operands the
    quantize kernel wrote (or None) on return. ``checked``: the eager wrappers already made x a contiguous
    CUDA tensor (the custom op checks it here). ``rng_state`` (eager only): the device (seed, offset) pair the
    kernels read instead of the halves."""
    if rng_state is not None and stochastic_rounding and x.is_cuda and _e2m1_mode(x.device) == "reference":
        seed, offset = _rng_values(rng_state)
        seed_lo, seed_hi, offset_lo, offset_hi = seed & _MASK32, seed >> 32, offset & _MASK32, offset >> 32
        rng_state = None
    if amax is None and units is None and not share_amax and x.is_cuda and TRACED_OPS_PLANNED and rng_state is None:
        res = _op_launch_run(x, (rowwise, columnwise, block_2d, row_scaled, four_over_six, e4m3_max, mse,
                                 err_fast_math, rht, stochastic_rounding),
                             (seed_hi << 32) | seed_lo, (offset_hi << 32) | offset_lo)
        if res is not None:
            return res
    if x.is_cuda and _e2m1_mode(x.device) == "reference":
        if units is not None:
            units[:] = [None, None]
        return _quantize_reference(x, amax, rowwise, columnwise, block_2d, row_scaled, four_over_six, e4m3_max,
                                   mse, err_fast_math, rht, stochastic_rounding, seed_lo, seed_hi, offset_lo,
                                   offset_hi)
    return _quantize_kernels(x, amax, rowwise, columnwise, block_2d, row_scaled, four_over_six, e4m3_max, mse,
                             err_fast_math, rht, stochastic_rounding, seed_lo, seed_hi, offset_lo, offset_hi,
                             share_amax=share_amax, units=units, checked=checked, rng_state=rng_state)


#: the custom ops' implementations (what a torch.compile graph runs) take the eager casts' resolved launches
#: (:class:`_Launch`: one C++ call where fp_recipes._torch_ops is built), not :func:`_quantize_kernels`' Python
#: launches; False: the latter (an A/B of the host time; the bytes are the same)
TRACED_OPS_PLANNED = True

# _quantize_impl's flags -> the plan whose resolved launches the ops take (its launches keep their amaxes in separate
# allocations: a custom op's outputs may not share storage)
_OP_PLANS: Dict[tuple, "QuantizePlan"] = {}


def _op_launch_run(x: torch.Tensor, flags: tuple, seed: int, offset: int) -> Optional[tuple]:
    """The six outputs of a custom op's quantization of ``x`` (no amax given, no unit operands) through a
    resolved launch, each its own tensor (absent ones empty); None where :func:`_quantize_kernels` must run."""
    plan = _OP_PLANS.get(flags)
    if plan is None:
        rowwise, columnwise, block_2d, row_scaled, fos, e4m3_max, mse, fast, rht, sr = flags
        plan = _OP_PLANS[flags] = QuantizePlan(
            rowwise=rowwise, columnwise=columnwise, block_2d=block_2d, row_scaled=row_scaled, four_over_six=fos,
            e4m3_max=e4m3_max, err_mode="MSE" if mse else "MAE", err_fast_math=fast, rht=rht,
            stochastic_rounding=sr)
    launch = plan.launches.get((x.shape, x.dtype))
    if launch is None:
        if not plan.valid or not x.is_contiguous() or x.dim() != 2 or x.dtype not in _DTYPE_CODES:
            return None
        _check_x_for_options(x, plan.rowwise, plan.columnwise, plan.block_2d, plan.rht)
        launch = _new_launch(x, plan, separate_amaxes=True)
        if launch is None:
            return None
    elif not x.is_contiguous():
        return None
    res = launch.run(x, seed, offset)
    if res is None:
        return None
    data, scale, amax, data_t, scale_t, amax_t = res[:6]
    dev = x.device
    if amax is not None and amax_t is not None and amax_t.data_ptr() == amax.data_ptr():
        amax_t = amax_t.clone()  # (both copies scaled by x's amax: one tensor for both)
    return (_empty_u8(dev) if data is None else data, _empty_e4m3(dev) if scale is None else scale,
            _empty_f32(dev) if amax is None else amax, _empty_u8(dev) if data_t is None else data_t,
            _empty_e4m3(dev) if scale_t is None else scale_t, _empty_f32(dev) if amax_t is None else amax_t)


def _quantize_reference(x: torch.Tensor, amax: Optional[torch.Tensor], rowwise: bool, columnwise: bool,
                        block_2d: bool, row_scaled: bool, four_over_six: bool, e4m3_max: int, mse: bool,
                        err_fast_math: bool, rht: bool, stochastic_rounding: bool, seed_lo: int, seed_hi: int,
                        offset_lo: int, offset_hi: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference twin's result in the kernels' tuple form (absent outputs as empty tensors)."""
    q = ref_nvfp4.nvfp4_quantize(x, amax=amax, rowwise=rowwise, columnwise=columnwise, block_2d=block_2d,
                                 row_scaled=row_scaled, four_over_six=four_over_six, e4m3_max=e4m3_max,
                                 err_mode="MSE" if mse else "MAE", err_fast_math=err_fast_math, rht=rht,
                                 stochastic_rounding=stochastic_rounding, seed=(seed_hi << 32) | seed_lo,
                                 offset=(offset_hi << 32) | offset_lo)
    dev = x.device
    empties = (_empty_u8, _empty_e4m3, _empty_f32) * 2
    out = [t if t is not None else make(dev) for t, make in zip(q, empties)]
    out[2], out[5] = out[2].clone(), out[5].clone()  # never an alias of the amax argument or of each other
    return tuple(out)


def _quantize_kernels(x: torch.Tensor, amax: Optional[torch.Tensor], rowwise: bool, columnwise: bool,
                      block_2d: bool, row_scaled: bool, four_over_six: bool, e4m3_max: int, mse: bool,
                      err_fast_math: bool, rht: bool, stochastic_rounding: bool, seed_lo: int, seed_hi: int,
                      offset_lo: int, offset_hi: int, share_amax: bool = False,
                      units: Optional[list] = None, checked: bool = False, rng_state: Optional[torch.Tensor] = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The launches of one quantization (see :func:`_quantize_impl`)."""
    if not checked:
        what = "nvfp4_quantize"
        _require_cuda(x, what)
        _require_contiguous(x, what)
    x = _aligned(x)
    m, n = x.shape
    x_ptr = _ptr(x)
    dev_t = x.device
    stream, dev = _launch_ctx(x)
    ext = _ext()
    code = _DTYPE_CODES[x.dtype]
    ws = _amax_ws(dev_t, stream)

    # ---- amaxes: the rowwise (global or per-row) amax, and the columnwise one (post-RHT when rht)
    row_am: Optional[torch.Tensor] = None  # (M,) when row_scaled
    g_am: Optional[torch.Tensor] = None  # 0-dim per-tensor amax of x
    t_am: Optional[torch.Tensor] = None  # 0-dim columnwise amax
    fused_row_amax = False  # v7: the per-row amax computed by the quantize launch itself (one read of x)
    if row_scaled:
        if amax is None and rowwise and not columnwise and m * n and getattr(ext, "nvfp4_fused_row_amax", False):
            row_am = torch.empty((m,), dtype=torch.float32, device=dev_t)
            fused_row_amax = True
        elif amax is not None:
            row_am = amax.reshape(m).to(torch.float32).contiguous().clone()
            if columnwise:
                t_am = row_am.amax() if m else torch.zeros((), dtype=torch.float32, device=dev_t)
        else:
            row_am = torch.empty((m,), dtype=torch.float32, device=dev_t)
            if columnwise:
                t_am = torch.empty((), dtype=torch.float32, device=dev_t)
            ext.nvfp4_row_amax(x_ptr, code, m, n, _ptr(row_am), _ptr(t_am), stream, dev, ws)
    else:
        need_g = rowwise or block_2d or (columnwise and not rht)
        if amax is not None:
            g_am = amax.reshape(()).to(torch.float32).clone()
            if rht:
                t_am = torch.empty((), dtype=torch.float32, device=dev_t)
                ext.nvfp4_amax(x_ptr, code, m, n, 0, t_am.data_ptr(), stream, dev, ws)
        elif need_g and rht and share_amax:
            # Eager: both amaxes in one 8-byte buffer, which the launcher zeroes with one memset when it has no
            # workspace (views of one buffer: not allowed as a custom op's outputs).
            both = torch.empty((2,), dtype=torch.float32, device=dev_t)
            g_am, t_am = both[0], both[1]
            ext.nvfp4_amax(x_ptr, code, m, n, g_am.data_ptr(), t_am.data_ptr(), stream, dev, ws)
        else:
            g_am = torch.empty((), dtype=torch.float32, device=dev_t) if need_g else None
            t_am = torch.empty((), dtype=torch.float32, device=dev_t) if rht else None
            ext.nvfp4_amax(x_ptr, code, m, n, 0 if g_am is None else g_am.data_ptr(),
                           0 if t_am is None else t_am.data_ptr(), stream, dev, ws)
        if columnwise and not rht:
            t_am = g_am.clone() if rowwise and not share_amax else g_am

    shapes = _output_shapes(m, n, rowwise, columnwise, row_scaled)
    data = torch.empty(shapes[0], dtype=torch.uint8, device=dev_t)
    scale = torch.empty(shapes[1], dtype=torch.float8_e4m3fn, device=dev_t)
    data_t = torch.empty(shapes[3], dtype=torch.uint8, device=dev_t)
    scale_t = torch.empty(shapes[4], dtype=torch.float8_e4m3fn, device=dev_t)
    rowwise_amax = row_am if row_scaled else g_am
    fos = _FOS_OFF if not four_over_six else (_FOS_FAST if err_fast_math else _FOS_STRICT)
    unit = unit_t = None
    if units is not None:
        if units[0] and rowwise:
            unit = torch.empty((m, n), dtype=torch.bfloat16, device=dev_t)
        if units[1] and columnwise:
            unit_t = torch.empty((n, m), dtype=torch.bfloat16, device=dev_t)
        units[:] = [unit, unit_t]
    if m * n:
        # data, scale, data_t, scale_t: fresh allocations, whose data_ptr() is _ptr()'s (null when empty)
        ext.nvfp4_quantize(
            x_ptr, code, m, n,
            data.data_ptr() if rowwise else 0, scale.data_ptr() if rowwise else 0,
            _ptr(rowwise_amax) if (rowwise or block_2d) else 0, row_scaled,
            data_t.data_ptr() if columnwise else 0, scale_t.data_ptr() if columnwise else 0,
            _ptr(t_am) if columnwise else 0,
            rht, block_2d, fos, mse, float(e4m3_max), stochastic_rounding,
            (seed_hi << 32) | seed_lo, (offset_hi << 32) | offset_lo, stream, dev,
            0 if unit is None else unit.data_ptr(), 0 if unit_t is None else unit_t.data_ptr(),  # unit, unit_t
            *((_ptr(row_am),) if fused_row_amax else ()),  # row_amax_out (a binding without it: never passed)
            **({} if rng_state is None else {"rng_state": rng_state.data_ptr()}))
    out_amax = rowwise_amax if rowwise else _empty_f32(dev_t)
    out_amax_t = t_am if columnwise else _empty_f32(dev_t)
    if rowwise and columnwise and out_amax_t is out_amax and not share_amax:
        out_amax_t = out_amax_t.clone()
    return data, scale, out_amax, data_t, scale_t, out_amax_t


def _quantize_op_impl(x: torch.Tensor, amax: Optional[torch.Tensor], rowwise: bool, columnwise: bool,
                      block_2d: bool, row_scaled: bool, four_over_six: bool, e4m3_max: int, mse: bool,
                      err_fast_math: bool, rht: bool, stochastic_rounding: bool, seed_lo: int, seed_hi: int,
                      offset_lo: int, offset_hi: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _quantize_impl(x, amax, rowwise, columnwise, block_2d, row_scaled, four_over_six, e4m3_max, mse,
                          err_fast_math, rht, stochastic_rounding, seed_lo, seed_hi, offset_lo, offset_hi)


_quantize_op = define_op("nvfp4_quantize", _quantize_op_impl)


@register_fake(_quantize_op)
def _quantize_op_fake(x, amax, rowwise, columnwise, block_2d, row_scaled, four_over_six, e4m3_max, mse, err_fast_math,
      rht, stochastic_rounding, seed_lo, seed_hi, offset_lo, offset_hi):
    m, n = x.shape
    shapes = _output_shapes(m, n, rowwise, columnwise, row_scaled)
    dtypes = (torch.uint8, torch.float8_e4m3fn, torch.float32) * 2
    return tuple(x.new_empty(s, dtype=d) for s, d in zip(shapes, dtypes))


def _quantize_sr_state_op_impl(x: torch.Tensor, amax: Optional[torch.Tensor], rowwise: bool, columnwise: bool,
                               block_2d: bool, row_scaled: bool, four_over_six: bool, e4m3_max: int, mse: bool,
                               err_fast_math: bool, rht: bool, seed: torch.Tensor, offset: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                          torch.Tensor]:
    # the seed and counter are CPU tensors (checked by the wrapper): reading them never waits on a GPU
    s, o = int(seed) & _MASK64, int(offset) & _MASK64
    args = (x, amax, rowwise, columnwise, block_2d, row_scaled, four_over_six, e4m3_max, mse, err_fast_math, rht,
            True, s & _MASK32, s >> 32, o & _MASK32, o >> 32)
    return _quantize_impl(*args) if x.is_cuda else _quantize_reference(*args)


# cudagraph_unsafe: a CUDA graph would capture the counter read at capture time, and every replay would draw the
# same numbers; Inductor runs the op outside its captured partitions instead
_quantize_sr_state_op = define_op("nvfp4_quantize_sr_state", _quantize_sr_state_op_impl, cudagraph_unsafe=True)


def _refuse_under_cudagraphs() -> None:
    """A clear error instead of a crash: under Inductor's CUDA graphs (``mode="reduce-overhead"``) the backward's
    stochastically rounded casts read their counter from a CPU tensor the forward saved, and cudagraph trees hand
    the backward a tensor that is not the counter. On an H200 (torch 2.11, session 39) the counter's write-back
    crashed the process (a segmentation fault); moving the counter inside the op instead left the quantizer's
    counter unmoved, with the write going to memory that is not the counter's."""
    from torch._inductor import config as inductor_config

    if getattr(inductor_config.triton, "cudagraphs", False):
        raise RuntimeError(
            "NVFP4 stochastic rounding is not supported under torch.compile(mode=\"reduce-overhead\") (Inductor's "
            "CUDA graphs): the backward's casts read their Philox counter from a CPU tensor the forward saved, which "
            "CUDA-graph trees do not keep. Compile with mode=\"default\" or \"max-autotune-no-cudagraphs\", use "
            "NVFP4BlockScaling(disable_stochastic_rounding=True), or capture the eager model with "
            "fp_recipes.make_graphed_callables, which keeps the counter on the GPU (docs/cuda_graphs.md)")


@register_fake(_quantize_sr_state_op)
def _(x, amax, rowwise, columnwise, block_2d, row_scaled, four_over_six, e4m3_max, mse, err_fast_math, rht, seed,
      offset):
    _refuse_under_cudagraphs()
    return _quantize_op_fake(x, amax, rowwise, columnwise, block_2d, row_scaled, four_over_six, e4m3_max, mse,
                             err_fast_math, rht, True, 0, 0, 0, 0)


def _dequantize_op_impl(data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, e4m3_max: int,
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


_dequantize_op = define_op("nvfp4_dequantize", _dequantize_op_impl)


@register_fake(_dequantize_op)
def _(data, scale, amax, e4m3_max, row_scaled, out_dtype):
    rows, half = data.shape
    return data.new_empty((rows, half * 2), dtype=out_dtype)


# ---- first use on sm_100+: the hardware E2M1 conversion against the contract ---------------------
#
# The 100a (and 120a) cubins encode E2M1 with the hardware conversion cvt.rn.satfinite.e2m1x2.f32
# (csrc/formats.cuh); every other arch runs the software encoding. The contract (docs/nvfp4.md) fixes the
# bytes; the hardware path was compiled but never run in this project. So on the first quantization on a
# device of compute capability 10.0 or higher, a few crafted quantizations (RN ties, saturation, zeros,
# NaN/Inf, 1-D, 2-D, RHT, row-scaled, FP32/BF16/FP16 inputs) run through the kernels and are compared
# byte for byte with the reference twin. On a mismatch (or an error) the kernels are switched to the
# software encoding (``nvfp4_set_software_e2m1``, a per-device flag in constant memory) and checked again;
# if that still fails, quantizations on that device run the reference twin. Each fallback warns once.

E2M1_HW_MIN_CAPABILITY = (10, 0)
_e2m1_lock = threading.RLock()
_E2M1: Dict[int, str] = {}  # device index -> "hardware" | "software" | "reference"
_e2m1_warned: set = set()


def _capability(index: int) -> tuple:
    """The device's compute capability (a seam: tests replace it)."""
    return tuple(torch.cuda.get_device_capability(index))


def e2m1_encoding(device: torch.device) -> str:
    """How NVFP4 quantizations on CUDA ``device`` encode E2M1: ``hardware`` (sm_100-family conversion,
    checked on first use), ``software`` (every other arch, or the fallback), or ``reference`` (the
    pure-torch twin runs: neither kernel encoding passed the check). Decided on first use."""
    return _e2m1_mode(device)


def _e2m1_mode(device: torch.device) -> str:
    index = device.index if device.index is not None else torch.cuda.current_device()
    mode = _E2M1.get(index)
    if mode is None:
        mode = _decide_e2m1(index, torch.device("cuda", index))
    return mode


def _warn_e2m1(key: str, message: str) -> None:
    if key not in _e2m1_warned:
        _e2m1_warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=5)


def _e2m1_cases() -> list:
    """(name, x on the CPU, quantize options) for the first-use check."""
    g = torch.Generator().manual_seed(1000)
    # RN ties: with E = 256 and every 1x16 block's max 1.5, S_enc = 1024 and each block's scale is 256,
    # so enc = 4 exactly and the elements land on the midpoints of the E2M1 grid (0.25 .. 5).
    ties = torch.tensor([1.5, 0.0625, 0.1875, 0.3125, 0.4375, 0.625, 0.875, 1.25,
                         -0.0625, -0.1875, -0.3125, -0.4375, -0.625, -0.875, -1.25, -0.0])
    tie_x = ties.repeat(32, 4).bfloat16()
    rand = (torch.randn(64, 128, generator=g) * 3).bfloat16()
    rand[3, :16] = 0.0
    rand[5, 7] = 300.0  # one large value: small blocks' scales underflow, their codes saturate
    special = torch.randn(32, 64, generator=g) * 2
    special[1, 3], special[2, 9], special[4, 0] = float("inf"), float("-inf"), float("nan")
    special[6, :16] = 1e-30
    return [
        ("RN ties, E=256", tie_x, {"rowwise": True, "columnwise": False, "e4m3_max": 256}),
        ("1-D rowwise + columnwise", rand, {"rowwise": True, "columnwise": True}),
        ("2-D tiles", rand, {"rowwise": True, "columnwise": True, "block_2d": True}),
        ("RHT columnwise", rand, {"rowwise": True, "columnwise": True, "rht": True}),
        ("row-scaled, NaN/Inf rows, FP32", special, {"rowwise": True, "row_scaled": True}),
        ("FP16 input", rand.half(), {"rowwise": True, "columnwise": True}),
    ]


def _same(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    """Equal bytes (codes, scales) or equal values with NaN positions equal (amaxes)."""
    if a is None or b is None:
        return a is None and b is None
    a, b = a.cpu(), b.cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype in (torch.uint8, torch.float8_e4m3fn):
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def _kernel_quantize(x: torch.Tensor, **opts) -> NVFP4Quantized:
    """The kernels only (no mode check): what the first-use check runs."""
    o = dict(rowwise=True, columnwise=False, block_2d=False, row_scaled=False, four_over_six=False, e4m3_max=448,
             mse=False, err_fast_math=False, rht=False, stochastic_rounding=False)
    o.update(opts)
    res = _quantize_kernels(x.contiguous(), None, o["rowwise"], o["columnwise"], o["block_2d"], o["row_scaled"],
                            o["four_over_six"], o["e4m3_max"], o["mse"], o["err_fast_math"], o["rht"],
                            o["stochastic_rounding"], 0, 0, 0, 0)
    data, scale, am, data_t, scale_t, am_t = res
    if not o["rowwise"]:
        data = scale = am = None
    if not o["columnwise"]:
        data_t = scale_t = am_t = None
    return NVFP4Quantized(data, scale, am, data_t, scale_t, am_t)


def e2m1_self_check(device: torch.device, quantize: Callable[..., NVFP4Quantized]) -> Tuple[bool, str]:
    """``quantize`` (the kernels) against the reference twin, byte for byte: (passed, what happened)."""
    try:
        for name, x, opts in _e2m1_cases():
            got = quantize(x.to(device), **opts)
            want = ref_nvfp4.nvfp4_quantize(x, **opts)
            for field in NVFP4Quantized._fields:
                if not _same(getattr(got, field), getattr(want, field)):
                    return False, f"{name}: {field} differs from the reference twin"
        return True, "the kernels' bytes equal the reference twin's"
    except Exception as exc:  # noqa: BLE001 - any failure means: not this encoding
        first = (str(exc).strip().splitlines() or [""])[0]
        return False, f"raised {type(exc).__name__}: {first}"


def _set_software_e2m1(index: int, on: bool) -> bool:
    """Switch the kernels on device ``index`` to the software E2M1 encoding; False when this build of the
    extension has no switch."""
    ext = backend.extension()
    if ext is None or not hasattr(ext, "nvfp4_set_software_e2m1"):
        return False
    try:
        torch.cuda.synchronize(index)
        ext.nvfp4_set_software_e2m1(bool(on), index)
    except RuntimeError:  # e.g. no cubin for this device holds the switch
        return False
    return True


def _decide_e2m1(index: int, device: torch.device, *, quantize: Optional[Callable[..., NVFP4Quantized]] = None,
                 set_software: Optional[Callable[[int, bool], bool]] = None) -> str:
    """The E2M1 mode of device ``index`` (cached): see the section comment. ``quantize`` and
    ``set_software`` default to the real kernels and switch (tests pass doubles)."""
    cap = _capability(index)
    if tuple(cap) < E2M1_HW_MIN_CAPABILITY:
        _E2M1[index] = "software"  # no hardware conversion in the cubin this device runs
        return "software"
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        _warn_e2m1(f"capture:{index}", f"fp_recipes: the first NVFP4 quantization on cuda:{index} "
                   f"(sm_{cap[0]}{cap[1]}) is inside a CUDA graph capture, where the E2M1 self-check cannot "
                   "synchronise; this capture runs the kernels unchecked (the check runs at the next eager "
                   "quantization)")
        return "hardware"
    quantize = quantize or _kernel_quantize
    set_software = set_software or _set_software_e2m1
    arch = f"sm_{cap[0]}{cap[1]}"
    with _e2m1_lock:
        if index in _E2M1:
            return _E2M1[index]
        ok, detail = e2m1_self_check(device, quantize)
        if ok:
            mode = "hardware"
        elif set_software(index, True):
            ok_sw, detail_sw = e2m1_self_check(device, quantize)
            if ok_sw:
                mode = "software"
                _warn_e2m1(f"sw:{index}", f"fp_recipes: the NVFP4 quantize kernels' hardware E2M1 conversion "
                           f"failed the first-use self-check on cuda:{index} ({arch}): {detail}; they use the "
                           "software E2M1 encoding on this device instead (the same bytes by contract)")
            else:
                set_software(index, False)
                mode = "reference"
                _warn_e2m1(f"ref:{index}", f"fp_recipes: the NVFP4 quantize kernels failed the first-use "
                           f"self-check on cuda:{index} ({arch}) with the hardware E2M1 conversion ({detail}) "
                           f"and with the software one ({detail_sw}); NVFP4 quantizations on this device run "
                           "the pure-torch reference (exact, slow)")
        else:
            mode = "reference"
            _warn_e2m1(f"ref:{index}", f"fp_recipes: the NVFP4 quantize kernels failed the first-use self-check "
                       f"on cuda:{index} ({arch}): {detail}, and this build has no software-E2M1 switch; NVFP4 "
                       "quantizations on this device run the pure-torch reference (exact, slow)")
        _E2M1[index] = mode
        return mode


def _reset_e2m1() -> None:
    """Forget the decisions and warnings (tests)."""
    with _e2m1_lock:
        _E2M1.clear()
        _e2m1_warned.clear()


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


def _quantized(res: tuple, rowwise: bool, columnwise: bool) -> NVFP4Quantized:
    """The op's six tensors as the reference's result: the copies not asked for (empty tensors) as None."""
    data, scale, out_amax, data_t, scale_t, amax_t = res
    if not rowwise:
        data = scale = out_amax = None
    if not columnwise:
        data_t = scale_t = amax_t = None
    return NVFP4Quantized(data, scale, out_amax, data_t, scale_t, amax_t)


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
    args = (x.contiguous(), amax, bool(rowwise), bool(columnwise), bool(block_2d), bool(row_scaled),
            bool(four_over_six), int(e4m3_max), err_mode == "MSE", bool(err_fast_math), bool(rht),
            bool(stochastic_rounding), seed & _MASK32, seed >> 32, offset & _MASK32, offset >> 32)
    if torch.compiler.is_compiling():
        res = _quantize_op(*args)
    else:
        # Eager: the launches directly, without the custom op's dispatch (tens of microseconds of host
        # time per call on a training step's hot path); the same function, so the same bytes.
        res = _quantize_impl(*args, share_amax=True, checked=True)
    return _quantized(res, rowwise, columnwise)


def nvfp4_quantize_sr_from_state(x: torch.Tensor, *, seed: torch.Tensor, offset: torch.Tensor,
                                 amax: Optional[torch.Tensor] = None, rowwise: bool = True, columnwise: bool = False,
                                 block_2d: bool = False, row_scaled: bool = False, four_over_six: bool = False,
                                 e4m3_max: int = 448, err_mode: str = "MAE", err_fast_math: bool = False,
                                 rht: bool = False) -> NVFP4Quantized:
    """A stochastically rounded :func:`nvfp4_quantize` whose Philox seed and counter are CPU int64 0-dim tensors
    (their 64-bit patterns), read when the op runs: the form a graph traced by torch.compile holds, so that the
    counter is neither a constant of the graph nor the pure-torch twin's Philox (compiled into many kernels). The
    op runs the CUDA kernels on a CUDA tensor and the reference twin elsewhere (the same bytes). The op is tagged
    ``cudagraph_unsafe``: under ``mode="reduce-overhead"`` Inductor runs it between its CUDA graphs (graph partition)
    or graphs nothing, never a replay with the counter of the capture."""
    _check_options(x, amax, rowwise, columnwise, block_2d, row_scaled, four_over_six, e4m3_max, err_mode, rht,
                   True, seed, offset)
    for name, t in (("seed", seed), ("offset", offset)):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"nvfp4_quantize_sr_from_state: {name} must be a CPU int64 0-dim tensor (read without "
                             f"waiting on a GPU), got {where}")
    if amax is not None:
        amax = amax.contiguous()
    res = _quantize_sr_state_op(x.contiguous(), amax, bool(rowwise), bool(columnwise), bool(block_2d),
                                bool(row_scaled), bool(four_over_six), int(e4m3_max), err_mode == "MSE",
                                bool(err_fast_math), bool(rht), seed, offset)
    return _quantized(res, rowwise, columnwise)


def nvfp4_quantize_with_units(x: torch.Tensor, *, unit_rowwise: bool, unit_columnwise: bool,
                              amax: Optional[torch.Tensor] = None, rowwise: bool = True, columnwise: bool = False,
                              block_2d: bool = False, row_scaled: bool = False, four_over_six: bool = False,
                              e4m3_max: int = 448, err_mode: str = "MAE", err_fast_math: bool = False,
                              rht: bool = False, stochastic_rounding: bool = False, seed: int = 0, offset: int = 0
                              ) -> tuple[NVFP4Quantized, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """:func:`nvfp4_quantize` (same checks, same bytes) whose kernel also writes the emulated GEMM's BF16
    unit operands of the copies asked for: ``unit`` (M, N) = ``gemm.decode_nvfp4_unit(data, scale,
    bfloat16)`` and ``unit_t`` (N, M) the same of the columnwise copy, bit for bit, read from registers
    instead of a decode pass over the packed copy. Eager CUDA calls only (not traced by torch.compile).
    Returns ``(quantized, unit or None, unit_t or None)``."""
    _check_options(x, amax, rowwise, columnwise, block_2d, row_scaled, four_over_six, e4m3_max, err_mode,
                   rht, stochastic_rounding, seed, offset)
    _require_cuda(x, "nvfp4_quantize")
    if amax is not None:
        amax = amax.contiguous()
    units = [bool(unit_rowwise), bool(unit_columnwise)]
    res = _quantize_impl(x.contiguous(), amax, bool(rowwise), bool(columnwise), bool(block_2d), bool(row_scaled),
                         bool(four_over_six), int(e4m3_max), err_mode == "MSE", bool(err_fast_math), bool(rht),
                         bool(stochastic_rounding), seed & _MASK32, seed >> 32, offset & _MASK32, offset >> 32,
                         share_amax=True, units=units, checked=True)
    data, scale, out_amax, data_t, scale_t, amax_t = res
    if not rowwise:
        data = scale = out_amax = None
    if not columnwise:
        data_t = scale_t = amax_t = None
    return NVFP4Quantized(data, scale, out_amax, data_t, scale_t, amax_t), units[0], units[1]


class QuantizePlan:
    """One quantizer's options for :func:`nvfp4_quantize_planned`, checked and converted once (what
    :func:`nvfp4_quantize` does on every call). Immutable: a quantizer makes a new one when its spec
    changes."""

    __slots__ = ("options", "valid", "flags", "rowwise", "columnwise", "block_2d", "row_scaled", "rht", "launches")

    def __init__(self, *, rowwise: bool, columnwise: bool, block_2d: bool, row_scaled: bool, four_over_six: bool,
                 e4m3_max: int, err_mode: str, err_fast_math: bool, rht: bool, stochastic_rounding: bool) -> None:
        self.options = dict(rowwise=rowwise, columnwise=columnwise, block_2d=block_2d, row_scaled=row_scaled,
                            four_over_six=four_over_six, e4m3_max=e4m3_max, err_mode=err_mode, rht=rht,
                            stochastic_rounding=stochastic_rounding)  # _check_options' keywords
        self.launches: Dict[tuple, "_Launch"] = {}  # (x.shape, x.dtype) -> its resolved launch (see _Launch)
        try:
            _check_static_options(**self.options)
            self.valid = True
        except (ValueError, TypeError):
            self.valid = False  # every call runs the full checks, which raise nvfp4_quantize's error
            return
        self.rowwise, self.columnwise, self.block_2d = bool(rowwise), bool(columnwise), bool(block_2d)
        self.row_scaled, self.rht = bool(row_scaled), bool(rht)
        # _quantize_impl's positional options, between amax and the seed halves
        self.flags = (self.rowwise, self.columnwise, self.block_2d, self.row_scaled, bool(four_over_six),
                      int(e4m3_max), err_mode == "MSE", bool(err_fast_math), self.rht, bool(stochastic_rounding))


def nvfp4_quantize_planned(x: torch.Tensor, plan: QuantizePlan, amax: Optional[torch.Tensor], seed: int, offset: int,
                           units: Optional[tuple] = None, rng_state: Optional[torch.Tensor] = None) -> tuple:
    """:func:`nvfp4_quantize` (same checks of ``x`` and ``amax``, same bytes) with ``plan``'s options, for an
    eager call of a quantizer whose input passed ``check_input`` (a float32/bfloat16/float16 tensor, here
    flattened to 2-D) and whose ``seed``/``offset`` are its own ints in [0, 2^64). ``units``: (rowwise,
    columnwise) unit operands to write as :func:`nvfp4_quantize_with_units` does, or None. ``rng_state``: the
    quantizer's device (seed, offset) pair (int64 (2,), on x's device), which the kernels read when they run
    instead of ``seed``/``offset`` (a CUDA graph's replays then draw fresh numbers). Returns
    ``(data, scale, amax, data_t, scale_t, amax_t, unit, unit_t)``, absent ones None."""
    launch = None
    if rng_state is not None:
        _check_rng_state(x, rng_state)
    if amax is None:
        launch = plan.launches.get((x.shape, x.dtype))
        if launch is not None:  # this shape and dtype passed the checks below before
            _require_cuda(x, "nvfp4_quantize")
            res = launch.run(x.contiguous(), seed, offset, units=units, rng_state=rng_state)
            if res is not None:
                return res
    if not plan.valid:
        _check_options(x, amax, seed=seed, offset=offset, **plan.options)  # raises nvfp4_quantize's error
    _check_x_for_options(x, plan.rowwise, plan.columnwise, plan.block_2d, plan.rht)
    if launch is None and amax is None:
        launch = _new_launch(x, plan)
        if launch is not None:
            res = launch.run(x.contiguous(), seed, offset, units=units, rng_state=rng_state)
            if res is not None:
                return res
    if amax is not None:
        _check_amax_override(x, amax, plan.row_scaled)
        amax = amax.contiguous()
    _require_cuda(x, "nvfp4_quantize")
    wanted = None if units is None else [bool(units[0]), bool(units[1])]
    data, scale, out_amax, data_t, scale_t, amax_t = _quantize_impl(
        x.contiguous(), amax, *plan.flags, seed & _MASK32, seed >> 32, offset & _MASK32, offset >> 32,
        share_amax=True, units=wanted, checked=True, rng_state=rng_state)
    if not plan.rowwise:
        data = scale = out_amax = None
    if not plan.columnwise:
        data_t = scale_t = amax_t = None
    unit, unit_t = (None, None) if wanted is None else wanted
    return data, scale, out_amax, data_t, scale_t, amax_t, unit, unit_t


def nvfp4_quantize_planned_dbias(x: torch.Tensor, plan: QuantizePlan, seed: int, offset: int,
                                 bias_dtype: torch.dtype, units: Optional[tuple] = None,
                                 rng_state: Optional[torch.Tensor] = None) -> Optional[tuple]:
    """:func:`nvfp4_quantize_planned` (no amax override; ``units`` as there) of a grad_output ``x`` (M, N) with
    its bias gradient fused into the columnwise quantization: ``(outputs, db)``, ``db`` the bytes of
    ``ops.bias_grad(x, bias_dtype)`` (the tile kernel writes the 64-row tile sums, one small launch reduces
    them; the standalone bias gradient reads x once more). None where the fused launch does not apply (no
    columnwise copy, 2-D blocks, an extension without it, a launch that needs the general path): the caller
    then quantizes and calls ``ops.bias_grad``. Checks ``x`` as :func:`nvfp4_quantize_planned` does."""
    if not (plan.valid and plan.columnwise and not plan.block_2d and bias_dtype in _DTYPE_CODES):
        return None
    ext = backend.extension()
    if ext is None or not getattr(ext, "nvfp4_fused_bias_grad", False):
        return None
    if rng_state is not None:
        _check_rng_state(x, rng_state)
    launch = plan.launches.get((x.shape, x.dtype))
    if launch is None:
        _check_x_for_options(x, plan.rowwise, plan.columnwise, plan.block_2d, plan.rht)
        launch = _new_launch(x, plan)
        if launch is None:
            return None
    else:
        _require_cuda(x, "nvfp4_quantize")
    m, n = x.shape
    partials = torch.empty(((m + 63) // 64, n), dtype=torch.float32, device=x.device)
    db = torch.empty((n,), dtype=bias_dtype, device=x.device)
    res = launch.run(x.contiguous(), seed, offset, bias=(partials, db), units=units, rng_state=rng_state)
    return None if res is None else (res, db)


def _check_rng_state(x: torch.Tensor, rng_state: torch.Tensor) -> None:
    """A device stochastic-rounding state the kernels can read: int64 (2,), contiguous, on x's device."""
    if (not isinstance(rng_state, torch.Tensor) or rng_state.dtype != torch.int64 or rng_state.shape != (2,)
            or not rng_state.is_contiguous() or rng_state.device != x.device):
        what = (f"{rng_state.dtype} {tuple(rng_state.shape)} on {rng_state.device}"
                if isinstance(rng_state, torch.Tensor) else type(rng_state).__name__)
        raise ValueError(f"nvfp4_quantize: rng_state must be a contiguous int64 tensor of shape (2,) (seed, offset) "
                         f"on the input's device {x.device}, got {what}")


def _rng_values(rng_state: torch.Tensor) -> tuple:
    """(seed, offset) ints of a device state, for a path that takes them on the host (the reference twin)."""
    if rng_state.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("nvfp4_quantize: this stochastically rounded cast takes the reference path (the device's "
                           "E2M1 self-check chose it), which reads the seed and offset on the host: it cannot be "
                           "captured in a CUDA graph")
    seed, offset = rng_state.tolist()
    return seed & _MASK64, offset & _MASK64


# Resolved launches kept per plan (distinct input shapes and dtypes of one quantizer; a model's quantizer
# sees one or a few). Past the cap, new shapes take the general path.
_MAX_LAUNCHES = 64


_MODE_CODES = {"plain": 0, "both": 1, "row": 2, "fused_row": 3}  # _Launch.mode -> fast_ops.cpp AmaxMode


def _new_launch(x: torch.Tensor, plan: QuantizePlan, separate_amaxes: bool = False) -> Optional["_Launch"]:
    """The resolved launch of ``x``'s shape and dtype, kept in ``plan`` once ``x`` passed every check of
    the plan's options; None for an empty ``x`` or past the cap (the general path takes those).
    ``separate_amaxes``: see :class:`_Launch`."""
    if not x.numel() or len(plan.launches) >= _MAX_LAUNCHES:
        return None
    _require_cuda(x, "nvfp4_quantize")
    launch = plan.launches[(x.shape, x.dtype)] = _Launch(plan, x, separate_amaxes)
    return launch


class _Launch:
    """One quantizer plan's quantization of one input shape and dtype (no amax override; unit operands
    on request): the output shapes, the dtype code and how the amaxes are laid out, resolved once, so a
    call allocates only the outputs it returns and makes the kernel calls directly. The same launches,
    arguments and bytes as :func:`_quantize_kernels` with ``share_amax=True``; :meth:`run` returns None
    where that path is needed (unaligned x, a device whose E2M1 check chose the reference twin)."""

    __slots__ = ("m", "n", "code", "rowwise", "columnwise", "row_scaled", "block_2d", "rht", "mode", "need_g",
                 "data_shape", "scale_shape", "data_t_shape", "scale_t_shape", "row_shape", "tail", "cpp")

    def __init__(self, plan: "QuantizePlan", x: torch.Tensor, separate_amaxes: bool = False) -> None:
        # separate_amaxes (a custom op's launch): x's amax and the post-RHT one in two allocations, not views of one
        m, n = x.shape
        rowwise, columnwise, block_2d, row_scaled, four_over_six, e4m3_max, mse, err_fast_math, rht, sr = plan.flags
        self.m, self.n, self.code = m, n, _DTYPE_CODES[x.dtype]
        self.rowwise, self.columnwise, self.row_scaled, self.block_2d, self.rht = (rowwise, columnwise, row_scaled,
                                                                                  block_2d, rht)
        self.need_g = rowwise or block_2d or (columnwise and not rht)
        if row_scaled:
            # the per-row amax inside the quantize launch (rowwise only, where the build has it), else a
            # row amax launch (with the global amax of the columnwise copy)
            self.mode = "fused_row" if rowwise and not columnwise else "row"
        else:
            self.mode = "both" if self.need_g and rht and not separate_amaxes else "plain"
        self.data_shape, self.scale_shape = (m, n // 2), (m, n // BLOCK)
        self.data_t_shape, self.scale_t_shape = (n, m // 2), (n, m // BLOCK)
        self.row_shape = (m,)
        fos = _FOS_OFF if not four_over_six else (_FOS_FAST if err_fast_math else _FOS_STRICT)
        # nvfp4_quantize's arguments between amax_t and the seed
        self.tail = (rht, block_2d, fos, mse, float(e4m3_max), sr)
        # the same launch as one C++ call (fp_recipes._torch_ops, FP_RECIPES_TORCH_OPS), where it is available
        fast = _extension.fast_ops() if x.is_cuda else None
        if fast is not None and not getattr(fast, "nvfp4_launch_units", False):
            fast = None  # (a build older than the unit operands of run(): the lines of run() take it)
        self.cpp = None if fast is None else fast.Nvfp4Launch(
            m, n, self.code, _MODE_CODES[self.mode], rowwise, columnwise, row_scaled, block_2d, rht, self.need_g, fos,
            mse, float(e4m3_max), sr)

    def run(self, x: torch.Tensor, seed: int, offset: int, bias: Optional[tuple] = None,
            units: Optional[tuple] = None, rng_state: Optional[torch.Tensor] = None) -> Optional[tuple]:
        """The outputs ``(data, scale, amax, data_t, scale_t, amax_t, unit, unit_t)`` (absent ones None),
        or None (nothing launched) where the general path must run. ``bias``: ``(partials, db)`` to write
        x's bias gradient into (see :func:`nvfp4_quantize_planned_dbias`). ``units``: (rowwise, columnwise)
        BF16 unit operands to write too (of the copies this plan makes). ``rng_state``: a checked device
        (seed, offset) pair the kernel reads instead of ``seed``/``offset``."""
        x_ptr = x.data_ptr()
        dev_t = x.device
        if x_ptr % 16 or (x.is_cuda and (_E2M1.get(dev_t.index) or _e2m1_mode(dev_t)) == "reference"):
            return None
        unit_row, unit_col = (False, False) if units is None else (bool(units[0]), bool(units[1]))
        if self.cpp is not None and x.is_cuda:  # the lines below as one C++ call (None: the general path)
            return self.cpp.run(x, seed, offset, *(bias if bias is not None else (None, None)), unit_row, unit_col,
                                rng_state)
        m, n, code = self.m, self.n, self.code
        stream, dev = _stream_of(dev_t), dev_t.index
        ext = backend.extension() or _ext()  # (_ext raises the missing extension's error)
        mode = self.mode
        row_am = g_am = t_am = None
        row_amax_out = 0
        ws_ptr = _amax_ws(dev_t, stream)
        if mode == "both":
            # both amaxes in one 8-byte buffer (x's, then the post-RHT one of the columnwise copy)
            both = torch.empty((2,), dtype=torch.float32, device=dev_t)
            g_am, t_am = both.unbind()
            g_ptr = both.data_ptr()
            t_ptr = g_ptr + 4
            ext.nvfp4_amax(x_ptr, code, m, n, g_ptr, t_ptr, stream, dev, ws_ptr)
            rowwise_amax = g_am
        elif mode == "plain":
            g_ptr = t_ptr = 0
            if self.need_g:
                g_am = torch.empty((), dtype=torch.float32, device=dev_t)
                g_ptr = g_am.data_ptr()
            if self.rht:
                t_am = torch.empty((), dtype=torch.float32, device=dev_t)
                t_ptr = t_am.data_ptr()
            ext.nvfp4_amax(x_ptr, code, m, n, g_ptr, t_ptr, stream, dev, ws_ptr)
            if self.columnwise and not self.rht:
                t_am, t_ptr = g_am, g_ptr
            rowwise_amax = g_am
        else:
            row_am = torch.empty(self.row_shape, dtype=torch.float32, device=dev_t)
            g_ptr = row_am.data_ptr()  # the rowwise amax: the per-row one
            t_ptr = 0
            if mode == "fused_row" and getattr(ext, "nvfp4_fused_row_amax", False):
                row_amax_out = g_ptr
            else:
                if self.columnwise:
                    t_am = torch.empty((), dtype=torch.float32, device=dev_t)
                    t_ptr = t_am.data_ptr()
                ext.nvfp4_row_amax(x_ptr, code, m, n, g_ptr, t_ptr, stream, dev, ws_ptr)
            rowwise_amax = row_am
        data = scale = data_t = scale_t = None
        data_ptr = scale_ptr = data_t_ptr = scale_t_ptr = 0
        if self.rowwise:
            data = torch.empty(self.data_shape, dtype=torch.uint8, device=dev_t)
            scale = torch.empty(self.scale_shape, dtype=torch.float8_e4m3fn, device=dev_t)
            data_ptr, scale_ptr = data.data_ptr(), scale.data_ptr()
        if self.columnwise:
            data_t = torch.empty(self.data_t_shape, dtype=torch.uint8, device=dev_t)
            scale_t = torch.empty(self.scale_t_shape, dtype=torch.float8_e4m3fn, device=dev_t)
            data_t_ptr, scale_t_ptr = data_t.data_ptr(), scale_t.data_ptr()
        unit = torch.empty((m, n), dtype=torch.bfloat16, device=dev_t) if unit_row and self.rowwise else None
        unit_t = torch.empty((n, m), dtype=torch.bfloat16, device=dev_t) if unit_col and self.columnwise else None
        unit_ptrs = (0 if unit is None else unit.data_ptr(), 0 if unit_t is None else unit_t.data_ptr())
        rht, block_2d, fos, mse, e4m3_max, sr = self.tail
        args = (x_ptr, code, m, n, data_ptr, scale_ptr, g_ptr if (self.rowwise or block_2d) else 0, self.row_scaled,
                data_t_ptr, scale_t_ptr, t_ptr, rht, block_2d, fos, mse, e4m3_max, sr, seed, offset, stream, dev)
        rng = {} if rng_state is None else {"rng_state": rng_state.data_ptr()}
        if row_amax_out:
            ext.nvfp4_quantize(*args, *unit_ptrs, row_amax_out, **rng)  # unit, unit_t, row_amax_out
        elif bias is not None:
            partials, db = bias
            ext.nvfp4_quantize(*args, *unit_ptrs, 0, partials.data_ptr(), db.data_ptr(), _DTYPE_CODES[db.dtype],
                               **rng)
        else:
            ext.nvfp4_quantize(*args, *unit_ptrs, **rng)  # unit, unit_t (the arguments _quantize_kernels passes)
        if not self.rowwise:
            rowwise_amax = None
        return data, scale, rowwise_amax, data_t, scale_t, t_am, unit, unit_t


@backend.register_cuda_impl("nvfp4_dequantize")
def nvfp4_dequantize(data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, *, e4m3_max: int = 448,
                     row_scaled: bool = False, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The CUDA twin of ref_nvfp4.nvfp4_dequantize."""
    what = "nvfp4_dequantize"
    check_nvfp4_dequantize_args(data, scale, amax, e4m3_max, row_scaled, out_dtype)
    _require_cuda(data, what)
    return _dequantize_op(data.contiguous(), scale.contiguous(), amax.contiguous(), int(e4m3_max),
                          bool(row_scaled), out_dtype)


# ---- the emulated GEMM's operands (CUDA only; the twins are gemm.decode_nvfp4_unit and ----------
# ---- ref_nvfp4.nvfp4_gemm_alpha, and the row epilogue of gemm.gemm_nvfp4_nvfp4) ---------------

def unit_operands_available() -> bool:
    """Whether the built extension has the unit-decode and row-epilogue kernels."""
    ext = backend.extension()
    return ext is not None and hasattr(ext, "nvfp4_decode_unit_bf16")


def nvfp4_unit_operands(copies, amax_a: Optional[torch.Tensor] = None, amax_b: Optional[torch.Tensor] = None,
                        e4m3_max_a: int = 448, e4m3_max_b: int = 448, *, with_alpha: bool = True,
                        device: Optional[torch.device] = None, alpha_workspace: bool = False):
    """BF16 unit values (E2M1 x E4M3, no global factor; exact) of up to four NVFP4 copies, each
    ``(data (rows, K/2) uint8, scale (rows, K/16) e4m3)`` contiguous on one CUDA device, in one launch.
    No copies (``device`` given) with ``with_alpha``: the launch writes only alpha (both GEMM operands
    came cached from the quantize kernels).

    With ``with_alpha`` the same launch writes ``alpha_beta`` = FP32 {alpha, 0}, alpha =
    RN(RN(amax_a * amax_b) * RN(1/(36 E_a E_b))) (bit-equal to ``ref_nvfp4.nvfp4_gemm_alpha``; an absent
    amax counts as 1, the unit alpha of a row-scaled GEMM) for a cuBLASLt call that reads it on the
    device. Returns ``(list of (rows, K) bfloat16 tensors, alpha_beta or None)``. No validation beyond
    what the kernel needs: callers (gemm/nvfp4_emulated.py) pass an NVFP4Tensor's own copies.

    ``alpha_workspace`` (the emulated GEMM, which consumes alpha_beta in its next launch on the same
    stream): alpha_beta is this stream's 16-byte alpha workspace instead of a fresh allocation, valid
    until the next call on the stream writes it again (launches on one stream run in order, so the
    GEMM reads it before the next decode launch overwrites it)."""
    num = len(copies)
    if not (0 < num or (with_alpha and device is not None)) or num > 4:
        raise ValueError(f"nvfp4_unit_operands: 1 to 4 copies per call (0 with alpha and a device), got "
                         f"{num}")
    dev = copies[0][0].device if num else device
    outs, data_p, scale_p, out_p, blocks = [None] * num, [0] * num, [0] * num, [0] * num, [0] * num
    for i, (data, scale) in enumerate(copies):
        rows, half = data.shape
        # the pointers _ptr() gives, from the shapes: data has rows * half elements, scale (once its shape
        # is checked) rows * (half // 8), the fresh output (null when empty) rows * half * 2
        data_ptr = data.data_ptr() if rows * half else 0
        if data.dtype != torch.uint8 or scale.shape != (rows, half // 8) or data.device != dev or \
                scale.device != dev or not data.is_contiguous() or not scale.is_contiguous() or data_ptr % 8:
            raise ValueError("nvfp4_unit_operands: each copy needs contiguous uint8 data (rows, K/2) at an "
                             "8-byte aligned address and contiguous e4m3 scales (rows, K/16) on one device; got "
                             f"{data.dtype} {tuple(data.shape)} and {scale.dtype} {tuple(scale.shape)}")
        out = outs[i] = torch.empty((rows, half * 2), dtype=torch.bfloat16, device=dev)
        data_p[i] = data_ptr
        scale_p[i] = scale.data_ptr() if rows * (half // 8) else 0
        out_p[i] = out.data_ptr()
        blocks[i] = rows * half // 8
    stream, index = _stream_of(dev), dev.index
    alpha_beta = None
    if with_alpha:
        alpha_beta = _ALPHA_WS.get((index, stream, threading.get_ident())) if alpha_workspace else None
        if alpha_beta is None:
            alpha_beta = _alpha_ws(dev, stream) if alpha_workspace else \
                torch.empty((4,), dtype=torch.float32, device=dev)
    ext = backend.extension() or _ext()  # (_ext raises the missing extension's error)
    # _ptr() of the amaxes, inline
    amax_a_ptr = 0 if amax_a is None or not amax_a.numel() else amax_a.data_ptr()
    amax_b_ptr = 0 if amax_b is None or not amax_b.numel() else amax_b.data_ptr()
    ext.nvfp4_decode_unit_bf16(data_p, scale_p, out_p, blocks, amax_a_ptr, amax_b_ptr, float(e4m3_max_a),
                               float(e4m3_max_b), 0 if alpha_beta is None else alpha_beta.data_ptr(), stream, index)
    return outs, alpha_beta


#: nvfp4_unit_operands as defined here: the emulated GEMM passes alpha_workspace only to this one (tests replace
#: the module attribute with fakes of the other keywords)
own_unit_operands = nvfp4_unit_operands

# The emulated GEMM's {alpha, beta} (FP32, 16 bytes) per (device, stream, thread): written by the decode launch and
# read by the cuBLASLt GEMM right after it on the same stream (see nvfp4_unit_operands). Per thread: two threads
# launching GEMMs on one stream interleave their launches (decode A, decode B, GEMM A), and GEMM A must not read
# B's alpha.
_ALPHA_WS: dict = {}


def _alpha_ws(device: torch.device, stream: int) -> torch.Tensor:
    """The calling thread's alpha workspace on this stream, created on first use; a fresh tensor (not kept) while
    the stream is being captured into a CUDA graph without one (the graph's memory pool then holds it), as for the
    amax workspace."""
    key = (device.index, stream, threading.get_ident())
    ws = _ALPHA_WS.get(key)
    if ws is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.empty((4,), dtype=torch.float32, device=device)
        ws = _ALPHA_WS[key] = workspace.persistent_cuda_tensor(
            lambda: torch.zeros((4,), dtype=torch.float32, device=device), device)
    return ws


def nvfp4_row_scale_epilogue(d: torch.Tensor, amax_a: torch.Tensor, a_rows: bool, amax_b: torch.Tensor,
                             b_cols: bool, bias: Optional[torch.Tensor], out_dtype: torch.dtype,
                             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The row-scaled GEMM's epilogue on its FP32 output ``d = RN(acc * alpha_unit)`` (M, N):
    ``cast(RN(RN(d * RN(sa * sb)) + bias))`` with sa = amax_a[m] (``a_rows``) or the scalar amax_a, sb =
    amax_b[n] (``b_cols``) or the scalar amax_b; the same FP32 roundings as the torch version in
    gemm/nvfp4_emulated.py. ``out``: a contiguous (M, N) tensor of ``out_dtype`` to write (a row block of
    a larger output, for the GEMM that runs in row chunks), else a new one."""
    m, n = d.shape
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=d.device)
    elif out.shape != (m, n) or out.dtype != out_dtype or out.device != d.device or not out.is_contiguous():
        raise ValueError(f"nvfp4_row_scale_epilogue: out must be a contiguous ({m}, {n}) {out_dtype} tensor on "
                         f"{d.device}, got {out.dtype} {tuple(out.shape)} on {out.device}"
                         f"{'' if out.is_contiguous() else ' (not contiguous)'}")
    if d.dtype != torch.float32 or not d.is_contiguous():
        raise ValueError(f"nvfp4_row_scale_epilogue: d must be a contiguous float32 matrix, got {d.dtype}"
                         f"{'' if d.is_contiguous() else ' (not contiguous)'}")
    if bias is not None and (bias.dtype not in _DTYPE_CODES or bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"nvfp4_row_scale_epilogue: bias must be a contiguous ({n},) float32/bfloat16/float16 "
                         f"vector, got {bias.dtype} {tuple(bias.shape)}")
    for name, t, vec, length in (("amax_a", amax_a, a_rows, m), ("amax_b", amax_b, b_cols, n)):
        if t.dtype != torch.float32 or t.numel() != (length if vec else 1) or t.device != d.device or \
                not t.is_contiguous():
            raise ValueError(f"nvfp4_row_scale_epilogue: {name} must be contiguous FP32 on {d.device} with "
                             f"{length if vec else 1} elements, got {t.dtype} {tuple(t.shape)} on {t.device}")
    if out.numel():
        stream, index = _launch_ctx(d)
        _ext().nvfp4_row_scale_epilogue(_ptr(d), m, n, _ptr(amax_a), bool(a_rows), _ptr(amax_b), bool(b_cols),
                                        _ptr(bias), _DTYPE_CODES[bias.dtype] if bias is not None else -1, _ptr(out),
                                        _DTYPE_CODES[out_dtype], stream, index)
    return out
