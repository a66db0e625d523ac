"""GEMMs on quantized operands: every format pair, grouped GEMMs, the cuBLASLt launchers.

Convention (TN, as cuBLAS): both operands have the contraction dimension LAST; ``gemm(a, b)`` returns
``op(a) @ op(b)^T`` (see :mod:`.dispatch`). One job per file:

* ``dispatch.py``        ``gemm(a, b)``: picks the path from the operands' own types (never a recipe)
* ``operands.py``        which copy of a quantized tensor a GEMM reads (rowwise / columnwise views)
* ``fp8.py``             FP8 x FP8: ``torch._scaled_mm`` on sm_89+, exact FP32 emulation elsewhere
* ``nvfp4.py``           NVFP4 x NVFP4: which implementation runs (per device; first-use self-check,
  FP_RECIPES_NVFP4_GEMM)
* ``nvfp4_emulated.py``  the exact NVFP4 emulation (torch ops; the few-launch CUDA path); the reference
* ``nvfp4_native.py``    native FP4 GEMM on sm_100+ (``torch._scaled_mm``; not yet run on Blackwell here)
* ``scale_layout.py``    the swizzled block-scale layout cuBLAS reads
* ``dense.py``           high-precision and mixed-format operands
* ``grouped.py``         one GEMM per group (``torch._scaled_grouped_mm`` where it applies)
* ``cublaslt.py``        cuBLASLt called directly: FP8 GEMMs through cached plans (dense, and many in
  one host call), BF16 GEMM with a device-side alpha
* ``_common.py``         capability query, FP32 matmuls, epilogue, padding
"""

from __future__ import annotations

from .dispatch import gemm
from .dense import gemm_high_precision
from .fp8 import fp8_native_gemm_available, gemm_fp8_fp8
from .grouped import grouped_gemm
from .nvfp4 import gemm_nvfp4_nvfp4, nvfp4_native_gemm_available
from .nvfp4_emulated import decode_nvfp4_unit

__all__ = [
    "gemm",
    "gemm_fp8_fp8",
    "gemm_nvfp4_nvfp4",
    "gemm_high_precision",
    "grouped_gemm",
    "decode_nvfp4_unit",
    "fp8_native_gemm_available",
    "nvfp4_native_gemm_available",
]
