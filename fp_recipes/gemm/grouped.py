"""Grouped GEMMs: one GEMM per group (MoE expert) with each group's own scales (FP8 per-tensor scales,
NVFP4 per-expert alpha)."""

from __future__ import annotations

import itertools
from typing import List, Optional, Sequence, Union

import torch

from . import _common
from .dispatch import Operand, gemm
from .operands import Fp8Operand, fp8_operand, operand_kind

__all__ = ["GROUPED_FP8_BACKEND", "grouped_gemm"]

# Which FP8 grouped GEMM runs where both work: "auto" (one torch._scaled_grouped_mm when eligible),
# "grouped_mm" (the same), or "loop" (one torch._scaled_mm per group: no concatenation copies).
GROUPED_FP8_BACKEND = "auto"


def _scaled_grouped_fprop(a_list: Sequence[Fp8Operand], b_list: Sequence[Fp8Operand],
                          out_dtype: torch.dtype, a_buffer: Optional[torch.Tensor] = None
                          ) -> Optional[torch.Tensor]:
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
    if a_buffer is not None:  # the members are its consecutive row blocks
        a_cat = a_buffer
    else:
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
                 transpose_b: bool = False, out_dtype: torch.dtype,
                 biases: Optional[Sequence[Optional[torch.Tensor]]] = None, use_fast_accum: bool = False,
                 concat: bool = True) -> Union[torch.Tensor, List[torch.Tensor]]:
    """One GEMM per group, ``out[g] = gemm(a_list[g], b_list[g])`` with each group's own scales
    (FP8 per-tensor scales, NVFP4 per-expert alpha). ``concat=True`` stacks the outputs along rows.

    FP8 E4M3 x E4M3 into BF16 on sm_90 without bias runs as one ``torch._scaled_grouped_mm``; other
    cases loop over the per-pair GEMM (itself native ``_scaled_mm`` where available). Zero-row groups
    give empty outputs (or, for a zero-size contraction, zeros)."""
    if len(a_list) != len(b_list):
        raise ValueError(f"grouped_gemm: {len(a_list)} A operands but {len(b_list)} B operands")
    if biases is not None and len(biases) != len(a_list):
        raise ValueError(f"grouped_gemm: {len(biases)} biases for {len(a_list)} groups")
    no_bias = biases is None or all(x is None for x in biases)
    if GROUPED_FP8_BACKEND != "loop" and concat and no_bias and not transpose_a and a_list and \
            all(operand_kind(x) == "fp8" for x in list(a_list) + list(b_list)):
        fa = [fp8_operand(x, False) for x in a_list]
        fb = [fp8_operand(x, transpose_b) for x in b_list]
        out = _scaled_grouped_fprop(fa, fb, out_dtype)
        if out is not None:
            return out
    outs = [gemm(a, b, transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=out_dtype,
                 bias=None if biases is None else biases[g], use_fast_accum=use_fast_accum)
            for g, (a, b) in enumerate(zip(a_list, b_list))]
    if not concat:
        return outs
    return torch.cat(outs, dim=0)
