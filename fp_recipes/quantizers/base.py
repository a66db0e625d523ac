"""Base classes for quantized tensors and quantizers.

A :class:`QuantizedTensor` carries *everything* a consumer needs (format, scales, amax, flags such as
``row_scaled``, the E4M3 bound, rowwise/columnwise copies): dequantize and GEMM never look at a recipe.
They are plain Python objects holding torch tensors, so ``torch.save``/``torch.load`` work, and
``state_dict()``/``from_state_dict()`` give a flat dict of tensors and plain values.
"""

from __future__ import annotations

from typing import Any, ClassVar, Dict, Optional, Tuple

import torch

from .. import ops
from .roles import QuantizerSpec


class QuantizedTensor:
    """A quantized tensor. Subclasses define their fields and ``dequantize``."""

    kind: ClassVar[str] = "quantized"

    @property
    def shape(self) -> torch.Size:  # logical (unquantized) shape
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def to(self, device: torch.device | str) -> "QuantizedTensor":
        raise NotImplementedError

    def state_dict(self) -> Dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_state_dict(cls, state: Dict[str, Any]) -> "QuantizedTensor":
        raise NotImplementedError

    def release_rowwise(self) -> None:
        """The rowwise copy's last GEMM has run: free that copy (when a columnwise one serves the GEMMs that
        follow) and what only that GEMM reads (an NVFP4 tensor's BF16 unit operand), so neither lives on
        through the later GEMMs (a Linear backward: dy's rowwise copy is freed after dgrad, before wgrad
        allocates dW). Nothing here; the quantized tensor types say what they hold."""


# Dynamo before torch 2.13 cannot trace ``obj.__dict__``: traced copies go field by field there
_DICT_TRACEABLE = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def shallow_copy(obj: Any) -> Any:
    """A new instance of ``type(obj)`` with ``obj``'s attributes (no constructor checks). In a trace by a
    Dynamo that cannot read ``__dict__`` (torch < 2.13), the attributes named by the class's
    ``COPY_FIELDS``."""
    new = object.__new__(type(obj))
    if _DICT_TRACEABLE or not torch.compiler.is_compiling():
        new.__dict__.update(obj.__dict__)
    else:
        for name in type(obj).COPY_FIELDS:
            setattr(new, name, getattr(obj, name))
    return new


class Quantizer:
    """Quantizes tensors for one role, as its :class:`QuantizerSpec` says."""

    def __init__(self, spec: QuantizerSpec) -> None:
        self.spec = spec

    def quantize(self, x: torch.Tensor) -> QuantizedTensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> QuantizedTensor:
        return self.quantize(x)

    def serve_module_gemms(self) -> None:
        """Called once by a module that owns this quantizer for an operand its own GEMMs alone read, right
        after each cast and one call at a time (a Linear's activation and gradient): a format may then make,
        in the cast, what those GEMMs would otherwise make from its output (NVFP4 on Hopper: the BF16 unit
        operand). Nothing here."""

    def fuses_activation(self, activation: str, x: torch.Tensor) -> bool:
        """Whether :meth:`quantize_activation` applies ``activation`` inside its own cast of ``x`` (the
        activation's output then never written). False here: it quantizes the activation's output."""
        return False

    def quantize_activation(self, x: torch.Tensor, activation: str) -> QuantizedTensor:
        """``quantize(activation(x))`` for an element-wise activation of :mod:`fp_recipes.ops.activations` (an
        MLP's FC2 given FC1's output). Quantizers whose kernel can apply the activation in its pass override it
        (the same bytes, the activation's output never written)."""
        from ..ops.activations import ELEMENTWISE

        return self.quantize(ELEMENTWISE[activation].forward(x))

    def quantize_with_bias_grad(self, x: torch.Tensor, bias_dtype: torch.dtype) -> Tuple[QuantizedTensor, torch.Tensor]:
        """``quantize(x)`` and the bias gradient of ``x`` (a Linear's grad_output, 2-D), the column sums
        in :func:`fp_recipes.ops.bias_grad`'s order rounded to ``bias_dtype``. Quantizers whose cast can
        make the sums in its own pass over ``x`` override this (same bits, one read of ``x`` fewer)."""
        return self.quantize(x), ops.bias_grad(x, bias_dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec.describe()})"


def check_input(x: torch.Tensor, what: str, *, min_dim: int = 1,
                dtypes: Optional[tuple] = (torch.float32, torch.float16, torch.bfloat16)) -> None:
    """Clear errors for bad inputs, shared by every quantizer and reference op."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
    if dtypes is not None and x.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{what}: input dtype {str(x.dtype).replace('torch.', '')} is not supported; "
                        f"allowed: {allowed}")
    if x.dim() < min_dim:
        raise ValueError(f"{what}: expected a tensor with at least {min_dim} dims, got shape "
                         f"{tuple(x.shape)}")
