"""``fp_recipes.Linear``: ``torch.nn.Linear`` whose GEMMs are quantized under ``fp_recipes.autocast``."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ..quantizers.roles import ModuleKind
from .base import QuantizedModule
from .linear_function import quantized_linear

__all__ = ["Linear"]


def _factory(params_dtype: Optional[torch.dtype], device) -> dict:
    return {"dtype": params_dtype if params_dtype is not None else torch.get_default_dtype(),
            "device": device}


def reset_linear_parameters(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    """The same initialisation as ``torch.nn.Linear`` (so swapping modules changes no statistics)."""
    torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        fan_in = weight.shape[1]
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        torch.nn.init.uniform_(bias, -bound, bound)


def check_features(owner: str, in_features: int, out_features: int) -> None:
    if in_features <= 0 or out_features <= 0:
        raise ValueError(f"{owner}: in_features and out_features must be positive, got "
                         f"{in_features}, {out_features}")


def new_linear_parameters(in_features: int, out_features: int, bias: bool,
                          kw: dict) -> Tuple[torch.nn.Parameter, Optional[torch.nn.Parameter]]:
    """A (out, in) weight and an optional (out,) bias, initialised by :func:`reset_linear_parameters`."""
    weight = torch.nn.Parameter(torch.empty(out_features, in_features, **kw))
    b = torch.nn.Parameter(torch.empty(out_features, **kw)) if bias else None
    with torch.no_grad():
        reset_linear_parameters(weight, b)
    return weight, b


class Linear(QuantizedModule):
    """``y = x W^T + b``. Outside autocast: exactly ``torch.nn.functional.linear``. Inside: fprop,
    dgrad and wgrad operands quantized by role as the autocast recipe plans them."""

    module_kind = ModuleKind.LINEAR

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 params_dtype: Optional[torch.dtype] = None, device=None) -> None:
        super().__init__()
        check_features("Linear", in_features, out_features)
        self.in_features = in_features
        self.out_features = out_features
        weight, b = new_linear_parameters(in_features, out_features, bias, _factory(params_dtype, device))
        self.register_parameter("weight", weight)
        self.register_parameter("bias", b)

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """``is_first_microbatch`` (TransformerEngine's): None reuses the quantized weight while it is
        unchanged (automatic), True quantizes and caches it, False reuses the cached copy (see
        docs/modules.md, "Weight casts once per optimizer step")."""
        y = self._linear_shortcut(x, is_first_microbatch)
        if y is not None:
            return y
        return self._forward(x, is_first_microbatch, None)

    def forward_activation(self, x: torch.Tensor, activation: str,
                           is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """``self(activation(x))`` for an element-wise activation of :mod:`fp_recipes.ops.activations` (an MLP's
        FC2 given FC1's output: :class:`LayerNormMLP`). Quantized, the activation is applied in the input's cast
        where the quantizer's kernel can (FP8 on CUDA, GELU: its output never written), else by its own op before
        the cast; the bytes and gradients are those of the activation's module followed by this layer."""
        return self._forward(x, is_first_microbatch, activation)

    def _forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool], activation: Optional[str]) -> torch.Tensor:
        """The general path (the shortcut's conditions failed, or an input activation)."""
        sets = self.gemm_quantizers()
        self.check_input(x, sets)
        if sets is None:
            return quantized_linear(x, self.weight, self.bias, None, input_activation=activation)
        cache, mode = self.weight_cache_for(is_first_microbatch)
        return quantized_linear(x, self.weight, self.bias, sets[0], cache, mode, self.weight_columnwise_copy,
                                input_activation=activation)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
