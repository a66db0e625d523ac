"""The memset-free amax workspace (ops/workspace.py) on CPU: which pointer each cast gets.

The kernels it feeds run on a GPU only (tests/test_cuda_fp8_kernels.py and test_cuda_nvfp4_units.py check
their bytes, the workspace re-zeroed, and CUDA-graph replays); here, with fake devices and a fake capture
query, the policy: one buffer per (device, stream), made once; none while the stream is captured (a
captured kernel would keep the buffer and share it with every replay); none for an extension built
before the FP8 casts took one."""

from __future__ import annotations

import pytest
import torch

from fp_recipes.ops import cuda_fp8, cuda_nvfp4, workspace


def test_one_buffer_per_stream_made_once(monkeypatch):
    monkeypatch.setattr(workspace, "AMAX_WS", {})
    cpu = torch.device("cpu")
    a, b = workspace.amax_ws(cpu, 7), workspace.amax_ws(cpu, 8)
    assert a != b and a == workspace.amax_ws(cpu, 7)
    buf = workspace.AMAX_WS[(None, 7)]
    assert buf.dtype == torch.int32 and buf.numel() == 4 and not buf.any()


def test_no_buffer_while_the_stream_is_captured(monkeypatch):
    monkeypatch.setattr(workspace, "AMAX_WS", {})
    capturing = [True]
    monkeypatch.setattr(workspace, "_CAPTURING", [lambda: capturing[0]])
    cuda = torch.device("cuda", 0)
    assert workspace.amax_ws(cuda, 5) == 0
    assert workspace.AMAX_WS == {}, "a buffer made during a capture would be zeroed only by replays"
    monkeypatch.setitem(workspace.AMAX_WS, (0, 5), torch.zeros(4, dtype=torch.int32))
    assert workspace.amax_ws(cuda, 5) == 0, "an existing buffer must not be baked into a graph either"
    capturing[0] = False
    assert workspace.amax_ws(cuda, 5) == workspace.AMAX_WS[(0, 5)].data_ptr()


def test_nvfp4_and_fp8_share_the_workspace():
    assert cuda_nvfp4._AMAX_WS is workspace.AMAX_WS and cuda_nvfp4._amax_ws is workspace.amax_ws


def test_fp8_casts_take_no_workspace_from_an_older_extension(monkeypatch):
    class Old:  # an extension built before the FP8 casts took amax_ws
        pass

    class New:
        fp8_amax_workspace = True

    monkeypatch.setattr(workspace, "AMAX_WS", {})
    for ext, want_ws in ((Old(), False), (New(), True)):
        monkeypatch.setattr(cuda_fp8, "_AMAX_WS_OK", [])
        monkeypatch.setattr(cuda_fp8.backend, "extension", lambda ext=ext: ext)
        got = cuda_fp8._amax_ws(torch.device("cpu"), 3)
        assert (got != 0) == want_ws


def _pool_of(ptr: int):
    """The memory pool id of the caching-allocator segment holding ``ptr`` ((0, 0): the default pool)."""
    for seg in torch.cuda.memory_snapshot():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return tuple(seg.get("segment_pool_id", (0, 0)))
    raise AssertionError(f"no segment holds {ptr:#x}")


@pytest.mark.cuda
def test_kept_buffers_stay_out_of_a_graph_pool_the_thread_allocates_to(monkeypatch):
    """torch.compile's mode="reduce-overhead" warms its CUDA graphs up with every allocation of the calling thread
    routed to the graph's pool, and refuses to run when a tensor it did not return stays alive there (session 38,
    H200). The amax workspace, the emulated GEMM's alpha workspace and cuBLASLt's workspace are kept across calls:
    made meanwhile, each must come from the default pool (ops/workspace.py persistent_cuda_tensor)."""
    from fp_recipes.gemm import cublaslt

    monkeypatch.setattr(workspace, "AMAX_WS", {})
    monkeypatch.setattr(cuda_nvfp4, "_ALPHA_WS", {})
    monkeypatch.setattr(cublaslt, "_workspaces", {})
    dev = torch.device("cuda", torch.cuda.current_device())
    pool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        stream = side.cuda_stream
        torch._C._cuda_beginAllocateCurrentThreadToPool(dev.index, pool)
        try:
            control = torch.empty(1024, device=dev)  # routed to the pool, as Inductor's warm-up allocations are
            amax_ptr = workspace.amax_ws(dev, stream)
            alpha = cuda_nvfp4._alpha_ws(dev, stream)
            gemm_ws = cublaslt._workspace(dev, stream, 4096)
        finally:
            torch._C._cuda_endAllocateToPool(dev.index, pool)
    torch.cuda.synchronize()
    assert _pool_of(control.data_ptr()) != (0, 0), "the control allocation should be in the graph's pool"
    for name, ptr in (("amax", amax_ptr), ("alpha", alpha.data_ptr()), ("cuBLASLt", gemm_ws.data_ptr())):
        assert _pool_of(ptr) == (0, 0), f"the {name} workspace was allocated into the graph's pool"
    assert not workspace.AMAX_WS[(dev.index, stream)].any() and not alpha.any()  # (zeroed, on their stream)
    del control
    torch._C._cuda_releasePool(dev.index, pool)
