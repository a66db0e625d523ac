"""``fp_recipes.LayerNormMLP``: TransformerEngine's ``LayerNormMLP`` — norm, FC1, activation, FC2 — from the
quantized modules this package already has.

``fc1`` is a :class:`LayerNormLinear` (the norm in high precision, its GEMM quantized as a ``layernorm_linear``),
``fc2`` a :class:`Linear`: every quantizer, cache, checkpoint, FSDP2 and torch.compile rule of those modules holds
as it is, and a recipe that treats the two module kinds apart treats FC1 and FC2 apart. An element-wise activation is
applied by FC2 to its input (``Linear.forward_activation``): in its input's cast where the quantizer's kernel can
(FP8 on CUDA, GELU: the activation's output is never written), else as torch's op before the cast; a gated one
runs between the two modules. Either way outside autocast the module equals ``norm -> torch.nn.Linear ->
activation -> torch.nn.Linear`` exactly, and inside it the three modules called in a row.

TransformerEngine's flat parameter names (``layer_norm_weight``, ``fc1_weight``, ``fc2_bias`` ...) load into it:
a TE checkpoint of the module maps onto ``fc1.*`` / ``fc2.*`` when loaded."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from ..ops import activations
from .layernorm_linear import LayerNormLinear
from .linear import Linear

__all__ = ["LayerNormMLP"]


# TransformerEngine's flat names of the module's parameters -> this module's
_TE_NAMES = {"layer_norm_weight": "fc1.layer_norm_weight", "layer_norm_bias": "fc1.layer_norm_bias",
             "fc1_weight": "fc1.weight", "fc1_bias": "fc1.bias", "fc2_weight": "fc2.weight", "fc2_bias": "fc2.bias"}


class LayerNormMLP(torch.nn.Module):
    """``fc2(activation(fc1(norm(x))))``; returns ``(out, norm(x))`` when ``return_layernorm_output=True``.

    ``activation``: one of ``ops.activations.NAMES`` — ``"gelu"`` is the tanh approximation (TransformerEngine's
    ``gelu``, ``F.gelu(approximate="tanh")``), ``"gelu_erf"`` the exact GELU (``torch.nn.GELU()``); the gated ones
    (``swiglu`` for Llama-style MLPs, ``geglu``, ``reglu``) give FC1 ``2 * ffn_hidden_size`` outputs and multiply
    the activated first half by the second. ``normalization``, ``eps``, ``zero_centered_gamma``: as for
    :class:`LayerNormLinear`."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, eps: float = 1e-5, bias: bool = True, *,
                 normalization: str = "LayerNorm", activation: str = "gelu", zero_centered_gamma: bool = False,
                 return_layernorm_output: bool = False, params_dtype: Optional[torch.dtype] = None,
                 device=None) -> None:
        super().__init__()
        activations.check_name("LayerNormMLP", activation)
        if hidden_size <= 0 or ffn_hidden_size <= 0:
            raise ValueError(f"LayerNormMLP: hidden_size and ffn_hidden_size must be positive, got {hidden_size}, "
                             f"{ffn_hidden_size}")
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.activation = activation
        self.return_layernorm_output = return_layernorm_output
        gated = activation in activations.GATED
        self.fc1 = LayerNormLinear(hidden_size, ffn_hidden_size * (2 if gated else 1), bias=bias,
                                   normalization=normalization, eps=eps, zero_centered_gamma=zero_centered_gamma,
                                   return_layernorm_output=return_layernorm_output, params_dtype=params_dtype,
                                   device=device)
        self.fc2 = Linear(ffn_hidden_size, hidden_size, bias=bias, params_dtype=params_dtype, device=device)

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None
                ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """``is_first_microbatch``: as for :class:`Linear` (both GEMMs' quantized weight caches)."""
        h = self.fc1(x, is_first_microbatch)
        ln_out = None
        if self.return_layernorm_output:
            h, ln_out = h
        gated = activations.GATED.get(self.activation)
        if gated is not None:
            out = self.fc2(gated(h), is_first_microbatch)
        else:  # FC2 takes FC1's output and applies the activation in its input's cast (Linear.forward_activation)
            out = self.fc2.forward_activation(h, self.activation, is_first_microbatch)
        return out if ln_out is None else (out, ln_out)

    def set_recipe(self, recipe, amax_reduction_group=None) -> "LayerNormMLP":
        """:meth:`QuantizedModule.set_recipe` on both GEMMs' modules."""
        self.fc1.set_recipe(recipe, amax_reduction_group)
        self.fc2.set_recipe(recipe, amax_reduction_group)
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        # a TransformerEngine checkpoint's flat names, renamed in place before the submodules read theirs
        for te_name, name in _TE_NAMES.items():
            key = prefix + te_name
            if key in state_dict and prefix + name not in state_dict:
                state_dict[prefix + name] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, activation={self.activation}"
