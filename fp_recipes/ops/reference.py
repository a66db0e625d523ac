"""Pure-torch reference twins: one function per CUDA kernel, with the kernel's exact signature.

These are the numeric contracts (docs/numerics.md). CUDA kernels must reproduce their bytes (data
and scales) exactly. The twins live in one module per family; this module is their single index.
"""

from .ref_fp8 import *  # noqa: F401,F403
from .ref_fp8 import __all__ as _fp8_all
from .ref_nvfp4 import *  # noqa: F401,F403
from .ref_nvfp4 import __all__ as _nvfp4_all
from .ref_per_token import *  # noqa: F401,F403
from .ref_per_token import __all__ as _per_token_all

__all__ = list(_fp8_all) + list(_nvfp4_all) + list(_per_token_all)
