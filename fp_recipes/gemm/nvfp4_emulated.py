"""NVFP4 x NVFP4, exactly emulated: the reference of every NVFP4 GEMM path, and what runs wherever the
GPU has no FP4 tensor cores (Hopper, CPU).

E2M1 code x E4M3 block scale is exact in BF16, so each operand is decoded to BF16 *without* its
global factor, multiplied with FP32 accumulation, and the FP32 global factor
``alpha = nvfp4_gemm_alpha(amax_a, amax_b, E_a, E_b)`` is applied in the FP32 epilogue. The global
scale is never folded into the E4M3 block scales (seed 003). Row-scaled operands: unit-amax GEMM into
FP32, then each output row scaled by ``RN(amax_row[m] * amax_other)``, bias in FP32, then the cast.

Two implementations of the same values: :func:`gemm_nvfp4_emulated` in torch ops (every device), and
:func:`gemm_nvfp4_emulated_cuda`, three launches on CUDA (one decode kernel that also writes alpha on the
device, one cuBLASLt BF16 GEMM reading that alpha, a row-scale epilogue kernel; a row-scaled product of
2048 rows or more runs its GEMM and epilogue in up to 4 row chunks, to bound its FP32 scratch)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .. import _extension, formats, ops
from ..ops.op_library import define_op, register_fake
from . import cublaslt
from ._common import finish, mm_bf16_fp32_accum
from .operands import Nvfp4Operand

__all__ = ["decode_nvfp4_unit", "nvfp4_alpha", "apply_global_factors", "gemm_nvfp4_emulated",
           "gemm_nvfp4_emulated_cuda", "gemm_nvfp4_emulated_traced", "cached_unit", "row_chunk"]

_PAIR_TABLES: dict = {}


def _byte_pair_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(256, 2): the two E2M1 values (low nibble first) of every packed byte, from formats.py."""
    key = (device, dtype)
    table = _PAIR_TABLES.get(key)
    if table is None:
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


def nvfp4_alpha(amax_a: torch.Tensor, amax_b: torch.Tensor, e_a: int, e_b: int) -> torch.Tensor:
    """The FP32 global factor of a per-tensor pair (``ops.nvfp4_gemm_alpha``)."""
    return ops.nvfp4_gemm_alpha(amax_a.float(), amax_b.float(), e_a, e_b)


def row_scale_factor(a: Nvfp4Operand, b: Nvfp4Operand) -> torch.Tensor:
    """The per-row (and/or per-column) amax product a row-scaled result is multiplied by, after the
    unit-amax alpha: (M, 1), (1, N) or (M, N) FP32."""
    amax_a = a.amax.float()
    amax_b = b.amax.float()
    if a.row_scaled and b.row_scaled:
        return amax_a.unsqueeze(1) * amax_b.unsqueeze(0)
    if a.row_scaled:
        return (amax_a * amax_b).unsqueeze(1)
    return (amax_a * amax_b).unsqueeze(0)


def apply_global_factors(acc: torch.Tensor, a: Nvfp4Operand, b: Nvfp4Operand, out_dtype: torch.dtype,
                         bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The epilogue of every NVFP4 GEMM path on its FP32 accumulator ``acc = sum (q_a sf_a)(q_b sf_b)``
    (M, N): per tensor ``RN(acc * alpha)``; row-scaled ``RN(RN(acc * alpha_1) * RN(A_a[m] * A_b))``;
    then the bias in FP32 and the one cast (docs/nvfp4.md section 6)."""
    if not a.row_scaled and not b.row_scaled:
        return finish(acc * nvfp4_alpha(a.amax, b.amax, a.e4m3_max, b.e4m3_max), bias, out_dtype)
    # Row-scaled: unit-amax alpha first, then the per-row (and/or per-column) amax product.
    one = torch.ones((), dtype=torch.float32, device=acc.device)
    out = acc * nvfp4_alpha(one, one, a.e4m3_max, b.e4m3_max)
    return finish(out * row_scale_factor(a, b), bias, out_dtype)


def gemm_nvfp4_emulated(a: Nvfp4Operand, b: Nvfp4Operand, out_dtype: torch.dtype,
                        bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The portable emulation in torch ops (the twin of :func:`gemm_nvfp4_emulated_cuda`)."""
    unit = torch.bfloat16 if a.data.is_cuda else torch.float32  # the GEMM's input dtype; both exact
    acc = mm_bf16_fp32_accum(decode_nvfp4_unit(a.data, a.scale, unit), decode_nvfp4_unit(b.data, b.scale, unit))
    return apply_global_factors(acc, a, b, out_dtype, bias)


_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def cached_unit(op: Nvfp4Operand, dev: torch.device) -> Optional[torch.Tensor]:
    """The operand's cached BF16 unit copy when the GEMM can read it as is (the quantize kernel wrote it
    from the same codes and scales: bit-equal to decoding them), else None."""
    u = op.unit
    rows, half = op.data.shape
    if u is None or u.dtype != torch.bfloat16 or u.shape != (rows, half * 2) or u.device != dev or \
            not u.is_contiguous() or u.data_ptr() % 16:
        return None
    return u


_cuda_nvfp4: Any = None  # fp_recipes.ops.cuda_nvfp4 once imported (by the first CUDA GEMM: it registers custom ops)


def _cuda_ops() -> Any:
    global _cuda_nvfp4
    from ..ops import cuda_nvfp4

    _cuda_nvfp4 = cuda_nvfp4
    return cuda_nvfp4


def gemm_nvfp4_emulated_cuda(a: Nvfp4Operand, b: Nvfp4Operand, out_dtype: torch.dtype,
                             bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The emulation in three launches at most: one kernel decodes the operands that have no cached BF16
    unit copy (the CUDA quantizer writes those next to the packed copies) and writes alpha on the device;
    one cuBLASLt BF16 GEMM (FP32 accumulation) applies that alpha (and a
    bias of the output dtype) in its epilogue; a row-scaled product adds one epilogue kernel (per row
    chunk: :func:`row_chunk`). The same
    values and roundings as :func:`gemm_nvfp4_emulated`; only the FP32 accumulation order is
    cuBLAS's choice, as it already was. None when it cannot run here (no cuBLASLt, tracing under
    torch.compile, operands it does not take): the caller runs the torch emulation. With the torch-linked host
    path (FP_RECIPES_TORCH_OPS) the whole call is one C++ call making the same launches."""
    if torch.compiler.is_compiling():
        return None
    return emulated_cuda_eager(a, b, out_dtype, bias)


#: Under torch.compile, whether the emulated GEMM is one opaque op (``torch.ops.fp_recipes.nvfp4_emulated_gemm``) that
#: runs this module's eager CUDA path (decode kernel, cuBLASLt, row epilogue: the values of the eager step) instead of
#: the torch-ops emulation, which Inductor compiles into a table decode per operand (measured on an H200, session 37:
#: ``bench_model.py --compiled-nvfp4 --nvfp4-traced-ops-ab``; benchmarks/RESULTS.md).
TRACED_AS_OP = True


def _emulated_gemm_op_impl(a_data: torch.Tensor, a_scale: torch.Tensor, a_amax: torch.Tensor, a_row_scaled: bool,
                           a_e4m3_max: int, b_data: torch.Tensor, b_scale: torch.Tensor, b_amax: torch.Tensor,
                           b_row_scaled: bool, b_e4m3_max: int, out_dtype: torch.dtype,
                           bias: Optional[torch.Tensor]) -> torch.Tensor:
    a = Nvfp4Operand(a_data, a_scale, a_amax, a_row_scaled, a_e4m3_max, False)
    b = Nvfp4Operand(b_data, b_scale, b_amax, b_row_scaled, b_e4m3_max, False)
    out = emulated_cuda_eager(a, b, out_dtype, bias) if a_data.is_cuda else None
    return gemm_nvfp4_emulated(a, b, out_dtype, bias) if out is None else out


_emulated_gemm_op = define_op("nvfp4_emulated_gemm", _emulated_gemm_op_impl)


@register_fake(_emulated_gemm_op)
def _(a_data, a_scale, a_amax, a_row_scaled, a_e4m3_max, b_data, b_scale, b_amax, b_row_scaled, b_e4m3_max,
      out_dtype, bias):
    return a_data.new_empty((a_data.shape[0], b_data.shape[0]), dtype=out_dtype)


def gemm_nvfp4_emulated_traced(a: Nvfp4Operand, b: Nvfp4Operand, out_dtype: torch.dtype,
                               bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The emulated GEMM as one op for a traced graph (:data:`TRACED_AS_OP`): the eager path's values on CUDA (its
    launches; cuBLAS's accumulation order, as eager), the torch emulation's elsewhere. Both operands' copies as they
    are stored; the unit caches are not read (a traced cast writes none)."""
    return _emulated_gemm_op(a.data, a.scale, a.amax, a.row_scaled, a.e4m3_max, b.data, b.scale, b.amax, b.row_scaled,
                             b.e4m3_max, out_dtype, bias)


def emulated_cuda_eager(a: Nvfp4Operand, b: Nvfp4Operand, out_dtype: torch.dtype,
                        bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """:func:`gemm_nvfp4_emulated_cuda` for a caller that knows it is not being traced."""
    if out_dtype not in _OUT_DTYPES:
        return None
    fast = _extension.fast_ops()
    if fast is not None and cublaslt.available():
        # this function as one C++ call (fp_recipes._torch_ops: the same launches); None: the Python code below
        chunk_rows, chunk_max = row_chunk_args(a.data.shape[0], b.data.shape[0])  # (read for row-scaled products)
        out = fast.nvfp4_emulated_gemm(a.data, a.scale, a.amax, a.unit, a.row_scaled, a.e4m3_max, b.data, b.scale,
                                       b.amax, b.unit, b.row_scaled, b.e4m3_max, out_dtype, bias,
                                       cublaslt.WORKSPACE_BYTES, chunk_rows, chunk_max)
        if out is not None:
            return out
    cuda_nvfp4 = _cuda_nvfp4 or _cuda_ops()
    dev = a.data.device
    if not cuda_nvfp4.unit_operands_available() or not cublaslt.available() or b.data.device != dev:
        return None
    m, n, k = a.data.shape[0], b.data.shape[0], a.data.shape[1] * 2
    amax_a, amax_b = a.amax, b.amax
    if m == 0 or n == 0 or k == 0 or not (amax_a.dtype == torch.float32 and amax_a.device == dev and
                                          amax_b.dtype == torch.float32 and amax_b.device == dev and
                                          amax_a.is_contiguous() and amax_b.is_contiguous()):
        return None
    if bias is not None and (bias.device != dev or bias.dtype not in _OUT_DTYPES or not bias.is_contiguous()):
        return None
    row = a.row_scaled or b.row_scaled
    ua = None if a.unit is None else cached_unit(a, dev)
    ub = None if b.unit is None else cached_unit(b, dev)
    if ua is None and ub is None:
        copies = [(a.data, a.scale), (b.data, b.scale)]
    else:
        copies = [(op.data, op.scale) for op, u in ((a, ua), (b, ub)) if u is None]
    unit_operands = cuda_nvfp4.nvfp4_unit_operands
    try:
        if unit_operands is cuda_nvfp4.own_unit_operands:
            # alpha in the stream's workspace: the GEMM below is the next launch on this stream that reads it
            decoded, alpha_beta = unit_operands(copies, None if row else amax_a, None if row else amax_b,
                                                a.e4m3_max, b.e4m3_max, device=dev, alpha_workspace=True)
        else:  # replaced (tests' fakes take the public keywords only)
            decoded, alpha_beta = unit_operands(
                copies, None if row else amax_a, None if row else amax_b, a.e4m3_max, b.e4m3_max, device=dev)
    except ValueError:  # non-contiguous or unaligned copies: the torch emulation takes them
        return None
    if ua is None:
        ua = decoded[0]
    if ub is None:
        ub = decoded[-1]  # the last decoded copy: b's, whether or not a's was decoded too
    if not row:
        fuse_bias = bias is None or bias.dtype == out_dtype
        out = torch.empty((m, n), dtype=out_dtype if fuse_bias else torch.float32, device=dev)
        if not cublaslt.bf16_gemm_device_alpha(ua, ub, out, alpha_beta, bias=bias if fuse_bias else None):
            out = torch.mm(ua, ub.t(), out_dtype=torch.float32) * alpha_beta[0]
            fuse_bias = False
        return out if fuse_bias else finish(out, bias, out_dtype)
    # The FP32 product of a row-scaled GEMM is twice the size of a BF16 output; computed in row chunks, the
    # scratch is a quarter of the full product (half a BF16 output): the model's peak memory stays at or
    # below BF16's (issue 13). Each chunk is one GEMM of >= 1024 rows (a full wave of output tiles at
    # Llama widths) and one epilogue launch writing its rows of the output.
    rows = row_chunk(m, n)
    out = torch.empty((m, n), dtype=out_dtype, device=dev)
    scratch = torch.empty((min(rows, m), n), dtype=torch.float32, device=dev)
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        d = scratch[: r1 - r0]
        if not cublaslt.bf16_gemm_device_alpha(ua[r0:r1], ub, d, alpha_beta):
            d = torch.mm(ua[r0:r1], ub.t(), out_dtype=torch.float32) * alpha_beta[0]
        cuda_nvfp4.nvfp4_row_scale_epilogue(d, amax_a[r0:r1] if a.row_scaled else amax_a, a.row_scaled, amax_b,
                                            b.row_scaled, bias, out_dtype, out=out[r0:r1])
    return out


#: the fewest rows a chunk of a row-scaled GEMM has, and the most chunks it is split into
ROW_CHUNK_MIN_ROWS, ROW_CHUNK_MAX_CHUNKS = 1024, 4
#: when set, a row-scaled GEMM's chunks are cut by their FP32 scratch instead: at most this many bytes a chunk
#: (multiples of 128 rows, at least 128), so that the epilogue reads the scratch from L2
#: (``benchmarks/nvfp4_row_chunks.py`` measures the trade)
ROW_CHUNK_SCRATCH_BYTES: Optional[int] = None


def row_chunk_args(m: int, n: Optional[int] = None) -> tuple:
    """(fewest rows a chunk, most chunks) of a row-scaled GEMM of ``m`` x ``n`` outputs, as the C++ path takes them."""
    if ROW_CHUNK_SCRATCH_BYTES and n:
        rows = max(128, ROW_CHUNK_SCRATCH_BYTES // (4 * n) // 128 * 128)
        return rows, max(1, m // rows)
    return ROW_CHUNK_MIN_ROWS, ROW_CHUNK_MAX_CHUNKS


def row_chunk(m: int, n: Optional[int] = None) -> int:
    """Rows per chunk of a row-scaled GEMM with ``m`` output rows (and ``n`` columns): up to 4 chunks of at least
    1024 rows (fewer than 2048 rows: one chunk, the whole product); with ``ROW_CHUNK_SCRATCH_BYTES`` set, chunks of
    about ``ROW_CHUNK_SCRATCH_BYTES // (4 n)`` rows (rounded down to a multiple of 128, at least 128), ``m`` spread
    evenly over ``m`` // that many chunks."""
    min_rows, max_chunks = row_chunk_args(m, n)
    chunks = max(1, min(max_chunks, m // min_rows))
    return -(-m // chunks)
