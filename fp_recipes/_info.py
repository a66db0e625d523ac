"""``fp_recipes.backend_info()``: what runs where, for the whole library.

It sits above both layers it reports on: the op dispatch (``ops/backend.py``: extension, device, CUDA
kernels) and the GEMMs (``gemm/``: the cuBLASLt launcher), so neither imports the other for it.
"""

from __future__ import annotations

from typing import Any, Dict

__all__ = ["backend_info"]


def backend_info() -> Dict[str, Any]:
    """What runs where: backend, GPU arch, the archs the extension was built for, the CUDA ops, and the
    GEMM launchers.

    ``str(fp_recipes.backend_info()["summary"])`` reads e.g. "cuda (sm_90, built for 90a;100a)" or
    "reference (no CUDA device)"; ``["grouped_gemm"]`` says whether the cuBLASLt launcher loaded (its
    version) or why not; ``["host_path"]`` whether the eager FP8 casts and GEMMs take the torch-linked C++
    host path (``fp_recipes._torch_ops``, FP_RECIPES_TORCH_OPS) or why not.
    """
    from . import _extension
    from .gemm import cublaslt
    from .ops.backend import ops_info

    info = ops_info()
    info["grouped_gemm"] = cublaslt.status()
    info["host_path"] = _extension.fast_ops_status()
    return info
