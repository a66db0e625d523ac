"""The NVFP4 kernels' per-block math, built for the CPU with g++, against the torch reference.

The CUDA kernels can only run on a GPU, but the arithmetic they run per 16-element block lives in two
headers (formats.cuh's E2M1 section, nvfp4_device.cuh). tests/nvfp4_host/nvfp4_host_harness.cpp
compiles those headers for the host (the GPU's round-to-nearest intrinsics become plain IEEE float
operations) and emulates the kernels' block loops, so every CI run checks the exact bytes of 1-D,
row-scaled, 2-D, 4over6 (strict/fast, MAE/MSE, E 448/256), RHT and SR quantization, the E2M1 rounding
over all FP32 values near the grid, Philox against Random123's known answers, and the division-free
RN(w / 6E). The GPU tests (test_cuda_nvfp4_kernels.py) then check the kernels' indexing and layout.
"""

from __future__ import annotations

import ctypes
import itertools

import pytest
import torch

from fp_recipes import formats
from fp_recipes.ops import ref_nvfp4 as R

from _host_harness import ROOT, build_harness, ptr
from _nvfp4_stress import fos_stress

HARNESS = ROOT / "tests" / "nvfp4_host" / "nvfp4_host_harness.cpp"


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return build_harness(HARNESS, tmp_path_factory.mktemp("nvfp4_host"), "nvfp4_host", "-O1")


_p = ptr


def host_quantize(lib, x, amax=None, rowwise=True, columnwise=False, block_2d=False, row_scaled=False,
                  four_over_six=False, e4m3_max=448, err_mode="MAE", err_fast_math=False, rht=False,
                  stochastic_rounding=False, seed=0, offset=0) -> dict:
    """The harness's bytes in the reference's field names (the kernels' orchestration, in Python)."""
    i64, u64, ci, f32 = ctypes.c_int64, ctypes.c_uint64, ctypes.c_int, ctypes.c_float
    xf = x.float().contiguous()
    m, n = xf.shape
    fos = 0 if not four_over_six else (2 if err_fast_math else 1)
    mse = int(err_mode == "MSE")
    sr = int(stochastic_rounding)
    if amax is None:
        amax = xf.abs().amax(dim=1) if row_scaled else xf.abs().amax()
    amax = amax.float().contiguous().clone()

    def rows(a, am, rs):
        r, c = a.shape
        data = torch.empty(r, c // 2, dtype=torch.uint8)
        scale = torch.empty(r, c // 16, dtype=torch.uint8)
        lib.h_rows(_p(a), i64(r), i64(c), _p(am), ci(rs), ci(fos), ci(mse), f32(e4m3_max), ci(sr), u64(seed),
                   u64(offset), _p(data), _p(scale))
        return data, scale

    out = {}
    if block_2d:
        data = torch.empty(m, n // 2, dtype=torch.uint8)
        scale = torch.empty(m, n // 16, dtype=torch.uint8)
        dt = torch.empty(n, m // 2, dtype=torch.uint8)
        st = torch.empty(n, m // 16, dtype=torch.uint8)
        lib.h_2d(_p(xf), i64(m), i64(n), f32(amax.item()), ci(fos), ci(mse), f32(e4m3_max), ci(sr), u64(seed),
                 u64(offset), _p(data), _p(scale), _p(dt), _p(st))
        if rowwise:
            out.update(data=data, scale=scale, amax=amax)
        if columnwise:
            out.update(data_t=dt, scale_t=st, amax_t=amax)
        return out
    if rowwise:
        d, s = rows(xf, amax, int(row_scaled))
        out.update(data=d, scale=s, amax=amax)
    if columnwise:
        xt = xf.t().contiguous()
        if rht:
            lib.h_rht(_p(xt), i64(n), i64(m))
            at = xt.abs().amax()
        else:
            at = amax.amax() if row_scaled else amax
        at = at.reshape(()).contiguous().clone()
        d, s = rows(xt, at, 0)
        out.update(data_t=d, scale_t=s, amax_t=at)
    return out


def assert_same(got: dict, want: R.NVFP4Quantized, what: str) -> None:
    for f in want._fields:
        w = getattr(want, f)
        if w is None:
            assert f not in got, f"{what}: {f} should be absent"
            continue
        g = got[f]
        if f.startswith("amax"):
            assert torch.equal(torch.isnan(g), torch.isnan(w)), f"{what}: {f} NaN positions"
            assert torch.equal(torch.nan_to_num(g).view(torch.int32), torch.nan_to_num(w).view(torch.int32)), f
        else:
            gb, wb = g.view(torch.uint8), w.view(torch.uint8)
            assert torch.equal(gb, wb), f"{what}: {f}: {(gb != wb).sum().item()} of {wb.numel()} bytes differ"


def make(shape, dtype, kind, seed):
    g = torch.Generator().manual_seed(seed)
    m, n = shape
    x = torch.randn(m, n, generator=g)
    if kind == "huge":
        b = x.view(m, n // 16, 16)
        pos = torch.randint(0, 16, (m, n // 16), generator=g)
        mag = torch.exp2(torch.randint(6, 20, (m, n // 16), generator=g).float())
        b.scatter_(2, pos.unsqueeze(-1), (mag * torch.sign(torch.randn(m, n // 16, generator=g))).unsqueeze(-1))
    elif kind == "mixed":
        x = x * torch.exp2(torch.randint(-40, 20, (m, n), generator=g).float())
        x.view(-1)[::17] = 0
    elif kind == "special":
        f = x.view(-1)
        idx = torch.randperm(m * n, generator=g)
        k = max(1, m * n // 97)
        f[idx[:k]] = float("nan")
        f[idx[k:2 * k]] = float("inf")
        f[idx[2 * k:3 * k]] = -float("inf")
        f[idx[3 * k:4 * k]] = -0.0
    elif kind == "zeros":
        x.zero_()
    elif kind == "ties":  # exact E2M1 midpoints after scaling by 1 (amax 6 -> unit scale for E=448)
        x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]).repeat(m * n // 8).view(m, n) * torch.sign(x)
    return x.to(dtype)


MODES = [("1d", False), ("1d", True), ("2d", False)]
FOS = [("off", False), ("MAE", False), ("MAE", True), ("MSE", False), ("MSE", True)]


@pytest.mark.parametrize("kind", ["randn", "huge", "mixed", "special", "zeros", "ties"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantize_modes(lib, kind, dtype):
    x = make((32, 48), dtype, kind, seed=len(kind))
    for (layout, rs), (err, fast), emax in itertools.product(MODES, FOS, (448, 256)):
        kw = dict(rowwise=True, columnwise=True, block_2d=layout == "2d", row_scaled=rs, e4m3_max=emax)
        if err != "off":
            kw.update(four_over_six=True, err_mode=err, err_fast_math=fast)
        want = R.nvfp4_quantize(x, **kw)
        # 4over6 blocks take a short or a general path (fos_short_ok); force_general=1 runs every block
        # through the general one, so both paths meet every block they can be given.
        for force_general in ((0, 1) if err != "off" else (0,)):
            lib.h_set_force_general(force_general)
            try:
                assert_same(host_quantize(lib, x, **kw), want, f"{kw} force_general={force_general}")
            finally:
                lib.h_set_force_general(0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_four_over_six_paths(lib, seed):
    """4over6 over stress blocks, with the tensor amax as computed and as given (smaller and larger than the
    true one: clamped scales, huge and tiny global scales), and whole tensors scaled to the ends of the FP32
    range (the strict error's RN(q * sf * amax) then leaves [2^-80, FLT_MAX]); both paths, all modes."""
    x0 = fos_stress(seed)
    true_amax = x0.abs().amax()
    cases = [(x0, None), (x0, true_amax * 0.3), (x0, true_amax * 7.0), (x0, torch.tensor(3e38)),
             (x0, torch.tensor(1e-30))] + [(x0 * 2.0**k, None) for k in (-100, -118, 112.75, 116.5, 118.75)]
    for (x, amax), (err, fast), emax, layout in itertools.product(cases, FOS[1:], (448, 256), ("1d", "2d")):
        kw = dict(rowwise=True, columnwise=layout == "2d", block_2d=layout == "2d", e4m3_max=emax,
                  four_over_six=True, err_mode=err, err_fast_math=fast)
        if amax is not None:
            kw["amax"] = amax.reshape(()).float()
        want = R.nvfp4_quantize(x, **kw)
        for force_general in (0, 1):
            lib.h_set_force_general(force_general)
            try:
                assert_same(host_quantize(lib, x, **kw), want, f"{kw} force_general={force_general}")
            finally:
                lib.h_set_force_general(0)


def test_e2m1_short_paths_all_values(lib):
    """The clamp-free magic-add rounding of the short 4over6 path: two binades exact on [0, 4.5], three on
    [0, 7) (compare-selected and exponent-computed magics), over every FP32 in [2^-3, bound] plus a stride
    below (all of which round to 0 or 0.5)."""
    for levels, hi in ((2, 4.5), (3, 7.0), (4, 7.0)):  # 4: e2m1_magic3_exp
        lo_bits, hi_bits = 0x3E000000, int(torch.tensor(hi).view(torch.int32))
        bits = torch.cat([torch.arange(0, lo_bits, 997, dtype=torch.int64),
                          torch.arange(lo_bits, hi_bits + (1 if levels == 2 else 0), dtype=torch.int64)])
        a = bits.to(torch.int32).view(torch.float32).contiguous()
        idx = torch.empty(a.numel(), dtype=torch.uint8)
        mag = torch.empty(a.numel(), dtype=torch.float32)
        lib.h_e2m1_short(_p(a), ctypes.c_int64(a.numel()), ctypes.c_int(levels), _p(idx), _p(mag))
        want = (formats.e2m1_encode(a) & 7).to(torch.uint8)
        assert torch.equal(idx, want), f"levels={levels}"
        assert torch.equal(mag, formats.e2m1_decode(want)), f"levels={levels}"


@pytest.mark.parametrize("kind", ["randn", "mixed", "special"])
def test_rht_and_sr(lib, kind):
    x = make((48, 64), torch.bfloat16, kind, seed=5)
    for seed, offset in ((0, 0), (2**63 + 5, 2**40 + 1)):
        for kw in (dict(columnwise=True, rht=True), dict(columnwise=True, rht=True, stochastic_rounding=True),
                   dict(columnwise=True, stochastic_rounding=True),
                   dict(columnwise=True, block_2d=True, stochastic_rounding=True)):
            kw = dict(kw, seed=seed, offset=offset)
            assert_same(host_quantize(lib, x, **kw), R.nvfp4_quantize(x, **kw), str(kw))


def _all_near_grid() -> torch.Tensor:
    """Every FP32 in [2^-3, 8) (both signs) plus a stride over all bit patterns (NaN/Inf included)."""
    near = torch.arange(0x3E000000, 0x41000000, dtype=torch.int64)
    spread = torch.arange(0, 1 << 32, 4099, dtype=torch.int64)
    bits = torch.cat([near, near | (1 << 31), spread])
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32).contiguous()


def test_e2m1_round_all_near_grid(lib):
    # The kernels round products RN(x * enc), which are never signalling NaNs; quiet them the same way
    # (the host's fminf, unlike the GPU's, answers NaN for a signalling NaN operand).
    y = (_all_near_grid() * torch.tensor(1.0)).contiguous()
    idx = torch.empty(y.numel(), dtype=torch.uint8)
    mag = torch.empty(y.numel(), dtype=torch.float32)
    lib.h_e2m1(_p(y), ctypes.c_int64(y.numel()), _p(idx), _p(mag))
    want = (formats.e2m1_encode(y) & 7).to(torch.uint8)
    assert torch.equal(idx, want)
    assert torch.equal(mag, formats.e2m1_decode(want))


def test_e2m1_stochastic_all_bytes(lib):
    grid = torch.tensor([0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 5.5, 6.0, 7.0, 1.999, 5.999])
    y = torch.cat([grid.repeat_interleave(256), torch.randn(200_000) * 3, torch.tensor([float("inf"), -float("inf"),
                                                                                        float("nan"), -0.0, 0.0])])
    y = torch.cat([y, -y]).contiguous()
    rb = torch.randint(0, 256, (y.numel(),), dtype=torch.int64)
    rb[: grid.numel() * 256] = torch.arange(256).repeat(grid.numel())
    out = torch.empty(y.numel(), dtype=torch.uint8)
    lib.h_sr(_p(y), _p(rb), ctypes.c_int64(y.numel()), _p(out))
    assert torch.equal(out, R._e2m1_sr(y, y, rb))


def _encode16_sr_reference(x: torch.Tensor, enc: torch.Tensor, rnd: torch.Tensor) -> torch.Tensor:
    """Packed bytes (n, 8) of e2m1_encode_sr per element: y = RN(x * enc), element j's random byte is byte j % 4
    of word j // 4, the sign from x, low nibble first."""
    n = x.shape[0]
    y = x * enc.unsqueeze(1)  # FP32 RN, as __fmul_rn
    shifts = (8 * (torch.arange(16) % 4)).to(torch.int64)
    words = rnd.to(torch.int64) & 0xFFFFFFFF
    rb = (words[:, torch.arange(16) // 4] >> shifts) & 0xFF
    codes = R._e2m1_sr(y, x, rb).reshape(n, 8, 2).to(torch.int64)
    return (codes[:, :, 0] | (codes[:, :, 1] << 4)).to(torch.uint8)


def test_encode16_sr_matches_elementwise(lib):
    """The kernels' block SR encode (encode16_sr: encode16_sr_ceil, one directed rounding to the grid, in the
    shipped build)
    makes the decisions of e2m1_encode_sr: every FP32 in [2^-3, 8) at a stride (each with a random byte), the
    grid values, midpoints and binade edges with all 256 bytes, and specials (0, -0, Inf, NaN, huge, tiny)."""
    assert lib.h_sr_ceil() == 1  # the shipped default (nvfp4_device.cuh)
    g = torch.Generator().manual_seed(26)
    near = torch.arange(0x3E000000, 0x41000000, 37, dtype=torch.int32).view(torch.float32)
    near = near[: near.numel() // 16 * 16]  # whole blocks: the edge values below start a block
    edges = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 6.5, 7.0,
                          7.5, 1.999999, 3.999999, 5.999999, 0.0078125, 1e-30, 1e-45])
    edges = edges.repeat_interleave(256)
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0, 3.0e38, -3.0e38, 1e-40, 65504.0])
    vals = torch.cat([near, edges, special, torch.randn(160_000, generator=g) * 4])
    vals = torch.cat([vals, -vals])
    pad = (-vals.numel()) % 16
    vals = torch.cat([vals, torch.zeros(pad)])
    n = vals.numel() // 16
    x = vals.reshape(n, 16).contiguous()
    enc = torch.ones(n)
    enc[n // 2:] = torch.exp2(torch.randn(n - n // 2, generator=g) * 3)  # scaled blocks: y = RN(x * enc)
    rnd = torch.randint(-(2**31), 2**31, (n, 4), dtype=torch.int64, generator=g)
    # the edge values with every byte: element j of a block takes byte j % 4 of word j // 4
    first = near.numel() // 16
    k = torch.arange(first, first + edges.numel() // 16)
    byte = torch.arange(256).repeat(edges.numel() // 256)[: k.numel() * 16].reshape(-1, 16)
    rnd[k] = sum((byte[:, j::4] & 0xFF) << (8 * j) for j in range(4)).to(torch.int64)
    rnd = torch.where(rnd >= 2**31, rnd - 2**32, rnd).to(torch.int32).contiguous()
    out = torch.empty(n, 8, dtype=torch.uint8)
    lib.h_encode16_sr(_p(x), _p(enc), _p(rnd), ctypes.c_int64(n), _p(out))
    want = _encode16_sr_reference(x, enc, rnd.view(torch.int32).to(torch.int64))
    bad = (out != want).any(dim=1).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} of {n} blocks differ, first: x={x[bad[0]].tolist()} enc={enc[bad[0]]}"


def test_philox_known_answers(lib):
    """Random123's philox4x32-10 known-answer vectors (kat_vectors)."""
    out = (ctypes.c_uint32 * 4)()
    for ctr, key, want in (
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ):
        lib.h_philox(*[ctypes.c_uint32(v) for v in ctr + key], out)
        assert tuple(out) == want


def test_division_free_6e(lib):
    """div_6e(w) == RN(w / 6E) bit for bit over random bit patterns, tiny and huge values, Inf, NaN."""
    g = torch.Generator().manual_seed(0)
    bits = torch.cat([torch.randint(0, 2**32, (2_000_000,), generator=g, dtype=torch.int64),
                      torch.arange(0, 1 << 22, dtype=torch.int64), torch.arange(0x7F000000, 0x7F800001, dtype=torch.int64)])
    w = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32).contiguous()
    for e in (448.0, 256.0, None):
        out = torch.empty_like(w)
        if e is None:  # div6_rn: RN(bamax / 6) of the 4over6 base scale
            lib.h_div6(_p(w), ctypes.c_int64(w.numel()), _p(out))
            want = w / torch.tensor(6.0)
        else:
            lib.h_div6e(_p(w), ctypes.c_int64(w.numel()), ctypes.c_float(e), _p(out))
            want = w / torch.tensor(6 * e)
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(out), nan)
        assert torch.equal(out[~nan], want[~nan])
