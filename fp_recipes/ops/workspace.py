"""The memset-free amax workspace shared by the FP8 and NVFP4 casts.

One zeroed 16-byte buffer per (device, stream): a cast's blocks reduce its amax there, the last block
writes the amax output and zeroes the buffer again (csrc/fp8_device.cuh ``flush_amax_record``,
csrc/nvfp4_amax.cu), so a cast needs no memset launch before its kernel. Launches on one stream run in
order, so two kernels never use the same buffer at once."""

from __future__ import annotations

import torch

__all__ = ["AMAX_WS", "amax_ws"]

#: (device index, stream handle) -> the int32 (4,) workspace
AMAX_WS: dict = {}


def amax_ws(device: torch.device, stream: int) -> int:
    """Pointer to this stream's amax workspace, or 0 (the launcher then zeroes the outputs with a memset)
    while the stream is being captured into a CUDA graph (a workspace created inside a capture would be
    zeroed only when the graph replays)."""
    key = (device.index, stream)
    ws = AMAX_WS.get(key)
    if ws is None:
        if torch.cuda.is_current_stream_capturing():
            return 0
        ws = AMAX_WS[key] = torch.zeros((4,), dtype=torch.int32, device=device)
    return ws.data_ptr()
