"""The memset-free amax workspace shared by the FP8 and NVFP4 casts.

One zeroed 16-byte buffer per (device, stream): a cast's blocks reduce its amax there, the last block
writes the amax output and zeroes the buffer again (csrc/fp8_device.cuh ``flush_amax_record``,
csrc/nvfp4_amax.cu), so a cast needs no memset launch before its kernel. Launches on one stream run in
order, so two eager kernels never use the same buffer at once.

Not inside a CUDA-graph capture: a captured kernel would keep the capture stream's buffer, and a replay
(on any stream, possibly beside another replay or eager work on that stream) would share it. Captured
casts therefore zero their amax with a memset node, as before the workspace existed.

Every buffer kept for the life of the process (these workspaces, the emulated GEMM's alpha, cuBLASLt's
workspace) is allocated by :func:`persistent_cuda_tensor`, outside any CUDA-graph memory pool: torch.compile's
``mode="reduce-overhead"`` warms its graphs up with every allocation of the calling thread routed to the graph's
pool, and refuses to run when a tensor it did not return stays alive there."""

from __future__ import annotations

import threading
from typing import Callable

import torch

__all__ = ["AMAX_WS", "amax_ws", "persistent_cuda_tensor", "stream_capturing"]

#: (device index, stream handle) -> the int32 (4,) workspace
AMAX_WS: dict = {}

_CAPTURING: list = []  # [torch's "is the current stream capturing" query], looked up on first CUDA use


def stream_capturing() -> bool:
    """Whether this thread's current CUDA stream is being captured into a CUDA graph (False before CUDA is
    initialized, and on a CPU build). For host-side decisions a capture changes: a cached value the graph would
    keep reading, a host counter it would bake in, an update its replays would skip. False while torch.compile
    traces: those decisions are the eager path's (a traced graph has none of them), and Dynamo cannot trace torch's
    query, which returns a bool (on a GPU every compiled module would fail there)."""
    if torch.compiler.is_compiling():
        return False
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _capturing() -> bool:
    """:func:`stream_capturing` for a launcher that already holds a CUDA device and runs eagerly: torch's C query,
    looked up once, without the Python wrapper or the trace and initialization checks (one call per cast)."""
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
        # (another thread may have made one meanwhile: the helper's join releases the GIL; the first one stays)
        ws = AMAX_WS.setdefault(key, persistent_cuda_tensor(
            lambda: torch.zeros((4,), dtype=torch.int32, device=device), device))
    return ws.data_ptr()


def persistent_cuda_tensor(make: Callable[[], torch.Tensor], device: torch.device) -> torch.Tensor:
    """``make()`` run on a short-lived helper thread with the caller's device and current stream, so that the
    tensor comes from the caching allocator's default pool even while the calling thread allocates into a
    CUDA-graph pool (torch routes a graph pool's allocations by thread: Inductor's CUDA-graph warm-up,
    ``torch.cuda.graph``). For tensors kept across steps and created once; not while the stream is being
    captured (the helper's kernels would join the capture): callers check that first."""
    if device.type != "cuda":
        return make()
    stream = torch.cuda.current_stream(device)
    box: dict = {}

    def run() -> None:
        try:
            with torch.cuda.device(stream.device), torch.cuda.stream(stream):
                box["out"] = make()
        except BaseException as e:  # re-raised on the caller's thread
            box["err"] = e

    helper = threading.Thread(target=run, name="fp_recipes-persistent-alloc")
    helper.start()
    helper.join()
    if "err" in box:
        raise box["err"]
    return box["out"]
