"""Grouped GEMMs: one GEMM per group (MoE expert) with each group's own scales (FP8 per-tensor scales,
NVFP4 per-expert alpha).

:func:`grouped_gemm` takes a list of operands per side (any formats: the per-pair :func:`gemm`, or one
``torch._scaled_grouped_mm``), or two FP8 multi-casts (:class:`~fp_recipes.quantizers.grouped.Fp8MultiCast`:
every group's copies in shared buffers). What one training step costs on a GPU is mostly host time when
the experts' GEMMs are short, so a pass over multi-casts is ONE host call into cuBLASLt with cached
descriptors and algorithms (:mod:`.cublaslt`) on addresses into those buffers (no tensor view per
group), writing straight into each group's rows of the output (no concatenation); where that is
unavailable, one ``torch._scaled_mm`` per group, and on CPU the same ``gemm_fp8_fp8`` the list path runs
(so both compute the same bits). ``torch._scaled_grouped_mm`` would need the weights stacked (a copy of
all of them per step) and per-row scale vectors, and measured slower on Hopper.
"""

from __future__ import annotations

import itertools
from typing import Callable, List, Optional, Sequence, Union

import torch

from . import _common, cublaslt
from .dispatch import Operand, gemm
from .fp8 import fp8_native_gemm_available, gemm_fp8_fp8
from .operands import Fp8Operand, fp8_operand, operand_kind

__all__ = ["GROUPED_FP8_BACKEND", "USE_CUBLASLT", "grouped_gemm"]

# Which FP8 grouped GEMM runs where both work: "auto" (one torch._scaled_grouped_mm when eligible),
# "grouped_mm" (the same), or "loop" (one torch._scaled_mm per group: no concatenation copies).
GROUPED_FP8_BACKEND = "auto"


def _scaled_grouped_fprop(a_list: Sequence[Fp8Operand], b_list: Sequence[Fp8Operand],
                          out_dtype: torch.dtype) -> Optional[torch.Tensor]:
    """One ``torch._scaled_grouped_mm`` launch for the "2-D x 3-D" shape (rows split by group, one
    B matrix per group), with the per-tensor scales expanded to torch's row/column scale vectors.
    None when torch cannot run it here (the caller then loops over ``_scaled_mm``)."""
    if not hasattr(torch, "_scaled_grouped_mm") or out_dtype != torch.bfloat16 or not a_list:
        return None
    dev = a_list[0].data.device
    if dev.type != "cuda" or _common.capability(dev.index if dev.index is not None else 0) < (9, 0) or \
            _common.capability(dev.index if dev.index is not None else 0) >= (10, 0):
        return None
    if any(o.data.dtype != torch.float8_e4m3fn for o in list(a_list) + list(b_list)):
        return None  # torch's grouped FP8 GEMM takes E4M3 x E4M3 only
    k = a_list[0].data.shape[1]
    n = b_list[0].data.shape[0]
    if k % 16 or n % 16 or any(o.data.shape != (n, k) for o in b_list):
        return None
    rows = [o.data.shape[0] for o in a_list]
    a_cat = torch.cat([o.data for o in a_list], dim=0) if len(a_list) > 1 else a_list[0].data
    b_stack = torch.stack([o.data for o in b_list], dim=0)  # (G, N, K)
    # built on the host and copied without a stream sync
    counts = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)
    offs = torch.tensor(list(itertools.accumulate(rows)), dtype=torch.int32).to(dev, non_blocking=True)
    sa = torch.stack([o.scale_inv.reshape(()) for o in a_list]).repeat_interleave(counts, output_size=sum(rows))
    sb = torch.stack([o.scale_inv for o in b_list]).unsqueeze(1).expand(len(b_list), n).contiguous()
    return torch._scaled_grouped_mm(a_cat, b_stack.transpose(-2, -1), sa, sb, offs=offs,
                                    out_dtype=torch.bfloat16)


def grouped_gemm(a_list: Sequence[Operand], b_list: Sequence[Operand], *, transpose_a: bool = False,
                 transpose_b: bool = False, out_dtype: Union[torch.dtype, Sequence[torch.dtype]],
                 biases: Optional[Sequence[Optional[torch.Tensor]]] = None, use_fast_accum: bool = False,
                 concat: bool = True, groups: Optional[Sequence[int]] = None
                 ) -> Union[torch.Tensor, List[Optional[torch.Tensor]]]:
    """One GEMM per group g of ``groups`` (default: all), ``gemm(a_list[g], b_list[g])`` (+ ``biases[g]``)
    with each group's own scales (FP8 per-tensor scales, NVFP4 per-expert alpha).

    ``a_list``/``b_list``: one operand per group, or both FP8 multi-casts (see the module doc).
    ``concat=True``: the outputs stacked along rows (groups left out must have no rows; at least one
    group); ``False``: a list with one output per group, None for groups left out, ``out_dtype`` one
    dtype or one per group. Lists of FP8 E4M3 operands into BF16 on sm_90, without bias, stacked, run
    as one ``torch._scaled_grouped_mm``; other lists loop over the per-pair GEMM (itself native
    ``_scaled_mm`` where available). Zero-row groups give empty outputs (or, for a zero-size
    contraction, zeros)."""
    if type(a_list).__name__ == "Fp8MultiCast":
        gs = range(len(a_list.rows)) if groups is None else groups
        # both read transposed (wgrad: the contraction over the groups' rows) and both zero-padded alike:
        # K = the padded rows, a multiple of 16, on both sides (the zeros add nothing)
        padded = transpose_a and transpose_b and a_list.t_layout is not None and b_list.t_layout is not None
        return _multi_cast_gemms(_Side(a_list, transpose_a, padded), _Side(b_list, transpose_b, padded), gs,
                                 out_dtype, biases, use_fast_accum, concat)
    num = len(a_list)
    if num != len(b_list):
        raise ValueError(f"grouped_gemm: {num} A operands but {len(b_list)} B operands")
    if biases is not None and len(biases) != num:
        raise ValueError(f"grouped_gemm: {len(biases)} biases for {num} groups")
    gs = range(num) if groups is None else groups
    dtypes = [out_dtype if isinstance(out_dtype, torch.dtype) else out_dtype[g] for g in gs]
    if GROUPED_FP8_BACKEND != "loop" and concat and not transpose_a and gs and \
            (biases is None or all(biases[g] is None for g in gs)) and \
            all(operand_kind(x[g]) == "fp8" for x in (a_list, b_list) for g in gs):
        out = _scaled_grouped_fprop([fp8_operand(a_list[g], False) for g in gs],
                                    [fp8_operand(b_list[g], transpose_b) for g in gs], dtypes[0])
        if out is not None:
            return out
    outs = [gemm(a_list[g], b_list[g], transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=dt,
                 bias=None if biases is None else biases[g], use_fast_accum=use_fast_accum)
            for g, dt in zip(gs, dtypes)]
    if concat:
        return torch.cat(outs, dim=0)
    full: List[Optional[torch.Tensor]] = [None] * num
    for g, o in zip(gs, outs):
        full[g] = o
    return full


# -- FP8 multi-casts: GEMM lists on addresses ----------------------------------------------------------

USE_CUBLASLT = True  # multi-cast GEMMs through fp_recipes.gemm.cublaslt when available (benchmarks switch it off)
_SCALED_MM_OUT_OK = True  # torch._scaled_mm(..., out=) works here (set False after a failure)


class _Side:
    """One GEMM operand of every group in a pass: which copy (rowwise, or ``transposed``) of which cast;
    ``padded``: the transposed copy with its zero padding (both sides of a pass or neither: K must agree).

    A pass that reads one side transposed and the other rowwise (dgrad: the weights' transposed copy)
    contracts over the unpadded rows: the addresses are the same, and a K that is not a multiple of 16
    (the only case where padded and unpadded rows differ) is one the cuBLASLt list does not take."""

    __slots__ = ("casts", "transposed", "padded")

    def __init__(self, casts, transposed: bool, padded: bool = False) -> None:
        self.casts, self.transposed, self.padded = casts, transposed, padded

    def rows(self, g: int) -> int:
        return self.casts.cols if self.transposed else self.casts.rows[g]

    def depth(self, g: int) -> int:  # the contraction
        if self.padded:
            return self.casts.t_layout[0][g]
        return self.casts.rows[g] if self.transposed else self.casts.cols

    def tensor(self, g: int) -> torch.Tensor:
        if self.padded:
            return self.casts.data_t_padded(g)
        return self.casts.data_t(g) if self.transposed else self.casts.data(g)

    def ptrs(self, gs: Sequence[int]) -> List[int]:
        return self.casts.data_t_ptrs(gs) if self.transposed else self.casts.data_ptrs(gs)


def _multi_cast_gemms(a: _Side, b: _Side, gs: Sequence[int], out_dtype, biases, fast_accum: bool, concat: bool):
    """:func:`grouped_gemm` of two multi-casts: with ``concat``, group g writes rows
    ``[starts[g], starts[g+1])`` of one output (A read rowwise); otherwise one tensor per group, one GEMM
    list per output dtype."""
    device = a.casts.device
    if concat:
        starts, n = a.casts.starts, b.rows(0)
        y = torch.empty(starts[-1], n, dtype=out_dtype, device=device)
        esize = y.element_size()
        _gemms(gs, lambda g: y[starts[g]:starts[g + 1]], lambda: [y.data_ptr() + starts[g] * n * esize for g in gs],
               a, b, out_dtype, device, biases, fast_accum)
        return y
    outs: List[Optional[torch.Tensor]] = [None] * len(a.casts.rows)
    by_dtype: dict = {}
    one = isinstance(out_dtype, torch.dtype)
    if one or len(set(out_dtype)) == 1:  # one dtype (the usual case): one list, no per-group bookkeeping
        dt = out_dtype if one else out_dtype[0]
        by_dtype[dt] = gs
        a_rows, b_rows, c_a, c_b = a.casts.rows, b.casts.rows, a.casts.cols, b.casts.cols
        for g in gs:
            # one tensor per group: autograd hands a fresh gradient to .grad as it is, but copies a view
            outs[g] = torch.empty(c_a if a.transposed else a_rows[g], c_b if b.transposed else b_rows[g], dtype=dt,
                                  device=device)
    else:
        for g in gs:
            dt = out_dtype[g]
            outs[g] = torch.empty(a.rows(g), b.rows(g), dtype=dt, device=device)
            by_dtype.setdefault(dt, []).append(g)
    for dt, dgs in by_dtype.items():
        _gemms(dgs, lambda g: outs[g], lambda: [outs[g].data_ptr() for g in dgs], a, b, dt, device, biases,
               fast_accum)
    return outs


def _side_lists(side: _Side, gs: Sequence[int]) -> tuple:
    """(operand addresses, scale_inv addresses, rows, contraction depths) of one side for groups ``gs``,
    in one pass of integer arithmetic over the cast's layout (what ``side.ptrs(gs)``,
    ``side.casts.scale_ptrs(gs)``, ``side.rows(g)`` and ``side.depth(g)`` give, without a call per group):
    group g's rowwise copy starts at ``data_buf + starts[g] * cols`` and its transposed copy at
    ``data_t_buf + t_starts[g]`` (dense: ``starts[g] * cols``; FP8: one byte per element), its scale_inv
    at ``f32 + 16 g``."""
    casts = side.casts
    starts, rows, cols = casts.starts, casts.rows, casts.cols
    fb = casts.f32.data_ptr()
    scales = [fb + 16 * g for g in gs]
    if not side.transposed:
        base = casts.data_buf.data_ptr()
        sizes = [rows[g] for g in gs]
        return [base + starts[g] * cols for g in gs], scales, sizes, [cols] * len(sizes)
    # (cols, rows_g): cols rows, contraction over the group's rows (padded: the zero-padded rows)
    ptrs = casts.data_t_ptrs(gs)
    depths = casts.t_layout[0] if side.padded else rows
    return ptrs, scales, [cols] * len(ptrs), [depths[g] for g in gs]


def _native(device: torch.device, fp8_a: torch.dtype, fp8_b: torch.dtype) -> bool:
    """Whether FP8 GEMMs of these dtypes run natively on ``device`` (a CUDA device of sm_89+); the host
    benchmark (benchmarks/host_grouped_cpu.py) replaces it to run this path's Python on CPU tensors."""
    return device.type == "cuda" and fp8_native_gemm_available(device, fp8_a, fp8_b)


def _gemms(gs: Sequence[int], out: Callable[[int], torch.Tensor], out_ptrs: Callable[[], List[int]], a: _Side,
           b: _Side, out_dtype: torch.dtype, device: torch.device,
           biases: Optional[Sequence[Optional[torch.Tensor]]], fast_accum: bool) -> None:
    """For every group g in ``gs``: ``out(g) = A_g @ B_g^T * sa_g * sb_g (+ bias_g)``.

    On CUDA with cuBLASLt: one host call for the whole list, on addresses (:func:`cublaslt.fp8_gemms_ptr`);
    the GEMMs it cannot take, and everything elsewhere, go through :func:`_gemm_into` one by one."""
    if not gs:
        return
    todo: Sequence[int] = gs
    fp8_a, fp8_b = a.casts.dtype, b.casts.dtype
    if biases is not None and all(bias is None for bias in biases):
        biases = None
    native = _native(device, fp8_a, fp8_b)
    bias_ok = biases is None or all(biases[g] is None or biases[g].dtype == out_dtype for g in gs)
    if native and USE_CUBLASLT and bias_ok and a.casts.addressable and b.casts.addressable and \
            cublaslt.available():
        bias_ptrs = None if biases is None else [0 if biases[g] is None else biases[g].data_ptr() for g in gs]
        a_ptrs, a_scales, ms, ks = _side_lists(a, gs)
        b_ptrs, b_scales, ns, _ = _side_lists(b, gs)
        skipped = cublaslt.fp8_gemms_ptr(
            a_ptrs, a_scales, b_ptrs, b_scales, out_ptrs(), ms, ns, ks,
            fp8_a, fp8_b, out_dtype, device, bias=bias_ptrs, bias_dtype=out_dtype if bias_ptrs else None,
            fast_accum=fast_accum)
        todo = [gs[i] for i in skipped]
    for g in todo:
        _gemm_into(out(g), a.tensor(g), a.casts.scale_inv(g), b.tensor(g), b.casts.scale_inv(g), out_dtype,
                   native, bias=None if biases is None else biases[g], fast_accum=fast_accum)


def _gemm_into(out: Optional[torch.Tensor], a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor,
               sb: torch.Tensor, out_dtype: torch.dtype, native: bool, bias: Optional[torch.Tensor] = None,
               fast_accum: bool = False) -> torch.Tensor:
    """``a @ b^T * sa * sb (+ bias)`` (both contraction-last), written into ``out`` when given.

    cuBLASLt takes the operands as they are when K and N are multiples of 16 and a bias (if any) can
    be fused; otherwise (and on CPU) ``gemm_fp8_fp8`` pads or emulates, exactly as the list path."""
    global _SCALED_MM_OUT_OK
    if native:
        # cuBLASLt (behind torch._scaled_mm) refuses operand and scale pointers that are not 16-byte
        # aligned (CUBLAS_STATUS_NOT_SUPPORTED), and gemm_fp8_fp8 passes a contiguous view through as
        # it is. Views into the multi-cast buffers can be misaligned here: a wgrad operand starts at
        # starts[g] * cols bytes (e.g. cols = 24 after an expert of 1 row), and the reference twin's
        # scale_inv is a packed (G,) vector. A fresh copy is aligned (only GEMMs off the cuBLASLt list
        # get here).
        a, sa, b, sb = _aligned16(a), _aligned16(sa), _aligned16(b), _aligned16(sb)
    if native and a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0 and \
            (bias is None or (bias.dtype == out_dtype and out_dtype in (torch.bfloat16, torch.float16))):
        if out is not None and _SCALED_MM_OUT_OK:
            try:
                torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, bias=bias, out_dtype=out_dtype,
                                 use_fast_accum=fast_accum, out=out)
                return out
            except (RuntimeError, TypeError):
                _SCALED_MM_OUT_OK = False  # no usable out= variant in this torch: copy instead
        res = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, bias=bias, out_dtype=out_dtype,
                               use_fast_accum=fast_accum)
    else:
        res = gemm_fp8_fp8(Fp8Operand(a, sa), Fp8Operand(b, sb), out_dtype=out_dtype, bias=bias,
                           use_fast_accum=fast_accum)
    if out is not None:
        out.copy_(res)
        return out
    return res


def _aligned16(t: torch.Tensor) -> torch.Tensor:
    """``t`` if its data starts at a 16-byte aligned address, else an aligned copy."""
    return t if t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)
