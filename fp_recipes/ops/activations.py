"""The MLP activations by name (``LayerNormMLP``'s ``activation``), each torch's own ops, with the backward torch's
autograd would run for it.

A quantized Linear may take its input *before* the activation (``quantized_linear(..., input_activation=name)``): a
quantizer whose kernel can apply the activation in its cast (``Quantizer.quantize_activation``) then never writes
the activation's output; every other quantizer quantizes ``forward(x)``. Either way the bytes are those of
``quantize(forward(x))`` and the input's gradient is ``backward(dy, x)``: what the activation module and a Linear
in a row give. The gated activations (two halves of one tensor) are not in :data:`ELEMENTWISE`: they run outside."""

from __future__ import annotations

from typing import Callable, Dict, NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["Activation", "ELEMENTWISE", "GATED", "NAMES", "check_name"]


class Activation(NamedTuple):
    forward: Callable[[torch.Tensor], torch.Tensor]
    # (dy, x) -> dx: the ATen backward autograd records for ``forward``
    backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # (dy, x) -> dx written over dy: the same kernel with ``dy`` as its output (element-wise, so each element is
    # read before it is written); for a caller that owns ``dy``, saving a tensor of its size at the backward's peak
    backward_: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _gated(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def gated(h: torch.Tensor) -> torch.Tensor:
        a, b = h.chunk(2, dim=-1)  # (TransformerEngine and Megatron: the first half goes through the activation)
        return act(a) * b
    return gated


#: the element-wise activations (``gelu`` is the tanh approximation, TransformerEngine's ``gelu``)
ELEMENTWISE: Dict[str, Activation] = {
    "gelu": Activation(_gelu_tanh, lambda dy, x: torch.ops.aten.gelu_backward(dy, x, approximate="tanh"),
                       lambda dy, x: torch.ops.aten.gelu_backward.grad_input(dy, x, approximate="tanh",
                                                                             grad_input=dy)),
    "gelu_erf": Activation(F.gelu, lambda dy, x: torch.ops.aten.gelu_backward(dy, x),
                           lambda dy, x: torch.ops.aten.gelu_backward.grad_input(dy, x, grad_input=dy)),
    "relu": Activation(F.relu, lambda dy, x: torch.ops.aten.threshold_backward(dy, x, 0),
                       lambda dy, x: torch.ops.aten.threshold_backward.grad_input(dy, x, 0, grad_input=dy)),
    "silu": Activation(F.silu, lambda dy, x: torch.ops.aten.silu_backward(dy, x),
                       lambda dy, x: torch.ops.aten.silu_backward.grad_input(dy, x, grad_input=dy)),
}

#: the gated ones: FC1 has twice the outputs; the activated first half times the second
GATED: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "geglu": _gated(_gelu_tanh),
    "reglu": _gated(F.relu),
    "swiglu": _gated(F.silu),
}

NAMES = tuple(ELEMENTWISE) + tuple(GATED)


def check_name(owner: str, name: str) -> None:
    if name not in NAMES:
        raise ValueError(f"{owner}: activation={name!r} is not supported; allowed: {', '.join(NAMES)} (gelu is the "
                         "tanh approximation, TransformerEngine's 'gelu'; gelu_erf is torch.nn.GELU()'s exact one)")
