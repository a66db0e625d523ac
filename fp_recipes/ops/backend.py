"""Which backend runs each op: the CUDA extension ``fp_recipes._C`` or the pure-torch reference.

CUDA op modules (``cuda_fp8.py``, ``cuda_nvfp4.py``) register implementations under the *same name
and signature* as the reference twin in ``ops/reference.py``; :func:`fp_recipes.ops.dispatch` picks
one per call. Nothing is silent: a CUDA tensor that has to fall back to the reference warns once.
"""

from __future__ import annotations

import importlib
import threading
import warnings
from typing import Any, Callable, Dict, Optional

_CUDA_OP_MODULES = ("fp_recipes.ops.cuda_fp8", "fp_recipes.ops.cuda_nvfp4")

_lock = threading.Lock()
_ext: Any = None
_ext_error: Optional[str] = None
_ext_loaded = False
_cuda_impls: Dict[str, Callable] = {}
_cuda_modules_loaded = False
_warned: set = set()


def extension() -> Any:
    """The loaded ``fp_recipes._C`` module, or None (see :func:`extension_error`)."""
    global _ext, _ext_error, _ext_loaded
    if not _ext_loaded:
        with _lock:
            if not _ext_loaded:
                try:
                    from fp_recipes import _C  # type: ignore[attr-defined]

                    _ext = _C
                except ImportError as exc:  # not built (no nvcc, FP_RECIPES_NO_CUDA) or broken
                    _ext_error = f"{type(exc).__name__}: {exc}"
                _ext_loaded = True
    return _ext


def extension_error() -> Optional[str]:
    extension()
    return _ext_error


def register_cuda_impl(name: str) -> Callable[[Callable], Callable]:
    """Decorator for CUDA op modules: ``@register_cuda_impl("fp8_quantize")``."""

    def deco(fn: Callable) -> Callable:
        _cuda_impls[name] = fn
        return fn

    return deco


def _load_cuda_modules() -> None:
    global _cuda_modules_loaded
    if _cuda_modules_loaded:
        return
    with _lock:
        if _cuda_modules_loaded:
            return
        for mod in _CUDA_OP_MODULES:
            try:
                importlib.import_module(mod)
            except ModuleNotFoundError as exc:
                if exc.name != mod:  # a real import error inside the module: surface it
                    raise
        _cuda_modules_loaded = True


def current_stream(device: Any) -> int:
    """The handle of ``device``'s current CUDA stream (None index: the current device), for a kernel
    launch. torch's raw accessor builds no Stream object: launches sit on hot paths where that host
    time adds up."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


def warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def cuda_impl(name: str) -> Optional[Callable]:
    """The CUDA implementation of op ``name``, or None (after warning once) when there is none."""
    if extension() is None:
        warn_once(
            "no-extension",
            "fp_recipes: a CUDA tensor is being quantized but the CUDA extension fp_recipes._C is not "
            f"available ({_ext_error}); running the pure-torch reference instead (exact, but slow). "
            "Reinstall with nvcc on PATH to build the kernels.",
        )
        return None
    _load_cuda_modules()
    impl = _cuda_impls.get(name)
    if impl is None:
        warn_once(f"no-kernel:{name}",
                  f"fp_recipes: op {name!r} has no CUDA kernel; running its pure-torch reference.")
    return impl


def registered_cuda_ops() -> list[str]:
    if extension() is None:
        return []
    _load_cuda_modules()
    return sorted(_cuda_impls)


def backend_info() -> Dict[str, Any]:
    """What runs where: backend, GPU arch, and the archs the extension was built for.

    ``str(fp_recipes.backend_info()["summary"])`` reads e.g. "cuda (sm_90, built for 90a;100a)" or
    "reference (no CUDA device)".
    """
    import torch

    ext = extension()
    info: Dict[str, Any] = {
        "extension": ext is not None,
        "extension_error": _ext_error,
        "built_archs": ext.built_archs() if ext is not None else None,
        "cuda_available": torch.cuda.is_available(),
        "device_arch": None,
        "cuda_ops": registered_cuda_ops(),
    }
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        info["device_arch"] = f"sm_{major}{minor}"
        info["device_name"] = torch.cuda.get_device_name()
    if ext is not None and info["cuda_available"]:
        info["backend"] = "cuda"
        info["summary"] = f"cuda ({info['device_arch']}, built for {info['built_archs']})"
    else:
        info["backend"] = "reference"
        reason = "no CUDA device" if not info["cuda_available"] else f"no extension: {_ext_error}"
        info["summary"] = f"reference ({reason})"
    from .. import gemm_lt

    info["grouped_gemm"] = gemm_lt.status()
    return info
