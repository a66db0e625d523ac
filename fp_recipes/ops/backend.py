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

import torch

# the extension and the stream handle live one layer down (fp_recipes/_extension.py), where the GEMM
# launchers (fp_recipes/gemm/cublaslt.py) import them too without importing this module
from .._extension import current_stream, extension, extension_error  # noqa: F401  (re-exported)

_CUDA_OP_MODULES = ("fp_recipes.ops.cuda_fp8", "fp_recipes.ops.cuda_nvfp4")

_lock = threading.Lock()
_cuda_impls: Dict[str, Callable] = {}
_cuda_modules_loaded = False
_warned: set = set()


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
            f"available ({extension_error()}); running the pure-torch reference instead (exact, but slow). "
            "Reinstall with nvcc on PATH to build the kernels.",
        )
        return None
    _load_cuda_modules()
    impl = _cuda_impls.get(name)
    if impl is None:
        warn_once(f"no-kernel:{name}",
                  f"fp_recipes: op {name!r} has no CUDA kernel; running its pure-torch reference.")
    return impl


_resolved: Dict[str, Callable] = {}
_ops: Any = None


def resolved(name: str, x: Any) -> Callable:
    """What ``fp_recipes.ops.<name>(x, ...)`` runs for the tensor ``x``, looked up once per op: on a
    CUDA tensor the registered kernel wrapper (or, without one, the dispatcher: its reference after
    the one warning), elsewhere the dispatcher. For per-call hot paths (the quantizers): the dispatcher
    scans the arguments and looks the implementation up on every call."""
    if x.is_cuda:
        fn = _resolved.get(name)
        if fn is not None:
            return fn
    if not x.is_cuda:
        return getattr(_ops, name)
    fn = cuda_impl(name) or getattr(_ops, name)
    if not torch.compiler.is_compiling():  # (a write to module state inside a trace is a side effect Dynamo
        _resolved[name] = fn               # cannot keep inside a traced autograd.Function)
    return fn


def bind_package(ops: Any) -> None:
    """Called once by ``fp_recipes.ops`` at its import, which also loads the extension and the CUDA op
    modules then: nothing :func:`resolved` and the dispatchers reach imports anything later. torch.compile
    cannot trace an import, so a model compiled before its first eager step would otherwise meet one
    inside the trace."""
    global _ops
    _ops = ops
    extension()
    _load_cuda_modules()


def registered_cuda_ops() -> list[str]:
    if extension() is None:
        return []
    _load_cuda_modules()
    return sorted(_cuda_impls)


def ops_info() -> Dict[str, Any]:
    """Where the ops run: backend, GPU arch, the archs the extension was built for, the CUDA ops.

    ``fp_recipes.backend_info()`` (``fp_recipes/_info.py``) is this plus the GEMM launchers.
    ``str(ops_info()["summary"])`` reads e.g. "cuda (sm_90, built for 90a;100a)" or
    "reference (no CUDA device)".
    """
    import torch

    ext = extension()
    info: Dict[str, Any] = {
        "extension": ext is not None,
        "extension_error": extension_error(),
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
        reason = "no CUDA device" if not info["cuda_available"] else f"no extension: {extension_error()}"
        info["summary"] = f"reference ({reason})"
    return info
