"""Megatron's column/row-parallel linears (and the fused layernorm + column-parallel linear) with
fp_recipes GEMMs.

Each class subclasses Megatron's own local layer, so parameters, initialisation (init_method, RNG
tracker, ``use_cpu_initialization``), parallel attributes and ``sharded_state_dict`` are Megatron's.
The constructor takes exactly the arguments Megatron passes to the TransformerEngine classes. When
the module runs quantized, the split and the sequence-parallel communication go through
``megatron.core.tensor_parallel`` mappings around :func:`fp_recipes.modules.linear_function.quantized_linear`
(which communicates nothing); when it does not, Megatron's own local forward runs unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear as _McoreColumn
from megatron.core.tensor_parallel.layers import RowParallelLinear as _McoreRow

from ...modules.linear_function import quantized_linear
from ...quantizers.roles import ModuleKind
from .quant import MegatronQuantized, RngNeutralQuantizedModule

__all__ = ["FpColumnParallelLinear", "FpRowParallelLinear", "FpLayerNormColumnParallelLinear",
           "apply_norm", "NORMS"]

NORMS = ("LayerNorm", "RMSNorm")


def _refuse(owner: str, **flags: Any) -> None:
    for name, value in flags.items():
        if value:
            raise ValueError(f"{owner}: {name}={value!r} is not supported by the fp_recipes Megatron "
                             f"backend (as in TransformerEngine's layers); it must be False")


class FpColumnParallelLinear(MegatronQuantized, _McoreColumn, RngNeutralQuantizedModule):
    """Column-parallel ``Y = X A^T (+ b)``; returns ``(output, bias_or_None)``."""

    module_kind = ModuleKind.LINEAR

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method: Callable,
                 gather_output: bool, bias: bool, skip_bias_add: bool, is_expert: bool,
                 skip_weight_param_allocation: bool = False, tp_comm_buffer_name: Optional[str] = None,
                 tp_group: Optional[torch.distributed.ProcessGroup] = None, stride: int = 1,
                 name: Optional[str] = None) -> None:
        _refuse(type(self).__name__, gather_output=gather_output,
                skip_weight_param_allocation=skip_weight_param_allocation)
        _McoreColumn.__init__(self, input_size, output_size, config=config, init_method=init_method,
                              bias=bias, gather_output=False, stride=stride, skip_bias_add=skip_bias_add,
                              is_expert=is_expert, tp_comm_buffer_name=tp_comm_buffer_name,
                              tp_group=tp_group)
        self.module_name = name
        self._setup_quant(config)

    def _parallel_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the local layer's autograd function does around its GEMM, as mappings."""
        if self.explicit_expert_comm or self.disable_grad_reduce:
            return x
        if self.sequence_parallel:
            return tensor_parallel.gather_from_sequence_parallel_region(
                x, tensor_parallel_output_grad=True, group=self.tp_group)
        return tensor_parallel.copy_to_tensor_model_parallel_region(x, group=self.tp_group)

    def _quantized_forward(self, x: torch.Tensor, sets) -> tuple:
        bias = None if self.skip_bias_add else self.bias
        out = quantized_linear(self._parallel_input(x), self.weight, bias, sets[0],
                               weight_columnwise_copy=self.weight_columnwise_copy)
        return out, (self.bias if self.skip_bias_add else None)

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None):
        _refuse(type(self).__name__, runtime_gather_output=runtime_gather_output)
        sets = self.gemm_quantizers()
        if sets is None:
            return _McoreColumn.forward(self, input_, weight)
        if weight is not None:
            raise ValueError(f"{type(self).__name__}: an external weight is not supported")
        return self._quantized_forward(input_, sets)


class FpRowParallelLinear(MegatronQuantized, _McoreRow, RngNeutralQuantizedModule):
    """Row-parallel ``Y = X A^T (+ b)``; returns ``(output, bias_or_None)``."""

    module_kind = ModuleKind.LINEAR

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method: Callable,
                 bias: bool, input_is_parallel: bool, skip_bias_add: bool, is_expert: bool,
                 tp_comm_buffer_name: Optional[str] = None,
                 tp_group: Optional[torch.distributed.ProcessGroup] = None,
                 name: Optional[str] = None) -> None:
        _McoreRow.__init__(self, input_size, output_size, config=config, init_method=init_method,
                           bias=bias, input_is_parallel=input_is_parallel, skip_bias_add=skip_bias_add,
                           is_expert=is_expert, tp_comm_buffer_name=tp_comm_buffer_name,
                           tp_group=tp_group)
        self.module_name = name
        self._setup_quant(config)

    def forward(self, input_: torch.Tensor):
        sets = self.gemm_quantizers()
        if sets is None:
            return _McoreRow.forward(self, input_)
        x = input_ if self.input_is_parallel else \
            tensor_parallel.scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)
        y = quantized_linear(x, self.weight, None, sets[0], weight_columnwise_copy=self.weight_columnwise_copy)
        if self.explicit_expert_comm:
            pass
        elif self.sequence_parallel:
            y = tensor_parallel.reduce_scatter_to_sequence_parallel_region(y, group=self.tp_group)
        else:
            y = tensor_parallel.reduce_from_tensor_model_parallel_region(y, group=self.tp_group)
        if self.skip_bias_add:
            return y, self.bias
        return (y + self.bias if self.bias is not None else y), None


def apply_norm(x: torch.Tensor, normalization: str, weight: torch.Tensor, bias: Optional[torch.Tensor],
               eps: float, zero_centered_gamma: bool) -> torch.Tensor:
    """LayerNorm / RMSNorm exactly as torch's modules compute them (Megatron's local norms)."""
    gamma = weight + 1 if zero_centered_gamma else weight
    if normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), gamma, bias, eps)
    return F.rms_norm(x, (x.shape[-1],), gamma, eps)


def check_normalization(owner: str, config: Any) -> str:
    norm = getattr(config, "normalization", "LayerNorm")
    if norm not in NORMS:
        raise ValueError(f"{owner}: config.normalization={norm!r} is not supported; allowed: "
                         f"{', '.join(NORMS)}")
    return norm


class FpLayerNormColumnParallelLinear(FpColumnParallelLinear):
    """``norm(x)`` then a column-parallel linear, in one module (``fuse_layernorm_and_linear``).
    The norm parameters are ``layer_norm_weight`` / ``layer_norm_bias`` (TE's names) and are marked
    ``sequence_parallel`` so Megatron all-reduces their gradients over the TP group."""

    module_kind = ModuleKind.LAYERNORM_LINEAR

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method: Callable,
                 gather_output: bool, bias: bool, skip_bias_add: bool, is_expert: bool,
                 skip_weight_param_allocation: bool = False, tp_comm_buffer_name: Optional[str] = None,
                 tp_group: Optional[torch.distributed.ProcessGroup] = None, stride: int = 1,
                 name: Optional[str] = None) -> None:
        _refuse(type(self).__name__, is_expert=is_expert)
        self.normalization = check_normalization(type(self).__name__, config)
        super().__init__(input_size, output_size, config=config, init_method=init_method,
                         gather_output=gather_output, bias=bias, skip_bias_add=skip_bias_add,
                         is_expert=is_expert, skip_weight_param_allocation=skip_weight_param_allocation,
                         tp_comm_buffer_name=tp_comm_buffer_name, tp_group=tp_group, stride=stride,
                         name=name)
        self.eps = float(config.layernorm_epsilon)
        self.zero_centered_gamma = bool(config.layernorm_zero_centered_gamma)
        device = self.weight.device
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(init(input_size, dtype=config.params_dtype,
                                                         device=device))
        if self.normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size, dtype=config.params_dtype,
                                                                  device=device))
        else:
            self.register_parameter("layer_norm_bias", None)
        for p in (self.layer_norm_weight, self.layer_norm_bias):
            if p is not None:
                setattr(p, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None):
        x = apply_norm(input_, self.normalization, self.layer_norm_weight, self.layer_norm_bias,
                       self.eps, self.zero_centered_gamma)
        return super().forward(x, weight, runtime_gather_output)
