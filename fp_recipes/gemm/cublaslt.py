"""cuBLASLt called directly: FP8 GEMMs through plans cached per shape (the dense GEMM of a Linear, and
many from one host call: the launch path of grouped (MoE) layers on CUDA), and the BF16 GEMM with a
device-side alpha of the emulated NVFP4 path.

A grouped layer runs one GEMM per expert and pass. ``torch._scaled_mm`` spends tens of microseconds of
host time per call (argument checks, descriptors and an algorithm query every time), which at MoE sizes
is longer than the GEMM. :func:`fp8_gemms` hands the whole list to ``fp_recipes._C.lt_fp8_gemms``, which
keeps cuBLASLt descriptors and the chosen algorithm per problem shape, so each expert costs one
``cublasLtMatmul``. The math is ``torch._scaled_mm``'s (cuBLASLt, FP32 accumulation, per-tensor FP32
scales, optional bias epilogue, fast accumulation as asked); GEMMs cuBLASLt's FP8 kernels cannot take
are returned to the caller, who runs them the portable way.

cuBLASLt itself is the copy torch loaded (found in this process's memory map), opened at run time, so
the extension needs no link-time dependency on it.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .. import _extension
from ..ops.workspace import persistent_cuda_tensor

__all__ = ["available", "bf16_gemm_device_alpha", "fp8_gemm", "fp8_gemms", "fp8_gemms_ptr", "status"]

# No workspace for the dense GEMMs: cuBLASLt then picks algorithms that need none, and with a workspace (torch
# gives it 32 MiB on Hopper) each GEMM of a Linear step came with a `Memset (Device)` launch of cuBLAS's own. On an
# H200, one Linear 4096^3 fwd+bwd: 3 launches fewer for every recipe (FP8 delayed 14 -> 11, NVFP4 15 -> 12) at equal
# GPU time (benchmarks/RESULTS.md, session 34; `bench_model.py --gemm-workspace BYTES` and `--gemm-workspace-ab`).
WORKSPACE_BYTES = 0
# The grouped FP8 GEMMs (one per expert, issued back to back) are planned without a workspace: on an
# H100, GroupedLinear 8 x (2048x7168x2048) fwd+bwd took 2.131 -> 1.938 ms (delayed) and 1.971 -> 1.768
# ms (current) with the algorithms cuBLASLt picks for no workspace (benchmarks/RESULTS.md, session 20)
GROUPED_WORKSPACE_BYTES = 0

_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3,
               torch.float8_e5m2: 4}

_lock = threading.Lock()
_state: Dict[str, object] = {"loaded": None, "error": None}
_workspaces: Dict[Tuple[int, int, int], torch.Tensor] = {}


def _loaded_cublaslt_path() -> str:
    """The file of the cuBLASLt torch already mapped (same build as torch's GEMMs); the soname if torch
    has not mapped one (the dynamic loader then finds it on the usual paths)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip().split(" ")[-1]
                if "libcublasLt.so" in path:
                    return path
    except OSError:
        pass
    major = (torch.version.cuda or "13").split(".")[0]
    return f"libcublasLt.so.{major}"


def _load() -> bool:
    if _state["loaded"] is not None:
        return bool(_state["loaded"])
    with _lock:
        if _state["loaded"] is not None:
            return bool(_state["loaded"])
        ext = _extension.extension()
        if ext is None or not hasattr(ext, "lt_compiled"):
            _state["error"] = "the CUDA extension is not built"
        elif not ext.lt_compiled():
            _state["error"] = "the extension was built without <cublasLt.h>"
        elif not torch.cuda.is_available():
            _state["error"] = "no CUDA device"
        else:
            try:
                with warnings.catch_warnings():  # "no current CUDA context" before any CUDA op: harmless
                    warnings.simplefilter("ignore")
                    torch.cuda.current_blas_handle()  # makes torch map its cuBLAS / cuBLASLt
                _state["version"] = ext.lt_load(_loaded_cublaslt_path())
                # the one-GEMM entry point of the dense FP8 GEMM (an extension built before it lacks it)
                _state["single"] = hasattr(ext, "lt_fp8_gemm")
            except RuntimeError as exc:
                _state["error"] = str(exc)
        _state["loaded"] = _state["error"] is None
    return bool(_state["loaded"])


def single_gemm() -> bool:
    """Whether the loaded extension has the one-GEMM entry point :func:`fp8_gemm` uses."""
    return _load() and bool(_state.get("single", False))


def available() -> bool:
    """Whether :func:`fp8_gemms` can run here (extension built with cuBLASLt headers, library loaded)."""
    return _load()


def status() -> str:
    """One line for ``fp_recipes.backend_info()`` / diagnostics."""
    if _load():
        return f"cuBLASLt {_state['version']} (FP8 GEMMs through cached plans: dense and grouped)"
    return f"unavailable: {_state['error']}"


_MAX_WORKSPACES = 8  # code that makes a new stream per step must not pile up workspaces (when WORKSPACE_BYTES > 0)


def _workspace(device: torch.device, stream: int, nbytes: Optional[int] = None) -> torch.Tensor:
    """One workspace per device and stream: GEMMs on one stream run in order, so they can share it.
    The oldest is dropped beyond :data:`_MAX_WORKSPACES` (it was allocated and used on its own stream
    only, so the caching allocator's stream-ordered reuse keeps that safe)."""
    nbytes = WORKSPACE_BYTES if nbytes is None else nbytes
    key = (device.index if device.index is not None else torch.cuda.current_device(), stream, nbytes)
    ws = _workspaces.get(key)
    if ws is None:
        while len(_workspaces) >= _MAX_WORKSPACES:
            _workspaces.pop(next(iter(_workspaces)))
        make = lambda: torch.empty(nbytes, dtype=torch.uint8, device=device)  # noqa: E731
        # (kept across calls: from the default pool unless this stream is being captured, when the graph's pool
        # holds it as before)
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        ws = _workspaces[key] = make() if capturing else persistent_cuda_tensor(make, device)
    return ws


def fp8_gemm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
             out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
             fast_accum: bool = False) -> Optional[torch.Tensor]:
    """``a @ b.T * scale_a * scale_b (+ bias)`` as a new (m, n) ``out_dtype`` tensor through the cached
    cuBLASLt plan of its shape (the dense FP8 GEMM of a Linear: ``torch._scaled_mm``'s math without its
    per-call heuristic query), or None, having launched nothing, when this path cannot run it (cuBLASLt
    not loadable, K or N not a multiple of 16, an operand, row stride or scale pointer not 16-byte
    aligned, no algorithm, another device current): the caller then runs ``torch._scaled_mm``.

    ``a`` (m, k) and ``b`` (n, k) FP8 on one CUDA device with unit column stride (rows may be strided),
    ``scale_*`` FP32 one-element device tensors, ``bias`` an (n,) vector of ``out_dtype`` or None; enqueued
    on the current stream."""
    if not _load() or not _state.get("single", False):
        return None
    device = a.device
    index = device.index
    # torch.cuda.current_device() without its lazy-init check (a CUDA tensor exists: CUDA is initialised)
    current = torch._C._cuda_getDevice()
    if index is not None and index != current:
        return None  # torch._scaled_mm switches devices itself: rare, left to it
    if a.stride(1) != 1 or b.stride(1) != 1:
        return None
    stream = _extension.current_stream(device)
    ws = _workspace(device, stream)
    m, k = a.shape
    n = b.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=device)
    ok = _extension.extension().lt_fp8_gemm(
        a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0), scale_a.data_ptr(), scale_b.data_ptr(),
        out.data_ptr(), 0 if bias is None else bias.data_ptr(), m, n, k, _DTYPE_CODE[a.dtype],
        _DTYPE_CODE[b.dtype], _DTYPE_CODE[out_dtype], -1 if bias is None else _DTYPE_CODE[bias.dtype],
        bool(fast_accum), ws.data_ptr(), ws.numel(), current, stream)
    return out if ok else None


def fp8_gemms(a: Sequence[torch.Tensor], scale_a: Sequence[torch.Tensor], b: Sequence[torch.Tensor],
              scale_b: Sequence[torch.Tensor], out: Sequence[torch.Tensor], *,
              bias: Optional[Sequence[Optional[torch.Tensor]]] = None, fast_accum: bool = False) -> List[int]:
    """``out[i] = a[i] @ b[i].T * scale_a[i] * scale_b[i] (+ bias[i])`` for every i, in one host call.

    ``a[i]`` (m_i, k_i) and ``b[i]`` (n_i, k_i) are contiguous FP8 (one dtype per side for the whole
    list), ``scale_*[i]`` one-element FP32 device tensors, ``out[i]`` a contiguous (m_i, n_i) tensor of
    one dtype (bf16/fp16/fp32) to write into, ``bias[i]`` an (n_i,) vector of the output dtype or None.
    All on one CUDA device, enqueued on its current stream. Returns the indices it did not run (K or N
    not a multiple of 16, an operand or scale not 16-byte aligned, or K == 0): the caller computes those
    some other way."""
    if not a:
        return []
    bias_ptrs: Optional[List[int]] = None
    bias_dtype = None
    if bias is not None and any(t is not None for t in bias):
        bias_ptrs = [0 if t is None else t.data_ptr() for t in bias]
        bias_dtype = next(t for t in bias if t is not None).dtype
    return fp8_gemms_ptr(
        [t.data_ptr() for t in a], [t.data_ptr() for t in scale_a], [t.data_ptr() for t in b],
        [t.data_ptr() for t in scale_b], [t.data_ptr() for t in out], [t.shape[0] for t in a],
        [t.shape[0] for t in b], [t.shape[1] for t in a], a[0].dtype, b[0].dtype, out[0].dtype, a[0].device,
        bias=bias_ptrs, bias_dtype=bias_dtype, fast_accum=fast_accum)


def fp8_gemms_ptr(a: Sequence[int], scale_a: Sequence[int], b: Sequence[int], scale_b: Sequence[int],
                  out: Sequence[int], ms: Sequence[int], ns: Sequence[int], ks: Sequence[int], a_dtype: torch.dtype,
                  b_dtype: torch.dtype, out_dtype: torch.dtype, device: torch.device, *,
                  bias: Optional[Sequence[int]] = None, bias_dtype: Optional[torch.dtype] = None,
                  fast_accum: bool = False) -> List[int]:
    """:func:`fp8_gemms` on raw device addresses: GEMM i reads an (ms[i], ks[i]) and an (ns[i], ks[i])
    row-major FP8 matrix and writes an (ms[i], ns[i]) row-major one, each dense. For callers that keep
    several operands in one buffer (a grouped layer's experts): no tensor view per operand (a view
    costs microseconds of host time; an address is an integer addition). The caller keeps the memory
    alive until the GEMMs have run on ``device``'s current stream."""
    if not a:
        return []
    ext = _extension.extension()
    current = torch.cuda.current_device()
    index = device.index if device.index is not None else current
    # cuBLASLt launches on the CURRENT device (and picks its algorithm for it): a stream of another
    # device is an error. A model on cuda:1 called while cuda:0 is current must switch first (torch's own
    # ops do this with a device guard).
    with contextlib.nullcontext() if index == current else torch.cuda.device(index):
        stream = _extension.current_stream(torch.device("cuda", index))
        if GROUPED_WORKSPACE_BYTES:
            ws = _workspace(device, stream, GROUPED_WORKSPACE_BYTES)
            ws_ptr, ws_bytes = ws.data_ptr(), ws.numel()
        else:
            ws_ptr, ws_bytes = 0, 0
        return ext.lt_fp8_gemms(
            list(a), list(b), list(scale_a), list(scale_b), list(out), list(bias) if bias is not None else [],
            list(ms), list(ns), list(ks), _DTYPE_CODE[a_dtype], _DTYPE_CODE[b_dtype], _DTYPE_CODE[out_dtype],
            _DTYPE_CODE[bias_dtype] if bias_dtype is not None else -1, bool(fast_accum), ws_ptr, ws_bytes,
            index, stream)


def bf16_gemm_device_alpha(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, alpha_beta: torch.Tensor, *,
                           bias: Optional[torch.Tensor] = None) -> bool:
    """``out = alpha * (a @ b.T) (+ bias)`` with FP32 accumulation, alpha read on the device from
    ``alpha_beta[0]`` (and a zero beta from ``alpha_beta[1]``), so no host synchronisation: the emulated
    NVFP4 GEMM's one launch. ``a`` (m, k) and ``b`` (n, k) contiguous BF16, ``out`` a contiguous (m, n)
    bf16/fp16/fp32 tensor to write, ``bias`` an (n,) vector of ``out``'s dtype or None, all on one CUDA
    device; enqueued on its current stream. Returns False, having launched nothing, when cuBLASLt cannot
    run it (empty or unaligned operands, K not a multiple of 8, no algorithm): the caller then computes it
    another way."""
    if not _load():
        return False
    device = a.device
    current = torch.cuda.current_device()
    index = device.index if device.index is not None else current
    with contextlib.nullcontext() if index == current else torch.cuda.device(index):
        stream = _extension.current_stream(torch.device("cuda", index))
        ws = _workspace(device, stream)
        ext = _extension.extension()
        return bool(ext.lt_bf16_gemm(
            a.data_ptr(), b.data_ptr(), out.data_ptr(), 0 if bias is None else bias.data_ptr(), a.shape[0],
            b.shape[0], a.shape[1], _DTYPE_CODE[out.dtype], _DTYPE_CODE[bias.dtype] if bias is not None else -1,
            alpha_beta.data_ptr(), ws.data_ptr(), ws.numel(), index, stream))
