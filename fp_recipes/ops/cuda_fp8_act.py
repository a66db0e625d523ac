"""The FP8 cast of an activation's output without the output in memory (CUDA): ``launch_fp8_act_quantize``.

An MLP's FC2 casts ``gelu(h)``, which torch's GELU kernel would write in BF16 and the cast read again. This kernel
applies the activation to each element of ``h`` as torch's CUDA kernel computes it (the same operations, the
result rounded to ``h``'s dtype) and casts that, in the tiled pass of the plain casts (plus the amax pass for
current scaling): the bytes of ``fp8_quantize(F.gelu(h, approximate="tanh"))``, two passes over a BF16 tensor fewer.

The twin is that composition itself: torch's GELU, then the plain cast. Reproducing torch's GELU depends on the
operations torch's own build contracted, so the first fused cast per device and input dtype checks itself against
the composition on a probe tensor (special values, every exponent); a mismatch warns once and the quantizer keeps
the composition there (``fusion_ok``)."""

from __future__ import annotations

import threading
import warnings
from typing import Dict, Optional, Tuple

import torch

from .. import _extension
from . import backend
from .cuda_fp8 import _OUT_CODE, DTYPE_CODE, FP8_DTYPE, _cast_fakes, _launch, _stream, _with_placeholders
from .op_library import define_op, register_fake
from .ref_fp8 import FP8Quantized

__all__ = ["ACT_CODES", "available", "checked", "fp8_act_quantize", "fusion_ok", "delayed_act_cast_op",
           "current_act_cast_op", "traced_cast_impls"]

#: activation name (``ops.activations``) -> the kernel's code
ACT_CODES = {"gelu": 1}


def available() -> bool:
    """Whether the loaded extension has the fused cast."""
    ext = backend.extension()
    return ext is not None and hasattr(ext, "fp8_act_quantize")


def fp8_act_quantize(x: torch.Tensor, activation: str, fmt: str, rowwise: bool, columnwise: bool, *,
                     scale: Optional[torch.Tensor] = None, record: Optional[torch.Tensor] = None,
                     use_power_2_scales: bool = False, amax_epsilon: float = 0.0,
                     separate: bool = False) -> FP8Quantized:
    """The cast of ``activation(x)`` (2-D contiguous CUDA ``x``): delayed scaling with ``scale`` (FP32 0-dim; the
    amax of ``activation(x)`` max-merged into ``record``, the history slot), else current scaling. The unwanted
    copy is None; the FP32 values are views of one allocation, or (``separate``: an op's outputs) each its own.
    The caller checked the arguments (the quantizer's plain case: ``fusion_ok`` and its own checks)."""
    current = scale is None
    if not separate and x.numel():  # the torch-linked host path: one C++ call, the same launch (FP_RECIPES_TORCH_OPS)
        fast = _extension.fast_ops()
        if fast is not None and getattr(fast, "fp8_cast_acts", False):
            out = fast.fp8_cast(x, _OUT_CODE[fmt], rowwise, columnwise, current, bool(use_power_2_scales),
                                float(amax_epsilon), scale, record, None, ACT_CODES[activation])
            if out is not None:
                return FP8Quantized(data=out[0], data_t=out[1], scale_inv=out[2], amax=out[3], scale=out[4])
    m, n = x.shape
    dev = x.device
    dt = FP8_DTYPE[fmt]
    data = torch.empty((m, n), dtype=dt, device=dev) if rowwise else None
    data_t = torch.empty((n, m), dtype=dt, device=dev) if columnwise else None
    if separate:
        f32 = {"dtype": torch.float32, "device": dev}
        scale_inv, amax = torch.empty((), **f32), torch.empty((), **f32)
        scale_out = torch.empty((), **f32) if current else scale
    else:
        buf = torch.empty((3 if current else 2,), dtype=torch.float32, device=dev)  # [scale_inv, amax(, scale)]
        scale_inv, amax = buf[0], buf[1]
        scale_out = buf[2] if current else scale
    empty = x.numel() == 0
    _launch(dev, backend.extension().fp8_act_quantize, 0 if empty else x.data_ptr(), DTYPE_CODE[x.dtype], m, n,
            ACT_CODES[activation], 0 if current else scale.data_ptr(), DTYPE_CODE[dt], bool(use_power_2_scales),
            float(amax_epsilon), 0 if data is None or empty else data.data_ptr(),
            0 if data_t is None or empty else data_t.data_ptr(), scale_out.data_ptr() if current else 0,
            scale_inv.data_ptr(), amax.data_ptr(), 0 if current else record.data_ptr(), _stream(dev))
    return FP8Quantized(data=data, data_t=data_t, scale_inv=scale_inv, amax=amax, scale=scale_out)


# ---- the same cast as ops a torch.compile graph calls (one per cast, as the plain casts' ops) -------------------

def _delayed_act_cast_impl(x: torch.Tensor, scale: torch.Tensor, history: torch.Tensor, fmt: str, rowwise: bool,
                           columnwise: bool, activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                       torch.Tensor]:
    """A delayed-scaling quantizer's traced cast of ``activation(x)`` (the amax recorded into ``history[0]``):
    (data, data_t, scale_inv, amax), empty placeholders for unwanted copies."""
    res = fp8_act_quantize(x, activation, fmt, rowwise, columnwise, scale=scale, record=history[0], separate=True)
    return _with_placeholders(x, fmt, (res.data, res.data_t, res.scale_inv, res.amax))


def _current_act_cast_impl(x: torch.Tensor, fmt: str, use_power_2_scales: bool, amax_epsilon: float, rowwise: bool,
                           columnwise: bool, activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                       torch.Tensor, torch.Tensor]:
    """A current-scaling quantizer's traced cast of ``activation(x)``: (data, data_t, scale_inv, amax, scale)."""
    res = fp8_act_quantize(x, activation, fmt, rowwise, columnwise, use_power_2_scales=use_power_2_scales,
                           amax_epsilon=amax_epsilon, separate=True)
    return _with_placeholders(x, fmt, (res.data, res.data_t, res.scale_inv, res.amax, res.scale))


def traced_cast_impls() -> dict:
    """The ops' Python implementations by name, for ``_torch_ops.register_traced_ops`` (as
    ``cuda_fp8.traced_cast_impls``): C++ CUDA kernels make the launch, these run where the C++ call declines."""
    return {"fp8_delayed_act_cast": _delayed_act_cast_impl, "fp8_current_act_cast": _current_act_cast_impl}


delayed_act_cast_op = define_op("fp8_delayed_act_cast", _delayed_act_cast_impl, mutates_args=("history",))
current_act_cast_op = define_op("fp8_current_act_cast", _current_act_cast_impl)


@register_fake(delayed_act_cast_op)
def _(x, scale, history, fmt, rowwise, columnwise, activation):
    return _cast_fakes(x, fmt, rowwise, columnwise)


@register_fake(current_act_cast_op)
def _(x, fmt, use_power_2_scales, amax_epsilon, rowwise, columnwise, activation):
    return (*_cast_fakes(x, fmt, rowwise, columnwise), x.new_empty((), dtype=torch.float32))


_CHECKED: Dict[Tuple[int, torch.dtype, str], bool] = {}
_LOCK = threading.Lock()


def _key(device: torch.device, dtype: torch.dtype, activation: str) -> Tuple[int, torch.dtype, str]:
    return (device.index if device.index is not None else torch.cuda.current_device(), dtype, activation)


def checked(device: torch.device, dtype: torch.dtype, activation: str) -> bool:
    """(traced code) Whether :func:`fusion_ok` has run and passed for these: a trace cannot run the check itself
    (``modules/base.py`` runs it for every input dtype while preparing a trace); False where it has not."""
    return _CHECKED.get(_key(device, dtype, activation)) is True


def fusion_ok(device: torch.device, dtype: torch.dtype, activation: str) -> bool:
    """Whether the fused cast gives the composition's bytes on this device for this input dtype: checked once
    (a probe of 1040 x 144 values: exponents -30..30, zeros, infinities, NaN, the GELU's steep region), both
    scalings and formats, both copies; the one host read of a step that makes it (not while a CUDA graph is
    captured: False there until an eager use has checked). False, with one warning, where it does not match."""
    key = _key(device, dtype, activation)
    ok = _CHECKED.get(key)
    if ok is not None:
        return ok
    if torch.cuda.is_current_stream_capturing():
        return False  # (the check reads its result on the host: not inside a CUDA-graph capture; the next eager use)
    with _LOCK:
        ok = _CHECKED.get(key)
        if ok is None:
            mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(0)  # (one read per device and dtype, not a step's)
            try:
                ok = _CHECKED[key] = _self_check(torch.device("cuda", key[0]), dtype, activation)
            finally:
                torch.cuda.set_sync_debug_mode(mode)
    return ok


def _probe(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(20261127)
    x = torch.randn(1040, 144, generator=g) * torch.exp2(torch.randint(-30, 30, (1040, 144), generator=g).float())
    x[0, :64] = torch.linspace(-8, 8, 64)  # (the steep region and the tails)
    x[1, :6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3e38])
    return x.to(dtype).to(device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers (NaN payloads compared, -0 apart from +0)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def _self_check(device: torch.device, dtype: torch.dtype, activation: str) -> bool:
    from . import activations, cuda_fp8

    act = activations.ELEMENTWISE[activation].forward
    x = _probe(device, dtype)
    with torch.cuda.device(device):
        a = act(x)
        for fmt in ("e4m3", "e5m2"):
            scale = torch.tensor(0.75, device=device)
            hist_got, hist_want = torch.zeros((), device=device), torch.zeros((), device=device)
            got = fp8_act_quantize(x, activation, fmt, True, True, scale=scale, record=hist_got)
            want = cuda_fp8.fp8_quantize_recording(a, scale, fmt, True, True, hist_want)
            cur = fp8_act_quantize(x, activation, fmt, True, True)
            cur_want = cuda_fp8.fp8_current_scaling_quantize(a, fmt, rowwise=True, columnwise=True)
            pairs = [(got.data, want.data), (got.data_t, want.data_t), (got.amax, want.amax), (hist_got, hist_want),
                     (got.scale_inv, want.scale_inv), (cur.data, cur_want.data), (cur.data_t, cur_want.data_t),
                     (cur.amax, cur_want.amax), (cur.scale, cur_want.scale), (cur.scale_inv, cur_want.scale_inv)]
            for i, (p, q) in enumerate(pairs):
                if not torch.equal(_bits(p), _bits(q)):
                    warnings.warn(f"fp_recipes: the fused FP8 cast of {activation}(x) does not give the bytes of "
                                  f"torch's {activation} then the cast on {torch.cuda.get_device_name(device)} for "
                                  f"{str(dtype).replace('torch.', '')} input ({fmt}, output {i}); using the two "
                                  "separately there", RuntimeWarning, stacklevel=3)
                    return False
    return True
