"""``fp_recipes.LayerNormLinear``: LayerNorm/RMSNorm followed by a quantized Linear.

The normalisation runs in high precision with torch's own ops (its backward is autograd's); only the
GEMM is quantized, with roles of module kind ``layernorm_linear`` so a recipe can treat it apart."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

from ..quantizers.roles import ModuleKind
from .base import QuantizedModule
from .linear_function import quantized_linear
from .linear import _factory, check_features, new_linear_parameters

__all__ = ["LayerNormLinear"]

_NORMS = ("LayerNorm", "RMSNorm")


class LayerNormLinear(QuantizedModule):
    """``linear(norm(x))``; returns ``(out, norm(x))`` when ``return_layernorm_output=True``.

    ``zero_centered_gamma=True`` stores gamma - 1 (initialised to 0) and applies ``1 + gamma``, which
    keeps weight decay from pulling the scale towards zero. Outside autocast the result equals
    ``torch.nn.LayerNorm``/``torch.nn.RMSNorm`` followed by ``torch.nn.Linear`` exactly."""

    module_kind = ModuleKind.LAYERNORM_LINEAR

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 normalization: str = "LayerNorm", eps: float = 1e-5, zero_centered_gamma: bool = False,
                 return_layernorm_output: bool = False, params_dtype: Optional[torch.dtype] = None,
                 device=None) -> None:
        super().__init__()
        if normalization not in _NORMS:
            raise ValueError(f"LayerNormLinear: normalization={normalization!r} is not supported; "
                             f"allowed: {', '.join(_NORMS)}")
        check_features("LayerNormLinear", in_features, out_features)
        self.in_features = in_features
        self.out_features = out_features
        self.normalization = normalization
        self.eps = float(eps)
        self.zero_centered_gamma = zero_centered_gamma
        self.return_layernorm_output = return_layernorm_output
        kw = _factory(params_dtype, device)
        gamma_init = torch.zeros if zero_centered_gamma else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(gamma_init(in_features, **kw))
        if normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(torch.zeros(in_features, **kw))
        else:
            self.register_parameter("layer_norm_bias", None)
        weight, b = new_linear_parameters(in_features, out_features, bias, kw)
        self.register_parameter("weight", weight)
        self.register_parameter("bias", b)

    def _gamma(self) -> torch.Tensor:
        return self.layer_norm_weight + 1 if self.zero_centered_gamma else self.layer_norm_weight

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        shape = (self.in_features,)
        if self.normalization == "LayerNorm":
            return F.layer_norm(x, shape, self._gamma(), self.layer_norm_bias, self.eps)
        return F.rms_norm(x, shape, self._gamma(), self.eps)

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None
                ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """``is_first_microbatch``: as for :class:`Linear` (the quantized weight's cache)."""
        both = self._linear_shortcut(x, is_first_microbatch, True)
        if both is not None:
            return both if self.return_layernorm_output else both[0]
        sets = self.gemm_quantizers()
        self.check_input(x, sets)
        ln_out = self.normalize(x)
        if sets is None:
            out = quantized_linear(ln_out, self.weight, self.bias, None)
        else:
            cache, mode = self.weight_cache_for(is_first_microbatch)
            out = quantized_linear(ln_out, self.weight, self.bias, sets[0], cache, mode, self.weight_columnwise_copy)
        if self.return_layernorm_output:
            return out, ln_out
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, normalization={self.normalization}, eps={self.eps}, "
                f"zero_centered_gamma={self.zero_centered_gamma}")
