"""CPU-side checks of the multi-tensor FP8 casts (no GPU needed): the reference twin is the per-member loop
of the single-tensor twins with the one-buffer output layout, argument validation says what is wrong and
what is allowed, the fake (meta) implementations and torch.compile tracing work, and the extension's own
checks raise before touching a GPU. The byte-equality of the CUDA kernel: tests/test_cuda_fp8_multi.py."""

from __future__ import annotations

import glob
import os

import pytest
import torch

import fp_recipes
from fp_recipes import ops
from fp_recipes.ops import backend, ref_fp8

BUILT = bool(glob.glob(os.path.join(os.path.dirname(fp_recipes.__file__), "_C*.so")))
needs_ext = pytest.mark.skipif(not BUILT, reason="fp_recipes._C not built here (no nvcc / FP_RECIPES_NO_CUDA)")
COPIES = ((True, False), (False, True), (True, True))


def _members(rows, cols, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn((sum(rows), cols), generator=g) * 3).to(dtype)
    xs = list(x.split(rows))
    if len(xs) > 2 and xs[1].numel():
        xs[1].view(-1)[0] = float("nan")
    return xs


def _scales(n):
    return [torch.tensor(2.0 ** (i % 7 - 3)) if i % 2 else torch.tensor([0.75 * (i + 1)]) for i in range(n)]


def _same(a, b):
    if a is None or b is None:
        assert a is None and b is None
        return
    assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    else:
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


@pytest.mark.parametrize("num_members", [1, 3, 65])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_is_the_per_member_loop(num_members, dtype):
    rows = [(0, 1, 17, 64, 3)[i % 5] for i in range(num_members)]
    for cols in (24, 33):
        xs = _members(rows, cols, dtype, seed=num_members)
        scales = _scales(num_members)
        for fmt in ("e4m3", "e5m2"):
            for rowwise, columnwise in COPIES:
                got = ops.fp8_multi_quantize(xs, scales, fmt, rowwise=rowwise, columnwise=columnwise)
                for i, (x, s) in enumerate(zip(xs, scales)):
                    want = ref_fp8.fp8_quantize(x, s.reshape(()), fmt, rowwise=rowwise, columnwise=columnwise)
                    _same(got.data[i], want.data)
                    _same(got.data_t[i], want.data_t)
                    _same(got.scale_inv[i], want.scale_inv)
                    _same(got.amax[i], want.amax)
                    _same(got.scale[i], s.reshape(()))
                for pow2, eps in ((False, 0.0), (True, 2.5)):
                    kw = dict(use_power_2_scales=pow2, amax_epsilon=eps, rowwise=rowwise, columnwise=columnwise)
                    got = ops.fp8_multi_current_scaling_quantize(xs, fmt, **kw)
                    for i, x in enumerate(xs):
                        want = ref_fp8.fp8_current_scaling_quantize(x, fmt, **kw)
                        for field in ("scale_inv", "amax", "scale"):
                            _same(getattr(got, field)[i], getattr(want, field))
                        _same(got.data[i], want.data)
                        _same(got.data_t[i], want.data_t)


def test_reference_output_layout_is_one_buffer_per_copy():
    rows, cols = [5, 0, 3, 1], 12
    res = ops.fp8_multi_quantize(_members(rows, cols), _scales(4), "e4m3", rowwise=True, columnwise=True)
    offs = [0, 5, 5, 8]
    for copies, shape in ((res.data, lambda r: (r, cols)), (res.data_t, lambda r: (cols, r))):
        storage = copies[0].untyped_storage().data_ptr()
        for i, (v, r) in enumerate(zip(copies, rows)):
            assert tuple(v.shape) == shape(r) and v.is_contiguous()
            assert v.untyped_storage().data_ptr() == storage
            assert v.storage_offset() == offs[i] * cols
    assert res.scale_inv.shape == (4,) and res.amax.shape == (4,) and res.scale.shape == (4,)


def test_empty_total_and_empty_members():
    xs = [torch.empty((0, 16)), torch.empty((0, 16))]
    res = ops.fp8_multi_quantize(xs, [torch.tensor(4.0), torch.tensor(0.5)], "e4m3", rowwise=True, columnwise=True)
    assert [tuple(d.shape) for d in res.data] == [(0, 16), (0, 16)]
    assert [tuple(d.shape) for d in res.data_t] == [(16, 0), (16, 0)]
    assert res.amax.tolist() == [0.0, 0.0] and res.scale_inv.tolist() == [0.25, 2.0]
    res = ops.fp8_multi_current_scaling_quantize(xs, "e4m3", amax_epsilon=7.0)
    assert res.amax.tolist() == [0.0, 0.0] and res.scale.tolist() == [64.0, 64.0]
    assert res.data_t == [None, None]
    res = ops.fp8_multi_current_scaling_quantize(xs, "e5m2")
    assert res.scale.tolist() == [1.0, 1.0]


def test_argument_validation_messages():
    x = torch.zeros((4, 8))
    s = torch.tensor(1.0)
    q, c = ops.fp8_multi_quantize, ops.fp8_multi_current_scaling_quantize
    with pytest.raises(TypeError, match="list or tuple"):
        q(x, [s], "e4m3")
    with pytest.raises(ValueError, match="xs is empty"):
        q([], [], "e4m3")
    with pytest.raises(ValueError, match="xs is empty"):
        c([], "e4m3")
    with pytest.raises(TypeError, match=r"xs\[1\] must be a torch.Tensor"):
        q([x, 3], [s, s], "e4m3")
    with pytest.raises(TypeError, match=r"xs\[0\] has dtype int32; allowed: float32, float16, bfloat16"):
        c([x.int()], "e4m3")
    with pytest.raises(ValueError, match=r"xs\[1\] must be 2-D"):
        c([x, x.reshape(-1)], "e4m3")
    with pytest.raises(ValueError, match="same number of columns; xs\\[1\\] has 4 but xs\\[0\\] has 8"):
        c([x, torch.zeros(2, 4)], "e4m3")
    with pytest.raises(TypeError, match="one dtype"):
        c([x, x.half()], "e4m3")
    with pytest.raises(ValueError, match="fmt must be one of 'e4m3', 'e5m2'"):
        c([x], "e2m1")
    with pytest.raises(ValueError, match="2 members but 1 scales"):
        q([x, x], [s], "e4m3")
    with pytest.raises(TypeError, match="list or tuple of FP32 scalar tensors"):
        q([x], s, "e4m3")
    with pytest.raises(TypeError, match=r"scales\[0\] must be float32"):
        q([x], [s.double()], "e4m3")
    with pytest.raises(ValueError, match=r"scales\[0\] must be a 0-dim or 1-element tensor"):
        q([x], [torch.ones(2)], "e4m3")
    with pytest.raises(ValueError, match="rowwise and columnwise are both False"):
        q([x], [s], "e4m3", rowwise=False)
    with pytest.raises(ValueError, match="amax_epsilon must be >= 0"):
        c([x], "e4m3", amax_epsilon=-1.0)


def _meta(shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


@needs_ext
def test_fake_impls_and_torch_compile():
    from fp_recipes.ops import cuda_fp8 as cu

    assert "fp8_multi_quantize" in backend.registered_cuda_ops()
    assert "fp8_multi_current_scaling_quantize" in backend.registered_cuda_ops()
    xs = [_meta((5, 24)), _meta((0, 24)), _meta((3, 24))]
    r = cu.fp8_multi_quantize(xs, [_meta((), torch.float32)] * 3, "e5m2", rowwise=True, columnwise=True)
    assert [tuple(d.shape) for d in r.data] == [(5, 24), (0, 24), (3, 24)]
    assert [tuple(d.shape) for d in r.data_t] == [(24, 5), (24, 0), (24, 3)]
    assert r.data[0].dtype == torch.float8_e5m2 and r.scale.shape == (3,) and r.amax.dtype == torch.float32
    r = cu.fp8_multi_current_scaling_quantize(xs, "e4m3", rowwise=False, columnwise=True)
    assert r.data == [None] * 3 and r.data_t[2].dtype == torch.float8_e4m3fn

    def f(a, b, s0, s1):
        q = cu.fp8_multi_quantize([a, b], [s0, s1], "e4m3", rowwise=True, columnwise=True)
        c = cu.fp8_multi_current_scaling_quantize([a, b], "e5m2", use_power_2_scales=True)
        return q.data_t[1], q.scale, c.data[0], c.amax

    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True, backend="eager")(
        _meta((16, 64)), _meta((8, 64)), _meta((), torch.float32), _meta((1,), torch.float32))
    assert [tuple(o.shape) for o in out] == [(64, 8), (2,), (16, 64), (2,)]


@needs_ext
def test_custom_op_refuses_cpu_tensors():
    from fp_recipes.ops import cuda_fp8 as cu

    with pytest.raises(ValueError, match="CUDA kernel.*reference for CPU tensors"):
        cu.fp8_multi_quantize([torch.zeros(2, 4)], [torch.ones(())], "e4m3")
    with pytest.raises(ValueError, match="CUDA kernel"):
        torch.ops.fp_recipes.fp8_multi_current_scaling_quantize([torch.zeros(2, 4)], "e4m3", False, 0.0, True, False)


@needs_ext
def test_extension_argument_checks_raise_without_a_gpu():
    ext = backend.extension()
    # (x, rows, cols, in_dtype, out, out_t, scales, out_dtype, scale_out, scale_inv, amax, stream)
    with pytest.raises(ValueError, match="float8_e4m3fn or float8_e5m2"):
        ext.fp8_multi_quantize([16], [2], 8, 2, [], [], [16], 2, 0, 16, 16, 0)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        ext.fp8_multi_quantize([16], [2], 8, 3, [], [], [16], 3, 0, 16, 16, 0)
    with pytest.raises(ValueError, match="member 1 has negative rows -2"):
        ext.fp8_multi_quantize([16, 16], [2, -2], 8, 2, [], [], [16, 16], 3, 0, 16, 16, 0)
    with pytest.raises(ValueError, match="member 0: null scale pointer"):
        ext.fp8_multi_quantize([16], [2], 8, 2, [], [], [0], 3, 0, 16, 16, 0)
    with pytest.raises(ValueError, match="member 0: null input pointer"):
        ext.fp8_multi_quantize([0], [2], 8, 2, [], [], [16], 3, 0, 16, 16, 0)
    with pytest.raises(ValueError, match="2 inputs but 1 row counts"):
        ext.fp8_multi_quantize([16, 16], [2], 8, 2, [], [], [16, 16], 3, 0, 16, 16, 0)
    with pytest.raises(ValueError, match="out must have one pointer per member or none"):
        ext.fp8_multi_quantize([16, 16], [2, 2], 8, 2, [16], [], [16, 16], 3, 0, 16, 16, 0)
    with pytest.raises(ValueError, match="cols must be non-negative"):
        ext.fp8_multi_quantize([16], [2], -8, 2, [], [], [16], 3, 0, 16, 16, 0)
    with pytest.raises(ValueError, match="null scale_inv/amax"):
        ext.fp8_multi_quantize([16], [2], 8, 2, [], [], [16], 3, 0, 0, 16, 0)
    with pytest.raises(ValueError, match="null scale/scale_inv/amax"):
        ext.fp8_multi_current_scaling_quantize([16], [2], 8, 2, [], [], 3, False, 0.0, 0, 16, 16, 0)
    with pytest.raises(ValueError, match="member 0 has negative rows"):
        ext.fp8_multi_current_scaling_quantize([16], [-1], 8, 2, [], [], 3, False, 0.0, 16, 16, 16, 0)
    # No members: nothing to do, nothing launched.
    ext.fp8_multi_quantize([], [], 8, 2, [], [], [], 3, 0, 0, 0, 0)


def test_every_multi_cast_entry_launches_with_the_buffers_addresses(monkeypatch):
    """The three CUDA entry points (views, custom-op buffers, the grouped layer's buffers) share one launch
    site; recorded on CPU, each passes its own buffers' addresses, the members' pointers and the
    scale_inv stride its layout needs (4 floats: 16-byte aligned slots for cuBLASLt), and (the grouped
    layer's buffers) the row strides of the transposed copies, padded to 16 (cuda_fp8.padded_t_layout)."""
    from fp_recipes.ops import cuda_fp8 as cu

    calls = []

    class _Ext:
        def fp8_multi_quantize(self, x, rows, cols, in_dt, out, out_t, scales, out_dt, scale, sinv, amax, stream,
                               stride, records=(), ld_t=()):
            calls.append(("delayed", x, rows, cols, out, out_t, scales, scale, sinv, amax, stream, stride, ld_t))

        def fp8_multi_current_scaling_quantize(self, x, rows, cols, in_dt, out, out_t, out_dt, p2, eps, scale, sinv,
                                               amax, stream, stride, ld_t=()):
            calls.append(("current", x, rows, cols, out, out_t, p2, eps, scale, sinv, amax, stream, stride, ld_t))

    monkeypatch.setattr(cu, "_ext", lambda: _Ext())
    monkeypatch.setattr(backend, "current_stream", lambda device: 77)
    xs, scales = _members([3, 0, 5], 16), _scales(3)

    res = cu._fp8_multi_quantize_impl(xs, scales, "e4m3", True, True)
    kind, x, rows, cols, out, out_t, sptrs, scale, sinv, amax, stream, stride, ld_t = calls.pop()
    assert (kind, rows, cols, stream, stride, ld_t) == ("delayed", [3, 0, 5], 16, 77, 1, ())  # dense data_t
    assert x == [t.data_ptr() for t in xs] and sptrs == [t.data_ptr() for t in scales]
    for i in (0, 2):  # member 1 has no rows (an empty view has no meaningful address)
        assert out[i] == res.data[i].data_ptr() and out_t[i] == res.data_t[i].data_ptr()
    assert out[1] == out[2] and len(out) == len(out_t) == 3
    assert (sinv, amax, scale) == (res.scale_inv.data_ptr(), res.amax.data_ptr(), res.scale.data_ptr())

    data, data_t, f32, starts, (ld, t_starts) = cu.fp8_multi_cast_buffers(xs, "e5m2", power_2=True, amax_epsilon=0.5)
    kind, x, rows, cols, out, out_t, p2, eps, scale, sinv, amax, stream, stride, ld_t = calls.pop()
    fb = f32.data_ptr()
    assert (kind, p2, eps, stride, starts) == ("current", True, 0.5, 4, [0, 3, 3, 8])
    assert ld_t == ld == [16, 0, 16] and t_starts == [0, 256, 256, 512] and data_t.numel() == 512
    assert out == [data.data_ptr() + s * 16 for s in starts[:-1]]
    assert out_t == [data_t.data_ptr() + s for s in t_starts[:-1]]
    assert (sinv, amax, scale) == (fb, fb + 4 * 4 * 3, fb + 4 * 5 * 3)
    assert data.dtype == torch.float8_e5m2 and f32.numel() == 18

    cu.fp8_multi_cast_buffers([xs[1]], "e4m3", scales=scales[:1])  # no rows at all: no output addresses
    assert calls.pop()[4:6] == ([], [])
