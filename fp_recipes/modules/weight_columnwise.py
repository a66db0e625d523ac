"""A weight's columnwise copy for dgrad: held from the forward, or made again in the backward.

Hopper's FP8 GEMMs take only the TN layout, so dgrad (dy @ W) reads W's *columnwise* FP8 copy. Cast in
the forward beside the rowwise copy and saved for the backward, it costs 1 byte per weight element from
the forward to the backward, while FP8 saves only 1 byte per input element in place of BF16's 2: a
Linear with more outputs than tokens (N > M) then holds more than its BF16 twin (which saves only x:
its dgrad reads the weight, resident anyway). At hidden 4096 with 4096 tokens (``bench_model.py``) the
saved weight copies outweigh the activation savings by ~290 MiB over 4 blocks.

So a module's ``weight_columnwise_copy`` says where the copy comes from:

* ``"save"``: cast with the rowwise copy in the forward (one pass over W) and saved;
* ``"recast"``: the forward casts the rowwise copy alone and keeps the scale it used; the backward casts
  the columnwise copy from the weight (resident) with that scale: the same bytes, one more read of W;
* ``"auto"`` (default): ``"recast"`` when N > M (the saved copy would exceed what the BF16 Linear saves
  for its backward), else ``"save"``.

Recasting applies to per-tensor FP8 weights (delayed and current scaling: a quantizer with
``quantize_rowwise``/``quantize_columnwise``), eagerly and in torch.compile graphs, when the weight is a
plain tensor and is not served from or stored into the weight cache (a cached copy holds both copies
anyway: it is used as is). Other formats and weights FSDP2 all-gathered quantized always save.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import torch

from .amax_reduction import reducer
from .weight_cache import WeightCache
from ..quantizers.roles import ScalingKind

__all__ = ["COPY_POLICIES", "DeferredColumnwise", "check_policy", "recasts", "quantize_weight_rowwise"]

COPY_POLICIES = ("auto", "save", "recast")
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def check_policy(value: Any, owner: str = "", recasts_supported: bool = True) -> str:
    if value not in COPY_POLICIES:
        raise ValueError(f"weight_columnwise_copy must be one of {', '.join(map(repr, COPY_POLICIES))}, "
                         f"got {value!r}")
    if value == "recast" and not recasts_supported:
        raise ValueError(f"{owner}: weight_columnwise_copy='recast' is not supported (its weights' columnwise "
                         "copies are saved from the forward); allowed here: 'auto', 'save'")
    return value


def recasts(policy: str, quantizer: Any, weight: torch.Tensor, tokens: int) -> bool:
    """Whether this forward casts ``weight``'s rowwise copy alone and the backward the columnwise one."""
    if policy == "save" or quantizer is None or tokens == 0 or type(weight) not in _PLAIN_TENSORS:
        return False
    if policy == "auto" and weight.shape[0] <= tokens:
        return False
    spec = quantizer.spec
    return spec.rowwise and spec.columnwise and hasattr(quantizer, "quantize_columnwise")


class DeferredColumnwise:
    """What the backward needs to make a weight's columnwise copy: the quantizer, the weight, the scale of the
    rowwise cast and that cast's scale_inv/amax (saved through ``split_saved``, as a quantized tensor is).
    (No ``__slots__``: torch.compile traces it as it traces the quantized tensors.)"""

    def __init__(self, quantizer: Any, weight: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor,
                 amax: torch.Tensor) -> None:
        self.quantizer = quantizer
        self.weight, self.scale, self.scale_inv, self.amax = weight, scale, scale_inv, amax

    def split_saved(self) -> Tuple[tuple, "DeferredColumnwise"]:
        return (self.weight, self.scale, self.scale_inv, self.amax), DeferredColumnwise(self.quantizer, *(None,) * 4)

    def with_saved_tensors(self, tensors: Sequence[Optional[torch.Tensor]]) -> "DeferredColumnwise":
        return DeferredColumnwise(self.quantizer, *tensors)

    def columnwise(self) -> Any:
        """The columnwise copy the forward would have saved (the same bytes)."""
        return self.quantizer.quantize_columnwise(self.weight, self.scale, self.scale_inv, self.amax)


def quantize_weight_rowwise(quantizer: Any, weight: torch.Tensor, group: Any, *, record: bool,
                            cache: Optional[WeightCache], mode: str, full, forced: bool = False) -> Tuple[Any, Any]:
    """(the quantized weight, None) from the weight cache (hit, or a cast that will be stored: ``full``,
    the usual ``quantize_weight``, makes both copies), else (the rowwise cast alone, a
    :class:`DeferredColumnwise` for the backward). ``forced``: a checkpoint recompute of a
    call that cast the rowwise copy alone (the cache is not consulted: the same tensors are saved)."""
    if cache is not None and not forced:
        if type(cache) is not WeightCache or len(cache) or (record and cache.will_store(mode)):
            return full(), None
        cache.lookup_one(quantizer, weight, mode, probe=record)  # (empty: sees whether reuse started)
        if record and cache.will_store(mode):
            return full(), None
    q, scale = quantizer.quantize_rowwise(weight)
    if record:
        if quantizer.spec.scaling is ScalingKind.DELAYED:
            reducer.record_forward(quantizer, group)
        if cache is not None:
            cache.store_one(quantizer, weight, q, mode)  # (not storing: keeps the key the copy would have)
    return q, DeferredColumnwise(quantizer, weight, scale, q.scale_inv, q.amax)
