"""Non-finite amax warnings of delayed scaling, read from device flags without a host sync.

A scale update that finds a NaN or Inf in an amax history counts it as 0 and sets a sticky flag on the
device; :class:`NonfiniteWatch` turns each flag into one :class:`NonFiniteAmaxWarning`. While a CUDA
graph is captured no host work may run on the capturing stream, so a report there is skipped, or handed
to the :class:`DeferredReports` registered for that stream (``make_graphed_callables`` repeats it after
every replay). The deferral is keyed by the capture's stream, never patched onto the class: reports
made by other threads and streams meanwhile are untouched.
"""

from __future__ import annotations

import ctypes
import threading
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["DeferredReports", "NonFiniteAmaxWarning", "NonfiniteWatch"]


class NonFiniteAmaxWarning(RuntimeWarning):
    """A delayed-scaling quantizer saw a NaN or +-Inf amax (shown once per quantizer)."""


def _warn_nonfinite(flags: Sequence[bool], quantizers: Sequence[Any]) -> None:
    for flagged, q in zip(flags, quantizers):
        if flagged and not getattr(q, "nonfinite_warned", False):
            q.nonfinite_warned = True
            role = q.spec.role
            warnings.warn(
                f"fp_recipes: a NaN or Inf amax reached the delayed-scaling history of {role} (the "
                f"{role.tensor.value} of GEMM {role.gemm} of a {role.module.value} module"
                f"{f' {role.name!r}' if role.name else ''}); it was counted as 0, so the scale keeps "
                "following the finite steps. That tensor (or, with an amax reduction group, the same tensor "
                "on another rank) held a non-finite value: a bad batch or an overflowing layer. Shown once "
                "per tensor.", NonFiniteAmaxWarning, stacklevel=2)


# capture stream handle -> the DeferredReports registered for it (see DeferredReports)
_DEFERRED: Dict[int, "DeferredReports"] = {}
_DEFERRED_LOCK = threading.Lock()


class DeferredReports:
    """Collects the reports made on one capturing stream, for the capturer to repeat after each replay.

    ``with DeferredReports(stream, quantizers) as reports:`` registers it for ``stream`` (one per stream).
    A report made while ``stream`` captures is recorded in :attr:`captured` (once per watch) instead of
    run. A report about one of ``quantizers`` made while no stream captures is counted in
    :attr:`outside`: a scale update of the captured modules ran eagerly, so the graph would not repeat it
    (the capturer treats that as an error). Reports about other quantizers, from any thread, run as usual.
    """

    def __init__(self, stream: "torch.cuda.Stream", quantizers: Sequence[Any]) -> None:
        self.stream = int(stream.cuda_stream)
        self._ids = frozenset(id(q) for q in quantizers)
        self._keep = list(quantizers)  # the ids stay theirs while this is registered
        self.captured: List[Tuple["NonfiniteWatch", List[Any]]] = []
        self.outside = 0

    def __enter__(self) -> "DeferredReports":
        with _DEFERRED_LOCK:
            if self.stream in _DEFERRED:
                raise RuntimeError("fp_recipes: reports on this stream are already deferred by another capture")
            _DEFERRED[self.stream] = self
        return self

    def __exit__(self, *exc: Any) -> None:
        with _DEFERRED_LOCK:
            if _DEFERRED.get(self.stream) is self:
                del _DEFERRED[self.stream]

    def take(self) -> List[Tuple["NonfiniteWatch", List[Any]]]:
        """The reports captured since the last call."""
        out, self.captured = self.captured, []
        return out

    def _add(self, watch: "NonfiniteWatch", quantizers: Sequence[Any]) -> None:
        if not any(w is watch for w, _ in self.captured):
            self.captured.append((watch, list(quantizers)))

    def _concerns(self, quantizers: Sequence[Any]) -> bool:
        return any(id(q) in self._ids for q in quantizers)


def _on_capture(watch: "NonfiniteWatch", quantizers: Sequence[Any]) -> bool:
    """True if the current stream captures (the report is then deferred or skipped); counts eager reports
    about a capture's quantizers (see :class:`DeferredReports`)."""
    if torch.cuda.is_current_stream_capturing():
        if _DEFERRED:
            stream = int(torch.cuda.current_stream(watch.flags.device).cuda_stream)
            reports = _DEFERRED.get(stream)
            if reports is not None:
                reports._add(watch, quantizers)
        # else skipped: the flags are sticky, so the next eager report of this watch still sees them
        return True
    if _DEFERRED:
        for reports in list(_DEFERRED.values()):
            if reports._concerns(quantizers):
                reports.outside += 1
    return False


# Whether an updating kernel may set the flags in mapped host memory (NonfiniteWatch.mapped_flags); off:
# every report copies the device flags to pinned memory and records an event (the fallback path).
USE_MAPPED_FLAGS = True

# Slabs of page-locked, device-mapped host memory for NonfiniteWatch.mapped_flags: [host address, device
# address, bytes left]. Never freed (a few bytes per quantizer list, for the life of the process).
_MAPPED_SLAB: List[int] = [0, 0, 0]
_MAPPED_SLAB_BYTES = 1 << 16
_MAPPED_LOCK = threading.Lock()


def _mapped_bytes(count: int) -> Optional[Tuple[int, int]]:
    """(host address, device address) of ``count`` zeroed bytes of mapped host memory, or None: no
    extension with the allocator, too many bytes, or the current stream captures (a page-locked
    allocation is not allowed there)."""
    from ..ops import backend

    ext = backend.extension()
    if ext is None or not hasattr(ext, "mapped_host_alloc") or count > _MAPPED_SLAB_BYTES:
        return None
    if torch.cuda.is_current_stream_capturing():
        return None
    with _MAPPED_LOCK:
        if _MAPPED_SLAB[2] < count:
            try:
                host, dev = ext.mapped_host_alloc(_MAPPED_SLAB_BYTES)
            except (RuntimeError, ValueError):
                return None
            _MAPPED_SLAB[:] = [int(host), int(dev), _MAPPED_SLAB_BYTES]
        used = _MAPPED_SLAB_BYTES - _MAPPED_SLAB[2]
        _MAPPED_SLAB[2] -= (count + 15) // 16 * 16
        return _MAPPED_SLAB[0] + used, _MAPPED_SLAB[1] + used


class NonfiniteWatch:
    """Sticky per-quantizer flags, set on the device by a scale update that found a non-finite value in
    a history, and turned into one :class:`NonFiniteAmaxWarning` per quantizer without a host sync.

    On CPU the flags are read at once. On CUDA, where the updating kernel sets them in host memory mapped
    into the device's address space (:meth:`mapped_flags`: the one-launch update), each :meth:`report`
    reads that memory directly: no copy, no event; a flag is seen by the first report after its update
    ran. Otherwise each report first reads the pinned host copy made by an earlier report if its copy has
    landed (``Event.query()``, no wait), then starts a new non-blocking copy: a warning comes one or two
    updates after the step that saw the value, and the step never waits for the GPU. The flags are never
    cleared (a copy in flight cannot lose a flag). On a capturing stream nothing runs on the host (see
    :class:`DeferredReports`)."""

    def __init__(self, count: int, device: torch.device) -> None:
        self.flags = torch.zeros(count, dtype=torch.bool, device=device)
        self._host: Optional[torch.Tensor] = None
        self._event: Any = None
        self._copying = False
        self._all_warned = False
        self._mapped: Optional[tuple] = None  # (host address, device address, zero bytes) or ()

    def mapped_flags(self) -> int:
        """The device address of ``count`` mapped host bytes for the updating kernel to set instead of
        :attr:`flags` (0: none to be had; the kernel then sets :attr:`flags`). Decided once per watch."""
        if self._mapped is None:
            n = self.flags.numel()
            got = _mapped_bytes(n) if USE_MAPPED_FLAGS and self.flags.device.type == "cuda" and n else None
            self._mapped = (got[0], got[1], bytes(n)) if got is not None else ()
        return self._mapped[1] if self._mapped else 0

    def mapped_host(self) -> Tuple[int, int]:
        """(host address, bytes) of the mapped flags the updating kernel sets ((0, 0): the flags live on the
        device), as decided by :meth:`mapped_flags`; for a host path that reads them itself."""
        mapped = self._mapped
        return (mapped[0], len(mapped[2])) if mapped else (0, 0)

    def report(self, quantizers: Sequence[Any]) -> None:
        if self.flags.device.type != "cuda":
            if not self._all_warned and bool(self.flags.any()):
                self._warn(self.flags.tolist(), quantizers)
            return
        if _on_capture(self, quantizers) or self._all_warned:
            return
        mapped = self._mapped
        if mapped:
            raw = ctypes.string_at(mapped[0], len(mapped[2]))
            if raw != mapped[2]:
                self._warn([b != 0 for b in raw], quantizers)
            return
        if self._copying:
            if not self._event.query():
                return  # the last copy has not landed: read it at a later update
            self._copying = False
            self._warn(self._host.tolist(), quantizers)
            if self._all_warned:
                return
        if self._host is None:
            self._host = torch.zeros(self.flags.shape, dtype=torch.bool, pin_memory=True)
            self._event = torch.cuda.Event()
        self._host.copy_(self.flags, non_blocking=True)
        self._event.record()
        self._copying = True

    def _warn(self, flags: List[bool], quantizers: Sequence[Any]) -> None:
        _warn_nonfinite(flags, quantizers)
        self._all_warned = all(getattr(q, "nonfinite_warned", False) for q in quantizers)
