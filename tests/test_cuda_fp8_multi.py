"""The multi-tensor FP8 casts (G separate tensors, one launch) against the single-tensor kernel called per
member and against the reference twin, byte for byte: data, data_t, scale_inv, amax, scale of every member.
Needs a GPU (skipped otherwise); the CPU-side checks are in tests/test_cuda_fp8_multi_cpu.py.
"""

from __future__ import annotations

import pytest
import torch

from fp_recipes.ops import ref_fp8
from test_cuda_fp8_kernels import assert_same, make_input

pytestmark = pytest.mark.cuda

DEV = "cuda"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
COPIES = ((True, False), (False, True), (True, True))
CHUNK = 64  # kMultiChunk in csrc/fp8_multi_cast.cu: G = 65 and G = 150 span several launches


@pytest.fixture(scope="module")
def cu():
    from fp_recipes.ops import backend

    assert backend.extension() is not None, backend.extension_error()
    from fp_recipes.ops import cuda_fp8

    return cuda_fp8


# ---- inputs --------------------------------------------------------------------------------------

_ROW_PATTERN = (2048, 0, 1, 37, 64, 3, 130, 16, 2049, 0, 65, 5)


def member_rows(g: int, big: bool) -> list[int]:
    """Rows per member: 0, 1, odd, multiples of 16 and not, >= 2048 (only a few when G is large)."""
    rows = []
    for i in range(g):
        r = _ROW_PATTERN[i % len(_ROW_PATTERN)]
        if r >= 2048 and (not big or i >= len(_ROW_PATTERN)):
            r = 96 + i % 7
        rows.append(r)
    return rows


def make_members(rows, cols, dtype, seed, layout: str, specials: bool = True):
    """layout 'split': row slices of one contiguous tensor (the GroupedLinear case); 'separate': one tensor
    per member, every other one starting 1 element past a 16-byte boundary (misaligned vector loads)."""
    total = sum(rows)
    if layout == "split":
        xs = list(make_input((total, cols), dtype, "normal", seed=seed).split(rows))
    else:
        xs = []
        for i, r in enumerate(rows):
            base = make_input((r * cols + 1,), dtype, "normal", seed=seed + i)
            xs.append(base[1:].view(r, cols) if i % 2 else base[:-1].view(r, cols))
    if specials:
        nonempty = [i for i, x in enumerate(xs) if x.numel() > 0]
        if len(nonempty) >= 4:
            # One member with NaN and Inf, one with huge values, one all zeros; the others must not see them.
            a, b, c = nonempty[1], nonempty[2], nonempty[3]
            xs[a].view(-1)[xs[a].numel() // 2] = float("nan")
            xs[a].view(-1)[0] = float("inf")
            xs[b].view(-1)[::5] = torch.finfo(dtype).max
            xs[b].view(-1)[1::7] = -torch.finfo(dtype).max
            xs[c].zero_()
    return xs


def member_scales(g: int, seed: int):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    vals = torch.exp2(torch.randint(-10, 10, (g,), generator=gen, device=DEV).float()) * 1.37
    # Each member's scale in its own tensor, 0-dim or 1-element.
    return [vals[i].clone() if i % 3 else vals[i].clone().reshape(1) for i in range(g)]


# ---- comparisons ---------------------------------------------------------------------------------

def check_against_single(got, singles, rowwise, columnwise, tag):
    """Member g of a multi result equals the single-tensor kernel's result on member g alone."""
    g = len(singles)
    assert len(got.data) == g and len(got.data_t) == g
    assert got.scale_inv.shape == (g,) and got.amax.shape == (g,) and got.scale.shape == (g,)
    for i, s in enumerate(singles):
        t = f"{tag} member {i}"
        assert_same(got.data[i], s.data if rowwise else None, f"data {t}")
        assert_same(got.data_t[i], s.data_t if columnwise else None, f"data_t {t}")
        assert_same(got.scale_inv[i], s.scale_inv.reshape(()), f"scale_inv {t}")
        assert_same(got.amax[i], s.amax.reshape(()), f"amax {t}")
        assert_same(got.scale[i], s.scale.reshape(()), f"scale {t}")


def check_against_twin(got, want, tag):
    for i in range(len(want.data)):
        assert_same(got.data[i], want.data[i], f"data {tag} member {i}")
        assert_same(got.data_t[i], want.data_t[i], f"data_t {tag} member {i}")
    for field in ("scale_inv", "amax", "scale"):
        assert_same(getattr(got, field), getattr(want, field), f"{field} {tag}")


def check_layout(res, rows, cols):
    """Rowwise copies: views of one (sum(rows), cols) buffer; transposed: the (cols, rows_g) blocks of one
    flat buffer, one after another."""
    offs = [0]
    for r in rows:
        offs.append(offs[-1] + r)
    for copies in (res.data, res.data_t):
        if copies[0] is None:
            continue
        base = copies[0].data_ptr()
        storage = copies[0].untyped_storage().data_ptr()
        for i, v in enumerate(copies):
            assert v.is_contiguous()
            assert v.untyped_storage().data_ptr() == storage, f"member {i} is not in the shared buffer"
            if v.numel():
                assert v.data_ptr() == base + offs[i] * cols, f"member {i} at the wrong offset"


# ---- delayed scaling -----------------------------------------------------------------------------

@pytest.mark.parametrize("num_members", [1, 3, 8, 65, 150])
@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_quantize_matches_single_kernel_and_twin(cu, num_members, dtype):
    big = num_members <= 8
    for cols in ((7168, 33, 24, 1) if big else (136, 33)):
        rows = member_rows(num_members, big)
        for layout in ("split", "separate"):
            xs = make_members(rows, cols, dtype, seed=num_members + cols, layout=layout)
            scales = member_scales(num_members, seed=cols)
            for fmt in ("e4m3", "e5m2"):
                for rowwise, columnwise in COPIES:
                    tag = f"G={num_members} cols={cols} {layout} {fmt} rw={rowwise} cw={columnwise}"
                    got = cu.fp8_multi_quantize(xs, scales, fmt, rowwise=rowwise, columnwise=columnwise)
                    singles = [cu.fp8_quantize(x, s.reshape(()), fmt, rowwise=rowwise, columnwise=columnwise)
                               for x, s in zip(xs, scales)]
                    check_against_single(got, singles, rowwise, columnwise, tag)
                    want = ref_fp8.fp8_multi_quantize(xs, scales, fmt, rowwise=rowwise, columnwise=columnwise)
                    check_against_twin(got, want, tag)
                    check_layout(got, rows, cols)
            del xs


# ---- current scaling -----------------------------------------------------------------------------

@pytest.mark.parametrize("num_members", [1, 3, 8, 65, 150])
@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_current_scaling_matches_single_kernel_and_twin(cu, num_members, dtype):
    big = num_members <= 8
    for cols in ((7168, 33, 24) if big else (136, 33)):
        rows = member_rows(num_members, big)
        xs = make_members(rows, cols, dtype, seed=3 * num_members + cols, layout="split")
        if dtype == torch.float32:
            # A denormal amax in the last member: fmt_max / amax overflows -> FLT_MAX (pow2: 2^127).
            xs[-1].fill_(1e-40)
        cases = ((False, 0.0), (True, 0.0), (False, 1e-12), (True, 3.0)) if big else ((False, 0.0), (True, 3.0))
        for fmt in ("e4m3", "e5m2"):
            for pow2, eps in cases:
                for rowwise, columnwise in COPIES:
                    tag = f"G={num_members} cols={cols} {fmt} pow2={pow2} eps={eps} rw={rowwise} cw={columnwise}"
                    kw = dict(use_power_2_scales=pow2, amax_epsilon=eps, rowwise=rowwise, columnwise=columnwise)
                    got = cu.fp8_multi_current_scaling_quantize(xs, fmt, **kw)
                    singles = [cu.fp8_current_scaling_quantize(x, fmt, **kw) for x in xs]
                    check_against_single(got, singles, rowwise, columnwise, tag)
                    check_against_twin(got, ref_fp8.fp8_multi_current_scaling_quantize(xs, fmt, **kw), tag)
        del xs


# ---- specials, edge cases, entry points ----------------------------------------------------------

def test_nan_member_leaves_the_others_alone(cu):
    rows = [300, 257, 64, 1]
    xs = [make_input((r, 520), torch.bfloat16, "normal", seed=i) for i, r in enumerate(rows)]
    xs[1][100, 7] = float("nan")
    xs[2][3, 3] = float("inf")
    half = torch.tensor(0.5, device=DEV)
    runs = {
        "current": (cu.fp8_multi_current_scaling_quantize(xs, "e4m3", columnwise=True),
                    lambda x: cu.fp8_current_scaling_quantize(x, "e4m3", columnwise=True)),
        "delayed": (cu.fp8_multi_quantize(xs, [half] * 4, "e4m3", columnwise=True),
                    lambda x: cu.fp8_quantize(x, half, "e4m3", columnwise=True)),
    }
    for mode, (res, single_fn) in runs.items():
        amax = res.amax.cpu()
        assert torch.isnan(amax[1]) and torch.isinf(amax[2]), mode
        assert torch.isfinite(amax[0]) and torch.isfinite(amax[3]), mode
        for i in (0, 3):
            single = single_fn(xs[i])
            assert_same(res.data[i], single.data, f"{mode} member {i}")
            assert_same(res.data_t[i], single.data_t, f"{mode} member {i} t")
            assert_same(res.scale[i], single.scale.reshape(()), f"{mode} member {i} scale")
            assert_same(res.amax[i], single.amax, f"{mode} member {i} amax")


def test_empty_total_and_zero_width(cu):
    for rows, cols in (([0, 0, 0], 64), ([3, 0, 5], 0), ([0], 7)):
        xs = [torch.empty((r, cols), dtype=torch.bfloat16, device=DEV) for r in rows]
        scales = [torch.tensor(2.0 ** i, device=DEV) for i in range(len(rows))]
        for rowwise, columnwise in COPIES:
            got = cu.fp8_multi_quantize(xs, scales, "e5m2", rowwise=rowwise, columnwise=columnwise)
            check_against_twin(got, ref_fp8.fp8_multi_quantize(xs, scales, "e5m2", rowwise=rowwise,
                                                               columnwise=columnwise), f"{rows}x{cols}")
            for eps in (0.0, 0.25):
                kw = dict(amax_epsilon=eps, rowwise=rowwise, columnwise=columnwise)
                got = cu.fp8_multi_current_scaling_quantize(xs, "e4m3", **kw)
                check_against_twin(got, ref_fp8.fp8_multi_current_scaling_quantize(xs, "e4m3", **kw),
                                   f"current {rows}x{cols} eps={eps}")


def test_eager_entry_points_equal_the_dispatched_ops(cu):
    from fp_recipes import ops

    rows = [2048, 0, 511, 1, 64, 2047, 96, 3]
    x = make_input((sum(rows), 1000), torch.bfloat16, "normal", seed=4)
    xs = list(x.split(rows))
    scales = member_scales(len(rows), seed=2)
    for rowwise, columnwise in COPIES:
        a = cu._fp8_multi_quantize_impl(xs, scales, "e4m3", rowwise, columnwise)
        b = ops.fp8_multi_quantize(xs, scales, "e4m3", rowwise=rowwise, columnwise=columnwise)
        check_against_twin(a, b, f"delayed rw={rowwise} cw={columnwise}")
        a = cu._fp8_multi_current_impl(xs, "e5m2", True, 1e-6, rowwise, columnwise)
        b = ops.fp8_multi_current_scaling_quantize(xs, "e5m2", use_power_2_scales=True, amax_epsilon=1e-6,
                                                   rowwise=rowwise, columnwise=columnwise)
        check_against_twin(a, b, f"current rw={rowwise} cw={columnwise}")
    assert backend_impl("fp8_multi_quantize") is cu.fp8_multi_quantize
    assert backend_impl("fp8_multi_current_scaling_quantize") is cu.fp8_multi_current_scaling_quantize


def backend_impl(name):
    from fp_recipes.ops import backend

    return backend.cuda_impl(name)


def test_noncontiguous_member_is_copied(cu):
    base = make_input((64, 200), torch.float16, "normal", seed=8)
    xs = [base[:, :100], base[:10, 100:].contiguous()]  # the first is a strided view
    scales = [torch.tensor(1.5, device=DEV)] * 2
    with pytest.warns(RuntimeWarning, match="not contiguous"):
        got = cu.fp8_multi_quantize(xs, scales, "e4m3", columnwise=True)
    check_against_twin(got, ref_fp8.fp8_multi_quantize(xs, scales, "e4m3", columnwise=True), "noncontig")


def test_repeatable_many_members(cu):
    """Same inputs, same bytes, run after run (a race would move an amax)."""
    rows = [97 + (i % 5) * 64 for i in range(3 * CHUNK + 7)]
    x = make_input((sum(rows), 264), torch.float32, "normal", seed=1)
    xs = list(x.split(rows))
    first = cu.fp8_multi_current_scaling_quantize(xs, "e4m3", columnwise=True)
    want = ref_fp8.fp8_multi_current_scaling_quantize(xs, "e4m3", columnwise=True)
    check_against_twin(first, want, "first")
    for _ in range(10):
        check_against_twin(cu.fp8_multi_current_scaling_quantize(xs, "e4m3", columnwise=True), want, "again")


def test_torch_compile_fullgraph(cu):
    def f(a, b, s0, s1):
        q = cu.fp8_multi_quantize([a, b], [s0, s1], "e4m3", rowwise=True, columnwise=True)
        c = cu.fp8_multi_current_scaling_quantize([a, b], "e5m2", use_power_2_scales=True)
        return q.data[0], q.data_t[1], q.amax, q.scale_inv, c.data[1], c.scale

    a = make_input((256, 1024), torch.bfloat16, "normal", seed=1)
    b = make_input((100, 1024), torch.bfloat16, "normal", seed=2)
    s0, s1 = torch.tensor(0.25, device=DEV), torch.tensor([4.0], device=DEV)
    eager = f(a, b, s0, s1)
    compiled = torch.compile(f, fullgraph=True)(a, b, s0, s1)
    for x, y in zip(eager, compiled):
        assert_same(y, x, "compiled")


def test_errors_are_clear(cu):
    a = make_input((8, 16), torch.bfloat16, "normal")
    s = torch.tensor(1.0, device=DEV)
    with pytest.raises(ValueError, match="same device|is on"):
        cu.fp8_multi_quantize([a], [s.cpu()], "e4m3")
    with pytest.raises(ValueError, match="same number of columns"):
        cu.fp8_multi_quantize([a, a[:, :8]], [s, s], "e4m3")
    with pytest.raises(ValueError, match="CUDA kernel"):
        torch.ops.fp_recipes.fp8_multi_quantize([a.cpu()], [s.cpu()], "e4m3", True, False)
