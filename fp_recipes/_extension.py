"""The compiled extension ``fp_recipes._C`` and the stream handle every launch takes.

The lowest layer of the package: it imports nothing from fp_recipes, so both the op dispatch
(``ops/backend.py``, which re-exports these names) and the GEMM launchers (``gemm/cublaslt.py``) can
import it without importing each other.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

__all__ = ["extension", "extension_error", "current_stream"]

_lock = threading.Lock()
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
