"""Reference twins of the per-token casts (TileKernels' E5M6 contract, and its FP8 E4M3 sibling).

For each token (row) and each block of ``block_size`` consecutive channels (the whole row when
``block_size`` is None), in this order, all FP32 with round to nearest even:

1. ``a = max |x|`` over the block, on FP32 values (never a BF16/FP16 accumulator: seed 000). NaN
   propagates.
2. ``a_c = max(a, 1e-4)`` (the FP32 constant nearest 1e-4).
3. ``sf = RN(a_c / M)`` with M = 65024 (E5M6) or 448 (E4M3).
4. ``round_sf``: ``e = ((bits(sf) - 1) >> 23) + 1 - 127`` (= ceil(log2 sf)), ``sf = 2^e``,
   ``sf_inv = 2^-e``, both exact; otherwise ``sf_inv = RN(M / a_c)``.
5. ``v = RN(x * sf_inv)``; E5M6: :func:`fp_recipes.formats.e5m6_encode` then
   :func:`~fp_recipes.formats.pack_e5m6`; E4M3: saturate_RN (:func:`~fp_recipes.formats.e4m3_encode`).
6. scales: ``sf`` as FP32, or (``scale_format="ue8m0"``, needs ``round_sf``) the byte ``e + 127``.

Non-finite blocks (fp_recipes' rule; TileKernels leaves it undefined): when ``a`` is Inf or NaN the
block's ``sf`` and ``sf_inv`` are NaN, so every code of the block is NaN (E5M6 0x7FF, E4M3 0x7F) and
its scale is NaN (FP32) or 0xFF (UE8M0). Garbage in stays visibly garbage instead of silently
turning into finite values.

``cast_back``: ``out_dtype(RN(decode(code) * sf))``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import formats
from .ref_fp8 import check_float_input, check_fmt, check_out_dtype

AMAX_FLOOR = 1e-4  # converted to FP32 where used
_FMT_MAX = {"e5m6": formats.E5M6_MAX, "e4m3": formats.E4M3_MAX}


class PerTokenQuantized(NamedTuple):
    """data: E5M6 uint8 (T, H*3/2) or float8_e4m3fn (T, H); scales: FP32 or uint8 (T, H/block)."""

    data: torch.Tensor
    scales: torch.Tensor


def _resolve_block(hidden: int, block_size: Optional[int], fmt: str, what: str) -> int:
    if fmt == "e5m6" and hidden % 8:
        raise ValueError(f"{what}: e5m6 packs 8 values into 12 bytes, so the hidden size must be a "
                         f"multiple of 8; got {hidden}")
    if hidden <= 0:
        raise ValueError(f"{what}: the hidden size (last dim) must be > 0, got {hidden}")
    if block_size is None:
        return hidden
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"{what}: block_size must be None or a positive int, got {block_size!r}")
    if hidden % block_size:
        raise ValueError(f"{what}: block_size {block_size} must divide the hidden size {hidden}")
    if fmt == "e5m6" and block_size % 8:
        raise ValueError(f"{what}: e5m6 block_size must be a multiple of 8, got {block_size}")
    return block_size


def _check_scale_format(scale_format: str, round_sf: bool, what: str) -> None:
    if scale_format not in ("fp32", "ue8m0"):
        raise ValueError(f"{what}: scale_format must be 'fp32' or 'ue8m0', got {scale_format!r}")
    if scale_format == "ue8m0" and not round_sf:
        raise ValueError(f"{what}: scale_format='ue8m0' stores power-of-two scales, so it needs "
                         "round_sf=True")


def check_per_token_cast_args(x: torch.Tensor, fmt: str, round_sf: bool, scale_format: str,
                              block_size: Optional[int]) -> tuple[str, int]:
    """per_token_cast's argument checks (shared with the CUDA wrapper); returns (fmt, block)."""
    what = "per_token_cast"
    check_float_input(x, what)
    fmt = check_fmt(fmt, ("e5m6", "e4m3"), what)
    _check_scale_format(scale_format, round_sf, what)
    return fmt, _resolve_block(x.shape[1], block_size, fmt, what)


def check_cast_back_args(data: torch.Tensor, scales: torch.Tensor, fmt: str, out_dtype: torch.dtype,
                         scale_format: str, block_size: Optional[int]) -> tuple[str, int, int, int]:
    """cast_back's argument checks (shared with the CUDA wrapper); returns (fmt, tokens, hidden, block)."""
    what = "cast_back"
    fmt = check_fmt(fmt, ("e5m6", "e4m3"), what)
    check_out_dtype(out_dtype, what)
    if scale_format not in ("fp32", "ue8m0"):
        raise ValueError(f"{what}: scale_format must be 'fp32' or 'ue8m0', got {scale_format!r}")
    if not isinstance(data, torch.Tensor) or data.dim() != 2:
        raise ValueError(f"{what}: data must be a 2-D tensor")
    if fmt == "e5m6":
        if data.dtype != torch.uint8:
            raise TypeError(f"{what}: e5m6 data must be packed uint8, got {data.dtype}")
        if data.shape[1] % 12:
            raise ValueError(f"{what}: packed e5m6 rows must hold a multiple of 12 bytes, got {data.shape[1]}")
        h = data.shape[1] * 2 // 3
    else:
        if data.dtype != torch.float8_e4m3fn:
            raise TypeError(f"{what}: e4m3 data must be float8_e4m3fn, got {data.dtype}")
        h = data.shape[1]
    t = data.shape[0]
    block = _resolve_block(h, block_size, fmt, what)
    want_dtype = torch.uint8 if scale_format == "ue8m0" else torch.float32
    if not isinstance(scales, torch.Tensor) or scales.dtype != want_dtype:
        raise TypeError(f"{what}: scale_format={scale_format!r} needs {want_dtype} scales, got "
                        f"{scales.dtype if isinstance(scales, torch.Tensor) else type(scales).__name__}")
    if scales.device != data.device:
        raise ValueError(f"{what}: scales are on {scales.device} but data is on {data.device}")
    if tuple(scales.shape) != (t, h // block):
        raise ValueError(f"{what}: scales must have shape {(t, h // block)} for hidden {h} and block "
                         f"{block_size}, got {tuple(scales.shape)}")
    return fmt, t, h, block


def per_token_scales(amax: torch.Tensor, fmt_max: float, round_sf: bool):
    """Steps 2-4 on an FP32 amax tensor: returns (sf, sf_inv, e) with e None unless round_sf."""
    floor = torch.tensor(AMAX_FLOOR, dtype=torch.float32, device=amax.device)
    fmax = torch.tensor(fmt_max, dtype=torch.float32, device=amax.device)
    bad = ~torch.isfinite(amax)
    a_c = torch.maximum(torch.where(bad, floor, amax), floor)
    sf = a_c / fmax
    e = None
    if round_sf:
        e = ((formats.fp32_bits(sf) - 1) >> 23) + 1 - 127
        sf = formats.pow2(e)
        sf_inv = formats.pow2(-e)
    else:
        sf_inv = fmax / a_c
    nan = torch.full_like(sf, float("nan"))
    return torch.where(bad, nan, sf), torch.where(bad, nan, sf_inv), e


def per_token_cast(x: torch.Tensor, fmt: str, *, round_sf: bool = False, scale_format: str = "fp32",
                   block_size: Optional[int] = None) -> PerTokenQuantized:
    """Per-token (per-block) cast of 2-D ``x`` (T, H); see the module docstring for the formula."""
    fmt, block = check_per_token_cast_args(x, fmt, round_sf, scale_format, block_size)
    t, h = x.shape
    nb = h // block
    xf = x.to(torch.float32).reshape(t, nb, block)
    a = xf.abs().amax(dim=-1) if t else torch.zeros(t, nb, dtype=torch.float32, device=x.device)
    a = torch.where(torch.isnan(xf).any(dim=-1), torch.full_like(a, float("nan")), a)
    sf, sf_inv, e = per_token_scales(a, _FMT_MAX[fmt], round_sf)
    v = (xf * sf_inv.unsqueeze(-1)).reshape(t, h)  # NaN sf_inv -> NaN v -> NaN codes
    if fmt == "e5m6":
        data = formats.pack_e5m6(formats.e5m6_encode(v))
    else:
        data = formats.fp8_encode(v, "e4m3")
    if scale_format == "ue8m0":
        scales = torch.where(torch.isnan(sf), torch.full_like(e, formats.UE8M0_NAN), e + 127).to(torch.uint8)
    else:
        scales = sf
    return PerTokenQuantized(data=data, scales=scales)


def cast_back(data: torch.Tensor, scales: torch.Tensor, fmt: str, *, out_dtype: torch.dtype = torch.bfloat16,
              scale_format: str = "fp32", block_size: Optional[int] = None) -> torch.Tensor:
    """Dequantize a :func:`per_token_cast` result: ``out_dtype(RN(decode(code) * sf))`` per block."""
    fmt, t, h, block = check_cast_back_args(data, scales, fmt, out_dtype, scale_format, block_size)
    if fmt == "e5m6":
        values = formats.e5m6_decode(formats.unpack_e5m6(data))
    else:
        values = formats.e4m3_decode(data)
    nb = h // block
    sf = formats.ue8m0_decode(scales) if scale_format == "ue8m0" else scales
    out = values.reshape(t, nb, block) * sf.unsqueeze(-1)
    return out.reshape(t, h).to(out_dtype)


__all__ = ["cast_back", "per_token_cast"]
