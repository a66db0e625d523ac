"""Select the host path of the eager FP8 casts and GEMMs and the NVFP4 quantize launches inside one process, for A/B rows measured side by side
(a host's speed drifts between processes and machine instances by more than the difference measured):
``python_host_path()`` runs its block with the Python path, what FP_RECIPES_TORCH_OPS=off selects at start-up
(the variable itself is read once). Benchmarks only: it swaps process-wide look-ups, so no other thread may run
FP8 work meanwhile."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def python_host_path():
    from fp_recipes import _extension
    from fp_recipes.gemm import fp8 as gemm_fp8
    from fp_recipes.ops import cuda_fp8, cuda_nvfp4

    if _extension.fast_ops() is None:
        raise SystemExit(f"no torch-linked host path to compare against: {_extension.fast_ops_status()}")
    cuda_fp8.fp8_cast_planned(*_warm_up())  # fill the look-ups before saving them
    if not cuda_nvfp4._FAST:
        cuda_nvfp4._fast_ops()
    saved = (list(cuda_fp8._FAST), list(gemm_fp8._FAST_GEMM), list(cuda_nvfp4._FAST), _extension._fast)
    cuda_fp8._FAST[:], gemm_fp8._FAST_GEMM[:], cuda_nvfp4._FAST[:], _extension._fast = [None], [None], [None], None
    try:  # (NVFP4 launches resolved inside the block keep the Python path: build the modules inside it)
        yield
    finally:
        (cuda_fp8._FAST[:], gemm_fp8._FAST_GEMM[:], cuda_nvfp4._FAST[:], _extension._fast) = saved


def _warm_up():
    import torch

    from fp_recipes.gemm import fp8 as gemm_fp8
    from fp_recipes.ops import cuda_fp8

    if not gemm_fp8._FAST_GEMM:
        gemm_fp8._fast_gemm()
    return torch.ones((16, 16), device="cuda"), cuda_fp8.CastPlan("e4m3", True, False, True)
