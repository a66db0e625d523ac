"""Select the host path of the eager FP8 casts and GEMMs (and the traced FP8 ops' C++ kernels) and the NVFP4
quantize launches inside one process, for A/B rows measured side by side (a host's speed drifts between processes
and machine instances by more than the difference measured):
``python_host_path()`` runs its block with the Python path, what FP_RECIPES_TORCH_OPS=off selects at start-up
(the variable itself is read once). Benchmarks only: it swaps process-wide look-ups, so no other thread may run
FP8 work meanwhile."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def python_host_path():
    from fp_recipes import _extension
    from fp_recipes.gemm import fp8 as gemm_fp8

    if _extension.fast_ops() is None:
        raise SystemExit(f"no torch-linked host path to compare against: {_extension.fast_ops_status()}")
    if not gemm_fp8._FAST_GEMM:
        gemm_fp8._fast_gemm()  # fill the look-up before saving it
    fast = _extension._fast
    saved = (list(gemm_fp8._FAST_GEMM), fast)
    gemm_fp8._FAST_GEMM[:], _extension._fast = [None], None
    ops_were = fast.traced_ops_enabled(False) if hasattr(fast, "traced_ops_enabled") else None
    try:  # (NVFP4 launches resolved inside the block keep the Python path: build the modules inside it)
        yield
    finally:
        gemm_fp8._FAST_GEMM[:], _extension._fast = saved
        if ops_were is not None:
            fast.traced_ops_enabled(ops_were)
