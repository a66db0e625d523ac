"""The memset-free amax workspace shared by the FP8 and NVFP4 casts.

One zeroed 16-byte buffer per (device, stream): a cast's blocks reduce its amax there, the last block
writes the amax output and zeroes the buffer again (csrc/fp8_device.cuh ``flush_amax_record``,
csrc/nvfp4_amax.cu), so a cast needs no memset launch before its kernel. Launches on one stream run in
order, so two eager kernels never use the same buffer at once.

Not inside a CUDA-graph capture: a captured kernel would keep the capture stream's buffer, and a replay
(on any stream, possibly beside another replay or eager work on that stream) would share it. Captured
casts therefore zero their amax with a memset node, as before the workspace existed."""

from __future__ import annotations

import torch

__all__ = ["AMAX_WS", "amax_ws"]

#: (device index, stream handle) -> the int32 (4,) workspace
AMAX_WS: dict = {}

_CAPTURING: list = []  # [torch's "is the current stream capturing" query], looked up on first CUDA use


def _capturing() -> bool:
    if not _CAPTURING:
        _CAPTURING.append(torch._C._cuda_isCurrentStreamCapturing)
    return bool(_CAPTURING[0]())


def amax_ws(device: torch.device, stream: int) -> int:
    """Pointer to the amax workspace of ``device``'s ``stream``, or 0 while that stream is being captured
    into a CUDA graph (the launcher then zeroes the amax outputs with a memset)."""
    if device.type == "cuda" and _capturing():
        return 0
    key = (device.index, stream)
    ws = AMAX_WS.get(key)
    if ws is None:
        ws = AMAX_WS[key] = torch.zeros((4,), dtype=torch.int32, device=device)
    return ws.data_ptr()
