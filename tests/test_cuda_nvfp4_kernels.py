"""NVFP4 CUDA kernels against their pure-torch twins (ops/ref_nvfp4.py): bytes, not tolerances.

Every quantize case compares data, scale, amax, data_t, scale_t and amax_t byte for byte (amaxes:
NaN where the reference has NaN, identical bits elsewhere). The reference runs on the same CUDA
tensors (it is device-agnostic torch code). The CPU part at the bottom checks the fake (meta)
kernels and the argument validation, which need no GPU.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from fp_recipes.ops import cuda_nvfp4 as K
from fp_recipes.ops import ref_nvfp4 as R
from _nvfp4_stress import fos_stress
import _tile2_walk

cuda = pytest.mark.cuda

FIELDS = ("data", "scale", "amax", "data_t", "scale_t", "amax_t")


# ---- comparison helpers ------------------------------------------------------------------------

def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float32:
        return t.contiguous().view(torch.int32)
    return t.contiguous().view(torch.uint8)


def assert_same_bytes(got: torch.Tensor | None, want: torch.Tensor | None, what: str) -> None:
    if want is None:
        assert got is None, f"{what}: expected None, got a tensor"
        return
    assert got is not None, f"{what}: expected a tensor, got None"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.device == want.device, f"{what}: device {got.device} != {want.device}"
    if want.dtype == torch.float32:
        gn, wn = torch.isnan(got), torch.isnan(want)
        assert torch.equal(gn, wn), f"{what}: NaN positions differ"
        gb, wb = _bits(torch.where(gn, 0.0, got)), _bits(torch.where(wn, 0.0, want))
    else:
        gb, wb = _bits(got), _bits(want)
    if not torch.equal(gb, wb):
        bad = (gb != wb).nonzero()
        first = tuple(bad[0].tolist())
        raise AssertionError(f"{what}: {bad.shape[0]} of {wb.numel()} entries differ; first at {first}: "
                             f"got {gb[first].item():#x}, want {wb[first].item():#x}")


def check_quantize(x: torch.Tensor, **kw) -> None:
    want = R.nvfp4_quantize(x, **kw)
    got = K.nvfp4_quantize(x, **kw)
    assert isinstance(got, R.NVFP4Quantized)
    for f in FIELDS:
        assert_same_bytes(getattr(got, f), getattr(want, f), f"{f} ({kw}, {x.dtype}, {tuple(x.shape)})")


# ---- inputs --------------------------------------------------------------------------------------

def make_input(shape: tuple[int, int], dtype: torch.dtype, kind: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    m, n = shape
    x = torch.randn(m, n, device="cuda", generator=g, dtype=torch.float32)
    if kind == "randn":
        pass
    elif kind == "zeros":
        x = torch.zeros_like(x)
    elif kind == "huge":  # one huge value per 1x16 block (and thus per 16x1 column block mostly)
        if n >= 16:
            blocks = x.view(m, n // 16, 16) if n % 16 == 0 else None
            if blocks is not None:
                pos = torch.randint(0, 16, (m, n // 16), device="cuda", generator=g)
                mag = torch.exp2(torch.randint(6, 20, (m, n // 16), device="cuda", generator=g).float())
                blocks.scatter_(2, pos.unsqueeze(-1), (mag * torch.sign(torch.randn(m, n // 16, device="cuda",
                                                                                   generator=g))).unsqueeze(-1))
    elif kind == "mixed":  # wide dynamic range: exercises E4M3 subnormal scales and saturation
        e = torch.randint(-40, 20, (m, n), device="cuda", generator=g).float()
        x = x * torch.exp2(e)
        if m * n >= 64:
            x.view(-1)[:: max(1, (m * n) // 17)] = 0.0
    elif kind == "special":  # NaN, +-Inf and -0 sprinkled in
        flat = x.view(-1)
        idx = torch.randperm(m * n, device="cuda", generator=g)
        k = max(1, (m * n) // 97)
        flat[idx[:k]] = float("nan")
        flat[idx[k:2 * k]] = float("inf")
        flat[idx[2 * k:3 * k]] = -float("inf")
        flat[idx[3 * k:4 * k]] = -0.0
    elif kind == "inf":  # Inf but no NaN: amax = Inf, S_enc = 1
        x.view(-1)[:: max(1, (m * n) // 5)] = -float("inf")
    elif kind == "tiny":
        x = x * 1e-30
    else:
        raise ValueError(kind)
    return x.to(dtype)


# ---- the main matrix -------------------------------------------------------------------------------

MODES = []
for layout, scaling in (("1d", "tensor"), ("1d", "row"), ("2d", "tensor")):
    for emax in (448, 256):
        MODES.append((layout, scaling, "off", False, emax))
        for err, fast in itertools.product(("MAE", "MSE"), (False, True)):
            MODES.append((layout, scaling, err, fast, emax))


def _mode_kwargs(layout, scaling, err, fast, emax):
    kw = dict(block_2d=layout == "2d", row_scaled=scaling == "row", e4m3_max=emax)
    if err != "off":
        kw.update(four_over_six=True, err_mode=err, err_fast_math=fast)
    return kw


def _mode_id(m):
    layout, scaling, err, fast, emax = m
    return f"{layout}-{scaling}-{err}{'-fast' if fast and err != 'off' else ''}-E{emax}"


SMALL_SHAPES = [(16, 16), (48, 32), (64, 64), (80, 1040), (208, 160)]
KINDS = ["randn", "huge", "mixed", "special", "zeros"]


@cuda
@pytest.mark.parametrize("mode", MODES, ids=[_mode_id(m) for m in MODES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SMALL_SHAPES, ids=[f"{m}x{n}" for m, n in SMALL_SHAPES])
@pytest.mark.parametrize("kind", KINDS)
def test_quantize_matrix(mode, dtype, shape, kind):
    kw = _mode_kwargs(*mode)
    x = make_input(shape, dtype, kind, seed=shape[0] * 7 + shape[1] + KINDS.index(kind))
    check_quantize(x, rowwise=True, columnwise=True, **kw)


@cuda
@pytest.mark.parametrize("mode", MODES, ids=[_mode_id(m) for m in MODES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_quantize_matrix_medium(mode, dtype):
    kw = _mode_kwargs(*mode)
    x = make_input((1024, 2048), dtype, "randn", seed=7)
    check_quantize(x, rowwise=True, columnwise=True, **kw)
    check_quantize(x, rowwise=True, columnwise=False, **kw)
    check_quantize(x, rowwise=False, columnwise=True, **kw)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "fp32", "fp16"])
@pytest.mark.parametrize("kind", ["randn", "special", "inf", "tiny", "zeros"])
def test_quantize_special_values(dtype, kind):
    x = make_input((96, 192), dtype, kind, seed=3)
    for kw in (dict(), dict(block_2d=True), dict(row_scaled=True),
               dict(four_over_six=True, err_mode="MSE"), dict(four_over_six=True, err_fast_math=True),
               dict(block_2d=True, four_over_six=True, e4m3_max=256)):
        check_quantize(x, rowwise=True, columnwise=True, **kw)


TAIL_SHAPES = [(16, 48), (1, 16), (3, 32), (17, 16), (130, 80), (1000, 96)]


@cuda
@pytest.mark.parametrize("shape", TAIL_SHAPES, ids=[f"{m}x{n}" for m, n in TAIL_SHAPES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_rowwise_tails(shape, dtype):
    """Rowwise only: any M (no tile of 16 rows needed)."""
    x = make_input(shape, dtype, "huge", seed=11)
    check_quantize(x)
    check_quantize(x, row_scaled=True, four_over_six=True)
    check_quantize(x, stochastic_rounding=True, seed=5, offset=9)


COL_SHAPES = [(16, 1), (32, 7), (48, 33), (64, 100), (160, 130)]


@cuda
@pytest.mark.parametrize("shape", COL_SHAPES, ids=[f"{m}x{n}" for m, n in COL_SHAPES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_columnwise_tails(shape, dtype):
    """Columnwise only: any N (the columns of x are the rows of x^T)."""
    x = make_input(shape, dtype, "randn", seed=13)
    check_quantize(x, rowwise=False, columnwise=True)
    check_quantize(x, rowwise=False, columnwise=True, four_over_six=True, err_mode="MSE", err_fast_math=True)
    check_quantize(x, rowwise=False, columnwise=True, stochastic_rounding=True, seed=2**40 + 3, offset=77)
    if dtype == torch.bfloat16:
        check_quantize(x, rowwise=False, columnwise=True, rht=True)


RHT_SHAPES = [(16, 16), (64, 64), (96, 48), (32, 20), (48, 46), (256, 1040), (2048, 512)]  # N % 8, % 4, % 2: each amax form


@cuda
@pytest.mark.parametrize("shape", RHT_SHAPES, ids=[f"{m}x{n}" for m, n in RHT_SHAPES])
@pytest.mark.parametrize("kind", ["randn", "huge", "mixed", "special"])
@pytest.mark.parametrize("sr", [False, True], ids=["rn", "sr"])
def test_rht(shape, kind, sr):
    x = make_input(shape, torch.bfloat16, kind, seed=17)
    kw = dict(stochastic_rounding=sr, seed=123456789, offset=2**33 + 5) if sr else {}
    if shape[1] % 16 == 0:  # (the rowwise copy needs N % 16 == 0)
        check_quantize(x, rowwise=True, columnwise=True, rht=True, **kw)
    check_quantize(x, rowwise=False, columnwise=True, rht=True, **kw)


SR_SHAPES = [(16, 16), (64, 128), (112, 80), (1024, 1024)]


@cuda
@pytest.mark.parametrize("shape", SR_SHAPES, ids=[f"{m}x{n}" for m, n in SR_SHAPES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("layout", ["1d", "2d"])
@pytest.mark.parametrize("seed,offset", [(0, 0), (42, 1), (2**63 + 12345, 2**40 + 7), (2**64 - 1, 2**64 - 1)])
def test_stochastic_rounding(shape, dtype, layout, seed, offset):
    x = make_input(shape, dtype, "mixed" if seed else "randn", seed=19)
    check_quantize(x, rowwise=True, columnwise=True, block_2d=layout == "2d", stochastic_rounding=True,
                   seed=seed, offset=offset)


@cuda
def test_stochastic_rounding_unbiased():
    """Averaging many SR draws converges to x (the rounding is unbiased). Tolerance: each draw has an
    error of at most one E2M1 step (<= 2 units of the block scale); with 512 independent draws the
    standard error of the mean is < step/sqrt(512)/2 ~ 2.2% of a step; we allow 6 standard errors
    (13%) of the largest step in each block, far below the 50% a biased RN-like rounding would show."""
    x = make_input((64, 256), torch.float32, "randn", seed=23)
    q0 = K.nvfp4_quantize(x, stochastic_rounding=True, seed=1, offset=0)
    acc = torch.zeros_like(x)
    n = 512
    for off in range(n):
        q = K.nvfp4_quantize(x, amax=q0.amax, stochastic_rounding=True, seed=1, offset=off)
        acc += K.nvfp4_dequantize(q.data, q.scale, q.amax)
    mean = acc / n
    unit = R.nvfp4_dequantize(torch.full_like(q0.data, 0x22), q0.scale, q0.amax)  # E2M1 1.0 per element
    step = 2.0 * unit  # the largest E2M1 step (4 -> 6)
    inside = x.abs() < 6.0 * unit  # saturated elements (|x * enc| >= 6) round to 6 deterministically
    assert inside.float().mean() > 0.9
    assert torch.all(((mean - x).abs() <= 0.13 * step)[inside])
    rn = K.nvfp4_quantize(x, amax=q0.amax)
    rn_err = (K.nvfp4_dequantize(rn.data, rn.scale, rn.amax) - x).abs().mean()
    assert (mean - x).abs().mean() < rn_err, "the SR mean must beat a single RN rounding"


@cuda
@pytest.mark.parametrize("row_scaled,rht", [(False, False), (False, True), (True, False)])
def test_given_amax(row_scaled, rht):
    """A given amax (e.g. cross-rank reduced) is used as is. row_scaled excludes rht (test_errors_options)."""
    x = make_input((128, 256), torch.bfloat16, "randn", seed=29)
    if row_scaled:
        amax = x.float().abs().amax(dim=1) * 0.5  # smaller than true: saturating blocks
    else:
        amax = torch.tensor(0.75, device="cuda")
    check_quantize(x, amax=amax, row_scaled=row_scaled, rht=rht, columnwise=True)
    if not row_scaled:
        check_quantize(x, amax=amax.reshape(1), rht=rht, columnwise=True)
        check_quantize(x, amax=amax, block_2d=not rht, rht=rht, columnwise=True, four_over_six=not rht)


BIG_CASES = [
    ((16384, 8192), torch.bfloat16, dict(rowwise=True, columnwise=True)),
    ((16384, 8192), torch.bfloat16, dict(block_2d=True, columnwise=True, four_over_six=True,
                                         err_fast_math=True)),
    ((16384, 6144), torch.bfloat16, dict(row_scaled=True, four_over_six=True, err_mode="MSE")),
    ((16384, 6144), torch.bfloat16, dict(columnwise=True, rht=True, stochastic_rounding=True, seed=7,
                                         offset=3)),
    ((8192, 4096), torch.float32, dict(columnwise=True, four_over_six=True, e4m3_max=256)),
    # the rowwise kernel's per-tensor 4over6 (shared {sf, enc} table, strict value tables, per-warp paths)
    ((16384, 6144), torch.bfloat16, dict(four_over_six=True)),
    ((16384, 8192), torch.bfloat16, dict(four_over_six=True, err_fast_math=True, err_mode="MSE")),
]


@cuda
@pytest.mark.parametrize("k", [0.0, -100.0, 116.5])
@pytest.mark.parametrize("layout", ["1d", "row", "2d"])
def test_four_over_six_stress(k, layout):
    """4over6 where warps mix blocks of the short and the general path, and (k != 0) the strict error's
    RN(q * sf * amax) leaves [2^-80, FLT_MAX]: every mode, both E, rowwise kernel and tile kernel."""
    x = (fos_stress(1, 256, 512) * 2.0**k).cuda()
    for (err, fast), emax in itertools.product(itertools.product(("MAE", "MSE"), (False, True)), (448, 256)):
        kw = dict(four_over_six=True, err_mode=err, err_fast_math=fast, e4m3_max=emax,
                  row_scaled=layout == "row", block_2d=layout == "2d", columnwise=layout == "2d")
        check_quantize(x, **kw)


@cuda
@pytest.mark.parametrize("shape,dtype,kw", BIG_CASES, ids=[str(i) for i in range(len(BIG_CASES))])
def test_big(shape, dtype, kw):
    x = make_input(shape, dtype, "randn", seed=31)
    check_quantize(x, **kw)
    del x
    torch.cuda.empty_cache()


# ---- v7 kernels: tile2_kernel (plain row+col, 2-D, SR, RHT) and row_scaled_kernel (fused row amax) ----
# tile2 runs a persistent grid (one wave of resident blocks, each walking many 64-column x 128-row tiles
# for 16-bit input, 64-row tiles for FP32) with a cp.async double-buffered tile: the shapes below give
# more tiles than resident blocks (the loop and the buffer reuse), partial tiles in both dimensions,
# M not a multiple of 128 / 64, N not a multiple of 64, and N * sizeof % 16 != 0 (element copies).

V7_TILE_KW = [
    dict(rowwise=True, columnwise=True),
    dict(rowwise=False, columnwise=True),
    dict(rowwise=True, columnwise=True, block_2d=True),
    dict(rowwise=True, columnwise=False, block_2d=True),
    dict(rowwise=False, columnwise=True, block_2d=True),
    dict(rowwise=True, columnwise=True, stochastic_rounding=True, seed=2**40 + 11, offset=9),
    dict(rowwise=True, columnwise=True, block_2d=True, stochastic_rounding=True, seed=3, offset=2**35),
    dict(rowwise=True, columnwise=True, e4m3_max=256),
]
V7_RHT_KW = [
    dict(rowwise=True, columnwise=True, rht=True),
    dict(rowwise=False, columnwise=True, rht=True),
    dict(rowwise=True, columnwise=True, rht=True, stochastic_rounding=True, seed=77, offset=5),
]
# (tile2 takes strips of 4 tiles a thread block: 352 columns are a strip of 4 and one of 2, the last tile partial)
V7_SHAPES = [(16, 16), (128, 64), (144, 80), (272, 1040), (1, 16), (17, 48), (96, 352)]
# (shape, dtype, kind): more tiles than resident thread blocks
V7_BIG = [((2064, 4112), torch.bfloat16, "randn"), ((4096, 4160), torch.bfloat16, "special"),
          ((2064, 2064), torch.float32, "mixed"), ((1040, 4160), torch.float16, "huge")]


@pytest.fixture(params=_tile2_walk.WALKS)
def tile2_walk(request):
    """tile2_kernel's walk: its default on these shapes (one 64-column tile a thread block: strips start at 16 waves
    of tiles) and strips of 4 tiles forced, both against the twin."""
    with _tile2_walk.walk(request.param):
        yield request.param


def _v7_kw_fits(shape, kw):
    m, n = shape
    if kw.get("rowwise", True) and n % 16:
        return False
    if (kw.get("columnwise", False) or kw.get("block_2d", False)) and m % 16:
        return False
    if kw.get("block_2d", False) and n % 16:
        return False
    return True


@cuda
@pytest.mark.parametrize("shape", V7_SHAPES, ids=[f"{m}x{n}" for m, n in V7_SHAPES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("kind", ["randn", "special", "huge", "mixed", "zeros"])
def test_v7_tile_modes(shape, dtype, kind, tile2_walk):
    x = make_input(shape, dtype, kind, seed=shape[0] * 3 + shape[1] + len(kind))
    for kw in V7_TILE_KW + (V7_RHT_KW if dtype == torch.bfloat16 else []):
        if _v7_kw_fits(shape, kw):
            check_quantize(x, **kw)


@cuda
@pytest.mark.parametrize("shape,dtype,kind", V7_BIG, ids=[f"{s[0]}x{s[1]}-{k}" for s, _, k in V7_BIG])
def test_v7_tile_many_tiles(shape, dtype, kind, tile2_walk):
    x = make_input(shape, dtype, kind, seed=shape[1])
    for kw in V7_TILE_KW + (V7_RHT_KW if dtype == torch.bfloat16 else []):
        check_quantize(x, **kw)


@cuda
@pytest.mark.parametrize("shape", [(16, 1), (48, 33), (160, 130), (2064, 1001)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_v7_tile_unaligned_columns(shape, dtype, tile2_walk):
    """Columnwise only with N * sizeof(T) % 16 != 0: tile2 copies elements one by one (no cp.async)."""
    x = make_input(shape, dtype, "special", seed=41)
    check_quantize(x, rowwise=False, columnwise=True)
    check_quantize(x, rowwise=False, columnwise=True, amax=torch.tensor(3.0, device="cuda"))
    check_quantize(x, rowwise=False, columnwise=True, stochastic_rounding=True, seed=1, offset=1)
    if dtype == torch.bfloat16:
        check_quantize(x, rowwise=False, columnwise=True, rht=True)


@cuda
def test_v7_tile_nan_inf_amax():
    """Given amaxes of 0, Inf and NaN reach every block of the persistent loop alike."""
    x = make_input((2064, 1040), torch.bfloat16, "randn", seed=43)
    for a in (0.0, float("inf"), float("nan"), 1e-30, 3e38):
        amax = torch.tensor(a, device="cuda")
        check_quantize(x, amax=amax, columnwise=True)
        check_quantize(x, amax=amax, columnwise=True, block_2d=True)


V7_ROW_SHAPES = [(1, 16), (3, 48), (130, 80), (64, 4096), (40, 8192), (33, 8208), (17, 16384), (5, 16400)]


@cuda
@pytest.mark.parametrize("shape", V7_ROW_SHAPES, ids=[f"{m}x{n}" for m, n in V7_ROW_SHAPES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("kind", ["randn", "special", "huge", "zeros"])
def test_v7_row_scaled(shape, dtype, kind):
    """Row-scaled rowwise: the per-row amax computed in the quantize launch (16-bit, N <= 16384: one thread
    block per row with 2 or 4 blocks per thread; else row_amax + quantize), and the row kernel with a given
    amax; every 4over6 mode, both E."""
    x = make_input(shape, dtype, kind, seed=shape[0] + shape[1] + len(kind))
    check_quantize(x, row_scaled=True)
    check_quantize(x, row_scaled=True, amax=x.float().abs().amax(dim=1) * 0.75)
    for err, fast in itertools.product(("MAE", "MSE"), (False, True)):
        check_quantize(x, row_scaled=True, four_over_six=True, err_mode=err, err_fast_math=fast, e4m3_max=256)
    check_quantize(x, row_scaled=True, four_over_six=True, err_fast_math=True)
    # row-scaled with a columnwise copy keeps the row_amax pass + tile kernel
    if shape[0] % 16 == 0:
        check_quantize(x, row_scaled=True, columnwise=True)


@cuda
def test_v7_row_scaled_big():
    x = make_input((16384, 6144), torch.bfloat16, "randn", seed=47)
    check_quantize(x, row_scaled=True)
    check_quantize(x, row_scaled=True, four_over_six=True, err_fast_math=True)
    del x
    torch.cuda.empty_cache()


# ---- amax ops and dequantize ----------------------------------------------------------------------

@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "fp32", "fp16"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (16, 16), (33, 1000), (4096, 4104), (0, 16), (16, 0)])
@pytest.mark.parametrize("kind", ["randn", "special", "mixed"])
def test_amax_ops(dtype, shape, kind):
    x = make_input(shape, dtype, kind, seed=37) if shape[0] * shape[1] else torch.empty(shape, dtype=dtype,
                                                                                        device="cuda")
    assert_same_bytes(K.nvfp4_amax(x), R.nvfp4_amax(x), "amax")
    assert_same_bytes(K.nvfp4_row_amax(x), R.nvfp4_row_amax(x), "row_amax")


@cuda
def test_amax_noncontiguous_and_offset():
    base = make_input((64, 96), torch.bfloat16, "randn", seed=41)
    for x in (base.t(), base[:, 1:17], base.view(-1)[3:3 + 48 * 16].view(48, 16)):
        assert_same_bytes(K.nvfp4_amax(x), R.nvfp4_amax(x), "amax")
        assert_same_bytes(K.nvfp4_row_amax(x), R.nvfp4_row_amax(x), "row_amax")
    x = base.view(-1)[16:16 + 32 * 64].view(32, 64)  # 32-byte offset: still 16-byte aligned
    check_quantize(x, columnwise=True)
    x = base.view(-1)[1:1 + 32 * 64].view(32, 64)  # misaligned storage offset -> copied
    check_quantize(x, columnwise=True)
    check_quantize(base.t(), columnwise=True)  # non-contiguous -> contiguous copy, like the reference


@cuda
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kw", [dict(), dict(row_scaled=True), dict(e4m3_max=256, four_over_six=True),
                                dict(block_2d=True)], ids=["plain", "row", "e256", "2d"])
@pytest.mark.parametrize("kind", ["randn", "special", "mixed"])
def test_dequantize(out_dtype, kw, kind):
    x = make_input((64, 192), torch.float32, kind, seed=43)
    q = R.nvfp4_quantize(x, **kw)
    args = dict(e4m3_max=kw.get("e4m3_max", 448), row_scaled=kw.get("row_scaled", False), out_dtype=out_dtype)
    assert_same_bytes(K.nvfp4_dequantize(q.data, q.scale, q.amax, **args),
                      R.nvfp4_dequantize(q.data, q.scale, q.amax, **args), "dequantize")


@cuda
def test_dispatch_uses_kernel():
    import fp_recipes.ops as ops
    from fp_recipes.ops import backend

    assert backend.cuda_impl("nvfp4_quantize") is K.nvfp4_quantize
    x = make_input((64, 64), torch.bfloat16, "randn", seed=47)
    got = ops.nvfp4_quantize(x, columnwise=True)
    want = R.nvfp4_quantize(x, columnwise=True)
    for f in FIELDS:
        assert_same_bytes(getattr(got, f), getattr(want, f), f)


@cuda
def test_other_stream_and_device_index():
    x = make_input((128, 128), torch.bfloat16, "randn", seed=53)
    want = R.nvfp4_quantize(x, columnwise=True, four_over_six=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = K.nvfp4_quantize(x, columnwise=True, four_over_six=True)
    torch.cuda.current_stream().wait_stream(s)
    for f in FIELDS:
        assert_same_bytes(getattr(got, f), getattr(want, f), f)


@cuda
def test_torch_compile_fullgraph():
    def step(x, amax):
        q = K.nvfp4_quantize(x, amax=amax, columnwise=True, four_over_six=True, err_fast_math=True)
        return q.data, q.scale, q.data_t, q.scale_t, K.nvfp4_dequantize(q.data, q.scale, q.amax)

    x = make_input((256, 512), torch.bfloat16, "randn", seed=59)
    amax = K.nvfp4_amax(x)
    compiled = torch.compile(step, fullgraph=True)
    for got, want in zip(compiled(x, amax), step(x, amax)):
        assert_same_bytes(got, want, "compiled")


# ---- errors ------------------------------------------------------------------------------------------

@cuda
@pytest.mark.parametrize("kw,exc,match", [
    (dict(four_over_six=True, rht=True, columnwise=True), ValueError, "four_over_six=True is incompatible with rht"),
    (dict(four_over_six=True, stochastic_rounding=True), ValueError, "incompatible with stochastic_rounding"),
    (dict(row_scaled=True, block_2d=True), ValueError, "row_scaled=True is incompatible with block_2d"),
    (dict(row_scaled=True, stochastic_rounding=True), ValueError, "row_scaled=True is incompatible"),
    (dict(rht=True, rowwise=True, columnwise=False), ValueError, "columnwise=False"),
    (dict(rowwise=False, columnwise=False), ValueError, "nothing to do"),
    (dict(e4m3_max=300), ValueError, "448 or 256"),
    (dict(err_mode="L1", four_over_six=True), ValueError, "MAE"),
    (dict(seed=-1, stochastic_rounding=True), ValueError, "seed"),
])
def test_errors_options(kw, exc, match):
    x = make_input((32, 32), torch.bfloat16, "randn")
    with pytest.raises(exc, match=match):
        K.nvfp4_quantize(x, **kw)


@cuda
def test_errors_shapes_and_types():
    x = make_input((32, 40), torch.bfloat16, "randn")
    with pytest.raises(ValueError, match="multiple of 16"):
        K.nvfp4_quantize(x)
    with pytest.raises(ValueError, match="multiple of 16"):
        K.nvfp4_quantize(make_input((40, 32), torch.bfloat16, "randn"), columnwise=True)
    with pytest.raises(TypeError, match="bfloat16"):
        K.nvfp4_quantize(make_input((32, 32), torch.float32, "randn"), columnwise=True, rht=True)
    with pytest.raises(TypeError, match="not supported"):
        K.nvfp4_quantize(torch.zeros(32, 32, dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match="2-D"):
        K.nvfp4_quantize(torch.zeros(2, 32, 32, device="cuda"))
    with pytest.raises(ValueError, match="amax must be"):
        K.nvfp4_quantize(make_input((32, 32), torch.float32, "randn"), amax=torch.ones(32, device="cuda"))
    with pytest.raises(ValueError, match="amax is on"):
        K.nvfp4_quantize(make_input((32, 32), torch.float32, "randn"), amax=torch.tensor(1.0))
    q = K.nvfp4_quantize(make_input((32, 32), torch.float32, "randn"))
    with pytest.raises(ValueError, match="does not match"):
        K.nvfp4_dequantize(q.data, q.scale[:, :1].contiguous(), q.amax)
    with pytest.raises(TypeError, match="out_dtype"):
        K.nvfp4_dequantize(q.data, q.scale, q.amax, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="contiguous"):
        torch.ops.fp_recipes.nvfp4_amax(make_input((32, 64), torch.float32, "randn").t())


# ---- CPU: fake kernels and validation (no GPU needed) -----------------------------------------------

def test_fake_quantize_shapes_cpu():
    x = torch.empty(64, 128, dtype=torch.bfloat16, device="meta")
    outs = torch.ops.fp_recipes.nvfp4_quantize(x, None, True, True, False, False, False, 448, False, False,
                                               False, False, 0, 0, 0, 0)
    shapes = [tuple(t.shape) for t in outs]
    assert shapes == [(64, 64), (64, 8), (), (128, 32), (128, 4), ()]
    assert [t.dtype for t in outs] == [torch.uint8, torch.float8_e4m3fn, torch.float32] * 2
    outs = torch.ops.fp_recipes.nvfp4_quantize(x, None, True, False, False, True, False, 448, False, False,
                                               False, False, 0, 0, 0, 0)
    assert [tuple(t.shape) for t in outs] == [(64, 64), (64, 8), (64,), (0,), (0,), (0,)]
    assert tuple(torch.ops.fp_recipes.nvfp4_row_amax(x).shape) == (64,)
    assert tuple(torch.ops.fp_recipes.nvfp4_amax(x).shape) == ()
    d = torch.ops.fp_recipes.nvfp4_dequantize(torch.empty(64, 64, dtype=torch.uint8, device="meta"),
                                              torch.empty(64, 8, dtype=torch.float8_e4m3fn, device="meta"),
                                              torch.empty((), device="meta"), 448, False, torch.bfloat16)
    assert tuple(d.shape) == (64, 128) and d.dtype == torch.bfloat16


def test_fake_quantize_matches_reference_shapes_cpu():
    """The fake kernel's shapes and dtypes equal the reference's real outputs (run on CPU)."""
    for kw in (dict(), dict(columnwise=True), dict(rowwise=False, columnwise=True), dict(row_scaled=True),
               dict(block_2d=True, columnwise=True)):
        x = torch.randn(32, 48)
        want = R.nvfp4_quantize(x, **kw)
        fake = torch.ops.fp_recipes.nvfp4_quantize(
            x.to("meta"), None, kw.get("rowwise", True), kw.get("columnwise", False), kw.get("block_2d", False),
            kw.get("row_scaled", False), False, 448, False, False, False, False, 0, 0, 0, 0)
        for f, t in zip(FIELDS, fake):
            w = getattr(want, f)
            if w is None:
                assert t.numel() == 0, f
            else:
                assert (tuple(t.shape), t.dtype) == (tuple(w.shape), w.dtype), f


def test_validation_cpu():
    x = torch.randn(32, 32)
    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        K.nvfp4_quantize(x)
    with pytest.raises(ValueError, match="incompatible"):
        K.nvfp4_quantize(x.bfloat16(), four_over_six=True, rht=True, columnwise=True)
    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        K.nvfp4_amax(x)
    q = R.nvfp4_quantize(x)
    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        K.nvfp4_dequantize(q.data, q.scale, q.amax)
