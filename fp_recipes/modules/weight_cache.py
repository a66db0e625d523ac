"""Weight casts once per optimizer step: a module's quantized weights, reused while the weight is unchanged.

With gradient accumulation a weight is the same for every micro-batch of an optimizer step, yet each
forward would quantize it again (a full pass over the weight, two copies for FP8). A
:class:`WeightCache` (one per module) keeps the quantized weight of the last forward and hands it to
the next forward when nothing it depends on changed:

* the weight: the same tensor object, the same version counter (``weight._version``: every in-place
  update through autograd-visible ops, the optimizers' ``add_``/``_foreach_*`` and ``copy_`` under
  ``torch.no_grad()`` included, bumps it), the same storage address and dtype;
* the quantizer: the same object (one per module, recipe, GEMM and operand, so a recipe change misses);
* delayed scaling: the same scale tensor at the same version (the scale is rewritten at every outermost
  autocast exit, so a cached copy serves the forwards of one autocast region; across regions see
  ``is_first_microbatch``);
* no optimizer step ran since (any ``torch.optim.Optimizer``: a global post-step hook clears every
  cache, which also frees the copies, and covers optimizers that write the weights through ``.data``,
  which no version counter sees).

Automatic mode keeps a copy only while copies get reused. A copy that is dropped unused (the weight
changed, or an optimizer step ran, before any forward reused it: one micro-batch per optimizer step)
stops the storing: holding every weight's quantized copies from the forward to the optimizer step
would cost memory for nothing (at hidden 4096, 4 blocks: 704 MiB of rowwise FP8 copies through the
backward). While off, the cache remembers only what each copy would have been keyed on; a forward that
would have hit (the weight unchanged since the last forward: gradient accumulation started) turns the
storing back on, so the next forward reuses again. ``is_first_microbatch=True``/``False`` always store.

Forwards that hit the cache still do the per-forward bookkeeping: delayed scaling records the weight's
amax (kept with the copy) into the history and takes part in the amax reduction, so the amax history
and scales are the same as without the cache.

TransformerEngine's ``is_first_microbatch`` forward argument selects the mode per call:
``None`` (default) automatic as above; ``True`` quantize and cache (the first micro-batch);
``False`` reuse the cached copy whenever it belongs to the same weight tensor and quantizer, even
across autocast exits that rewrote a delayed-scaling scale (TE's contract: the caller guarantees the
weights did not change; the copy keeps the scale of the micro-batch that made it). No cache is used,
and the module keeps none, outside training mode (``module.eval()``) or under
``torch.inference_mode()``, under torch.compile (the graph owns the casts), while a CUDA graph is captured
around the call outside ``make_graphed_callables`` (the graph casts: a copy it read would go stale at the next
optimizer step; the copies are kept for later eager calls), for stochastically
rounded weights, and in automatic mode for parameters sharded by FSDP2 (its all-gathers refill the
unsharded weight in place without a version bump). ``module.cache_quantized_weights = False`` turns
it off for a module.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, Optional, Sequence

import torch

__all__ = ["AUTO", "REFRESH", "REUSE", "WeightCache", "cache_mode", "optimizer_steps"]

AUTO, REFRESH, REUSE = "auto", "refresh", "reuse"

_CACHES: "weakref.WeakSet[WeightCache]" = weakref.WeakSet()
_HOOK: list = []
_STEPS = [0]


def cache_mode(is_first_microbatch: Optional[bool]) -> str:
    """TransformerEngine's ``is_first_microbatch`` as a cache mode."""
    if is_first_microbatch is None:
        return AUTO
    if not isinstance(is_first_microbatch, bool):
        raise TypeError(f"is_first_microbatch must be None, True or False, got {is_first_microbatch!r}")
    return REFRESH if is_first_microbatch else REUSE


def optimizer_steps() -> int:
    """How many optimizer steps the post-step hook has seen (for tests and diagnostics)."""
    return _STEPS[0]


def _after_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    _STEPS[0] += 1
    for cache in list(_CACHES):
        cache.drop_after_step()


def _ensure_hook() -> None:
    if not _HOOK:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _HOOK.append(register_optimizer_step_post_hook(_after_optimizer_step))


class _Entry:
    """``weights``: one (weak reference, version, address, dtype) per weight; ``scales``: one
    :func:`_scale_key` per quantizer."""

    __slots__ = ("quantizers", "weights", "scales", "value", "n", "hits")


def _scale_key(q: Any) -> Optional[tuple]:
    s = getattr(q, "scale", None)
    return (s, s._version) if isinstance(s, torch.Tensor) and hasattr(q, "amax_history") else None


class WeightCache:
    """One module's cached quantized weights, one entry per (first) weight quantizer of a GEMM.

    An entry names its quantizers and weights (weakly), and what the weights' and scales' versions
    were; :meth:`lookup` returns the cached value when they still match (``mode``), :meth:`store`
    replaces the entry. Automatic mode stores only while copies are reused (module docstring):
    ``storing`` says whether it does now."""

    __slots__ = ("_entries", "_probes", "storing", "__weakref__")

    def __init__(self) -> None:
        self._entries: Dict[int, _Entry] = {}
        # automatic mode, not storing: the key a copy would have had, per first quantizer (no value)
        self._probes: Dict[int, _Entry] = {}
        self.storing = True

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every copy (the weights left training, or a module reset): says nothing about reuse."""
        if self._entries:
            self._entries = {}
        if self._probes:
            self._probes = {}

    def drop_after_step(self) -> None:
        """An optimizer step ran: drop every copy; one that no forward reused turns automatic storing off."""
        for e in self._entries.values():
            if e.hits == 0:
                self.storing = False
        self.clear()

    def _stale(self, key: int) -> None:
        """The entry under ``key`` no longer matches its weight: drop it now (its memory with it); unused,
        it turns automatic storing off."""
        e = self._entries.pop(key)
        if e.hits == 0:
            self.storing = False

    def _probe_hit(self, quantizers: Sequence[Any], weights: Sequence[torch.Tensor]) -> None:
        """Not storing: would the last forward's copy have served this one? Then reuse started: store again."""
        e = self._probes.get(id(quantizers[0]))
        if e is not None and _matches(e, quantizers, weights):
            self.storing = True
            self._probes = {}

    def lookup(self, quantizers: Sequence[Any], weights: Sequence[torch.Tensor], mode: str,
               probe: bool = True) -> Any:
        """The cached value for these quantizers and weights, or None. ``probe=False`` (a checkpoint
        recompute, which repeats a forward rather than following it): neither a hit nor a would-be hit
        counts as reuse (keeping every copy through the backward to save the recompute's casts is the
        memory that checkpointing gives up time to save)."""
        if mode == REFRESH:
            return None
        key = id(quantizers[0])
        e = self._entries.get(key)
        if e is None:
            if probe and not self.storing and mode == AUTO:
                self._probe_hit(quantizers, weights)
            return None
        if not _same_objects(e, quantizers, weights):
            return None
        if mode != REUSE and not _unchanged(e, quantizers, weights):
            self._stale(key)
            return None
        if probe:  # (a recompute's reuse does not count: it holds the copies through the backward)
            e.hits += 1
        return e.value

    def store(self, quantizers: Sequence[Any], weights: Sequence[torch.Tensor], value: Any,
              mode: str = REFRESH) -> None:
        """Keep ``value`` for the next forwards (automatic ``mode`` while not storing: only its key)."""
        if not _HOOK:
            _ensure_hook()
        e = _Entry()
        e.quantizers = tuple(quantizers)
        e.weights = tuple([(weakref.ref(w), w._version, w.data_ptr(), w.dtype) for w in weights])
        e.scales = tuple([_scale_key(q) for q in quantizers])
        e.n = len(e.quantizers)
        e.hits = 0
        self._keep(e, value, mode)

    def _keep(self, e: _Entry, value: Any, mode: str) -> None:
        if mode == AUTO and not self.storing:
            e.value = None
            if not self._probes:
                _CACHES.add(self)  # (the optimizer hook clears probes too)
            self._probes[id(e.quantizers[0])] = e
            return
        e.value = value
        if not self._entries:
            _CACHES.add(self)  # (an empty cache has nothing for the optimizer hook to drop)
        self._entries[id(e.quantizers[0])] = e

    def lookup_one(self, quantizer: Any, weight: torch.Tensor, mode: str, probe: bool = True) -> Any:
        """``lookup((quantizer,), (weight,), mode, probe)`` (one weight: no sequences built or zipped per call)."""
        if mode == REFRESH:
            return None
        key = id(quantizer)
        e = self._entries.get(key)
        if e is None:
            if probe and not self.storing and mode == AUTO:
                # (_probe_hit for one weight, inline: this runs at every forward of a module not storing)
                pr = self._probes.get(key)
                if pr is not None and pr.n == 1 and pr.quantizers[0] is quantizer:
                    ref, version, ptr, dtype = pr.weights[0]
                    if ref() is weight and weight._version == version and weight.data_ptr() == ptr \
                            and weight.dtype == dtype and _unchanged_scale(pr.scales[0], quantizer):
                        self.storing = True
                        self._probes = {}
            return None
        if e.n != 1 or e.quantizers[0] is not quantizer:
            return None
        ref, version, ptr, dtype = e.weights[0]
        if ref() is not weight:
            return None
        if mode != REUSE:
            if weight._version != version or weight.data_ptr() != ptr or weight.dtype != dtype:
                self._stale(key)
                return None
            scale_key = e.scales[0]
            if scale_key is not None and not _unchanged_scale(scale_key, quantizer):
                self._stale(key)
                return None
        if probe:  # (a recompute's reuse does not count: it holds the copies through the backward)
            e.hits += 1
        return e.value

    def store_one(self, quantizer: Any, weight: torch.Tensor, value: Any, mode: str = REFRESH) -> None:
        """``store((quantizer,), (weight,), value, mode)``."""
        if not _HOOK:
            _ensure_hook()
        e = _Entry()
        e.quantizers = (quantizer,)
        e.weights = ((weakref.ref(weight), weight._version, weight.data_ptr(), weight.dtype),)
        s = getattr(quantizer, "scale", None)  # (_scale_key, inline)
        e.scales = ((s, s._version),) if isinstance(s, torch.Tensor) and hasattr(quantizer, "amax_history") \
            else (None,)
        e.n = 1
        e.hits = 0
        if mode == AUTO and not self.storing:  # (_keep, inline: the per-forward path of a module not storing)
            e.value = None
            if not self._probes:
                _CACHES.add(self)
            self._probes[id(quantizer)] = e
            return
        self._keep(e, value, mode)

    def will_store(self, mode: str) -> bool:
        """Whether a forward in ``mode`` that misses keeps its quantized weight."""
        return mode != AUTO or self.storing


def _same_objects(e: _Entry, quantizers: Sequence[Any], weights: Sequence[torch.Tensor]) -> bool:
    """Whether entry ``e`` (or probe) was made from these quantizer and weight objects."""
    if e.n != len(quantizers):
        return False
    for q, q0 in zip(quantizers, e.quantizers):
        if q is not q0:
            return False
    for w, (ref, _, _, _) in zip(weights, e.weights):
        if ref() is not w:
            return False
    return True


def _unchanged(e: _Entry, quantizers: Sequence[Any], weights: Sequence[torch.Tensor]) -> bool:
    """Whether the weights (version, storage, dtype) and delayed-scaling scales are as when ``e`` was made."""
    for w, (_, version, ptr, dtype) in zip(weights, e.weights):
        if w._version != version or w.data_ptr() != ptr or w.dtype != dtype:
            return False
    for q, key in zip(quantizers, e.scales):
        if not _unchanged_scale(key, q):
            return False
    return True


def _unchanged_scale(key: Optional[tuple], quantizer: Any) -> bool:
    """Whether a delayed-scaling quantizer still has the scale tensor of ``key``, at that version (None: no
    scale in the key)."""
    return key is None or (quantizer.scale is key[0] and quantizer.scale._version == key[1])


def _matches(e: _Entry, quantizers: Sequence[Any], weights: Sequence[torch.Tensor]) -> bool:
    """Whether entry ``e`` (or probe) was made from these quantizers and weights, unchanged since."""
    return _same_objects(e, quantizers, weights) and _unchanged(e, quantizers, weights)


def cacheable(quantizer: Any, weight: torch.Tensor) -> bool:
    """Whether a quantized copy of ``weight`` by ``quantizer`` may be reused: not a weight FSDP2 gathered
    already quantized (it is the cast), not stochastically rounded (each cast draws new numbers)."""
    if quantizer is None:
        return False
    if type(weight) not in (torch.Tensor, torch.nn.Parameter) and \
            getattr(weight, "fp_recipes_prequantized", None) is not None:
        return False
    return not getattr(quantizer.spec, "stochastic_rounding", False)
