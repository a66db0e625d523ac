"""The grouped FP8 layer's transposed copies with their rows zero-padded to 16 (issue 14: odd experts).

The multi-cast of ``fp8_multi_cast_rows`` / ``fp8_multi_cast_buffers`` writes member g's transposed copy as
(cols, ld_t[g]), ld_t[g] = rows rounded up to 16, zeros past the rows (``cuda_fp8.padded_t_layout``), so the
wgrad GEMM of every expert (K = its rows) runs on the one cuBLASLt list with K = ld_t[g], never the
padding copy + ``_scaled_mm`` fallback. CPU: the layout, the launch arguments, the GEMM lists (with the
stub kernels of benchmarks/host_grouped_cpu.py). GPU (``@pytest.mark.cuda``): the bytes against the
single-tensor kernel and the reference twin, the padding zeros, and the layer against a loop of Linear.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import accumulate

import pytest
import torch

import fp_recipes
from fp_recipes import DelayedScaling, Float8CurrentScaling, GroupedLinear, Linear
from fp_recipes.gemm import grouped as GF
from fp_recipes.ops import cuda_fp8 as cu
from fp_recipes.ops import ref_fp8
from fp_recipes.quantizers.grouped import Fp8MultiCast

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = ([17, 33, 5] * 23, [1], [0, 0], [64, 0, 31, 128], [3, 0, 5, 7])
RECIPES = {"delayed": lambda: DelayedScaling(amax_history_len=4), "current": Float8CurrentScaling}
#: the same with every GEMM in cuBLASLt's fast accumulation (the grouped dgrad/wgrad lists then take the flag too)
FAST_ALL = {"delayed_fast_all": lambda: DelayedScaling(amax_history_len=4, fast_accumulation="all"),
            "current_fast_all": lambda: Float8CurrentScaling(fast_accumulation="all")}


# ---- CPU: the layout -----------------------------------------------------------------------------

@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("cols", [1, 24, 96])
def test_padded_layout(rows, cols):
    ld_t, t_starts = cu.padded_t_layout(rows, cols)
    assert len(ld_t) == len(rows) and len(t_starts) == len(rows) + 1 and t_starts[0] == 0
    for g, (r, ld) in enumerate(zip(rows, ld_t)):
        assert ld % 16 == 0 and r <= ld < r + 16
        assert t_starts[g + 1] - t_starts[g] == cols * ld
        assert t_starts[g] % 16 == 0  # every member 16-byte aligned (FP8: one byte per element)
    assert cu.padded_t_layout([0, 0], cols) == ([0, 0], [0, 0, 0])


class _RecordingExt:
    def __init__(self):
        self.calls = []

    def fp8_multi_quantize(self, *args):
        self.calls.append(("delayed",) + args)

    def fp8_multi_current_scaling_quantize(self, *args):
        self.calls.append(("current",) + args)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("delayed", [True, False])
@pytest.mark.parametrize("by_rows", [True, False])
def test_grouped_casts_launch_with_the_padded_layout(rows, delayed, by_rows, monkeypatch):
    """fp8_multi_cast_rows / _buffers allocate the padded transposed buffer and hand the kernel each
    member's address in it and its row stride; the rowwise copies stay dense. The public multi-tensor
    op (per-member views) keeps the dense layout (no row strides passed)."""
    from fp_recipes.ops import backend

    ext = _RecordingExt()
    monkeypatch.setattr(cu, "_ext", lambda: ext)
    monkeypatch.setattr(backend, "current_stream", lambda device: 5)
    cols = 24
    x = torch.randn(sum(rows), cols, dtype=torch.bfloat16)
    scales = [torch.tensor(0.5 * (i + 1)) for i in range(len(rows))] if delayed else None
    if by_rows:
        data, data_t, f32, starts, layout = cu.fp8_multi_cast_rows(x, rows, "e4m3", scales=scales)
    else:
        data, data_t, f32, starts, layout = cu.fp8_multi_cast_buffers(list(x.split(rows)), "e4m3", scales=scales)
    (call,) = ext.calls
    ld_t, t_starts = layout
    assert layout == cu.padded_t_layout(rows, cols) and starts == list(accumulate(rows, initial=0))
    assert data.shape == (sum(rows), cols) and data_t.numel() == t_starts[-1]
    out, out_t = call[5], call[6]
    plain = 13 if delayed else 14  # the launcher's arguments without records / row strides
    if sum(rows) == 0:
        assert out == out_t == [] and len(call) == 1 + plain  # nothing written: no row strides either
        return
    assert len(call) == 1 + 15 and call[-1] == ld_t
    assert out == [data.data_ptr() + s * cols for s in starts[:-1]]
    assert out_t == [data_t.data_ptr() + s for s in t_starts[:-1]]
    ext.calls.clear()
    if delayed:
        cu._fp8_multi_quantize_impl(list(x.split(rows)), scales, "e4m3", True, True)
        assert len(ext.calls[0]) == 1 + 13  # no ld_t: the dense (cols, rows_g) views of FP8MultiQuantized


def _casts(rows, cols, seed):
    """A padded Fp8MultiCast on CPU as the CUDA lane lays it out, with small-integer FP8 values (exact
    FP32 sums in any order) in the transposed copies, zeros in their padding, and scale_inv 0.5 / 0.25."""
    ld_t, t_starts = cu.padded_t_layout(rows, cols)
    starts = list(accumulate(rows, initial=0))
    gen = torch.Generator().manual_seed(seed)
    vals = torch.randint(-4, 5, (sum(rows), cols), generator=gen).float()
    data = vals.to(torch.float8_e4m3fn)
    data_t = torch.zeros(t_starts[-1], dtype=torch.uint8)
    for g, r in enumerate(rows):
        data_t[t_starts[g]:t_starts[g + 1]].view(cols, ld_t[g])[:, :r] = data[starts[g]:starts[g + 1]].view(
            torch.uint8).t()
    data_t = data_t.view(torch.float8_e4m3fn)
    f32 = torch.zeros(6 * len(rows))
    f32[0:4 * len(rows):4] = 0.5 if seed % 2 else 0.25
    return Fp8MultiCast(data, data_t, f32, data.dtype, rows, cols, starts, None, (ld_t, t_starts)), vals


def test_multicast_views_of_the_padded_layout():
    """data_t(g): the (cols, rows_g) column slice of the padded block (what callers read); data_t_padded(g):
    the whole (cols, ld_t) block; data_t_ptrs: the blocks' addresses; the layout survives the copies
    made for autograd."""
    rows, cols = [5, 0, 16, 3, 1], 32
    casts, vals = _casts(rows, cols, 1)
    ld_t, t_starts = casts.t_layout
    gs = [0, 2, 3, 4]
    assert casts.data_t_ptrs(gs) == [casts.data_t_buf.data_ptr() + t_starts[g] for g in gs]
    for g in range(len(rows)):
        assert casts.data_t(g).shape == (cols, rows[g]) and casts.data_t_padded(g).shape == (cols, ld_t[g])
        assert casts.data_t(g).data_ptr() == casts.data_t_padded(g).data_ptr()
        assert torch.equal(casts.data_t(g).float(), vals[casts.starts[g]:casts.starts[g + 1]].t())
        assert not casts.data_t_padded(g)[:, rows[g]:].float().any()
    trimmed = casts.columnwise_only()
    tensors, shell = trimmed.split_saved()
    back = shell.with_saved_tensors(tensors)
    for c in (trimmed, shell, back):
        assert c.t_layout is casts.t_layout
    assert back.data_t_ptrs(gs) == casts.data_t_ptrs(gs)


def _lists_recorder(monkeypatch, skip_all=False):
    """cuBLASLt's GEMM list replaced by a recorder (it runs nothing; skip_all: it skips every GEMM), and
    the per-GEMM fallback by one that records its operands' shapes and computes the product."""
    lists, fallbacks = [], []

    def fp8_gemms_ptr(a, sa, b, sb, out, ms, ns, ks, *args, **kwargs):
        lists.append(dict(a=list(a), b=list(b), ms=list(ms), ns=list(ns), ks=list(ks)))
        return list(range(len(a))) if skip_all else []

    orig = GF._gemm_into

    def gemm_into(out, a, sa, b, sb, out_dtype, native, **kwargs):
        fallbacks.append((tuple(a.shape), tuple(b.shape)))
        return orig(out, a, sa, b, sb, out_dtype, False, **kwargs)  # the CPU product

    monkeypatch.setattr(GF, "_native", lambda device, a, b: True)
    monkeypatch.setattr(GF.cublaslt, "available", lambda: True)
    monkeypatch.setattr(GF.cublaslt, "fp8_gemms_ptr", fp8_gemms_ptr)
    monkeypatch.setattr(GF, "_gemm_into", gemm_into)
    return lists, fallbacks


def test_wgrad_list_takes_every_expert_with_padded_k(monkeypatch):
    """dW_g = dy_g^T x_g on two padded casts: ONE list call with every expert, K = the padded rows on both
    sides, A and B at their padded blocks; nothing falls back, odd experts included."""
    rows = [17, 0, 33, 5, 1]
    dy, _ = _casts(rows, 48, 1)
    x, _ = _casts(rows, 64, 2)
    lists, fallbacks = _lists_recorder(monkeypatch)
    live = [g for g, r in enumerate(rows) if r]
    GF.grouped_gemm(dy, x, transpose_a=True, transpose_b=True, out_dtype=torch.float32, concat=False, groups=live)
    assert fallbacks == [] and len(lists) == 1
    (call,) = lists
    assert call["ks"] == [dy.t_layout[0][g] for g in live] == [32, 48, 16, 16]
    assert call["ms"] == [48] * 4 and call["ns"] == [64] * 4
    assert call["a"] == dy.data_t_ptrs(live) and call["b"] == x.data_t_ptrs(live)


def test_wgrad_fallback_on_padded_blocks_equals_the_unpadded_product(monkeypatch):
    """Where the list skips a GEMM, the fallback gets the padded (cols, ld_t) blocks (K a multiple of 16:
    no padding copy), and the product equals the one over the unpadded rows (exact here: small-integer
    values, so FP32 sums in any order agree); padded and dense casts of the same bytes agree too."""
    rows = [17, 0, 33, 5, 1]
    dy, dy_vals = _casts(rows, 48, 1)
    x, x_vals = _casts(rows, 64, 2)
    lists, fallbacks = _lists_recorder(monkeypatch, skip_all=True)
    live = [g for g, r in enumerate(rows) if r]
    got = GF.grouped_gemm(dy, x, transpose_a=True, transpose_b=True, out_dtype=torch.float32, concat=False,
                          groups=live)
    assert fallbacks == [((48, dy.t_layout[0][g]), (64, dy.t_layout[0][g])) for g in live]
    starts = dy.starts
    for g in live:
        want = dy_vals[starts[g]:starts[g + 1]].t() @ x_vals[starts[g]:starts[g + 1]] * (0.5 * 0.25)
        assert torch.equal(got[g], want)
    assert got[1] is None
    # the dense layout of the same bytes (the reference twin's): the same results, K = the rows
    dense = [Fp8MultiCast(c.data_buf, torch.cat([c.data_t(g).view(torch.uint8).reshape(-1) for g in range(len(rows))])
                          .view(c.dtype), c.f32, c.dtype, rows, c.cols, c.starts) for c in (dy, x)]
    fallbacks.clear()
    got2 = GF.grouped_gemm(*dense, transpose_a=True, transpose_b=True, out_dtype=torch.float32, concat=False,
                           groups=live)
    assert lists[-1]["ks"] == [rows[g] for g in live]
    assert all(torch.equal(got[g], got2[g]) for g in live)


def test_dgrad_pass_keeps_the_unpadded_contraction(monkeypatch):
    """dx = dy W: dy read rowwise (K = out_features) with the weights' transposed copies: K is not the
    padded rows there (one side only is transposed), and a weight block padded past n (n % 16 != 0) is
    read as its (k, n) column slice by the fallback (the list does not take K % 16 != 0)."""
    n, k = 24, 32
    w, _ = _casts([n, n, n], k, 3)  # three experts' (n, k) weights: transposed copies (k, 32), 8 zero columns
    dy, _ = _casts([5, 7, 2], n, 1)
    lists, fallbacks = _lists_recorder(monkeypatch, skip_all=True)
    GF.grouped_gemm(dy, w, transpose_b=True, out_dtype=torch.float32)
    assert lists[0]["ks"] == [n] * 3
    assert fallbacks == [((r, n), (k, n)) for r in (5, 7, 2)]


_STUB_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import host_grouped_cpu as H
H.install_stub_grouped()
from fp_recipes import _extension
from fp_recipes.gemm import grouped as GF
lists, fallbacks = [], []
_extension._ext.lt_fp8_gemms = lambda *a: lists.append([list(a[i]) for i in (6, 7, 8)]) or []
orig = GF._gemm_into
GF._gemm_into = lambda *a, **k: fallbacks.append(1) or orig(*a, **k)
step = H.make_step(sys.argv[2], 4, 0, 64, 48, False, True, splits=[17, 0, 33, 5])
step()
print(json.dumps({"lists": lists, "fallbacks": len(fallbacks)}))
"""


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_layer_wgrad_stays_on_the_list_with_odd_splits(recipe):
    """GroupedLinear's FP8 multi path with odd m_splits, its CUDA-side Python run on CPU with the stub kernels
    of benchmarks/host_grouped_cpu.py (a subprocess: they replace module globals): three GEMM lists
    (fprop K = in_features, dgrad K = out_features, wgrad K = the padded rows), no GEMM off the list."""
    out = subprocess.run([sys.executable, "-c", _STUB_SCRIPT, os.path.join(ROOT, "benchmarks"), recipe],
                         capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["fallbacks"] == 0
    assert res["lists"] == [[[17, 33, 5], [48] * 3, [64] * 3],  # fprop: (m_g, 64) x (48, 64)
                            [[17, 33, 5], [64] * 3, [48] * 3],  # dgrad: (m_g, 48) x (64, 48)
                            [[48] * 3, [64] * 3, [32, 48, 16]]]  # wgrad: (48, ld_g) x (64, ld_g)


# ---- GPU ----------------------------------------------------------------------------------------

def _dirty_allocator():
    """Leave nonzero bytes in the caching allocator's free blocks, so a padding the kernel failed to
    zero shows (fresh buffers reuse them)."""
    junk = torch.full((1 << 24,), 0x7E, dtype=torch.uint8, device="cuda")
    del junk


@pytest.mark.cuda
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("delayed", [True, False])
@pytest.mark.parametrize("by_rows", [True, False])
def test_cuda_padded_copies_equal_the_single_kernel_and_twin(rows, dtype, delayed, by_rows):
    """Every member: rowwise bytes and the unpadded part of its transposed copy equal the single-tensor
    kernel's and the reference twin's; the padding columns are zeros; scale_inv as the single cast."""
    cols, g = 96, len(rows)
    x = (torch.randn(sum(rows), cols, generator=torch.Generator().manual_seed(g)) * 3).to(dtype).cuda()
    if x.numel():
        x.view(-1)[::97] = 448.0 * 7  # values that saturate
    xs = list(x.split(rows))
    scales = [torch.tensor(0.5 * (i + 1), device="cuda") for i in range(g)] if delayed else None
    _dirty_allocator()
    if by_rows:
        data, data_t, f32, starts, (ld_t, t_starts) = cu.fp8_multi_cast_rows(x, rows, "e4m3", scales=scales)
    else:
        data, data_t, f32, starts, (ld_t, t_starts) = cu.fp8_multi_cast_buffers(xs, "e4m3", scales=scales)
    torch.cuda.synchronize()
    assert data_t.numel() == t_starts[-1] and data_t.data_ptr() % 16 == 0
    for i, xi in enumerate(xs):
        if delayed:
            single = cu.fp8_quantize(xi, scales[i], "e4m3", rowwise=True, columnwise=True)
            twin = ref_fp8.fp8_quantize(xi.cpu(), scales[i].cpu(), "e4m3", rowwise=True, columnwise=True)
        else:
            single = cu.fp8_current_scaling_quantize(xi, "e4m3", rowwise=True, columnwise=True)
            twin = ref_fp8.fp8_current_scaling_quantize(xi.cpu(), "e4m3", rowwise=True, columnwise=True)
        block = data_t[t_starts[i]:t_starts[i + 1]].view(cols, ld_t[i]).view(torch.uint8)
        assert torch.equal(block[:, :rows[i]], single.data_t.view(torch.uint8)), i
        assert torch.equal(block[:, :rows[i]].cpu(), twin.data_t.view(torch.uint8)), i
        assert not block[:, rows[i]:].any(), f"member {i}: padding not zero"
        assert torch.equal(data[starts[i]:starts[i + 1]].view(torch.uint8), single.data.view(torch.uint8)), i
        assert torch.equal(f32[4 * i].view(1).view(torch.int32).cpu(), single.scale_inv.reshape(1).view(torch.int32).cpu())


def _fp8_casts(rows, cols, seed, delayed):
    """(casts, per-member scale_inv) of a (sum(rows), cols) BF16 input through the grouped layer's cast."""
    from fp_recipes.quantizers.float8 import Float8CurrentScalingQuantizer, Float8Quantizer
    from fp_recipes.quantizers.grouped import fp8_multi_cast
    from fp_recipes.quantizers.roles import ModuleKind, QFormat, QuantizerRole, QuantizerSpec, ScalingKind, TensorKind

    spec = QuantizerSpec(role=QuantizerRole(ModuleKind.GROUPED_LINEAR, TensorKind.ACTIVATION, 0, None),
                         fmt=QFormat.E4M3, scaling=ScalingKind.DELAYED if delayed else ScalingKind.CURRENT,
                         amax_history_len=4, rowwise=True, columnwise=True)
    cls = Float8Quantizer if delayed else Float8CurrentScalingQuantizer
    qs = [cls(spec) for _ in rows]
    if delayed:
        for i, q in enumerate(qs):
            q.to("cuda")
            q.scale.fill_(0.5 + i % 3)
    x = (torch.randn(sum(rows), cols, generator=torch.Generator().manual_seed(seed)) * 2).to(torch.bfloat16).cuda()
    return fp8_multi_cast(qs, x, rows=rows, record=False)


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [[17, 33, 5] * 3, [1, 0, 31, 64, 7]])
@pytest.mark.parametrize("delayed", [True, False])
def test_cuda_wgrad_list_equals_the_padded_fallback(rows, delayed, monkeypatch):
    """The wgrad GEMMs of odd experts run on the cuBLASLt list (it skips none) and give, bit for bit, what
    the per-GEMM fallback computed before this change: gemm_fp8_fp8 on the unpadded (cols, m_g) copies,
    which zero-pads K to 16 and runs the same cuBLASLt GEMM."""
    from fp_recipes.gemm import cublaslt
    from fp_recipes.gemm.fp8 import gemm_fp8_fp8
    from fp_recipes.gemm.operands import Fp8Operand

    if not cublaslt.available():
        pytest.skip(f"no cuBLASLt path here: {cublaslt.status()}")
    dy, x = _fp8_casts(rows, 48, 1, delayed), _fp8_casts(rows, 64, 2, delayed)
    skipped, fallbacks = [], []
    orig_list, orig_into = cublaslt.fp8_gemms_ptr, GF._gemm_into
    monkeypatch.setattr(cublaslt, "fp8_gemms_ptr", lambda *a, **k: skipped.extend(orig_list(*a, **k)) or [])
    monkeypatch.setattr(GF, "_gemm_into", lambda *a, **k: fallbacks.append(1) or orig_into(*a, **k))
    live = [g for g, r in enumerate(rows) if r]
    got = GF.grouped_gemm(dy, x, transpose_a=True, transpose_b=True, out_dtype=torch.bfloat16, concat=False,
                          groups=live)
    assert skipped == [] and fallbacks == []
    for g in live:
        want = gemm_fp8_fp8(Fp8Operand(dy.data_t(g).contiguous(), dy.scale_inv(g)),
                            Fp8Operand(x.data_t(g).contiguous(), x.scale_inv(g)), out_dtype=torch.bfloat16)
        assert torch.equal(got[g], want), g


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(RECIPES) + list(FAST_ALL))
@pytest.mark.parametrize("bias", [True, False])
def test_cuda_grouped_odd_splits_equal_a_loop_of_linear(name, bias, monkeypatch):
    """GroupedLinear (FP8 multi path) with odd m_splits, forward and backward, against one Linear per
    expert with the same weights, bit for bit (two steps: delayed scaling's second step uses the first's
    amaxes); the wgrad GEMMs stay on the cuBLASLt list (none falls back)."""
    fallbacks = []
    orig_into = GF._gemm_into
    monkeypatch.setattr(GF, "_gemm_into", lambda *a, **k: fallbacks.append(1) or orig_into(*a, **k))
    torch.manual_seed(5)
    num, k, n = 4, 64, 48
    splits = [17, 0, 33, 5]
    grp = GroupedLinear(num, k, n, bias=bias, params_dtype=torch.bfloat16, device="cuda")
    lins = []
    for i in range(num):
        lin = Linear(k, n, bias=bias, params_dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            lin.weight.copy_(getattr(grp, f"weight{i}"))
            if bias:
                lin.bias.copy_(getattr(grp, f"bias{i}"))
        lins.append(lin)
    recipe = {**RECIPES, **FAST_ALL}[name]()
    for step in range(2):
        x = torch.randn(sum(splits), k, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        x2 = x.detach().clone().requires_grad_(True)
        dy = torch.randn(sum(splits), n, dtype=torch.bfloat16, device="cuda")
        grp.zero_grad(set_to_none=True)
        for lin in lins:
            lin.zero_grad(set_to_none=True)
        with fp_recipes.autocast(recipe=recipe):
            y = grp(x, splits)
            y2 = torch.cat([lin(xi) for lin, xi in zip(lins, torch.split(x2, splits))])
        y.backward(dy)
        y2.backward(dy)
        assert torch.equal(y, y2), step
        assert torch.equal(x.grad, x2.grad), step
        for i, lin in enumerate(lins):
            wg = getattr(grp, f"weight{i}").grad
            assert torch.equal(wg, lin.weight.grad if lin.weight.grad is not None else torch.zeros_like(wg)), (step, i)
            if bias:
                bg = getattr(grp, f"bias{i}").grad
                assert torch.equal(bg, lin.bias.grad if lin.bias.grad is not None else torch.zeros_like(bg)), (step, i)
    assert fallbacks == []


@pytest.mark.cuda
def test_cuda_row_strides_are_validated():
    """A row stride below the rows, past the last row tile (the kernel zeroes only there), or one per
    member missing: a clear error before anything is launched."""
    from fp_recipes.ops import backend

    ext = backend.extension()
    x = torch.zeros(5, 16, device="cuda", dtype=torch.bfloat16)
    out_t = torch.empty(16 * 64, device="cuda", dtype=torch.uint8)
    f = torch.empty(16, device="cuda")
    args = ([x.data_ptr()], [5], 16, 2, [], [out_t.data_ptr()], 3, False, 0.0, f.data_ptr(), f.data_ptr(),
            f.data_ptr(), 0, 1)
    for ld_t, msg in (([4], "ld_t 4 must be 0"), ([65], "ld_t 65 must be 0"), ([16, 16], "one row stride per member")):
        with pytest.raises(ValueError, match=msg):
            ext.fp8_multi_current_scaling_quantize(*args, ld_t)
    ext.fp8_multi_current_scaling_quantize(*args, [64])  # the most the last row tile holds
    torch.cuda.synchronize()
    assert not out_t.view(16, 64)[:, 5:].any()
