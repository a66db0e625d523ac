"""The delayed-scaling scale update of many Float8Quantizers as one CUDA launch (kernel in
``csrc/delayed_update.cu``).

``fp_recipes.modules.amax_reduction.batched_update_scales`` runs after every forward and every
backward; its torch ops are ~11 kernel launches per batch, and a grouped MoE step is host-bound, so
on CUDA it calls this instead: one Python -> C++ call and one launch (per 224 quantizers) per step.
The torch-op path stays the reference twin (bit for bit: tests/test_delayed_update_cuda.py).
"""

from __future__ import annotations

import contextlib
from typing import List, Optional

import torch

from . import backend


def available() -> bool:
    """The loaded extension has the kernel (an extension built before it lacks it)."""
    ext = backend.extension()
    return ext is not None and hasattr(ext, "delayed_update_scales")


class DelayedUpdate:
    """One batch's pointer table in a host int64 tensor, built once per set of state tensors: the
    histories, then the scales, then the flags (a bool per quantizer on the device, set when its history
    held a NaN or Inf, never cleared: see quantizers.float8.NonfiniteWatch; 0 for none). :meth:`__call__`
    updates them all on the current stream."""

    def __init__(self, histories: List[torch.Tensor], scales: List[torch.Tensor], length: int,
                 device: torch.device, flags: Optional[torch.Tensor] = None, flags_ptr: int = 0) -> None:
        self.tensors = histories + scales  # keeps the storages (and so the pointers) alive
        self.flags = flags
        self.count, self.length, self.device = len(histories), length, device
        # flags_ptr: the device address of the flags when they are not ``flags`` (mapped host memory)
        flag_address = flags_ptr or (0 if flags is None else flags.data_ptr())
        self.table = torch.tensor([t.data_ptr() for t in self.tensors] + [flag_address], dtype=torch.int64)
        self.table_ptr = self.table.data_ptr()  # (host memory: what the launcher reads)
        self._same = device.index is None

    @staticmethod
    def build(histories: List[torch.Tensor], scales: List[torch.Tensor], length: int,
              device: torch.device, flags: Optional[torch.Tensor] = None,
              flags_ptr: int = 0) -> Optional["DelayedUpdate"]:
        """The launcher for these tensors, or None where the kernel cannot take them (then the caller
        runs the torch ops): not FP32 on ``device``, a non-contiguous history, or shared storage
        (the warps of one launch must not update one tensor twice). ``flags``: None, or a contiguous
        bool tensor of one entry per quantizer on ``device``; ``flags_ptr``: where the kernel sets them
        instead (the device address of as many mapped host bytes; 0: in ``flags``)."""
        for h in histories:
            if h.dtype != torch.float32 or h.device != device or h.numel() != length or not h.is_contiguous():
                return None
        for s in scales:
            if s.dtype != torch.float32 or s.device != device or s.numel() != 1:
                return None
        if flags is not None and (flags.dtype != torch.bool or flags.device != device
                                  or tuple(flags.shape) != (len(histories),) or not flags.is_contiguous()):
            raise ValueError(f"DelayedUpdate.build: flags must be a contiguous bool ({len(histories)},) tensor "
                             f"on {device}, got {flags.dtype} {tuple(flags.shape)} on {flags.device}")
        ptrs = [t.data_ptr() for t in histories + scales]
        if len(set(ptrs)) != len(ptrs):
            return None
        return DelayedUpdate(histories, scales, length, device, flags, flags_ptr)

    def __call__(self, fmt_max: float, margin: int, algo: str) -> None:
        device = self.device
        same = self._same or device.index == torch.cuda.current_device()
        with contextlib.nullcontext() if same else torch.cuda.device(device):
            # the binding hands the launcher the table and table + count: the scales, then the flags
            backend.extension().delayed_update_scales(
                self.table_ptr, self.count, self.length, float(fmt_max), int(margin), algo == "max",
                backend.current_stream(device))


__all__ = ["DelayedUpdate", "available"]
