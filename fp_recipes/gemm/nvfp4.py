"""NVFP4 x NVFP4: which implementation runs, decided once per device.

* **emulated** (:mod:`.nvfp4_emulated`), the reference and the default everywhere but Blackwell: on CUDA
  its few-launch path when it takes the operands, else the torch ops. Hopper and CPU always run it.
* **native** (:mod:`.nvfp4_native`): ``torch._scaled_mm`` on FP4 tensor cores, on devices of compute
  capability 10.0 or higher (sm_100, sm_103, sm_120, ...), with the emulation's epilogue.

``FP_RECIPES_NVFP4_GEMM`` (the env table, fp_recipes/recipes/env.py) picks the policy: ``auto``
(default), ``native`` or ``emulated``. Under ``auto``, the first NVFP4 GEMM on a device with FP4 tensor
cores runs a self-check (:func:`self_check`): a few small GEMMs (odd M, K not a multiple of 32 or 64, N
not a multiple of 16, per-tensor and row-scaled operands, FP32 and BF16 outputs with a bias) through the
native path and through the exact emulation, compared within the FP32 accumulation-order bound (the
products are exact on both paths; only the order of the FP32 sums differs). If a native call raises or
any output is outside the bound, one warning says so and every NVFP4 GEMM on that device runs the
emulation. ``native`` skips the self-check and lets errors raise; ``emulated`` never runs native.

The native path has NOT run on Blackwell hardware in this project (:data:`NATIVE_NOT_RUN_NOTE`).

Test seams: the capability query is :func:`._common.device_capability`; every native GEMM (the
self-check's and the dispatched ones) is a call of :func:`.nvfp4_native.gemm_nvfp4_native` looked up
on that module at call time; :func:`reset` forgets the decisions and warnings.
"""

from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from . import _common, nvfp4_emulated, nvfp4_native
from .nvfp4_emulated import decode_nvfp4_unit, emulated_cuda_eager, gemm_nvfp4_emulated, row_scale_factor
from .operands import Nvfp4Operand

__all__ = ["ENV_VAR", "NATIVE_NOT_RUN_NOTE", "PathDecision", "gemm_nvfp4_nvfp4", "nvfp4_gemm_path",
           "nvfp4_native_gemm_available", "requested_policy", "self_check", "reset"]

ENV_VAR = "FP_RECIPES_NVFP4_GEMM"
MIN_CAPABILITY = (10, 0)  # sm_100 and later (sm_103, sm_110, sm_120, sm_121): FP4 tensor cores
NATIVE_NOT_RUN_NOTE = ("the native NVFP4 GEMM (torch._scaled_mm on float4_e2m1fn_x2, swizzled E4M3 block "
                       "scales) has not run on Blackwell hardware in this project: its scale layout, "
                       "padding, dispatch and fallback are tested on CPU only, and on sm_100+ it is used "
                       "only after a first-use self-check against the exact emulation")


@dataclass(frozen=True)
class PathDecision:
    """The NVFP4 GEMM implementation of one device and why."""

    path: str  # "native" | "emulated"
    reason: str


_lock = threading.RLock()
_decisions: Dict[Tuple[str, Optional[int], str], PathDecision] = {}
_compiled_view: Dict[Tuple[str, Optional[int]], str] = {}  # what traced code reads (no env lookup)
_warned: set = set()
_parsed: Dict[str, str] = {}


def reset() -> None:
    """Forget every decision and warning (tests; or after changing devices in a process)."""
    with _lock:
        _decisions.clear()
        _compiled_view.clear()
        _warned.clear()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def requested_policy() -> str:
    """``auto`` | ``native`` | ``emulated`` from FP_RECIPES_NVFP4_GEMM (unset or empty: ``auto``). A bad
    value raises the env table's error naming the variable, the value and the allowed values."""
    raw = os.environ.get(ENV_VAR)
    if raw is None or not raw.strip():
        return "auto"
    value = _parsed.get(raw)
    if value is None:
        from ..recipes.env import BY_NAME

        value = _parsed[raw] = BY_NAME[ENV_VAR].parse(raw)
    return value


def _device_key(device: torch.device) -> Tuple[str, Optional[int]]:
    if device.type == "cuda" and device.index is None:
        return device.type, torch.cuda.current_device()
    return device.type, device.index


def _arch(cap: Optional[tuple]) -> str:
    return "no CUDA capability" if cap is None else f"sm_{cap[0]}{cap[1]}"


def native_unsupported_reason(device: torch.device) -> Optional[str]:
    """None when ``device`` has FP4 tensor cores that this torch can drive, else why not."""
    cap = _common.device_capability(device)
    if cap is None:
        return f"{device.type} device: no FP4 tensor cores"
    if tuple(cap) < MIN_CAPABILITY:
        return f"{_arch(cap)} has no FP4 tensor cores (native NVFP4 GEMMs need sm_100 or later)"
    if not hasattr(torch, "float4_e2m1fn_x2") or not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no float4_e2m1fn_x2 / _scaled_mm"
    return None


# ---- the first-use self-check --------------------------------------------------------------------

# (name, (M, K), (N, K), a options, b options, out dtype, bias): odd M (two row tiles of the swizzle, one
# partial), K = 80 (neither a multiple of 32 nor of 64: data and scale-column padding), N = 40 (padded to
# 48), a longer K; E = 256 / 4over6 on the weight; a row-scaled activation with a BF16 bias.
_CASES = (
    ("per-tensor", (130, 80), (40, 80), {}, {"e4m3_max": 256, "four_over_six": True}, torch.float32, None),
    ("row-scaled", (72, 96), (48, 96), {"row_scaled": True}, {}, torch.bfloat16, torch.bfloat16),
    ("long K", (64, 1024), (32, 1024), {}, {}, torch.float32, None),
)


def _operand(x: torch.Tensor, device: torch.device, **opts) -> Nvfp4Operand:
    from ..ops import ref_nvfp4

    q = ref_nvfp4.nvfp4_quantize(x, rowwise=True, columnwise=False, **opts)  # the reference, on the CPU
    return Nvfp4Operand(q.data.to(device), q.scale.to(device), q.amax.to(device),
                        bool(opts.get("row_scaled", False)), int(opts.get("e4m3_max", 448)), False)


def _check_cases(device: torch.device) -> List[tuple]:
    g = torch.Generator().manual_seed(20260)
    cases = []
    for name, (m, k), (n, _), a_opts, b_opts, out_dtype, bias_dtype in _CASES:
        x = torch.randn(m, k, generator=g) * 3
        x[0, :16] = 0.0  # an all-zero block (scale 0)
        w = torch.randn(n, k, generator=g) / 8
        bias = None if bias_dtype is None else torch.randn(n, generator=g).to(bias_dtype).to(device)
        cases.append((name, _operand(x, device, **a_opts), _operand(w, device, **b_opts), out_dtype, bias))
    return cases


_OUT_ULP = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


def tolerance(a: Nvfp4Operand, b: Nvfp4Operand, want: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The stated bound |native - emulated| may reach, elementwise (float64): two FP32 sums of the same
    K exact products in different orders differ by at most 2 (K - 1) u sum |p| (u = 2^-24), times the
    global factor; plus one unit in the last place of the output dtype (the two FP32 results may round
    to neighbouring outputs) and a few FP32 roundings of the epilogue."""
    k = a.data.shape[1] * 2
    ua = decode_nvfp4_unit(a.data, a.scale).double().abs()
    ub = decode_nvfp4_unit(b.data, b.scale).double().abs()
    bound = 2.0 * max(k - 1, 1) * 2.0 ** -24 * (ua @ ub.t())
    inv = 1.0 / (36.0 * a.e4m3_max * b.e4m3_max)
    if a.row_scaled or b.row_scaled:
        factor = row_scale_factor(a, b).double().abs() * inv
    else:
        factor = (a.amax.double() * b.amax.double()).abs() * inv
    return bound * factor * 1.01 + want.double().abs() * (_OUT_ULP.get(out_dtype, 2.0 ** -7) + 8 * 2.0 ** -24)


def self_check(device: torch.device) -> Tuple[bool, str]:
    """Native against the exact emulation on ``device`` (:data:`_CASES`): (passed, what happened)."""
    try:
        cases = _check_cases(device)
        for name, a, b, out_dtype, bias in cases:
            got = nvfp4_native.gemm_nvfp4_native(a, b, out_dtype, bias)
            want = gemm_nvfp4_emulated(a, b, out_dtype, bias)
            if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
                return False, (f"{name}: native returned {getattr(got, 'dtype', type(got).__name__)} "
                               f"{tuple(getattr(got, 'shape', ()))}, expected {want.dtype} {tuple(want.shape)}")
            err = (got.double() - want.double()).abs()
            tol = tolerance(a, b, want, out_dtype)
            bad = ~(err <= tol)  # NaN counts as bad
            if bool(bad.any()):
                worst = float(torch.where(bad, err - tol, torch.zeros_like(err)).max())
                return False, (f"{name} ({a.data.shape[0]}x{b.data.shape[0]}x{a.data.shape[1] * 2}): "
                               f"{int(bad.sum())} of {bad.numel()} outputs outside the FP32 accumulation-order "
                               f"bound (largest excess {worst:.3g})")
        return True, f"{len(cases)} GEMMs agree with the exact emulation within the FP32 accumulation-order bound"
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use the native path here
        first = (str(exc).strip().splitlines() or [""])[0]
        return False, f"raised {type(exc).__name__}: {first}"


# ---- the decision ----------------------------------------------------------------------------------

def _decide(device: torch.device, policy: str) -> PathDecision:
    if policy == "emulated":
        return PathDecision("emulated", f"{ENV_VAR}=emulated")
    why = native_unsupported_reason(device)
    if why is not None:
        if policy == "native":
            _warn_once(f"native-unavailable:{device}",
                       f"fp_recipes: {ENV_VAR}=native but {why}; NVFP4 GEMMs on {device} run the exact "
                       "emulation")
        return PathDecision("emulated", why)
    arch = _arch(_common.device_capability(device))
    if policy == "native":
        return PathDecision("native", f"{arch}, {ENV_VAR}=native (no self-check)")
    ok, detail = self_check(device)
    if ok:
        return PathDecision("native", f"{arch}, first-use self-check passed: {detail}")
    _warn_once(f"self-check:{device}",
               f"fp_recipes: the native NVFP4 GEMM (torch._scaled_mm, float4_e2m1fn_x2) failed its first-use "
               f"self-check on {device} ({arch}): {detail.rstrip('.')}. NVFP4 GEMMs on this device run the exact emulation "
               f"instead (BF16 GEMM, FP32 accumulation). {ENV_VAR}=emulated skips the check; {ENV_VAR}=native "
               "forces the native path.")
    return PathDecision("emulated", f"{arch}, first-use self-check failed: {detail}")


def decision(device: torch.device) -> PathDecision:
    """The implementation NVFP4 GEMMs use on ``device`` under the current FP_RECIPES_NVFP4_GEMM, decided
    (self-check included) on first use and remembered per device and value."""
    policy = requested_policy()
    dkey = (device.type, device.index) if device.index is not None else _device_key(device)
    key = dkey + (policy,)
    d = _decisions.get(key)
    if d is not None:
        return d
    if policy == "auto" and native_unsupported_reason(device) is None and (
            torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        # a self-check synchronises: not inside a CUDA graph capture; decide at the next eager GEMM
        return PathDecision("emulated", "undecided (first NVFP4 GEMM inside a CUDA graph capture)")
    with _lock:
        d = _decisions.get(key)
        if d is None:
            d = _decisions[key] = _decide(device, policy)
            _compiled_view[dkey] = d.path
            if device.index is None:
                _compiled_view[(device.type, None)] = d.path
    return d


def nvfp4_gemm_path(device: torch.device) -> str:
    """``native`` or ``emulated``: what the next NVFP4 GEMM on ``device`` runs. Under torch.compile the
    last eager decision for the device is used (no self-check while tracing; none yet: emulated)."""
    if torch.compiler.is_compiling():
        return _compiled_view.get((device.type, device.index), "emulated")
    return decision(device).path


def nvfp4_native_gemm_available(device: torch.device) -> bool:
    """Whether NVFP4 GEMMs on ``device`` run natively (after the first-use self-check where it applies)."""
    return nvfp4_gemm_path(device) == "native"


# ---- the GEMM ----------------------------------------------------------------------------------------

def gemm_nvfp4_nvfp4(a: Nvfp4Operand, b: Nvfp4Operand, *, out_dtype: torch.dtype,
                     bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """NVFP4 x NVFP4: unit-scaled products with FP32 accumulation, global factor as FP32 alpha (native FP4
    tensor cores where decided, else the exact emulation)."""
    if a.rht != b.rht:
        raise ValueError("gemm: one NVFP4 operand is Hadamard-transformed (RHT) along K and the other is "
                         "not; the product would be wrong. RHT must be applied to both wgrad operands")
    ka, kb = a.data.shape[1] * 2, b.data.shape[1] * 2
    if ka != kb:
        raise ValueError(f"gemm: contraction dims differ: {a.data.shape[0]}x{ka} and {b.data.shape[0]}x{kb}")
    dev = a.data.device
    compiling = torch.compiler.is_compiling()
    # nvfp4_gemm_path(dev), with the compile check made once for this call
    path = _compiled_view.get((dev.type, dev.index), "emulated") if compiling else decision(dev).path
    if path == "native":
        try:
            return nvfp4_native.gemm_nvfp4_native(a, b, out_dtype, bias)
        except (RuntimeError, TypeError, ValueError) as exc:
            if compiling or requested_policy() == "native":
                raise
            first = (str(exc).strip().splitlines() or [""])[0]
            _warn_once(f"native-raised:{dev}:{a.data.shape[0]}x{b.data.shape[0]}x{ka}",
                       f"fp_recipes: the native NVFP4 GEMM raised on {dev} for M={a.data.shape[0]}, "
                       f"N={b.data.shape[0]}, K={ka} ({type(exc).__name__}: {first}); this GEMM runs the "
                       "exact emulation")
    if a.data.is_cuda and not compiling:
        out = emulated_cuda_eager(a, b, out_dtype, bias)
        if out is not None:
            return out
    elif compiling and nvfp4_emulated.TRACED_AS_OP:
        return nvfp4_emulated.gemm_nvfp4_emulated_traced(a, b, out_dtype, bias)
    return gemm_nvfp4_emulated(a, b, out_dtype, bias)
