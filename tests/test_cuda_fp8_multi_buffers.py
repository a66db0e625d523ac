"""cuda_fp8.fp8_multi_cast_buffers: the grouped layer's multi-tensor cast (addresses, scale_inv at a
16-byte stride) writes the same bytes as the public multi-tensor ops."""

from __future__ import annotations

import pytest
import torch

from fp_recipes import ops

pytestmark = pytest.mark.cuda


def _members(rows, cols, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(sum(rows), cols, generator=g) * 3).to(dtype).cuda()
    if x.numel():
        x.view(-1)[::97] = 448.0 * 7  # values that saturate
    return list(x.split(rows))


@pytest.mark.parametrize("rows", [[64, 0, 32, 128], [1], [0, 0], [2048] * 8, [17, 33, 5] * 23])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("delayed", [True, False])
def test_buffers_equal_the_public_ops(rows, dtype, fmt, delayed):
    from fp_recipes.ops import cuda_fp8

    cols = 96
    xs = _members(rows, cols, dtype, len(rows))
    g = len(xs)
    scales = [torch.tensor(0.5 * (i + 1), device="cuda") for i in range(g)]
    if delayed:
        ref = ops.fp8_multi_quantize(xs, scales, fmt, rowwise=True, columnwise=True)
        data, data_t, f32, starts, (ld_t, t_starts) = cuda_fp8.fp8_multi_cast_buffers(xs, fmt, scales=scales)
    else:
        ref = ops.fp8_multi_current_scaling_quantize(xs, fmt, rowwise=True, columnwise=True)
        data, data_t, f32, starts, (ld_t, t_starts) = cuda_fp8.fp8_multi_cast_buffers(xs, fmt)
    assert starts[-1] == sum(rows) and t_starts[-1] == data_t.numel()
    for i, r in enumerate(rows):
        s = starts[i]
        assert torch.equal(data[s:s + r].view(torch.uint8), ref.data[i].view(torch.uint8))
        block = data_t[t_starts[i]:t_starts[i + 1]].view(cols, ld_t[i]).view(torch.uint8)  # rows padded to 16
        assert torch.equal(block[:, :r], ref.data_t[i].view(torch.uint8))
        assert not block[:, r:].any()
    bits = f32.view(torch.int32)
    assert torch.equal(bits[0:4 * g:4], ref.scale_inv.view(torch.int32))
    assert torch.equal(bits[4 * g:5 * g], ref.amax.view(torch.int32))
    assert torch.equal(bits[5 * g:6 * g], ref.scale.view(torch.int32))
    assert f32.data_ptr() % 16 == 0


def test_scale_inv_stride_is_validated():
    from fp_recipes.ops import backend

    ext = backend.extension()
    x = torch.zeros(4, 16, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(16, device="cuda")
    with pytest.raises(ValueError, match="scale_inv_stride"):
        ext.fp8_multi_current_scaling_quantize([x.data_ptr()], [4], 16, 2, [], [], 3, False, 0.0, out.data_ptr(),
                                               out.data_ptr(), out.data_ptr(), 0, 0)
