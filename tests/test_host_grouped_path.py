"""The host-lean FP8 multi path of GroupedLinear (issue 14): the same bits as the per-expert path, and
the same kernel arguments as the view-based entry points (checked on CPU with a recording extension),
and a bound on the host work of one step from benchmarks/host_grouped_cpu.py (stub kernels)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fp_recipes
from fp_recipes import DelayedScaling, Float8CurrentScaling, GroupedLinear
from fp_recipes.modules import grouped_linear as GL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = {"delayed": lambda: DelayedScaling(amax_history_len=4), "current": Float8CurrentScaling}
SPLITS = ([8, 0, 24, 5, 0, 16, 1, 10], [0, 0, 0, 12, 0, 0, 0, 0], [6] * 8)


def _run(name, bias, splits_seq, multi, monkeypatch, ckpt=False, dtype=torch.float32):
    monkeypatch.setattr(GL, "MULTI_CAST", multi)
    torch.manual_seed(5)
    grp = GroupedLinear(8, 32, 48, bias=bias, params_dtype=dtype)
    recipe = RECIPES[name]()
    outs = []
    for step, splits in enumerate(splits_seq):
        x = torch.randn(sum(splits), 32, dtype=dtype, requires_grad=True)
        dy = torch.randn(sum(splits), 48, dtype=dtype)
        grp.zero_grad(set_to_none=True)
        with fp_recipes.autocast(recipe=recipe):
            y = checkpoint(grp, x, splits, use_reentrant=False) if ckpt and step == 1 else grp(x, splits)
        y.backward(dy)
        outs.append(y.detach())
        outs.append(x.grad)
        for w in grp.weights():
            outs.append(w.grad)
        if bias:
            outs.extend(b.grad for b in grp.biases())
        with torch.no_grad():
            for w in grp.weights():
                w.mul_(1.01)  # as an optimizer step
    outs.extend(t for k, t in sorted(grp.state_dict().items()) if k.startswith("qstate_") or "extra" in k)
    return outs


def _same(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        if isinstance(u, torch.Tensor):
            assert u.dtype == v.dtype and u.shape == v.shape
            assert torch.equal(u.view(torch.uint8) if u.element_size() == 1 else u, v.view(torch.uint8)
                               if v.element_size() == 1 else v) or torch.equal(torch.nan_to_num(u), torch.nan_to_num(v))
        else:
            assert u == v


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("ckpt", [False, True])
def test_multi_path_bitwise_equals_per_expert_path(name, bias, ckpt, monkeypatch):
    """Outputs, input/weight/bias gradients and the delayed-scaling state: the multi path (x and dy cast
    whole by rows) and the per-expert reference path, over uneven splits, zero-row experts, a step with
    one live expert, and a checkpointed call."""
    fast = _run(name, bias, SPLITS, True, monkeypatch, ckpt)
    slow = _run(name, bias, SPLITS, False, monkeypatch, ckpt)
    _same(fast, slow)


def test_multi_path_bf16_autocast(monkeypatch):
    """torch.autocast (bias cast per call) on the multi path: the same bits as the per-expert path."""
    res = []
    for multi in (True, False):
        monkeypatch.setattr(GL, "MULTI_CAST", multi)
        torch.manual_seed(2)
        grp = GroupedLinear(4, 32, 16, bias=True)
        x = torch.randn(40, 32, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16), fp_recipes.autocast(recipe=DelayedScaling()):
            y = grp(x, [10, 0, 20, 10])
        y.float().sum().backward()
        res.append([y, x.grad] + [p.grad for p in grp.parameters()])
    _same(*res)


class _RecordingExt:
    def __init__(self):
        self.calls = []

    def fp8_multi_quantize(self, *args):
        self.calls.append(("delayed",) + tuple(args))

    def fp8_multi_current_scaling_quantize(self, *args):
        self.calls.append(("current",) + tuple(args))


@pytest.mark.parametrize("rows", [[3, 0, 5, 7], [0, 0, 4], [0, 0], [6]])
@pytest.mark.parametrize("delayed", [True, False])
def test_cast_rows_launches_like_the_split_views(rows, delayed, monkeypatch):
    """cuda_fp8.fp8_multi_cast_rows(x, rows) hands the extension exactly what
    fp8_multi_cast_buffers(x.split(rows)) does, but for the output buffers' own addresses (fresh
    allocations): member addresses (0 for an empty member, as an empty view's data_ptr), rows, cols,
    dtype codes, scale and history addresses, stride."""
    from fp_recipes.ops import backend, cuda_fp8 as cu

    ext = _RecordingExt()
    monkeypatch.setattr(cu, "_ext", lambda: ext)
    monkeypatch.setattr(backend, "current_stream", lambda device: 5)
    x = torch.randn(sum(rows), 24, dtype=torch.bfloat16)
    scales = [torch.tensor(0.5 * (i + 1)) for i in range(len(rows))] if delayed else None
    records = [1000 + 8 * i for i in range(len(rows))] if delayed else ()
    kw = dict(scales=scales, power_2=True, amax_epsilon=0.25, records=records)
    got = cu.fp8_multi_cast_rows(x, rows, "e4m3", **kw)
    want = cu.fp8_multi_cast_buffers(list(x.split(rows)), "e4m3", **kw)
    c_got, c_want = ext.calls
    assert got[3] == want[3] and got[0].shape == want[0].shape and got[1].shape == want[1].shape
    assert got[2].shape == want[2].shape

    def rel(call, res):  # output addresses relative to their buffers
        data, data_t, f32 = (t.data_ptr() for t in res[:3])
        call = list(call)
        call[5] = [p - data for p in call[5]]
        call[6] = [p - data_t for p in call[6]]
        first = 9 if delayed else 10  # scale, scale_inv, amax addresses
        call[first:first + 3] = [p - f32 for p in call[first:first + 3]]
        return call

    assert rel(c_got, got) == rel(c_want, want)
    # scales given as addresses: the same call
    ext.calls.clear()
    if delayed:
        got2 = cu.fp8_multi_cast_rows(x, rows, "e4m3", **dict(kw, scales=[s.data_ptr() for s in scales]))
        assert rel(ext.calls[0], got2) == rel(c_got, got)


def test_gemm_side_lists_match_the_per_group_methods():
    """gemm/grouped.py _side_lists (one pass) gives what the per-group accessors give."""
    from itertools import accumulate

    from fp_recipes.gemm.grouped import _Side, _side_lists
    from fp_recipes.quantizers.grouped import Fp8MultiCast

    rows, cols = [5, 0, 16, 3, 1], 32
    starts = list(accumulate(rows, initial=0))
    data = torch.zeros(starts[-1], cols, dtype=torch.float8_e4m3fn)
    data_t = torch.zeros(starts[-1] * cols, dtype=torch.float8_e4m3fn)
    casts = Fp8MultiCast(data, data_t, torch.zeros(6 * len(rows)), data.dtype, rows, cols, starts)
    for transposed in (False, True):
        side = _Side(casts, transposed)
        for gs in ([0, 2, 3, 4], (2,), range(5)):
            ptrs, scales, ms, ks = _side_lists(side, gs)
            assert ptrs == side.ptrs(gs) and scales == casts.scale_ptrs(gs)
            assert ms == [side.rows(g) for g in gs] and ks == [side.depth(g) for g in gs]


# one step's host work with stub kernels (benchmarks/host_grouped_cpu.py, 8 experts, weights changing),
# measured after the issue-14 pass; the bound allows 10% more (a regression beyond that fails)
_MEASURED = {"delayed+bias": (95, 935), "delayed": (75, 871), "current+bias": (57, 626), "current": (37, 562)}
_MARGIN = 1.10


def test_stub_benchmark_call_counts_bounded():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "host_grouped_cpu.py"), "--steps", "1",
                          "--json"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for row, (aten, calls) in _MEASURED.items():
        assert res[row]["aten_ops"] <= aten * _MARGIN, (row, res[row])
        assert res[row]["python_calls"] <= calls * _MARGIN, (row, res[row])


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [[64, 0, 32, 128], [1], [0, 0], [17, 33, 5] * 23])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("delayed", [True, False])
def test_cuda_cast_rows_writes_the_bytes_of_the_split_views(rows, dtype, delayed):
    """On the GPU: fp8_multi_cast_rows(x, rows) (addresses by arithmetic) writes the same bytes, and
    records the same histories, as fp8_multi_cast_buffers(x.split(rows))."""
    from fp_recipes.ops import cuda_fp8

    cols, g = 96, len(rows)
    x = (torch.randn(sum(rows), cols, generator=torch.Generator().manual_seed(g)) * 3).to(dtype).cuda()
    scales = [torch.tensor(0.5 * (i + 1), device="cuda") for i in range(g)] if delayed else None
    got = cuda_fp8.fp8_multi_cast_rows(x, rows, "e4m3", scales=scales)
    want = cuda_fp8.fp8_multi_cast_buffers(list(x.split(rows)), "e4m3", scales=scales)
    torch.cuda.synchronize()
    assert got[3] == want[3]
    for a, b in zip(got[:2], want[:2]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for a, b in ((got[2], want[2]),):  # scale_inv at [4 i], amax, scale (the rest is padding)
        a, b = a.view(torch.int32), b.view(torch.int32)
        for sl in (slice(0, 4 * g, 4), slice(4 * g, 6 * g)):
            assert torch.equal(a[sl], b[sl])
    if delayed and cuda_fp8.can_record_amax():
        slots = [torch.full((1,), -1.0, device="cuda") for _ in range(2 * g)]
        cuda_fp8.fp8_multi_cast_rows(x, rows, "e4m3", scales=scales, records=[s.data_ptr() for s in slots[:g]])
        cuda_fp8.fp8_multi_cast_buffers(list(x.split(rows)), "e4m3", scales=scales,
                                        records=[s.data_ptr() for s in slots[g:]])
        torch.cuda.synchronize()
        assert torch.equal(torch.cat(slots[:g]), torch.cat(slots[g:]))


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("bias", [True, False])
def test_cuda_grouped_rows_path_equals_the_list_entry(name, bias, monkeypatch):
    """On the GPU: GroupedLinear with x / dy cast whole by rows gives the bits of the same layer whose
    multi-cast gets the experts' split views (fp8_multi_cast called without rows)."""
    from fp_recipes.quantizers import grouped as QG

    def run(split_views):
        if split_views:
            orig = QG.fp8_multi_cast

            def by_views(quantizers, parts, *, record=True, rows=None):
                if rows is not None:
                    parts = list(parts.split(list(rows)))
                return orig(quantizers, parts, record=record)
            monkeypatch.setattr(GL, "fp8_multi_cast", by_views)
        else:
            monkeypatch.setattr(GL, "fp8_multi_cast", QG.fp8_multi_cast)
        torch.manual_seed(5)
        grp = GroupedLinear(8, 64, 48, bias=bias, params_dtype=torch.bfloat16, device="cuda")
        recipe = RECIPES[name]()
        outs = []
        for splits in ([32, 0, 48, 16, 0, 16, 32, 16], [0, 0, 0, 64, 0, 0, 0, 0], [16] * 8):
            x = torch.randn(sum(splits), 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            dy = torch.randn(sum(splits), 48, dtype=torch.bfloat16, device="cuda")
            grp.zero_grad(set_to_none=True)
            with fp_recipes.autocast(recipe=recipe):
                y = grp(x, splits)
            y.backward(dy)
            outs += [y.detach(), x.grad] + [p.grad for p in grp.parameters()]
        outs += [t for k, t in sorted(grp.state_dict().items()) if k.startswith("qstate_")]
        return outs

    _same(run(False), run(True))
