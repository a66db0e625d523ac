"""NVFP4 reference twins: the byte-exact contract that the CUDA kernels (ops/cuda_nvfp4.py) reproduce.

NVFP4 = E2M1 elements, one E4M3 scale per 16 consecutive elements (1-D) or per 16x16 tile (2-D), and
an FP32 global amax (per tensor, or per row when ``row_scaled``). docs/nvfp4.md gives every formula
with its operation order; this module is that document in code.

Rules that make the twin exact and device-agnostic (the same bytes on CPU and on CUDA tensors):
- every FP32 step is one separate torch op (IEEE RN, no fused multiply-add);
- every constant is a 0-dim FP32 tensor *on the data's device*: torch divides a CUDA tensor by a CPU
  scalar as a multiplication by its reciprocal, which is not RN division;
- ``min(v, FLT_MAX)`` clamps are ``torch.fmin`` (CUDA ``fminf``: a NaN operand yields the other one);
- amaxes propagate NaN (a NaN anywhere in the reduced range gives NaN);
- the sign nibble bit is the sign bit of the *element being quantized* (never of an FP32 product,
  whose NaN sign differs between CPU and GPU); the RHT output's NaNs are made positive;
- sums whose order matters (4over6 errors, the RHT butterfly) are spelled out op by op.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Union

import torch

from fp_recipes import formats
from fp_recipes.ops._marks import device_agnostic

__all__ = [
    "nvfp4_amax",
    "nvfp4_row_amax",
    "nvfp4_quantize",
    "nvfp4_dequantize",
    "nvfp4_gemm_alpha",
    "nvfp4_rht",
]

BLOCK = 16
FLT_MAX = formats.FP32_MAX
E4M3_BOUNDS = (448, 256)
ERR_MODES = ("MAE", "MSE")
# The input signs of the random Hadamard transform (TransformerEngine's fixed vector).
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
RHT_SCALE = 0.25  # 1/sqrt(16): makes the transform orthonormal
_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1


class NVFP4Quantized(NamedTuple):
    """Result of :func:`nvfp4_quantize`. Absent copies are None.

    data: uint8 (M, N/2) packed E2M1 (element 2k low nibble); scale: float8_e4m3fn (M, N/16);
    amax: FP32 0-dim, or (M,) when row_scaled. data_t/scale_t/amax_t: the same for x^T (N, M),
    amax_t being the amax of what was quantized (post-RHT when rht).
    """

    data: Optional[torch.Tensor]
    scale: Optional[torch.Tensor]
    amax: Optional[torch.Tensor]
    data_t: Optional[torch.Tensor]
    scale_t: Optional[torch.Tensor]
    amax_t: Optional[torch.Tensor]


# ---- small exact helpers ---------------------------------------------------------------------------

def _c(value: float, like: torch.Tensor) -> torch.Tensor:
    """A 0-dim FP32 constant on ``like``'s device (never a CPU scalar: see the module docstring)."""
    return torch.tensor(value, dtype=torch.float32, device=like.device)


def _fmin_fltmax(v: torch.Tensor) -> torch.Tensor:
    return torch.fmin(v, _c(FLT_MAX, v))


def _recip(v: torch.Tensor) -> torch.Tensor:
    """RN(1 / v), a true FP32 division."""
    return torch.div(_c(1.0, v), v)


def _e4m3(v: torch.Tensor) -> torch.Tensor:
    """FP32 -> float8_e4m3fn, RN and saturating (formats.e4m3_encode)."""
    return formats.e4m3_encode(v).view(torch.float8_e4m3fn)


def _e4m3_f32(sf: torch.Tensor) -> torch.Tensor:
    return formats.e4m3_decode(sf)


def _sign_bit(x: torch.Tensor) -> torch.Tensor:
    """The IEEE sign bit of FP32 ``x`` (NaNs included) as uint8 0/1."""
    return ((formats.fp32_bits(x) >> 31) & 1).to(torch.uint8)


def _e2m1_rn(y: torch.Tensor, sign_of: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of the scaled values ``y`` (RN ties-to-even, saturating, NaN -> 7), with the sign bit
    of ``sign_of`` (the unscaled element; enc > 0 so the signs agree except for NaN's sign)."""
    mag = formats.e2m1_encode(y) & 0x7
    return mag | (_sign_bit(sign_of) << 3)


def _amax_all(x: torch.Tensor) -> torch.Tensor:
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.to(torch.float32).abs().amax()


# ---- Philox4x32-10 (Random123), int64 tensors holding 32-bit words --------------------------------

_PHILOX_M0, _PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85


def _mulhilo32(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of a * m (a: int64 tensor in [0, 2^32), m: 32-bit constant), exact
    in int64 by splitting m into 16-bit halves (no intermediate exceeds 2^49)."""
    p_lo = a * (m & 0xFFFF)
    p_hi = a * (m >> 16)
    t = p_lo + ((p_hi & 0xFFFF) << 16)
    return (p_hi >> 16) + (t >> 32), t & _MASK32


def philox4x32_10(counter: tuple[torch.Tensor, ...], key: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """Philox4x32 with 10 rounds on int64 tensors of 32-bit words; returns the 4 output words."""
    c0, c1, c2, c3 = (c.to(torch.int64) & _MASK32 for c in counter)
    k0, k1 = key[0] & _MASK32, key[1] & _MASK32
    for rnd in range(10):
        if rnd:
            k0 = (k0 + _PHILOX_W0) & _MASK32
            k1 = (k1 + _PHILOX_W1) & _MASK32
        hi0, lo0 = _mulhilo32(c0, _PHILOX_M0)
        hi1, lo1 = _mulhilo32(c2, _PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def sr_bytes(n_blocks: int, seed: Union[int, torch.Tensor], offset: Union[int, torch.Tensor],
             device: torch.device) -> torch.Tensor:
    """The 16 random bytes of each of ``n_blocks`` blocks: (n_blocks, 16) int64 in [0, 256).
    ``seed`` and ``offset``: ints in [0, 2^64), or 0-dim int64 tensors holding their bit patterns (two's
    complement above 2^63), which a graph traced by torch.compile reads when it runs.

    Block b uses counter (b lo32, b hi32, offset lo32, offset hi32) and key (seed lo32, seed hi32);
    element j takes byte j % 4 (0 = least significant) of output word j // 4.
    """
    b = torch.arange(n_blocks, dtype=torch.int64, device=device)
    if isinstance(offset, torch.Tensor):
        # a 0-dim int64 counter (a traced graph reads it when it runs): the 64-bit pattern, two's
        # complement for offsets >= 2^63; the arithmetic shift then the mask give the high word
        off = offset.to(device=device, dtype=torch.int64)
        off_lo = (off & _MASK32).expand(b.shape)
        off_hi = ((off >> 32) & _MASK32).expand(b.shape)
    else:
        off_lo = torch.full_like(b, offset & _MASK32)
        off_hi = torch.full_like(b, (offset >> 32) & _MASK32)
    if isinstance(seed, torch.Tensor):  # the same bit pattern convention as the offset
        seed = seed.to(device=device, dtype=torch.int64)
    words = philox4x32_10((b & _MASK32, b >> 32, off_lo, off_hi), (seed & _MASK32, (seed >> 32) & _MASK32))
    w = torch.stack(words, dim=-1)  # (n, 4)
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int64, device=device)
    return ((w.unsqueeze(-1) >> shifts) & 0xFF).reshape(n_blocks, BLOCK)


def _e2m1_sr(y: torch.Tensor, sign_of: torch.Tensor, rbytes: torch.Tensor) -> torch.Tensor:
    """Stochastically rounded E2M1 codes. v = |y| between grid neighbours lo < hi:
    frac = RN((v - lo) / (hi - lo)); round up iff 2*byte + 1 < frac * 512; v >= 6 -> 6; NaN -> 7."""
    v = y.abs()
    lo_idx = torch.zeros(v.shape, dtype=torch.int64, device=v.device)
    for g in formats.E2M1_VALUES[1:]:
        lo_idx += (v >= g).to(torch.int64)
    grid = torch.tensor(formats.E2M1_VALUES + (formats.E2M1_MAX,), dtype=torch.float32, device=v.device)
    lo = grid[lo_idx]
    hi = grid[torch.clamp(lo_idx + 1, max=7)]
    frac = torch.div(v - lo, hi - lo)  # hi - lo is 0 only where lo_idx == 7 (overridden below)
    up = (2 * rbytes + 1).to(torch.float32) < frac * _c(512.0, v)
    idx = torch.where(lo_idx >= 7, torch.full_like(lo_idx, 7), lo_idx + up.to(torch.int64))
    idx = torch.where(torch.isnan(v), torch.full_like(idx, 7), idx)
    return idx.to(torch.uint8) | (_sign_bit(sign_of) << 3)


# ---- random Hadamard transform ---------------------------------------------------------------------

def nvfp4_rht(x: torch.Tensor) -> torch.Tensor:
    """The 16-point random Hadamard transform of each group of 16 consecutive elements of the last
    dim of BF16 ``x`` (R, C), C % 16 == 0; returns BF16 (R, C). For the columnwise copy pass x^T.

    Fixed FP32 order (the CUDA kernel does exactly this): u_i = x_i * s_i (exact); four butterfly
    stages h = 1, 2, 4, 8, each replacing every pair (u_i, u_{i+h}) with i & h == 0 by
    (RN(u_i + u_{i+h}), RN(u_i - u_{i+h})); then RN(u_j * 0.25); then RN to BF16; any NaN becomes the
    positive BF16 NaN 0x7FC0 (CPU and GPU NaN signs differ after arithmetic; the sign becomes a code bit).
    The result is y_j = 0.25 * sum_i s_i x_i (-1)^popcount(i & j) (the Sylvester Hadamard H).
    """
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise TypeError(f"nvfp4_rht: expects a 2-D bfloat16 tensor, got {x.dtype} of shape {tuple(x.shape)}")
    rows, cols = x.shape
    if cols % BLOCK:
        raise ValueError(f"nvfp4_rht: the last dim ({cols}) must be a multiple of {BLOCK}")
    signs = torch.tensor(RHT_SIGNS, dtype=torch.float32, device=x.device)
    u = x.to(torch.float32).reshape(rows, cols // BLOCK, BLOCK) * signs
    h = 1
    while h < BLOCK:
        u = u.reshape(rows, cols // BLOCK, BLOCK // (2 * h), 2, h)
        a, b = u[..., 0, :], u[..., 1, :]
        u = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    y = (u.reshape(rows, cols) * _c(RHT_SCALE, u)).to(torch.bfloat16)
    canonical_nan = torch.tensor(0x7FC0, dtype=torch.int16, device=y.device).view(torch.bfloat16)
    return torch.where(torch.isnan(y), canonical_nan, y)


# ---- amax ------------------------------------------------------------------------------------------

def nvfp4_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the whole tensor as FP32 0-dim (NaN anywhere -> NaN; empty -> 0)."""
    _check_x(x, "nvfp4_amax")
    return _amax_all(x)


def nvfp4_row_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| of each row as FP32 (M,) (NaN in a row -> NaN for that row; N == 0 -> zeros)."""
    _check_x(x, "nvfp4_row_amax")
    if x.shape[1] == 0:
        return torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    return x.to(torch.float32).abs().amax(dim=1)


# ---- scale formulas --------------------------------------------------------------------------------

def global_encode_scale(amax: torch.Tensor, e4m3_max: int) -> torch.Tensor:
    """S_enc = fmin(RN(6E / amax), FLT_MAX); 1 where amax == 0 or S_enc == 0 (amax = Inf)."""
    s = _fmin_fltmax(torch.div(_c(6.0 * e4m3_max, amax), amax))
    return torch.where((amax == 0) | (s == 0), _c(1.0, s), s)


def _encode_scale(sf: torch.Tensor, s_dec: torch.Tensor) -> torch.Tensor:
    """enc = fmin(RN(1 / RN(fp32(sf) * S_dec)), FLT_MAX); a zero sf gives FLT_MAX."""
    return _fmin_fltmax(_recip(_e4m3_f32(sf) * s_dec))


def _plain_block_scale(bamax: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """sf = e4m3(fmin(RN(bamax * RN(S_enc * RN(1/6))), FLT_MAX))."""
    mult = s_enc * _recip(_c(6.0, s_enc))
    return _e4m3(_fmin_fltmax(bamax * mult))


def _seq_sum16(e: torch.Tensor) -> torch.Tensor:
    """err = RN(err + e_i) for i = 0..15 along the last dim, in element order."""
    acc = e[..., 0]
    for i in range(1, BLOCK):
        acc = acc + e[..., i]
    return acc


def tree_sum16(r: torch.Tensor, dim: int) -> torch.Tensor:
    """Combine 16 row sums along ``dim`` as a butterfly with strides 8, 4, 2, 1 (a warp shuffle-down
    reduction): ((((r0+r8)+(r4+r12))+((r2+r10)+(r6+r14))) + (((r1+r9)+(r5+r13))+((r3+r11)+(r7+r15))))."""
    r = r.movedim(dim, -1)
    for half in (8, 4, 2, 1):
        r = r[..., :half] + r[..., half:2 * half]
    return r[..., 0]


def _four_over_six_scale(x_el: torch.Tensor, bamax: torch.Tensor, s_enc: torch.Tensor,
                         amax: torch.Tensor, e4m3_max: int, err_mode: str, fast: bool,
                         bcast: Callable[[torch.Tensor], torch.Tensor],
                         reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The 4over6 block scale: the candidate (map-to-6 or map-to-4) with the smaller error.

    x_el: the FP32 elements; bamax, s_enc, amax: block-level tensors (same shape); bcast maps a
    block-level tensor onto x_el's shape; reduce maps per-element errors to block errors.
    """
    s_dec = _recip(s_enc)
    base = torch.div(bamax, _c(6.0, bamax)) * s_enc
    e4m3_cap = _c(formats.E4M3_MAX, base)  # 448 even when E = 256
    sf6 = _e4m3(torch.fmin(base, e4m3_cap))
    sf4 = _e4m3(torch.fmin(base * _c(1.5, base), e4m3_cap))
    six_e = _c(6.0 * e4m3_max, base)
    errs = []
    for sf in (sf6, sf4):
        sf32 = _e4m3_f32(sf)
        q = formats.e2m1_decode(_e2m1_rn(x_el * bcast(_encode_scale(sf, s_dec)), x_el))
        if fast:  # FP16 product domain: fp16(q) * fp16(sf) is exact in FP16, hence in FP32
            d = q * bcast(sf32) - x_el * bcast(s_enc)
        else:
            d = torch.div((q * bcast(sf32)) * bcast(amax), six_e) - x_el
        e = d.abs() if err_mode == "MAE" else d * d
        errs.append(reduce(e))
    pick4 = errs[1] < errs[0]  # strict: ties and NaN keep map-to-6
    return torch.where(pick4, sf4.view(torch.uint8), sf6.view(torch.uint8)).view(torch.float8_e4m3fn)


# ---- the quantizer ---------------------------------------------------------------------------------

class _Opts(NamedTuple):
    four_over_six: bool
    e4m3_max: int
    err_mode: str
    fast: bool


def _check_x(x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{what}: input dtype {x.dtype} is not supported; allowed: float32, bfloat16, float16")
    if x.dim() != 2:
        raise ValueError(f"{what}: expects a 2-D tensor (callers flatten leading dims), got shape {tuple(x.shape)}")


def _blocks_1d(xf: torch.Tensor, s_enc: torch.Tensor, amax: torch.Tensor, opts: _Opts
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales (R, C/16) and encode scales of 1x16 blocks. s_enc/amax: 0-dim or (R, 1)."""
    rows, cols = xf.shape
    x_el = xf.reshape(rows, cols // BLOCK, BLOCK)
    bamax = x_el.abs().amax(dim=-1) if x_el.numel() else torch.zeros(x_el.shape[:2], device=xf.device)
    s_blk = s_enc.expand_as(bamax)
    if opts.four_over_six:
        sf = _four_over_six_scale(x_el, bamax, s_blk, amax.expand_as(bamax), opts.e4m3_max, opts.err_mode,
                                  opts.fast, lambda t: t.unsqueeze(-1), _seq_sum16)
    else:
        sf = _plain_block_scale(bamax, s_blk)
    return sf, _encode_scale(sf, _recip(s_blk))


def _tiles_2d(xf: torch.Tensor, s_enc: torch.Tensor, amax: torch.Tensor, opts: _Opts
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and encode scales of 16x16 tiles, each (M/16, N/16). 4over6 errors are the tile's 16
    row sums (element order) combined by :func:`tree_sum16`."""
    m, n = xf.shape
    t = xf.reshape(m // BLOCK, BLOCK, n // BLOCK, BLOCK)
    shape = (m // BLOCK, n // BLOCK)
    tamax = t.abs().amax(dim=(1, 3)) if t.numel() else torch.zeros(shape, device=xf.device)
    s_blk = s_enc.expand(shape)
    if opts.four_over_six:
        sf = _four_over_six_scale(t, tamax, s_blk, amax.expand(shape), opts.e4m3_max, opts.err_mode, opts.fast,
                                  lambda v: v[:, None, :, None],
                                  lambda e: tree_sum16(_seq_sum16(e), dim=1))
    else:
        sf = _plain_block_scale(tamax, s_blk)
    return sf, _encode_scale(sf, _recip(s_blk))


def _encode(xf: torch.Tensor, enc: torch.Tensor, rbytes: Optional[torch.Tensor]) -> torch.Tensor:
    """Packed E2M1 data (R, C/2) of FP32 ``xf`` (R, C) with per-block encode scales (R, C/16)."""
    rows, cols = xf.shape
    x_el = xf.reshape(rows, cols // BLOCK, BLOCK)
    y = x_el * enc.unsqueeze(-1)
    if rbytes is None:
        codes = _e2m1_rn(y, x_el)
    else:
        codes = _e2m1_sr(y, x_el, rbytes.reshape(x_el.shape))
    return formats.pack_e2m1(codes.reshape(rows, cols))


def _sr(xf: torch.Tensor, on: bool, seed: int, offset: int) -> Optional[torch.Tensor]:
    if not on:
        return None
    return sr_bytes(xf.numel() // BLOCK, seed, offset, xf.device)


def _check_options(x: torch.Tensor, amax: Optional[torch.Tensor], rowwise: bool, columnwise: bool,
                   block_2d: bool, row_scaled: bool, four_over_six: bool, e4m3_max: int, err_mode: str,
                   rht: bool, stochastic_rounding: bool, seed: int, offset: int) -> None:
    what = "nvfp4_quantize"
    _check_x(x, what)
    _check_static_options(rowwise, columnwise, block_2d, row_scaled, four_over_six, e4m3_max, err_mode, rht,
                          stochastic_rounding)
    _check_x_for_options(x, rowwise, columnwise, block_2d, rht)
    _check_seed_offset(seed, offset)
    if amax is not None:
        _check_amax_override(x, amax, row_scaled)


def _check_static_options(rowwise: bool, columnwise: bool, block_2d: bool, row_scaled: bool, four_over_six: bool,
                          e4m3_max: int, err_mode: str, rht: bool, stochastic_rounding: bool) -> None:
    """The checks of :func:`_check_options` that read no tensor (a quantizer's options pass them once)."""
    what = "nvfp4_quantize"
    if not (rowwise or columnwise):
        raise ValueError(f"{what}: nothing to do: rowwise=False and columnwise=False")
    if e4m3_max not in E4M3_BOUNDS:
        raise ValueError(f"{what}: e4m3_max must be 448 or 256, got {e4m3_max!r}")
    if err_mode not in ERR_MODES:
        raise ValueError(f"{what}: err_mode must be 'MAE' or 'MSE', got {err_mode!r}")
    pairs = [
        (four_over_six and rht, "four_over_six=True", "rht=True"),
        (four_over_six and stochastic_rounding, "four_over_six=True", "stochastic_rounding=True"),
        (row_scaled and rht, "row_scaled=True", "rht=True"),
        (row_scaled and block_2d, "row_scaled=True", "block_2d=True"),
        (row_scaled and stochastic_rounding, "row_scaled=True", "stochastic_rounding=True"),
        (rht and block_2d, "rht=True", "block_2d=True"),
    ]
    for bad, a, b in pairs:
        if bad:
            raise ValueError(f"{what}: {a} is incompatible with {b}")
    if rht and not columnwise:
        raise ValueError(f"{what}: rht=True transforms the columnwise copy only, but columnwise=False")


def _check_x_for_options(x: torch.Tensor, rowwise: bool, columnwise: bool, block_2d: bool, rht: bool) -> None:
    """What the options ask of a 2-D ``x``: its dtype (RHT) and block-multiple dims."""
    what = "nvfp4_quantize"
    m, n = x.shape
    if rht and x.dtype != torch.bfloat16:
        raise TypeError(f"{what}: rht=True needs bfloat16 input, got {x.dtype}")
    if (rowwise or block_2d) and n % BLOCK:
        raise ValueError(f"{what}: the last dim N={n} must be a multiple of {BLOCK} for the rowwise copy"
                         + (" and for 2-D tiles" if block_2d else "") + f" (shape {tuple(x.shape)})")
    if (columnwise or block_2d) and m % BLOCK:
        raise ValueError(f"{what}: the first dim M={m} must be a multiple of {BLOCK} for the columnwise copy"
                         + (" and for 2-D tiles" if block_2d else "") + f" (shape {tuple(x.shape)})")


def _check_seed_offset(seed: int, offset: int) -> None:
    what = "nvfp4_quantize"
    for name, v in (("seed", seed), ("offset", offset)):
        if isinstance(v, torch.Tensor):
            if v.dtype != torch.int64 or v.dim() != 0:
                raise ValueError(f"{what}: a {name} tensor must be a 0-dim int64 tensor (the bit pattern of "
                                 f"the 64-bit value), got {v.dtype} of shape {tuple(v.shape)}")
            continue
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= _MASK64:
            raise ValueError(f"{what}: {name} must be an int in [0, 2^64), got {v!r}")


def _check_amax_override(x: torch.Tensor, amax: torch.Tensor, row_scaled: bool) -> None:
    what = "nvfp4_quantize"
    m = x.shape[0]
    want = (m,) if row_scaled else ()
    if not isinstance(amax, torch.Tensor) or amax.dtype != torch.float32:
        raise TypeError(f"{what}: amax must be an FP32 tensor, got {getattr(amax, 'dtype', type(amax))}")
    if tuple(amax.shape) != want and not (not row_scaled and tuple(amax.shape) == (1,)):
        kind = f"(M,) = ({m},) for row_scaled" if row_scaled else "0-dim for per-tensor scaling"
        raise ValueError(f"{what}: amax must be {kind}, got shape {tuple(amax.shape)}")
    if amax.device != x.device:
        raise ValueError(f"{what}: amax is on {amax.device} but x is on {x.device}")


def nvfp4_quantize(x: torch.Tensor, *, amax: Optional[torch.Tensor] = None, rowwise: bool = True,
                   columnwise: bool = False, block_2d: bool = False, row_scaled: bool = False,
                   four_over_six: bool = False, e4m3_max: int = 448, err_mode: str = "MAE",
                   err_fast_math: bool = False, rht: bool = False, stochastic_rounding: bool = False,
                   seed: int = 0, offset: int = 0) -> NVFP4Quantized:
    """Quantize 2-D ``x`` (M, N) to NVFP4 (see docs/nvfp4.md for every formula and its order).

    ``amax`` overrides the computed global amax (e.g. after a cross-rank MAX reduction): 0-dim, or (M,)
    when ``row_scaled``. It applies to the rowwise copy and to the columnwise copy without RHT (the
    max of the row amaxes when row_scaled); with RHT the columnwise amax is the post-RHT amax.
    """
    _check_options(x, amax, rowwise, columnwise, block_2d, row_scaled, four_over_six, e4m3_max, err_mode,
                   rht, stochastic_rounding, seed, offset)
    opts = _Opts(four_over_six, e4m3_max, err_mode, bool(err_fast_math))
    xf = x.to(torch.float32).contiguous()

    # global amax of x: per row (M,) when row_scaled, else 0-dim
    if amax is not None:
        g_amax = amax.detach().to(torch.float32).reshape(amax.shape if row_scaled else ()).clone()
    else:
        g_amax = nvfp4_row_amax(x) if row_scaled else _amax_all(xf)
    if row_scaled:
        t_amax = g_amax.amax() if g_amax.numel() else torch.zeros((), device=x.device)
    else:
        t_amax = g_amax

    data = scale = out_amax = data_t = scale_t = amax_t = None
    if block_2d:
        s_enc = global_encode_scale(g_amax, e4m3_max)
        sf_tile, enc_tile = _tiles_2d(xf, s_enc, g_amax, opts)
        if rowwise:
            scale = sf_tile.view(torch.uint8).repeat_interleave(BLOCK, dim=0).view(torch.float8_e4m3fn)
            enc = enc_tile.repeat_interleave(BLOCK, dim=0)
            data = _encode(xf, enc, _sr(xf, stochastic_rounding, seed, offset))
            out_amax = g_amax
        if columnwise:
            xt = xf.t().contiguous()
            scale_t = sf_tile.view(torch.uint8).t().repeat_interleave(BLOCK, dim=0).view(torch.float8_e4m3fn)
            enc_t = enc_tile.t().repeat_interleave(BLOCK, dim=0)
            data_t = _encode(xt, enc_t, _sr(xt, stochastic_rounding, seed, offset))
            amax_t = g_amax.clone()
        return NVFP4Quantized(data, scale, out_amax, data_t, scale_t, amax_t)

    if rowwise:
        s_enc = global_encode_scale(g_amax, e4m3_max)
        s_rows = s_enc.unsqueeze(-1) if row_scaled else s_enc
        a_rows = g_amax.unsqueeze(-1) if row_scaled else g_amax
        scale, enc = _blocks_1d(xf, s_rows, a_rows, opts)
        data = _encode(xf, enc, _sr(xf, stochastic_rounding, seed, offset))
        out_amax = g_amax
    if columnwise:
        if rht:
            xt_q = nvfp4_rht(x.t().contiguous())
            amax_t = _amax_all(xt_q)
            xt = xt_q.to(torch.float32)
        else:
            xt = xf.t().contiguous()
            amax_t = t_amax.clone()
        s_enc_t = global_encode_scale(amax_t, e4m3_max)
        scale_t, enc_t = _blocks_1d(xt, s_enc_t, amax_t, opts)
        data_t = _encode(xt, enc_t, _sr(xt, stochastic_rounding, seed, offset))
    return NVFP4Quantized(data, scale, out_amax, data_t, scale_t, amax_t)


# ---- dequantize and GEMM alpha ---------------------------------------------------------------------

def check_nvfp4_dequantize_args(data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor,
                               e4m3_max: int, row_scaled: bool, out_dtype: torch.dtype,
                               what: str = "nvfp4_dequantize") -> None:
    """The argument contract of nvfp4_dequantize, shared with its CUDA twin so the two can never
    disagree on what is valid."""
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 2:
        raise TypeError(f"{what}: data must be a 2-D uint8 tensor (packed E2M1), got "
                        f"{getattr(data, 'dtype', type(data))} {tuple(getattr(data, 'shape', ()))}")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float8_e4m3fn or scale.dim() != 2:
        raise TypeError(f"{what}: scale must be a 2-D float8_e4m3fn tensor, got "
                        f"{getattr(scale, 'dtype', type(scale))} {tuple(getattr(scale, 'shape', ()))}")
    rows, half = data.shape
    if scale.shape[0] != rows or scale.shape[1] * (BLOCK // 2) != half:
        raise ValueError(f"{what}: scale shape {tuple(scale.shape)} does not match data shape {tuple(data.shape)}: "
                         f"expected ({rows}, {half * 2 // BLOCK}) (one scale per 16 elements, unpadded)")
    if e4m3_max not in E4M3_BOUNDS:
        raise ValueError(f"{what}: e4m3_max must be 448 or 256, got {e4m3_max!r}")
    if not isinstance(amax, torch.Tensor) or amax.dtype != torch.float32:
        raise TypeError(f"{what}: amax must be an FP32 tensor, got {getattr(amax, 'dtype', type(amax))}")
    want = (rows,) if row_scaled else ()
    if tuple(amax.shape) != want and not (not row_scaled and tuple(amax.shape) == (1,)):
        raise ValueError(f"{what}: amax shape {tuple(amax.shape)} does not match row_scaled={row_scaled}: "
                         f"expected {'(' + str(rows) + ',)' if row_scaled else '0-dim'}")
    if data.device != scale.device or data.device != amax.device:
        raise ValueError(f"{what}: data ({data.device}), scale ({scale.device}) and amax ({amax.device}) "
                         "must be on one device")
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{what}: out_dtype {out_dtype} is not supported; allowed: float32, bfloat16, float16")


def nvfp4_dequantize(data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, *, e4m3_max: int = 448,
                     row_scaled: bool = False, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x = RN(q * RN(RN(fp32(sf) * amax) * RN(1/(6E)))), then RN to ``out_dtype``.

    data uint8 (R, C/2), scale float8_e4m3fn (R, C/16), amax FP32 0-dim (or (R,) when row_scaled).
    """
    check_nvfp4_dequantize_args(data, scale, amax, e4m3_max, row_scaled, out_dtype)
    rows, half = data.shape
    a = amax.unsqueeze(-1) if row_scaled else amax.reshape(())
    factor = (_e4m3_f32(scale) * a) * _recip(_c(6.0 * e4m3_max, a))  # (R, C/16)
    q = formats.e2m1_decode(formats.unpack_e2m1(data)).reshape(rows, -1, BLOCK)
    out = (q * factor.unsqueeze(-1)).reshape(rows, half * 2)
    return out.to(out_dtype)


@device_agnostic
def nvfp4_gemm_alpha(amax_a: torch.Tensor, amax_b: torch.Tensor, e4m3_max_a: int = 448,
                     e4m3_max_b: int = 448) -> torch.Tensor:
    """alpha = RN(RN(amax_a * amax_b) * RN(1/(36 * E_a * E_b))), FP32, for the GEMM epilogue.

    The block scales stay as quantized (never multiplied by a global factor, seed 003): the GEMM sums
    (q_a * sf_a) * (q_b * sf_b) and multiplies by alpha. Per-tensor amaxes only: a row-scaled operand
    uses the row epilogue of docs/nvfp4.md (unit amaxes, then RN(amax_r[m] * amax_b) per output row).
    """
    for name, e in (("e4m3_max_a", e4m3_max_a), ("e4m3_max_b", e4m3_max_b)):
        if e not in E4M3_BOUNDS:
            raise ValueError(f"nvfp4_gemm_alpha: {name} must be 448 or 256, got {e!r}")
    for name, t in (("amax_a", amax_a), ("amax_b", amax_b)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise TypeError(f"nvfp4_gemm_alpha: {name} must be an FP32 tensor, got {getattr(t, 'dtype', type(t))}")
        if t.numel() != 1 or t.dim() > 1:
            raise ValueError(f"nvfp4_gemm_alpha: {name} must be a per-tensor (0-dim) amax, got shape "
                             f"{tuple(t.shape)}; a row-scaled operand uses the row epilogue (docs/nvfp4.md)")
    denom = _c(36.0 * e4m3_max_a * e4m3_max_b, amax_a)  # exact: < 2^24
    return (amax_a.reshape(()) * amax_b.reshape(()).to(amax_a.device)) * _recip(denom)
