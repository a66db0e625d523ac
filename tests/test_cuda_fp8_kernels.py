"""The FP8 / grouped FP8 / per-token CUDA kernels against their reference twins, byte for byte.

Every case runs the kernel (through the op registered for fp_recipes.ops dispatch) and the twin from
ops/ref_fp8.py / ops/ref_per_token.py on the SAME CUDA tensors, then compares the raw bytes of data,
scales and amax (NaN included: both sides hold the canonical NaN). Needs a GPU (skipped otherwise).
"""

from __future__ import annotations

import math

import pytest
import torch

from fp_recipes import formats
from fp_recipes.ops import ref_fp8, ref_per_token

pytestmark = pytest.mark.cuda

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEV = "cuda"


@pytest.fixture(scope="module")
def cu():
    from fp_recipes.ops import backend

    assert backend.extension() is not None, backend.extension_error()
    from fp_recipes.ops import cuda_fp8

    return cuda_fp8


# ---- helpers -------------------------------------------------------------------------------------

def as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t.reshape(-1).view(torch.uint8)


def assert_same(got, want, what: str) -> None:
    if want is None:
        assert got is None, f"{what}: expected None"
        return
    assert got is not None, f"{what}: got None"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.device == want.device
    if got.dtype in (torch.float32, torch.float16, torch.bfloat16):
        # NaN payloads are not part of any contract (GPU arithmetic and fills canonicalize them in
        # different ways); a NaN must meet a NaN, every other value must match bit for bit.
        both_nan = torch.isnan(got) & torch.isnan(want)
        assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{what}: NaN positions differ"
        got = torch.where(both_nan, torch.zeros_like(got), got)
        want = torch.where(both_nan, torch.zeros_like(want), want)
    gb, wb = as_bytes(got), as_bytes(want)
    if not torch.equal(gb, wb):
        bad = (gb != wb).nonzero()
        i = int(bad[0, 0]) if bad.dim() > 1 else int(bad[0])
        raise AssertionError(f"{what}: {bad.shape[0]} differing bytes, first at byte {i}: "
                             f"got {int(gb.reshape(-1)[i])} want {int(wb.reshape(-1)[i])}")


def make_input(shape, dtype, kind: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    n = math.prod(shape)
    if kind == "zeros":
        return torch.zeros(shape, dtype=dtype, device=DEV)
    # A wide spread of magnitudes: normal, tiny (FP8 subnormal/underflow after scaling), large.
    x = torch.randn(n, generator=g, device=DEV, dtype=torch.float32)
    lo, hi = (-12, 12) if dtype == torch.float16 else (-24, 24)  # keep FP16 inputs mostly finite
    mag = torch.exp2(torch.randint(lo, hi, (n,), generator=g, device=DEV).float())
    x = x * mag
    if kind == "huge":
        lim = torch.finfo(dtype).max
        x[::7] = lim
        x[3::11] = -lim
        x[5::13] = float("inf")
        x[6::17] = float("-inf")
    if kind == "nan" and n > 0:
        x[n // 2] = float("nan")
        if n > 4:
            x[1::97] = float("inf")
    x = x.to(dtype)
    return x.reshape(shape)


SHAPES = [(1, 1), (1, 17), (3, 5), (7, 129), (64, 64), (65, 63), (128, 4096), (1, 24581), (16500, 24),
          (257, 1000)]


# ---- encoder: every FP32 bit pattern -------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_encode_every_fp32_bit_pattern(cu, fmt):
    """The hardware satfinite cvt must equal the reference encoder on all 2^32 inputs (scale 1)."""
    chunk = 1 << 26
    one = torch.ones((), dtype=torch.float32, device=DEV)
    for start in range(0, 1 << 32, chunk):
        bits = torch.arange(start, start + chunk, dtype=torch.int64, device=DEV)
        x = formats.fp32_from_bits(bits).reshape(-1, 4096)
        got = cu.fp8_quantize(x, one, fmt).data
        want = formats.fp8_encode(x, fmt)
        assert_same(got, want, f"{fmt} bits [{start:#x}, {start + chunk:#x})")


# ---- per tensor, given scale ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_quantize_matches_reference(cu, dtype, fmt, shape):
    for i, kind in enumerate(("normal", "zeros", "huge", "nan")):
        x = make_input(shape, dtype, kind, seed=i)
        for scale_val in (1.0, 0.3711, 2.0 ** 12, 3.5e-3):
            scale = torch.tensor(scale_val, dtype=torch.float32, device=DEV)
            for rowwise, columnwise in ((True, False), (False, True), (True, True)):
                got = cu.fp8_quantize(x, scale, fmt, rowwise=rowwise, columnwise=columnwise)
                want = ref_fp8.fp8_quantize(x, scale, fmt, rowwise=rowwise, columnwise=columnwise)
                tag = f"{kind} scale={scale_val} rw={rowwise} cw={columnwise}"
                assert_same(got.data, want.data, f"data {tag}")
                assert_same(got.data_t, want.data_t, f"data_t {tag}")
                assert_same(got.scale_inv, want.scale_inv, f"scale_inv {tag}")
                assert_same(got.amax, want.amax, f"amax {tag}")
                assert got.scale is scale


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_amax_matches_reference(cu, dtype):
    for shape in SHAPES + [(0, 5), (4096, 4096)]:
        for i, kind in enumerate(("normal", "zeros", "huge", "nan")):
            x = make_input(shape, dtype, kind, seed=10 + i)
            assert_same(cu.fp8_amax(x), ref_fp8.fp8_amax(x), f"amax {shape} {kind}")


def test_fp8_quantize_unaligned_and_noncontiguous_inputs(cu):
    base = make_input((1, 4097 * 33 + 1), torch.bfloat16, "normal", seed=3).reshape(-1)
    x = base[1:].reshape(33, 4097)  # 2-byte offset: misaligned for 16-byte loads
    scale = torch.tensor(0.75, device=DEV)
    for cw in (False, True):
        got = cu.fp8_quantize(x, scale, "e4m3", columnwise=cw)
        want = ref_fp8.fp8_quantize(x, scale, "e4m3", columnwise=cw)
        assert_same(got.data, want.data, "misaligned data")
        assert_same(got.data_t, want.data_t, "misaligned data_t")
        assert_same(got.amax, want.amax, "misaligned amax")
    xt = make_input((96, 64), torch.float32, "normal", seed=4).t()  # non-contiguous: copied, same bytes
    with pytest.warns(RuntimeWarning, match="not contiguous"):
        got = cu.fp8_quantize(xt, scale, "e5m2", columnwise=True)
    want = ref_fp8.fp8_quantize(xt, scale, "e5m2", columnwise=True)
    assert_same(got.data, want.data, "noncontig data")
    assert_same(got.data_t, want.data_t, "noncontig data_t")


# ---- current scaling -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_current_scaling_matches_reference(cu, dtype, fmt):
    tiny = torch.full((3, 40), 1e-40 if dtype == torch.float32 else 0.0, dtype=dtype, device=DEV)
    cases = [make_input(s, dtype, k, seed=j) for j, (s, k) in enumerate(
        [((1, 1), "normal"), ((65, 63), "normal"), ((257, 1000), "huge"), ((128, 4096), "nan"),
         ((16500, 24), "normal"), ((7, 129), "zeros")])] + [tiny]
    for x in cases:
        for pow2 in (False, True):
            for eps in (0.0, 1e-12, 3.0):
                for rowwise, columnwise in ((True, False), (True, True), (False, True)):
                    got = cu.fp8_current_scaling_quantize(x, fmt, use_power_2_scales=pow2, amax_epsilon=eps,
                                                          rowwise=rowwise, columnwise=columnwise)
                    want = ref_fp8.fp8_current_scaling_quantize(x, fmt, use_power_2_scales=pow2, amax_epsilon=eps,
                                                                rowwise=rowwise, columnwise=columnwise)
                    tag = f"{tuple(x.shape)} pow2={pow2} eps={eps} rw={rowwise} cw={columnwise}"
                    for field in ("data", "data_t", "scale_inv", "amax", "scale"):
                        assert_same(getattr(got, field), getattr(want, field), f"{field} {tag}")


# ---- dequantize ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_fp8_dequantize_matches_reference(cu, fmt, out_dtype):
    codes = torch.arange(256, dtype=torch.int64, device=DEV).to(torch.uint8)
    for n in (256, 256 * 97 + 13, 1 << 20):
        data = codes.repeat((n + 255) // 256)[:n]
        data = (data.reshape(-1, 64) if n % 64 == 0 else data).view(formats.FP8_DTYPE[fmt])
        for si in (1.0, 0.0078125, 3.3e-5, 1.7e30):
            scale_inv = torch.tensor(si, device=DEV)
            assert_same(cu.fp8_dequantize(data, scale_inv, out_dtype), ref_fp8.fp8_dequantize(data, scale_inv, out_dtype),
                        f"dequant n={n} si={si}")


# ---- grouped -------------------------------------------------------------------------------------

def _member_sizes(g: int, seed: int, width: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 40, (g,), generator=gen)
    rows[torch.randint(0, g, (max(1, g // 5),), generator=gen)] = 0  # empty members
    if g > 3:
        rows[1] = 700  # a large member spanning many tiles
    return [int(r) * width for r in rows]


@pytest.mark.parametrize("num_groups", [1, 63, 64, 65, 256, 1000])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_grouped_quantize_matches_reference(cu, num_groups, dtype):
    for width in (7168 if num_groups <= 65 else 256, 33):
        sizes = _member_sizes(num_groups, num_groups * 7 + width, width)
        n = sum(sizes)
        offsets = torch.tensor([0] + list(torch.tensor(sizes).cumsum(0).tolist()), dtype=torch.int64, device=DEV)
        x = make_input((max(n, 1),), dtype, "normal", seed=num_groups)[:n]
        if n > 10:
            x[n // 3] = float("nan")
            x[n // 2] = float("inf")
        x2 = x.reshape(-1, width) if n else x
        gen = torch.Generator(device=DEV).manual_seed(5)
        scales = torch.exp2(torch.randint(-8, 8, (num_groups,), generator=gen, device=DEV).float()) * 1.37
        for buf in (x, x2):
            for fmt in ("e4m3", "e5m2"):
                got = cu.fp8_grouped_quantize(buf, offsets, scales, fmt)
                want = ref_fp8.fp8_grouped_quantize(buf, offsets, scales, fmt)
                tag = f"G={num_groups} width={width} dim={buf.dim()} {fmt}"
                assert_same(got.data, want.data, f"data {tag}")
                assert_same(got.scale_inv, want.scale_inv, f"scale_inv {tag}")
                assert_same(got.amax, want.amax, f"amax {tag}")
                assert_same(cu.fp8_grouped_amax(buf, offsets), ref_fp8.fp8_grouped_amax(buf, offsets),
                            f"grouped amax {tag}")
                for od in DTYPES:
                    assert_same(cu.fp8_grouped_dequantize(got.data, offsets, got.scale_inv, od),
                                ref_fp8.fp8_grouped_dequantize(got.data, offsets, got.scale_inv, od),
                                f"grouped dequant {od} {tag}")


def test_fp8_grouped_members_equal_single_tensor_kernel(cu):
    """Each member of a grouped cast equals the single-tensor kernel on that member alone."""
    sizes = [0, 8192 * 3 + 5, 1, 0, 4097, 8192, 0]
    offs = [0]
    for s in sizes:
        offs.append(offs[-1] + s)
    x = make_input((offs[-1],), torch.bfloat16, "normal", seed=9)
    offsets = torch.tensor(offs, dtype=torch.int64, device=DEV)
    scales = torch.linspace(0.5, 4.0, len(sizes), device=DEV)
    got = cu.fp8_grouped_quantize(x, offsets, scales, "e4m3")
    for i, (a, b) in enumerate(zip(offs[:-1], offs[1:])):
        single = cu.fp8_quantize(x[a:b].reshape(1, -1).contiguous(), scales[i].clone(), "e4m3")
        assert_same(got.data[a:b].reshape(1, -1), single.data, f"member {i} data")
        assert_same(got.amax[i], single.amax, f"member {i} amax")


def test_fp8_grouped_zero_groups_and_all_empty(cu):
    x = torch.empty((0,), dtype=torch.bfloat16, device=DEV)
    for g in (0, 3):
        offsets = torch.zeros(g + 1, dtype=torch.int64, device=DEV)
        scales = torch.ones(g, device=DEV) * 2
        got = cu.fp8_grouped_quantize(x, offsets, scales, "e4m3")
        want = ref_fp8.fp8_grouped_quantize(x, offsets, scales, "e4m3")
        assert_same(got.data, want.data, "data")
        assert_same(got.scale_inv, want.scale_inv, "scale_inv")
        assert_same(got.amax, want.amax, "amax")


def test_fp8_grouped_repeatable(cu):
    """Same inputs, same bytes, run after run (a race would move the amax)."""
    sizes = [4096 * 9 + 3] * 300
    offsets = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int64, device=DEV)
    x = make_input((offsets[-1].item(),), torch.float32, "normal", seed=1)
    scales = torch.ones(300, device=DEV)
    first = cu.fp8_grouped_quantize(x, offsets, scales, "e4m3")
    want = ref_fp8.fp8_grouped_amax(x, offsets)
    for _ in range(20):
        again = cu.fp8_grouped_quantize(x, offsets, scales, "e4m3")
        assert_same(again.amax, want, "amax")
        assert_same(again.data, first.data, "data")


# ---- per token -----------------------------------------------------------------------------------

PT_SHAPES = [(1, 8), (3, 64), (17, 7168), (5, 8200), (300, 512), (2, 32768)]


def _pt_input(shape, dtype, seed):
    x = make_input(shape, dtype, "normal", seed=seed)
    t = shape[0]
    if t >= 3:
        x[1] = 0  # amax floor
        x[2, shape[1] // 2] = float("nan")
    if t >= 5:
        x[4, 3] = float("inf")
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["e5m6", "e4m3"])
@pytest.mark.parametrize("round_sf,scale_format", [(False, "fp32"), (True, "fp32"), (True, "ue8m0")])
def test_per_token_cast_matches_reference(cu, dtype, fmt, round_sf, scale_format):
    for j, shape in enumerate(PT_SHAPES):
        x = _pt_input(shape, dtype, seed=j)
        h = shape[1]
        blocks = [None, 8, 128, 24, h // 2] + ([4, 1, 100] if fmt == "e4m3" else [])
        for bs in blocks:
            if bs is None:
                pass
            elif h % bs or (fmt == "e5m6" and bs % 8) or h // bs > 12288:
                continue
            got = cu.per_token_cast(x, fmt, round_sf=round_sf, scale_format=scale_format, block_size=bs)
            want = ref_per_token.per_token_cast(x, fmt, round_sf=round_sf, scale_format=scale_format, block_size=bs)
            tag = f"{shape} bs={bs}"
            assert_same(got.data, want.data, f"data {tag}")
            assert_same(got.scales, want.scales, f"scales {tag}")
            for od in DTYPES:
                back = cu.cast_back(got.data, got.scales, fmt, out_dtype=od, scale_format=scale_format, block_size=bs)
                ref_back = ref_per_token.cast_back(want.data, want.scales, fmt, out_dtype=od,
                                                   scale_format=scale_format, block_size=bs)
                assert_same(back, ref_back, f"cast_back {od} {tag}")


def test_per_token_e4m3_odd_hidden(cu):
    x = make_input((9, 1001), torch.bfloat16, "normal", seed=2)
    for bs in (None, 7, 143):
        got = cu.per_token_cast(x, "e4m3", round_sf=True, block_size=bs)
        want = ref_per_token.per_token_cast(x, "e4m3", round_sf=True, block_size=bs)
        assert_same(got.data, want.data, f"data bs={bs}")
        assert_same(got.scales, want.scales, f"scales bs={bs}")
        assert_same(cu.cast_back(got.data, got.scales, "e4m3", block_size=bs),
                    ref_per_token.cast_back(want.data, want.scales, "e4m3", block_size=bs), f"back bs={bs}")


def test_per_token_beyond_kernel_limits_falls_back_loudly(cu):
    x = make_input((2, 40000), torch.bfloat16, "normal", seed=6)
    with pytest.warns(RuntimeWarning, match="beyond the CUDA kernel"):
        got = cu.per_token_cast(x, "e5m6", round_sf=True)
    want = ref_per_token.per_token_cast(x, "e5m6", round_sf=True)
    assert_same(got.data, want.data, "fallback data")
    assert_same(got.scales, want.scales, "fallback scales")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_per_token_e5m6_register_kernel_paths(cu, dtype):
    """The 16-bit-input E5M6 kernel's branches: 16-byte loads or element loads (a base that is not 16-byte
    aligned), 16-byte staged stores or word stores (hidden % 32 != 0), one scale per row or per block
    (unit counts dividing 32: warp-local block scales; others: shared-memory block amaxes), 2/4/8 units
    per thread, and units that leave the fast encode because a scaled value lies below 2^-14
    (0 < |v| < 2^-14: the contract's non-RN rule there)."""
    for t, h in ((5, 7168), (3, 1000), (3, 1536), (4, 8), (6, 2056), (2, 32768)):
        flat = make_input((t * h + 1,), dtype, "normal", seed=h)
        for x in (flat[: t * h].reshape(t, h), flat[1:].reshape(t, h)):
            x = x.clone() if x.data_ptr() % 16 == 0 else x
            x[0, : h // 2] = x[0, : h // 2] * 1e-4  # tiny values next to large ones in one row
            x[0, h - 1] = 30000.0
            if t > 2:
                x[2, h // 4] = float("-inf")
            # 8..256: blocks inside one warp's 32-unit slot (warp-local scales); 24, 512: the shared path
            for bs in (None, 8, 24, 128, 256, 512):
                if bs is not None and h % bs:
                    continue
                for rsf, sfmt in ((False, "fp32"), (True, "ue8m0")):
                    got = cu.per_token_cast(x, "e5m6", round_sf=rsf, scale_format=sfmt, block_size=bs)
                    want = ref_per_token.per_token_cast(x, "e5m6", round_sf=rsf, scale_format=sfmt, block_size=bs)
                    tag = f"{dtype} {t}x{h} aligned={x.data_ptr() % 16 == 0} bs={bs} {sfmt}"
                    assert_same(got.data, want.data, f"data {tag}")
                    assert_same(got.scales, want.scales, f"scales {tag}")


def test_per_token_bf16_amax_is_fp32(cu):
    """Seed 000: a BF16 accumulator would underestimate the amax and move a round_sf scale."""
    x = torch.full((4, 7168), 1.0, dtype=torch.bfloat16, device=DEV)
    x[:, 5] = 65024.0 * 2.0 ** -3 * (1 + 2.0 ** -7)  # just above a power of two
    got = cu.per_token_cast(x, "e5m6", round_sf=True, scale_format="ue8m0")
    want = ref_per_token.per_token_cast(x, "e5m6", round_sf=True, scale_format="ue8m0")
    assert_same(got.scales, want.scales, "ue8m0 scales")
    assert_same(got.data, want.data, "data")


# ---- memset-free amax (the per-stream workspace, ops/workspace.py) ----------------------------------

def _ws_words():
    from fp_recipes.ops import workspace

    key = (torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream)
    return workspace.AMAX_WS[key].cpu()


def test_fp8_casts_memset_free_back_to_back(cu):
    """Every FP8 cast on one stream reduces its amax in the stream's workspace with no memset: back-to-back
    casts of every kind (a leftover maximum would leak into the next one) give the reference's bytes, and
    the workspace ends zeroed."""
    assert cu._amax_ws(torch.device("cuda"), torch.cuda.current_stream().cuda_stream) != 0
    cases = [make_input(s, dt, k, seed=i) for i, (s, dt, k) in enumerate([
        ((257, 1000), torch.bfloat16, "huge"), ((1, 1), torch.float32, "normal"), ((65, 63), torch.float16, "nan"),
        ((128, 4096), torch.bfloat16, "zeros"), ((16500, 24), torch.float32, "normal"),
        ((4096, 4096), torch.bfloat16, "normal"), ((7, 129), torch.bfloat16, "nan")])]
    cases.append(torch.zeros((0, 16), device=DEV, dtype=torch.bfloat16))
    scale = torch.tensor(0.37, device=DEV)
    for rep in range(2):
        for x in cases:
            tag = f"{tuple(x.shape)} {x.dtype} rep {rep}"
            for rw, cw in ((True, False), (True, True), (False, True)):
                got = cu.fp8_current_scaling_quantize(x, "e4m3", rowwise=rw, columnwise=cw)
                want = ref_fp8.fp8_current_scaling_quantize(x, "e4m3", rowwise=rw, columnwise=cw)
                for f in ("data", "data_t", "scale_inv", "amax", "scale"):
                    assert_same(getattr(got, f), getattr(want, f), f"current {f} rw={rw} cw={cw} {tag}")
                got = cu.fp8_quantize(x, scale, "e5m2", rowwise=rw, columnwise=cw)
                want = ref_fp8.fp8_quantize(x, scale, "e5m2", rowwise=rw, columnwise=cw)
                for f in ("data", "data_t", "scale_inv", "amax"):
                    assert_same(getattr(got, f), getattr(want, f), f"delayed {f} rw={rw} cw={cw} {tag}")
            hist = torch.full((), 0.5, device=DEV)
            rec = cu.fp8_quantize_recording(x, scale, "e4m3", True, True, hist)
            assert_same(rec.amax, ref_fp8.fp8_amax(x), f"recording amax {tag}")
            assert_same(hist, torch.maximum(torch.tensor(0.5, device=DEV), ref_fp8.fp8_amax(x)), f"history {tag}")
            if x.dtype != torch.float32 and x.numel():
                q, db = cu.fp8_current_scaling_quantize_dbias(x, "e4m3", False, 0.0, True, True, x.dtype)
                assert_same(q.amax, ref_fp8.fp8_amax(x), f"current dbias amax {tag}")
                q, db = cu.fp8_quantize_dbias(x, scale, "e4m3", True, True, None, x.dtype)
                assert_same(q.amax, ref_fp8.fp8_amax(x), f"delayed dbias amax {tag}")
    torch.cuda.synchronize()
    assert torch.equal(_ws_words(), torch.zeros(4, dtype=torch.int32)), "workspace not re-zeroed"


@pytest.mark.parametrize("use_ws", [True, False], ids=["workspace", "memset"])
def test_fp8_cast_writes_amax_over_garbage(cu, use_ws):
    """With the workspace nothing zeroes current scaling's amax output before the kernel: its last block must
    write the value, whatever the buffer held; without it (ws 0, as under a CUDA-graph capture) the memset
    does. The delayed cast (no workspace) always memsets."""
    ext = cu._ext()
    stream = torch.cuda.current_stream().cuda_stream
    ws = cu._amax_ws(torch.device("cuda"), stream) if use_ws else 0
    for shape, kind in (((513, 1000), "normal"), ((64, 64), "nan"), ((3, 5), "zeros")):
        x = make_input(shape, torch.bfloat16, kind, seed=7)
        m, n = shape
        want = ref_fp8.fp8_amax(x)
        for cw in (False, True):
            out = torch.empty((m, n), dtype=torch.uint8, device=DEV)
            out_t = torch.empty((n, m), dtype=torch.uint8, device=DEV)
            scale, scale_inv = torch.empty((), device=DEV), torch.empty((), device=DEV)
            amax = torch.full((), 1e30, device=DEV)
            ext.fp8_current_scaling_quantize(x.data_ptr(), cu.DTYPE_CODE[x.dtype], m, n,
                                             cu.DTYPE_CODE[torch.float8_e4m3fn], False, 0.0, out.data_ptr(),
                                             out_t.data_ptr() if cw else 0, scale.data_ptr(), scale_inv.data_ptr(),
                                             amax.data_ptr(), stream, ws)
            assert_same(amax, want, f"current amax {shape} {kind} cw={cw}")
            amax.fill_(-3.0)
            one = torch.ones((), device=DEV)
            ext.fp8_quantize(x.data_ptr(), cu.DTYPE_CODE[x.dtype], m, n, one.data_ptr(),
                             cu.DTYPE_CODE[torch.float8_e4m3fn], out.data_ptr(), out_t.data_ptr() if cw else 0,
                             scale_inv.data_ptr(), amax.data_ptr(), stream)
            assert_same(amax, want, f"delayed amax {shape} {kind} cw={cw}")
    torch.cuda.synchronize()
    if use_ws:
        assert torch.equal(_ws_words(), torch.zeros(4, dtype=torch.int32)), "workspace not re-zeroed"


@pytest.mark.parametrize("shape,kind", [((8192, 8192), "spike"), ((4160, 4096), "nan"), ((64, 131072), "spike"),
                                        ((1, 1 << 20), "spike"), ((4097, 63), "spike")])
def test_casts_amax_over_many_blocks(cu, shape, kind):
    """The amax over many blocks (8192^2 with both copies: 16384 tiles, one block each), one element holding the
    maximum (or a NaN) at a random place, repeated on one stream: the delayed casts (atomics into the memset
    amax, the history merged per block) give the reference's amax and history, current scaling (the amax pass
    through the stream's workspace, then the cast) the reference's bytes; the workspace ends zeroed."""
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) * 0.01).to(torch.bfloat16).to(DEV)
    scale = torch.tensor(3.0, device=DEV)
    for trial in range(3):
        flat = x.view(-1)
        flat.mul_(0.5)
        i = int(torch.randint(flat.numel(), (1,), generator=gen))
        flat[i] = float("nan") if kind == "nan" else 7.5 + trial
        want = ref_fp8.fp8_amax(x)
        for rw, cw in ((True, False), (True, True), (False, True)):
            hist = torch.zeros((), device=DEV)
            got = cu.fp8_quantize_recording(x, scale, "e4m3", rw, cw, hist)
            assert_same(got.amax, want, f"amax {shape} trial {trial} rw={rw} cw={cw}")
            assert_same(hist, want, f"history {shape} trial {trial} rw={rw} cw={cw}")
            got = cu.fp8_current_scaling_quantize(x, "e5m2", rowwise=rw, columnwise=cw)
            ref = ref_fp8.fp8_current_scaling_quantize(x, "e5m2", rowwise=rw, columnwise=cw)
            for f in ("data", "data_t", "scale_inv", "amax", "scale"):
                assert_same(getattr(got, f), getattr(ref, f), f"current {f} {shape} trial {trial} rw={rw} cw={cw}")
    torch.cuda.synchronize()
    assert torch.equal(_ws_words(), torch.zeros(4, dtype=torch.int32)), "workspace not re-zeroed"


def test_current_casts_on_two_streams(cu):
    """Two streams casting at once, each with its own amax workspace (ops/workspace.py): every result is the
    reference's (a shared workspace would mix the streams' maxima or re-zero one mid-reduction)."""
    xs = [make_input((2048, 4096), torch.bfloat16, "normal", seed=s) * (s + 1) for s in range(4)]
    wants = [ref_fp8.fp8_current_scaling_quantize(x, "e4m3", columnwise=True) for x in xs]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    outs = [[], []]
    for rep in range(5):
        for i, st in enumerate(streams):
            with torch.cuda.stream(st):
                outs[i].append(cu.fp8_current_scaling_quantize(xs[(rep + 2 * i) % 4], "e4m3", columnwise=True))
    torch.cuda.synchronize()
    for i in range(2):
        for rep, got in enumerate(outs[i]):
            want = wants[(rep + 2 * i) % 4]
            for f in ("data", "data_t", "scale_inv", "amax", "scale"):
                assert_same(getattr(got, f), getattr(want, f), f"stream {i} rep {rep} {f}")


def test_fp8_casts_inside_cuda_graph(cu):
    """Casts captured on a stream without a workspace (the memset path) and on one with a workspace made
    before the capture both replay to the reference's bytes as the input changes."""
    x = make_input((256, 512), torch.bfloat16, "normal", seed=1)
    scale = torch.tensor(0.5, device=DEV)
    for warm in (False, True):
        side = torch.cuda.Stream()
        if warm:  # the capture stream's workspace exists before the capture
            with torch.cuda.stream(side):
                cu.fp8_current_scaling_quantize(x, "e4m3", columnwise=True)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            c = cu.fp8_current_scaling_quantize(x, "e4m3", columnwise=True)
            d = cu.fp8_quantize(x, scale, "e4m3", columnwise=True)
        for mult in (1.0, 1e-3, 300.0):
            x.copy_(make_input((256, 512), torch.bfloat16, "normal", seed=int(mult * 10)) * mult)
            graph.replay()
            torch.cuda.synchronize()
            wc = ref_fp8.fp8_current_scaling_quantize(x, "e4m3", columnwise=True)
            wd = ref_fp8.fp8_quantize(x, scale, "e4m3", columnwise=True)
            for f in ("data", "data_t", "scale_inv", "amax"):
                assert_same(getattr(c, f), getattr(wc, f), f"graph current {f} x{mult} warm={warm}")
                assert_same(getattr(d, f), getattr(wd, f), f"graph delayed {f} x{mult} warm={warm}")


def _memsets_in(step) -> int:
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if "cudaMemsetAsync" in e.name)


def test_fp8_linear_step_makes_no_amax_memset(cu):
    """A Linear forward + backward under current scaling makes no more memset calls than the same step in
    BF16 (each cast used to zero its amax with one: 3 per step). (Delayed scaling keeps its memsets: its
    amax comes from the store-heavy cast kernel, where the workspace handshake cost more than the memset.)"""
    import fp_recipes

    rec = fp_recipes.Float8CurrentScaling()
    layer = fp_recipes.Linear(256, 512, params_dtype=torch.bfloat16, device=DEV)
    x = torch.randn(128, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)

    def step(enabled):
        def run():
            with fp_recipes.autocast(enabled=enabled, recipe=rec):
                y = layer(x)
            y.backward(torch.ones_like(y))
        return run

    assert _memsets_in(step(True)) <= _memsets_in(step(False))


# ---- the quantizers' planned eager casts (CastPlan) ---------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_planned_casts_are_the_general_casts(cu, dtype):
    """fp8_cast_planned (the quantizers' eager path: outputs' FP32 values as views of one allocation) gives
    the general wrappers' bytes: current and delayed scaling, each copy choice, with the bias gradient, the
    history record, repeated calls on a cached launch, and the decline of a non-contiguous input."""
    for shape, kind in (((1, 16), "normal"), ((65, 64), "huge"), ((257, 1008), "nan"), ((128, 4096), "normal")):
        x = make_input(shape, dtype, kind, seed=3)
        for rw, cw in ((True, False), (True, True), (False, True)):
            tag = f"{shape} {kind} rw={rw} cw={cw}"
            plan = cu.CastPlan("e4m3", rw, cw, True, use_power_2_scales=True, amax_epsilon=1e-12)
            want = cu.fp8_current_scaling_quantize(x, "e4m3", use_power_2_scales=True, amax_epsilon=1e-12,
                                                   rowwise=rw, columnwise=cw)
            for rep in range(2):
                got = cu.fp8_cast_planned(x, plan)
                assert got is not None, tag
                for i, f in enumerate(("data", "data_t", "scale_inv", "amax", "scale")):
                    assert_same(got[i], getattr(want, f), f"current {f} {tag} rep {rep}")
            want_q, want_db = cu.fp8_current_scaling_quantize_dbias(x, "e4m3", True, 1e-12, rw, cw, dtype)
            got = cu.fp8_cast_planned(x, plan, bias_dtype=dtype)
            assert_same(got[5], want_db, f"current db {tag}")
            scale = torch.tensor(0.8125, device=DEV)
            plan = cu.CastPlan("e5m2", rw, cw, False)
            h_want, h_got = torch.full((), 0.25, device=DEV), torch.full((), 0.25, device=DEV)
            want = cu.fp8_quantize_recording(x, scale, "e5m2", rw, cw, h_want)
            got = cu.fp8_cast_planned(x, plan, scale, h_got)
            for i, f in enumerate(("data", "data_t", "scale_inv", "amax")):
                assert_same(got[i], getattr(want, f), f"delayed {f} {tag}")
            assert_same(h_got, h_want, f"delayed history {tag}")
            want_q, want_db = cu.fp8_quantize_dbias(x, scale, "e5m2", rw, cw, h_want, dtype)
            got = cu.fp8_cast_planned(x, plan, scale, h_got, dtype)
            assert_same(got[5], want_db, f"delayed db {tag}")
            assert_same(h_got, h_want, f"delayed history after dbias {tag}")
    xt = make_input((64, 96), dtype, "normal", seed=4).t()
    assert cu.fp8_cast_planned(xt, cu.CastPlan("e4m3", True, True, True)) is None  # the general path copies it


# ---- current scaling from a given amax (the traced cast of compile_visible_amax) -------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_cast_from_amax_is_the_current_scaling_cast(cu, dtype):
    """The cast that takes its amax from the graph gives the bytes of the current-scaling cast (its amax
    computed by torch ops, as a compiled graph computes it), with and without the bias gradient."""
    cases = [make_input(s, dtype, k, seed=j) for j, (s, k) in enumerate(
        [((1, 1), "normal"), ((65, 63), "huge"), ((257, 1000), "nan"), ((128, 4096), "normal"), ((7, 129), "zeros"),
         ((16500, 24), "normal")])] + [torch.zeros((0, 32), dtype=dtype, device=DEV)]
    for x in cases:
        amax = x.abs().amax().float() if x.numel() else torch.zeros((), device=DEV)
        for fmt in ("e4m3", "e5m2"):
            for pow2, eps in ((False, 0.0), (True, 1e-12), (False, 3.0)):
                for rw, cw in ((True, False), (True, True), (False, True)):
                    tag = f"{tuple(x.shape)} {fmt} pow2={pow2} eps={eps} rw={rw} cw={cw}"
                    want = cu.fp8_current_scaling_quantize(x, fmt, use_power_2_scales=pow2, amax_epsilon=eps,
                                                           rowwise=rw, columnwise=cw)
                    data, data_t, scale_inv, scale = cu.fp8_current_cast_from_amax_op(x, amax, fmt, pow2, eps, rw, cw)
                    assert_same(amax, want.amax, f"graph amax {tag}")
                    if rw:
                        assert_same(data, want.data, f"data {tag}")
                    if cw:
                        assert_same(data_t, want.data_t, f"data_t {tag}")
                    assert_same(scale_inv, want.scale_inv, f"scale_inv {tag}")
                    assert_same(scale, want.scale, f"scale {tag}")
            want, want_db = cu.fp8_current_scaling_quantize_dbias(x, fmt, False, 0.0, True, True, dtype)
            out = cu.fp8_current_cast_from_amax_dbias_op(x, amax, fmt, False, 0.0, True, True, dtype)
            assert_same(out[0], want.data, f"dbias data {tuple(x.shape)}")
            assert_same(out[1], want.data_t, f"dbias data_t {tuple(x.shape)}")
            assert_same(out[4], want_db, f"db {tuple(x.shape)}")


# ---- dispatch, compile, errors -------------------------------------------------------------------

def test_dispatch_runs_the_kernel(cu):
    import fp_recipes
    from fp_recipes import ops
    from fp_recipes.ops import backend

    info = fp_recipes.backend_info()
    assert info["backend"] == "cuda"
    for name in ("fp8_quantize", "fp8_current_scaling_quantize", "fp8_dequantize", "fp8_grouped_quantize",
                 "fp8_grouped_amax", "fp8_grouped_dequantize", "per_token_cast", "cast_back", "fp8_amax"):
        assert backend.cuda_impl(name) is getattr(cu, name)
    x = make_input((64, 128), torch.bfloat16, "normal")
    s = torch.tensor(0.5, device=DEV)
    assert_same(ops.fp8_quantize(x, s, "e4m3").data, ref_fp8.fp8_quantize(x, s, "e4m3").data, "dispatch")


def test_torch_compile_fullgraph(cu):
    def f(x, s, offsets, scales):
        q = cu.fp8_quantize(x, s, "e4m3", rowwise=True, columnwise=True)
        c = cu.fp8_current_scaling_quantize(x, "e5m2", use_power_2_scales=True)
        d = cu.fp8_dequantize(q.data, q.scale_inv, torch.bfloat16)
        g = cu.fp8_grouped_quantize(x, offsets, scales, "e4m3")
        p = cu.per_token_cast(x, "e5m6", round_sf=True, scale_format="ue8m0", block_size=128)
        b = cu.cast_back(p.data, p.scales, "e5m6", out_dtype=torch.float32, scale_format="ue8m0", block_size=128)
        return q.data_t, c.scale, d, g.amax, b, p.data

    x = make_input((256, 1024), torch.bfloat16, "normal")
    s = torch.tensor(0.25, device=DEV)
    offsets = torch.tensor([0, 1024 * 100, 1024 * 100, 1024 * 256], dtype=torch.int64, device=DEV)
    scales = torch.tensor([1.0, 2.0, 0.5], device=DEV)
    eager = f(x, s, offsets, scales)
    compiled = torch.compile(f, fullgraph=True)(x, s, offsets, scales)
    for a, b in zip(eager, compiled):
        assert_same(b, a, "compiled")


def test_torch_compile_through_dispatch(cu):
    from fp_recipes import ops

    def f(x, s):
        q = ops.fp8_quantize(x, s, "e4m3", columnwise=True)
        return ops.fp8_dequantize(q.data, q.scale_inv, torch.float32), q.amax

    x = make_input((128, 512), torch.float16, "normal")
    s = torch.tensor(2.0, device=DEV)
    eager = f(x, s)
    compiled = torch.compile(f, fullgraph=True)(x, s)
    for a, b in zip(eager, compiled):
        assert_same(b, a, "compiled via dispatch")


def test_errors_are_clear(cu):
    x = make_input((8, 16), torch.bfloat16, "normal")
    s = torch.tensor(1.0, device=DEV)
    with pytest.raises(TypeError, match="dtype"):
        cu.fp8_quantize(x.to(torch.int32), s, "e4m3")
    with pytest.raises(ValueError, match="fmt"):
        cu.fp8_quantize(x, s, "e3m4")
    with pytest.raises(TypeError, match="float32"):
        cu.fp8_quantize(x, s.double(), "e4m3")
    with pytest.raises(ValueError, match="2-D"):
        cu.fp8_quantize(x.reshape(-1), s, "e4m3")
    with pytest.raises(ValueError, match="same device|is on"):
        cu.fp8_quantize(x, s.cpu(), "e4m3")
    # The raw custom op: CPU tensors and non-contiguous tensors are refused with a message.
    with pytest.raises(ValueError, match="CUDA kernel"):
        torch.ops.fp_recipes.fp8_quantize(x.cpu(), s.cpu(), "e4m3", True, False)
    with pytest.raises(ValueError, match="contiguous"):
        torch.ops.fp_recipes.fp8_quantize(x.t(), s, "e4m3", True, False)
    # Grouped: bad offsets.
    buf = make_input((100,), torch.float32, "normal")
    scales = torch.ones(2, device=DEV)
    for bad, msg in (([0, 60, 50], "non-decreasing"), ([0, 50, 99], "offsets\\[-1\\]"), ([1, 50, 100], "offsets\\[0\\]")):
        with pytest.raises(ValueError, match=msg):
            cu.fp8_grouped_quantize(buf, torch.tensor(bad, device=DEV), scales, "e4m3")
    good = torch.tensor([0, 50, 100], device=DEV)
    cu.fp8_grouped_quantize(buf, good, scales, "e4m3")  # validated once, then cached for this tensor version
    good[1] = 101  # an in-place change must be seen
    with pytest.raises(ValueError, match="non-decreasing"):
        cu.fp8_grouped_quantize(buf, good, scales, "e4m3")
    with pytest.raises(TypeError, match="int64"):
        cu.fp8_grouped_quantize(buf, torch.tensor([0, 50, 100], device=DEV, dtype=torch.int32), scales, "e4m3")
    with pytest.raises(ValueError, match="shape"):
        cu.fp8_grouped_quantize(buf, torch.tensor([0, 50, 100], device=DEV), torch.ones(3, device=DEV), "e4m3")
    # Per token.
    with pytest.raises(ValueError, match="multiple of 8"):
        cu.per_token_cast(make_input((2, 12), torch.float32, "normal"), "e5m6")
    with pytest.raises(ValueError, match="round_sf"):
        cu.per_token_cast(x, "e4m3", scale_format="ue8m0")
    with pytest.raises(ValueError, match="divide"):
        cu.per_token_cast(x, "e4m3", block_size=5)
    # The extension's own checks (bypassing Python validation) raise too, never crash.
    from fp_recipes.ops import backend

    ext = backend.extension()
    with pytest.raises(ValueError, match="float8"):
        ext.fp8_quantize(x.data_ptr(), 2, 8, 16, s.data_ptr(), 0, 0, 0, s.data_ptr(), s.data_ptr(), 0)
    with pytest.raises(ValueError, match="block_size"):
        ext.per_token_cast(x.data_ptr(), 2, 8, 16, 0, False, False, 3, 0, 0, 0)
