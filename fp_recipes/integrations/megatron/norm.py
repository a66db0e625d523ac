"""LayerNorm / RMSNorm for Megatron specs, with sequence parallelism (Megatron's torch-norm wrapper
refuses ``sequence_parallel=True``). Under sequence parallelism each rank normalises its own tokens
(the norm is per token), and the parameters are marked ``sequence_parallel`` so Megatron all-reduces
their gradients over the tensor-parallel group, as it does for TransformerEngine's norms."""

from __future__ import annotations

from typing import Any

import torch

from .linear import apply_norm, check_normalization

__all__ = ["FpNorm"]


class FpNorm(torch.nn.Module):
    """``config.normalization`` (LayerNorm or RMSNorm) over the last dim; TENorm's constructor."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, has_residual: bool = False) -> None:
        super().__init__()
        self.normalization = check_normalization("FpNorm", config)
        if has_residual and getattr(config, "fused_residual_rmsnorm", False):
            raise ValueError("FpNorm: config.fused_residual_rmsnorm=True is not supported by the "
                             "fp_recipes Megatron backend; set it to False")
        self.hidden_size = hidden_size
        self.eps = float(eps)
        self.zero_centered_gamma = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        kw = {"dtype": config.params_dtype, "device": device}
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, **kw))
        if self.normalization == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, **kw))
        else:
            self.register_parameter("bias", None)
        for p in (self.weight, self.bias):
            if p is not None:
                setattr(p, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_norm(x, self.normalization, self.weight, self.bias, self.eps, self.zero_centered_gamma)

    def extra_repr(self) -> str:
        return f"{self.normalization}({self.hidden_size}, eps={self.eps})"
