"""The compiled extension ``fp_recipes._C`` and the stream handle every launch takes.

The lowest layer of the package: it imports nothing from fp_recipes, so both the op dispatch
(``ops/backend.py``, which re-exports these names) and the GEMM launchers (``gemm/cublaslt.py``) can
import it without importing each other.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

__all__ = ["extension", "extension_error", "current_stream", "fast_ops", "fast_ops_status"]

_lock = threading.RLock()  # fast_ops() loads _C while holding it
_ext: Any = None
_ext_error: Optional[str] = None
_ext_loaded = False


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


_fast: Any = None
_fast_status = ""
_fast_loaded = False
FAST_OPS_VAR = "FP_RECIPES_TORCH_OPS"
FAST_OPS_CHOICES = ("auto", "off")  # the env table's entry (recipes/env.py) allows the same: a test checks


def fast_ops() -> Any:
    """The torch-linked host path ``fp_recipes._torch_ops`` (eager FP8 casts and GEMMs, NVFP4 quantize launches,
    emulated NVFP4 GEMMs, delayed-scaling updates) initialised with ``_C``'s kernel table, or None (not built,
    FP_RECIPES_TORCH_OPS=off, or built against another ``_C``; :func:`fast_ops_status` says which). Read once: the
    choice holds for the process."""
    global _fast, _fast_status, _fast_loaded
    if not _fast_loaded:
        with _lock:
            if not _fast_loaded:
                _fast, _fast_status = _load_fast_ops()
                _fast_loaded = True
    return _fast


def _load_fast_ops() -> tuple:
    import os

    raw = os.environ.get(FAST_OPS_VAR, "")
    value = raw.strip().lower() or "auto"
    if value not in FAST_OPS_CHOICES:  # the env table's message (this module imports nothing of the package)
        raise ValueError(f"environment variable {FAST_OPS_VAR}={raw!r} is not allowed; allowed: "
                         f"{' | '.join(FAST_OPS_CHOICES)} (any case)")
    if value == "off":
        return None, f"off ({FAST_OPS_VAR}=off)"
    ext = extension()
    if ext is None or not hasattr(ext, "kernel_table"):
        return None, "unavailable: fp_recipes._C " + ("is not loaded" if ext is None else "has no kernel table")
    try:
        from fp_recipes import _torch_ops  # type: ignore[attr-defined]

        _torch_ops.init(ext.kernel_table())
    except ImportError as exc:
        return None, (f"not built or not loadable ({type(exc).__name__}: {exc}; pip install --no-build-isolation "
                      "builds it against the torch you run)")
    except (RuntimeError, TypeError, ValueError) as exc:  # an older _C, a stand-in without a real table
        return None, f"unavailable: {exc}"
    return _torch_ops, ("on: one C++ call per eager FP8 cast, FP8 GEMM, NVFP4 quantize launch, emulated NVFP4 GEMM "
                        "and delayed-scaling update (fp_recipes._torch_ops)")


def fast_ops_status() -> str:
    """What :func:`fast_ops` found, in words (doctor, the demo's table)."""
    fast_ops()
    return _fast_status


def extension_error() -> Optional[str]:
    """Why :func:`extension` is None (None when it loaded)."""
    extension()
    return _ext_error


_RAW_STREAM: list = []  # torch's raw stream accessor (or None), looked up on first use


def current_stream(device: Any) -> int:
    """The handle of ``device``'s current CUDA stream (None index: the current device), for a kernel
    launch. torch's raw accessor builds no Stream object: launches sit on hot paths where that host
    time adds up."""
    import torch

    if not _RAW_STREAM:
        _RAW_STREAM.append(getattr(torch._C, "_cuda_getCurrentRawStream", None))
    raw = _RAW_STREAM[0]
    index = device.index if device.index is not None else torch.cuda.current_device()
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream
