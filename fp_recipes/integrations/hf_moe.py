"""Hugging Face MoE experts (fused 3-D expert weights) as fp_recipes grouped GEMMs.

transformers (5.x) stores the routed experts of Mixtral, Qwen2/Qwen3-MoE, DeepSeek-V2/V3, OLMoE, GLM-MoE
and others in one module with ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I) parameters,
marked by its ``use_experts_implementation`` decorator (``has_gate``, ``is_transposed``, ...), and
called as ``experts(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k))``. They are not
``nn.Linear``\\ s, so a Linear swap leaves most of the FLOPs in high precision.

:class:`GroupedExperts` replaces such a module: it keeps the *same* parameter objects under the same
names (checkpoints load both ways, optimizers keep working) and computes the experts with two
:class:`~fp_recipes.GroupedLinear` GEMM sets (per-expert quantizers, one scale per expert):
tokens are permuted so that each expert's rows are contiguous (``m_splits``), run through gate/up,
the gate activation and down, weighted by their router probabilities and summed back per token.
Outside autocast the result is bit-identical to transformers' eager experts loop: each expert sees
the same rows in the same order, the same ``F.linear`` calls, and each token's contributions are
added in ascending expert order in the hidden dtype (done without atomics, so it is deterministic on
GPUs too). transformers is never imported here; modules are recognised by their structure.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from ..modules.base import QuantizedModule
from ..modules.grouped_linear import GroupedLinear

__all__ = ["ExpertProjection", "GroupedExperts", "fused_experts_problem", "is_fused_experts"]


class ExpertProjection(GroupedLinear):
    """A :class:`GroupedLinear` whose expert weights are the slices of one (E, out, in) parameter owned
    by its :class:`GroupedExperts` (bound before each call), so the checkpoint keeps one fused tensor.
    It owns only the quantizer state (per-expert scales, amax histories)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int) -> None:
        QuantizedModule.__init__(self)
        self._num_gemms = num_experts
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = False
        self._bound: dict = {}  # a plain dict: the weight stays registered on the owner only

    def bind(self, weight: torch.Tensor) -> None:
        expected = (self._num_gemms, self.out_features, self.in_features)
        if tuple(weight.shape) != expected:
            raise ValueError(f"ExpertProjection: weight must have shape {expected} (experts, out, in), got "
                             f"{tuple(weight.shape)}")
        self._bound["weight"] = weight

    def _weight(self) -> torch.Tensor:
        weight = self._bound.get("weight")
        if weight is None:
            raise RuntimeError("ExpertProjection is called through its GroupedExperts, which binds the fused "
                               "weight first; it has no weight of its own")
        return weight

    def weights(self) -> List[torch.Tensor]:
        return list(self._weight().unbind(0))

    def biases(self) -> List[Optional[torch.Tensor]]:
        return [None] * self._num_gemms

    def _param_device(self) -> Optional[torch.device]:
        weight = self._bound.get("weight")
        return None if weight is None else weight.device


def is_fused_experts(module: torch.nn.Module) -> bool:
    """A module holding 3-D expert weights (``gate_up_proj`` or ``up_proj``, and ``down_proj``)."""
    params = module._parameters
    down = params.get("down_proj")
    up = params.get("gate_up_proj", params.get("up_proj"))
    return (isinstance(down, torch.Tensor) and isinstance(up, torch.Tensor) and down.dim() == 3
            and up.dim() == 3)


def _default_gate(module: torch.nn.Module) -> bool:
    gate = getattr(type(module), "_apply_gate", None)
    return (gate is not None and getattr(gate, "__name__", "") == "_default_apply_gate"
            and getattr(gate, "__module__", "") == "transformers.integrations.moe")


def fused_experts_problem(module: torch.nn.Module) -> Optional[str]:
    """None when :class:`GroupedExperts` computes exactly what ``module`` computes; otherwise why not."""
    if not hasattr(module, "has_gate") or not hasattr(module, "is_transposed"):
        return ("not a transformers experts module (no use_experts_implementation markers has_gate/"
                "is_transposed), so its forward is unknown")
    flags = {"has_gate": True, "is_transposed": False, "is_concatenated": True, "has_bias": False,
             "has_post_expert_norm": False, "_is_expert_parallel": False}
    wrong = [f"{k}={getattr(module, k, None)!r}" for k, want in flags.items() if getattr(module, k, None) is not want]
    if wrong:
        return (f"layout {', '.join(wrong)} (supported: gated [gate; up] weights (E, out, in) without bias, "
                "no post-expert norm, no expert parallelism)")
    if not _default_gate(module):
        return "a custom _apply_gate (only act(gate) * up is supported)"
    if not isinstance(getattr(module, "act_fn", None), torch.nn.Module) and not callable(getattr(module, "act_fn", None)):
        return "no act_fn"
    gate_up, down = module._parameters.get("gate_up_proj"), module._parameters["down_proj"]
    if gate_up is None:
        return "no gate_up_proj"
    e, two_i, h = gate_up.shape
    if two_i % 2 or tuple(down.shape) != (e, h, two_i // 2):
        return (f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not (E, 2I, H) and "
                "(E, H, I)")
    return None


class GroupedExperts(torch.nn.Module):
    """Drop-in for a transformers fused experts module (see the module docstring).

    Parameters: ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I), the original objects. Children:
    ``gate_up`` and ``down`` (:class:`ExpertProjection`, quantizer state only) and the original
    ``act_fn``. ``forward(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H)``."""

    def __init__(self, experts: torch.nn.Module) -> None:
        from .convert import carry_module_state

        problem = fused_experts_problem(experts) if is_fused_experts(experts) else "no 3-D expert weights"
        if problem is not None:
            raise ValueError(f"GroupedExperts cannot replace {type(experts).__name__}: {problem}")
        super().__init__()
        carry_module_state(experts, self)  # the same parameters, act_fn, hooks, config and flags
        if "act_fn" not in self._modules:  # a plain function rather than an activation module
            self.__dict__["act_fn"] = experts.act_fn
        e, two_i, h = self.gate_up_proj.shape
        self.num_experts = e
        self.gate_up = ExpertProjection(e, h, two_i)
        self.down = ExpertProjection(e, two_i // 2, h)
        self.replaces = type(experts).__name__

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if hidden_states.dim() != 2 or top_k_index.dim() != 2 or top_k_weights.shape != top_k_index.shape \
                or top_k_index.shape[0] != hidden_states.shape[0]:
            raise ValueError(f"GroupedExperts: expected hidden_states (T, H), top_k_index (T, k) and "
                             f"top_k_weights (T, k), got {tuple(hidden_states.shape)}, "
                             f"{tuple(top_k_index.shape)}, {tuple(top_k_weights.shape)}")
        tokens, k = top_k_index.shape
        with torch.no_grad():
            # rows by expert, then top-k slot, then token: the order transformers' eager loop uses
            ids = top_k_index.t().reshape(-1)
            counts = torch.bincount(ids, minlength=self.num_experts)
            if counts.numel() != self.num_experts:
                raise ValueError(f"GroupedExperts: top_k_index holds expert {counts.numel() - 1} but there are "
                                 f"{self.num_experts} experts (0..{self.num_experts - 1})")
            perm = torch.argsort(ids, stable=True)
            token, slot = perm % tokens, perm // tokens
            # for the sum: rows grouped by token, each token's rows in ascending expert order
            by_token = torch.argsort(token, stable=True)
        m_splits = counts.tolist()
        self.gate_up.bind(self.gate_up_proj)
        self.down.bind(self.down_proj)
        gate, up = self.gate_up(hidden_states[token], m_splits).chunk(2, dim=-1)
        out = self.down(self.act_fn(gate) * up, m_splits)
        out = (out * top_k_weights[token, slot, None]).to(hidden_states.dtype)
        parts = out[by_token].view(tokens, k, hidden_states.shape[1])
        total = torch.zeros_like(hidden_states)
        for j in range(k):
            total = total + parts[:, j]
        return total

    def extra_repr(self) -> str:
        e, two_i, h = self.gate_up_proj.shape
        return f"replaces={self.replaces}, num_experts={e}, hidden={h}, intermediate={two_i // 2}"
