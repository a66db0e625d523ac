"""GEMMs on quantized operands: every format pair, one function each, and a dispatcher.

Convention (TN, as cuBLAS and the operand table in ``quantizers/roles.py``): both operands have the
contraction dimension LAST. ``gemm(a, b)`` returns ``op(a) @ op(b)^T`` of shape (rows(a), rows(b)),
where ``op(x)`` is the rowwise copy of ``x`` or, with ``transpose_x=True``, its columnwise copy (the
quantization of ``x^T``)::

    fprop  y  = gemm(x,  w)                                   (M,K) x (N,K) -> (M,N)
    dgrad  dx = gemm(dy, w,  transpose_b=True)                 (M,N) x (K,N) -> (M,K)
    wgrad  dw = gemm(dy, x,  transpose_a=True, transpose_b=True)  (N,M) x (K,M) -> (N,K)

The dispatcher reads only the tensors' own metadata (format, scales, amax, ``row_scaled``,
``e4m3_max``, RHT flag) -- never a recipe.

Backends:

* FP8 x FP8: ``torch._scaled_mm`` (per-tensor scales) on CUDA sm_89+, any pair except E5M2 x E5M2
  (which cuBLASLt does not support); K and N are zero-padded to multiples of 16 when needed (zeros
  add nothing to a dot product, so the result is unchanged). Elsewhere an exact emulation: the FP8
  values are exact in FP32, the FP32 matmul accumulates, and the product of the two dequantization
  scales is applied in the FP32 epilogue, as the hardware does.
* NVFP4 x NVFP4: exact emulation everywhere (native FP4 GEMMs need sm_100+, which this project cannot
  test; see ``_native_nvfp4_available``). E2M1 code x E4M3 block scale is exact in BF16, so each
  operand is decoded to BF16 *without* its global factor, multiplied with FP32 accumulation
  (on CUDA: one kernel decodes both operands and writes alpha on the device, one cuBLASLt BF16 GEMM
  reads that alpha, see ``_gemm_nvfp4_cuda``; an FP32 matmul of the BF16-exact values on CPU),
  and the FP32 global factor ``alpha = nvfp4_gemm_alpha(amax_a, amax_b, E_a, E_b)`` is applied in
  the FP32 epilogue. The global scale is never folded into the E4M3 block scales (seed 003).
  Row-scaled operands: unit-amax GEMM into FP32, then each output row scaled by
  ``RN(amax_row[m] * amax_other)``, bias in FP32, then the cast.
* Anything else (a high-precision operand, per-token tensors, mixed formats): both operands are
  dequantized to FP32 and multiplied in FP32; two plain tensors of one dtype use torch's own matmul in
  that dtype (the ``backward_override="high_precision"`` path behaves exactly like torch).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import torch

__all__ = [
    "gemm",
    "gemm_fp8_fp8",
    "gemm_nvfp4_nvfp4",
    "gemm_high_precision",
    "grouped_gemm",
    "decode_nvfp4_unit",
    "fp8_native_gemm_available",
]

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


# ----------------------------------------------------------------------------------------------
# operand views: which copy of a quantized tensor a GEMM reads
# ----------------------------------------------------------------------------------------------


def _kind(t: object) -> str:
    """'fp8' | 'nvfp4' | 'tensor' | 'other' from the tensor's own type (no recipe involved)."""
    if isinstance(t, torch.Tensor):
        return "tensor"
    name = type(t).__name__
    if name == "Float8Tensor":
        return "fp8"
    if name == "NVFP4Tensor":
        return "nvfp4"
    if hasattr(t, "dequantize"):
        return "other"
    raise TypeError(f"gemm: unsupported operand type {type(t).__name__}; expected a torch.Tensor, "
                    "Float8Tensor, NVFP4Tensor or another QuantizedTensor")


@dataclass
class _Fp8Operand:
    data: torch.Tensor  # (rows, K) fp8, contraction last
    scale_inv: torch.Tensor  # FP32, one element


@dataclass
class _Nvfp4Operand:
    data: torch.Tensor  # (rows, K/2) uint8 packed E2M1
    scale: torch.Tensor  # (rows, K/16) float8_e4m3fn block scales
    amax: torch.Tensor  # FP32 0-dim, or (rows,) when row_scaled
    row_scaled: bool
    e4m3_max: int
    rht: bool  # a random Hadamard transform was applied along K
    unit: Optional[torch.Tensor] = None  # cached BF16 unit operand (rows, K) = decode_nvfp4_unit(data, scale)


def _fp8_operand(t, transpose: bool) -> _Fp8Operand:
    if not transpose:
        data = t.rowwise_data() if hasattr(t, "rowwise_data") else t.data
    else:
        data = t.t_data() if hasattr(t, "t_data") else t.data_t
    if data.dim() != 2:
        data = data.reshape(-1, data.shape[-1])
    return _Fp8Operand(data, t.scale_inv.float().reshape(()))


def _nvfp4_operand(t, transpose: bool) -> _Nvfp4Operand:
    e4m3_max = int(getattr(t, "e4m3_max", 448))
    if not transpose:
        if t.data is None:
            raise ValueError("gemm: this NVFP4Tensor has no rowwise copy (quantized with rowwise=False)")
        return _Nvfp4Operand(t.data, t.scale, t.amax, bool(getattr(t, "row_scaled", False)), e4m3_max,
                             False, getattr(t, "gemm_unit", None))
    if getattr(t, "data_t", None) is None:
        raise ValueError("gemm: this NVFP4Tensor has no columnwise copy; the dgrad/wgrad GEMMs need "
                         "one (quantize with columnwise=True)")
    # The columnwise copy is always per-tensor scaled, even when the rowwise copy is row-scaled.
    return _Nvfp4Operand(t.data_t, t.scale_t, t.amax_t, False, e4m3_max,
                         bool(getattr(t, "rht_columnwise", False)), getattr(t, "gemm_unit_t", None))


def _dense_operand(t, transpose: bool) -> torch.Tensor:
    """A high-precision (rows, K) view: a plain tensor as is, a quantized one dequantized to FP32."""
    if isinstance(t, torch.Tensor):
        if t.dim() != 2:
            t = t.reshape(-1, t.shape[-1])
        return t.t() if transpose else t
    if _kind(t) == "nvfp4" and transpose and getattr(t, "rht_columnwise", False):
        raise ValueError("gemm: the columnwise copy of this NVFP4 tensor is Hadamard-transformed (RHT); it "
                         "can only be multiplied by another RHT'd columnwise NVFP4 operand")
    if _kind(t) == "nvfp4" and transpose:
        op = _nvfp4_operand(t, True)
        return _dequantize_nvfp4_operand(op)
    d = t.dequantize(torch.float32)
    if d.dim() != 2:
        d = d.reshape(-1, d.shape[-1])
    return d.t() if transpose else d


# ----------------------------------------------------------------------------------------------
# capability checks
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


def fp8_native_gemm_available(device: torch.device, a_dtype: torch.dtype = torch.float8_e4m3fn,
                              b_dtype: torch.dtype = torch.float8_e4m3fn) -> bool:
    """True when ``torch._scaled_mm`` can run this FP8 pair on ``device`` (CUDA sm_89+, not E5M2 x E5M2)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    if a_dtype == torch.float8_e5m2 and b_dtype == torch.float8_e5m2:
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (8, 9)


def _native_nvfp4_available(device: torch.device) -> bool:
    """Native NVFP4 GEMMs (sm_100+) are deliberately not wired up: this project has no Blackwell GPU to
    test them on, and an untested fast path that silently disagrees with the emulation would be worse
    than the emulation. The emulation is exact in its products and runs on every device."""
    return False


# ----------------------------------------------------------------------------------------------
# epilogue helpers
# ----------------------------------------------------------------------------------------------


def _finish(out32: torch.Tensor, bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """Bias in FP32, then the one cast to the output dtype."""
    if bias is not None:
        out32 = out32 + bias.float()
    return out32 if out_dtype == torch.float32 else out32.to(out_dtype)


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """FP32 ``a @ b^T`` with FP32 accumulation and no TF32 (the exact-emulation matmul)."""
    a = a.float()
    b = b.float()
    if a.is_cuda:
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            return a @ b.t()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev
    return a @ b.t()


def _mm_bf16_fp32_accum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b^T`` for BF16-exact operands, accumulated and returned in FP32.

    CUDA: a BF16 tensor-core GEMM with FP32 output (exact products, FP32 accumulation).
    CPU (or an older torch): an FP32 matmul of the same values (the values are exact in FP32 too)."""
    if a.is_cuda:
        try:
            return torch.mm(a.to(torch.bfloat16), b.to(torch.bfloat16).t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError):
            pass
    return _mm_fp32(a, b)


def _gemm_ready(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when cuBLASLt can read it in place (row-major, 16-byte aligned rows and start: e.g.
    a column slice of a transposed buffer), else a contiguous copy."""
    if x.stride(1) == 1 and x.stride(0) >= max(1, x.shape[1]) and \
            (x.stride(0) * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0:
        return x
    return x.contiguous()


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    size = x.shape[dim]
    rem = size % multiple
    if rem == 0:
        return x
    pad_shape = list(x.shape)
    pad_shape[dim] = multiple - rem
    return torch.cat([x, torch.zeros(pad_shape, dtype=x.dtype, device=x.device)], dim=dim)


# ----------------------------------------------------------------------------------------------
# FP8 x FP8
# ----------------------------------------------------------------------------------------------


def gemm_fp8_fp8(a: _Fp8Operand, b: _Fp8Operand, *, out_dtype: torch.dtype,
                 bias: Optional[torch.Tensor] = None, use_fast_accum: bool = False) -> torch.Tensor:
    """FP8 x FP8 with per-tensor scales: ``(a.data @ b.data^T) * (a.scale_inv * b.scale_inv) + bias``."""
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"gemm: contraction dims differ: {tuple(a.data.shape)} x {tuple(b.data.shape)}^T")
    m, n = a.data.shape[0], b.data.shape[0]
    if fp8_native_gemm_available(a.data.device, a.data.dtype, b.data.dtype):
        if m == 0 or n == 0 or a.data.shape[1] == 0:
            return _finish(torch.zeros(m, n, device=a.data.device), bias, out_dtype)
        a_data = _gemm_ready(_pad_to(a.data, 1, 16))
        b_data = _gemm_ready(_pad_to(_pad_to(b.data, 1, 16), 0, 16))
        fuse_bias = bias is not None and bias.dtype == out_dtype and out_dtype in (torch.bfloat16,
                                                                                   torch.float16)
        mm_dtype = out_dtype if (bias is None or fuse_bias) else torch.float32
        out = torch._scaled_mm(a_data, b_data.t(), scale_a=a.scale_inv,
                               scale_b=b.scale_inv, bias=bias if fuse_bias else None, out_dtype=mm_dtype,
                               use_fast_accum=use_fast_accum)
        if out.shape[1] != n:
            out = out[:, :n]
        if bias is not None and not fuse_bias:
            return _finish(out, bias, out_dtype)
        return out
    acc = _mm_fp32(a.data.float(), b.data.float())
    return _finish(acc * (a.scale_inv * b.scale_inv), bias, out_dtype)


# ----------------------------------------------------------------------------------------------
# NVFP4 x NVFP4 (emulated; exact products)
# ----------------------------------------------------------------------------------------------


_PAIR_TABLES: dict = {}


def _byte_pair_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(256, 2): the two E2M1 values (low nibble first) of every packed byte, from formats.py."""
    key = (device, dtype)
    table = _PAIR_TABLES.get(key)
    if table is None:
        from . import formats

        codes = formats.unpack_e2m1(torch.arange(256, dtype=torch.uint8).reshape(256, 1))  # (256, 2)
        table = formats.e2m1_decode(codes).to(dtype).to(device)
        _PAIR_TABLES[key] = table
    return table


def decode_nvfp4_unit(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E2M1 code x E4M3 block scale, WITHOUT the global factor: (rows, K) in ``dtype`` (FP32 or BF16;
    both exact).

    E2M1 magnitudes have at most 2 significant bits and E4M3 values at most 4, so each product has
    at most 6 significant bits and lies in [2^-10, 2688]: BF16 (8 bits, 8-bit exponent) holds it
    exactly, so the BF16 multiply (computed in FP32 and rounded) is exact too. One gather per packed
    byte (a 256-entry pair table) keeps the decode to a single pass over the data."""
    rows, half = data.shape
    if scale.shape != (rows, (half * 2) // 16):
        raise ValueError(f"NVFP4 scale shape {tuple(scale.shape)} does not match data {tuple(data.shape)} "
                         "(expected one E4M3 scale per 16 elements, unpadded)")
    table = _byte_pair_table(data.device, dtype)
    vals = table[data.view(torch.uint8).int()].reshape(rows, -1, 16)  # (rows, K/16, 16)
    sf = scale.to(dtype)  # E4M3 -> FP32/BF16: exact
    return (vals * sf.unsqueeze(-1)).reshape(rows, half * 2)


def _nvfp4_alpha(amax_a: torch.Tensor, amax_b: torch.Tensor, e_a: int, e_b: int) -> torch.Tensor:
    from . import ops

    return ops.nvfp4_gemm_alpha(amax_a.float(), amax_b.float(), e_a, e_b)


def _dequantize_nvfp4_operand(op: _Nvfp4Operand) -> torch.Tensor:
    """FP32 values of one NVFP4 copy by the dequantize contract (NUMERICS.md step 7); used only where
    an NVFP4 copy meets a non-NVFP4 operand."""
    from . import ops

    return ops.nvfp4_dequantize(op.data, op.scale, op.amax, e4m3_max=op.e4m3_max,
                                row_scaled=op.row_scaled, out_dtype=torch.float32)


def gemm_nvfp4_nvfp4(a: _Nvfp4Operand, b: _Nvfp4Operand, *, out_dtype: torch.dtype,
                     bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """NVFP4 x NVFP4: unit-scaled BF16-exact GEMM with FP32 accumulation, global factor as FP32 alpha."""
    if a.rht != b.rht:
        raise ValueError("gemm: one NVFP4 operand is Hadamard-transformed (RHT) along K and the other is "
                         "not; the product would be wrong. RHT must be applied to both wgrad operands")
    ka, kb = a.data.shape[1] * 2, b.data.shape[1] * 2
    if ka != kb:
        raise ValueError(f"gemm: contraction dims differ: {a.data.shape[0]}x{ka} and {b.data.shape[0]}x{kb}")
    if _native_nvfp4_available(a.data.device):  # pragma: no cover - never true (see docstring)
        raise NotImplementedError
    if a.data.is_cuda:
        out = _gemm_nvfp4_cuda(a, b, out_dtype, bias)
        if out is not None:
            return out
    return _gemm_nvfp4_emulated(a, b, out_dtype, bias)


def _gemm_nvfp4_emulated(a: _Nvfp4Operand, b: _Nvfp4Operand, out_dtype: torch.dtype,
                         bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The portable emulation in torch ops (the twin of the CUDA path below)."""
    unit = torch.bfloat16 if a.data.is_cuda else torch.float32  # the GEMM's input dtype; both exact
    acc = _mm_bf16_fp32_accum(decode_nvfp4_unit(a.data, a.scale, unit), decode_nvfp4_unit(b.data, b.scale, unit))
    if not a.row_scaled and not b.row_scaled:
        return _finish(acc * _nvfp4_alpha(a.amax, b.amax, a.e4m3_max, b.e4m3_max), bias, out_dtype)
    # Row-scaled: unit-amax alpha first, then the per-row (and/or per-column) amax product.
    one = torch.ones((), dtype=torch.float32, device=acc.device)
    out = acc * _nvfp4_alpha(one, one, a.e4m3_max, b.e4m3_max)
    amax_a = a.amax.float()
    amax_b = b.amax.float()
    if a.row_scaled and b.row_scaled:
        factor = amax_a.unsqueeze(1) * amax_b.unsqueeze(0)
    elif a.row_scaled:
        factor = (amax_a * amax_b).unsqueeze(1)
    else:
        factor = (amax_a * amax_b).unsqueeze(0)
    return _finish(out * factor, bias, out_dtype)


_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _fp32_amax_on(t: torch.Tensor, device: torch.device) -> bool:
    return t.dtype == torch.float32 and t.device == device and t.is_contiguous()


def _cached_unit(op: _Nvfp4Operand, dev: torch.device) -> Optional[torch.Tensor]:
    """The operand's cached BF16 unit copy when the GEMM can read it as is (the quantize kernel wrote it
    from the same codes and scales: bit-equal to decoding them), else None."""
    u = op.unit
    rows, half = op.data.shape
    if u is None or u.dtype != torch.bfloat16 or u.shape != (rows, half * 2) or u.device != dev or \
            not u.is_contiguous() or u.data_ptr() % 16:
        return None
    return u


def _gemm_nvfp4_cuda(a: _Nvfp4Operand, b: _Nvfp4Operand, out_dtype: torch.dtype,
                     bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The emulation in three launches at most: one kernel decodes the operands that have no cached BF16
    unit copy (the CUDA quantizer writes those next to the packed copies) and writes alpha on the device;
    one cuBLASLt BF16 GEMM (FP32 accumulation) applies that alpha (and a
    bias of the output dtype) in its epilogue; a row-scaled product adds one epilogue kernel. The same
    values and roundings as :func:`_gemm_nvfp4_emulated`; only the FP32 accumulation order is
    cuBLAS's choice, as it already was. None when it cannot run here (no cuBLASLt, tracing under
    torch.compile, operands it does not take): the caller runs the torch emulation."""
    if torch.compiler.is_compiling() or out_dtype not in _OUT_DTYPES:
        return None
    from . import gemm_lt
    from .ops import cuda_nvfp4

    dev = a.data.device
    if not cuda_nvfp4.unit_operands_available() or not gemm_lt.available() or b.data.device != dev:
        return None
    m, n, k = a.data.shape[0], b.data.shape[0], a.data.shape[1] * 2
    if m == 0 or n == 0 or k == 0 or not (_fp32_amax_on(a.amax, dev) and _fp32_amax_on(b.amax, dev)):
        return None
    if bias is not None and (bias.device != dev or bias.dtype not in _OUT_DTYPES or not bias.is_contiguous()):
        return None
    row = a.row_scaled or b.row_scaled
    units = [_cached_unit(a, dev), _cached_unit(b, dev)]
    todo = [i for i, u in enumerate(units) if u is None]
    try:
        decoded, alpha_beta = cuda_nvfp4.nvfp4_unit_operands(
            [(op.data, op.scale) for op in ((a, b)[i] for i in todo)],
            None if row else a.amax, None if row else b.amax, a.e4m3_max, b.e4m3_max, device=dev)
    except ValueError:  # non-contiguous or unaligned copies: the torch emulation takes them
        return None
    for i, u in zip(todo, decoded):
        units[i] = u
    ua, ub = units
    if not row:
        fuse_bias = bias is None or bias.dtype == out_dtype
        out = torch.empty((m, n), dtype=out_dtype if fuse_bias else torch.float32, device=dev)
        if not gemm_lt.bf16_gemm_device_alpha(ua, ub, out, alpha_beta, bias=bias if fuse_bias else None):
            out = torch.mm(ua, ub.t(), out_dtype=torch.float32) * alpha_beta[0]
            fuse_bias = False
        return out if fuse_bias else _finish(out, bias, out_dtype)
    d = torch.empty((m, n), dtype=torch.float32, device=dev)
    if not gemm_lt.bf16_gemm_device_alpha(ua, ub, d, alpha_beta):
        d = torch.mm(ua, ub.t(), out_dtype=torch.float32) * alpha_beta[0]
    return cuda_nvfp4.nvfp4_row_scale_epilogue(d, a.amax, a.row_scaled, b.amax, b.row_scaled, bias, out_dtype)


# ----------------------------------------------------------------------------------------------
# high precision / mixed
# ----------------------------------------------------------------------------------------------


def gemm_high_precision(a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype,
                        bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain operands: torch's own matmul when operands and output share a dtype (exactly like torch);
    otherwise an FP32 matmul (exact products of the narrower inputs) and one cast to ``out_dtype``."""
    if a.dtype == b.dtype == out_dtype and a.dtype != torch.float32:
        out = a @ b.t()
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out.to(out_dtype)
    return _finish(_mm_fp32(a, b), bias, out_dtype)


# ----------------------------------------------------------------------------------------------
# dispatcher
# ----------------------------------------------------------------------------------------------

Operand = Union[torch.Tensor, object]


def gemm(a: Operand, b: Operand, *, transpose_a: bool = False, transpose_b: bool = False,
         out_dtype: Optional[torch.dtype] = None, bias: Optional[torch.Tensor] = None,
         use_fast_accum: bool = False) -> torch.Tensor:
    """``op(a) @ op(b)^T (+ bias)``: both operands with the contraction dim last (see module doc).

    ``out_dtype`` defaults to the original dtype of ``a`` (or FP32). ``use_fast_accum`` only affects
    the native FP8 path (cuBLASLt's fast accumulation; torchao and TE use it for fprop only)."""
    ka, kb = _kind(a), _kind(b)
    if out_dtype is None:
        out_dtype = a.dtype if ka == "tensor" else getattr(a, "orig_dtype", torch.float32)
    if ka == "fp8" and kb == "fp8":
        return gemm_fp8_fp8(_fp8_operand(a, transpose_a), _fp8_operand(b, transpose_b), out_dtype=out_dtype,
                            bias=bias, use_fast_accum=use_fast_accum)
    if ka == "nvfp4" and kb == "nvfp4":
        return gemm_nvfp4_nvfp4(_nvfp4_operand(a, transpose_a), _nvfp4_operand(b, transpose_b),
                                out_dtype=out_dtype, bias=bias)
    da, db = _dense_operand(a, transpose_a), _dense_operand(b, transpose_b)
    if da.shape[1] != db.shape[1]:
        raise ValueError(f"gemm: contraction dims differ: {tuple(da.shape)} x {tuple(db.shape)}^T")
    if ka == "tensor" and kb == "tensor":
        return gemm_high_precision(da, db, out_dtype=out_dtype, bias=bias)
    return _finish(_mm_fp32(da, db), bias, out_dtype)


# ----------------------------------------------------------------------------------------------
# grouped
# ----------------------------------------------------------------------------------------------


# Which FP8 grouped GEMM runs where both work: "auto" (one torch._scaled_grouped_mm when eligible),
# "grouped_mm" (the same), or "loop" (one torch._scaled_mm per group: no concatenation copies).
GROUPED_FP8_BACKEND = "auto"


def _scaled_grouped_fprop(a_list: Sequence[_Fp8Operand], b_list: Sequence[_Fp8Operand],
                          out_dtype: torch.dtype, a_buffer: Optional[torch.Tensor] = None
                          ) -> Optional[torch.Tensor]:
    """One ``torch._scaled_grouped_mm`` launch for the "2-D x 3-D" shape (rows split by group, one
    B matrix per group), with the per-tensor scales expanded to torch's row/column scale vectors.
    None when torch cannot run it here (the caller then loops over ``_scaled_mm``)."""
    if not hasattr(torch, "_scaled_grouped_mm") or out_dtype != torch.bfloat16 or not a_list:
        return None
    dev = a_list[0].data.device
    if dev.type != "cuda" or _capability(dev.index if dev.index is not None else 0) < (9, 0) or \
            _capability(dev.index if dev.index is not None else 0) >= (10, 0):
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
            all(_kind(x) == "fp8" for x in list(a_list) + list(b_list)):
        fa = [_fp8_operand(x, False) for x in a_list]
        fb = [_fp8_operand(x, transpose_b) for x in b_list]
        out = _scaled_grouped_fprop(fa, fb, out_dtype)
        if out is not None:
            return out
    outs = [gemm(a, b, transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=out_dtype,
                 bias=None if biases is None else biases[g], use_fast_accum=use_fast_accum)
            for g, (a, b) in enumerate(zip(a_list, b_list))]
    if not concat:
        return outs
    return torch.cat(outs, dim=0)
