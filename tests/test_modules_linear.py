"""Linear / LayerNormLinear / GroupedLinear: torch parity outside autocast, and forward output plus all
three gradients against an independent reference of the module math for every recipe.

Tolerances: GEMM results use the FP32 dot-product bound of tests/_modules_helpers.py (both sides see
the same quantized values; only FP32 accumulation order and the scale-factor roundings differ). Bias
gradients are exact sums of the unquantized grad_output (compared with an FP32-sum bound)."""

from __future__ import annotations

import pytest
import torch

import fp_recipes
from fp_recipes import (DelayedScaling, Float8CurrentScaling, GroupedLinear, LayerNormLinear, Linear,
                        NVFP4BlockScaling)
from fp_recipes.quantizers.roles import ScalingKind, TensorKind

from _modules_helpers import assert_close_gemm, gemm_tol, ref_mm, ref_qdq

RECIPES = {
    "delayed_hybrid": lambda: DelayedScaling(amax_history_len=4, margin=1),
    "delayed_e4m3_recent": lambda: DelayedScaling(fp8_format="E4M3", amax_compute_algo="most_recent"),
    "current": lambda: Float8CurrentScaling(),
    "current_pow2": lambda: Float8CurrentScaling(use_power_2_scales=True),
    "delayed_bwd_hp": lambda: DelayedScaling(backward_override="high_precision"),
    "nvfp4": lambda: NVFP4BlockScaling(),
    "nvfp4_rn_1d_nohadamard": lambda: NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True,
                                                         disable_2d_quantization=True),
    "nvfp4_row_scaled": lambda: NVFP4BlockScaling(row_scaled_activation=True, disable_rht=True,
                                                  disable_2d_quantization=True, disable_stochastic_rounding=True),
    "nvfp4_4over6_all": lambda: NVFP4BlockScaling(nvfp4_4over6="all", disable_rht=True),
    "nvfp4_4over6_w_mse_fast": lambda: NVFP4BlockScaling(nvfp4_4over6="weights", nvfp4_4over6_err_mode="MSE",
                                                         nvfp4_4over6_err_use_fast_math=True),
    "nvfp4_bwd_dequantized": lambda: NVFP4BlockScaling(backward_override="dequantized"),
    "nvfp4_bwd_hp": lambda: NVFP4BlockScaling(backward_override="high_precision"),
    "per_token_e5m6": lambda: fp_recipes.recipes.PerTokenScaling(),
    "per_token_e4m3_ue8m0": lambda: fp_recipes.recipes.PerTokenScaling(fmt="e4m3", round_sf=True,
                                                                        scale_format="ue8m0"),
}


def _state_snapshot(q):
    """The quantizer state the next quantize() will use (scale, or SR seed/offset)."""
    if q is None:
        return {}
    snap = {}
    if isinstance(getattr(q, "scale", None), torch.Tensor):
        snap["scale"] = q.scale.detach().clone()
    for attr in ("seed", "offset"):
        if isinstance(getattr(q, attr, None), int):
            snap[attr] = getattr(q, attr)
    return snap


def _qdq(x, qs, tensor, snap):
    return ref_qdq(x, qs.specs[tensor], **snap)


def _reference(qs, x, w, b, dy, snaps):
    """(y, dx, dw, db) of the module math, FP64, and their tolerances."""
    override = qs.backward_override
    tc = x.is_cuda and qs.specs[TensorKind.ACTIVATION].scaling in (ScalingKind.DELAYED, ScalingKind.CURRENT)
    xr, xc = _qdq(x, qs, TensorKind.ACTIVATION, snaps["x"])
    wr, wc = _qdq(w, qs, TensorKind.WEIGHT, snaps["w"])
    y = ref_mm(xr, wr)
    y_tol = gemm_tol(xr, wr, x.dtype, fp8_tensor_cores=tc)
    if b is not None:
        y = y + b.double()
    if override is None:
        dyr, dyc = _qdq(dy, qs, TensorKind.GRAD_OUTPUT, snaps["dy"])
        bx, bw_x = wc, xc
    else:
        dyr, dyc = dy.float(), dy.float().t()
        if override.value == "high_precision":
            bx, bw_x = w.detach().float().t(), x.detach().float().t()
        else:
            bx, bw_x = wr.t(), xr.t()
    dx = ref_mm(dyr, bx)
    dw = ref_mm(dyc, bw_x)
    return ((y, y_tol), (dx, gemm_tol(dyr, bx, x.dtype, fp8_tensor_cores=tc)),
            (dw, gemm_tol(dyc, bw_x, w.dtype, fp8_tensor_cores=tc)))


def _step(m, recipe, x, dy):
    with fp_recipes.autocast(recipe=recipe):
        y = m(x)
    y.backward(dy)
    return y


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _device_slack(tol: torch.Tensor, ref: torch.Tensor, device: str) -> torch.Tensor:
    """CUDA: the FP32 epilogue of cuBLASLt may round the scale product and the bias add in another
    order than the emulation: a few more FP32 ulps of |ref| (the FP8 accumulation slack is in gemm_tol)."""
    return tol if device == "cpu" else tol + 2.0 ** -20 * ref.abs()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_reference(name, dtype, device):
    torch.manual_seed(1)
    recipe = RECIPES[name]()
    m, k, n = 32, 64, 48
    mod = Linear(k, n, device=device)
    x = (torch.randn(m, k) * 2).to(dtype).to(device).requires_grad_(True)
    dy = (torch.randn(m, n) * 1e-3).to(dtype).to(device)
    _step(mod, recipe, x, dy)  # warm-up: builds quantizers, moves delayed scales off 1.0
    qs = mod.quantizer_sets[0]
    x.grad = None
    mod.zero_grad()
    snaps = {"x": _state_snapshot(qs.activation), "w": _state_snapshot(qs.weight)}
    with fp_recipes.autocast(recipe=recipe):
        y = mod(x)
    snaps["dy"] = _state_snapshot(qs.grad_output)
    y.backward(dy)
    (y_ref, y_tol), (dx_ref, dx_tol), (dw_ref, dw_tol) = _reference(qs, x, mod.weight, mod.bias, dy, snaps)
    assert y.dtype == dtype and x.grad.dtype == dtype and mod.weight.grad.dtype == torch.float32
    y_tol = _device_slack(y_tol + 2 ** -23 * mod.bias.detach().double().abs(), y_ref, device)
    assert_close_gemm(y.detach(), y_ref, y_tol, f"{name} y")
    assert_close_gemm(x.grad, dx_ref, _device_slack(dx_tol, dx_ref, device), f"{name} dgrad")
    assert_close_gemm(mod.weight.grad, dw_ref, _device_slack(dw_tol, dw_ref, device), f"{name} wgrad")
    db_ref = dy.double().sum(0)
    assert torch.allclose(mod.bias.grad.double(), db_ref, rtol=0, atol=m * 2 ** -20 * dy.abs().max().item())


def test_linear_delayed_scale_is_used():
    """The delayed scale actually changes the quantized values (the reference must be sensitive)."""
    torch.manual_seed(0)
    mod = Linear(32, 16)
    x = torch.randn(16, 32) * 100
    recipe = DelayedScaling()
    with fp_recipes.autocast(recipe=recipe):
        y1 = mod(x)  # scale 1: |x| up to ~400 quantized coarsely, no saturation
    with fp_recipes.autocast(recipe=recipe):
        y2 = mod(x)  # scale 448/amax
    assert not torch.equal(y1, y2)
    qs = mod.quantizer_sets[0]
    assert qs.activation.scale.item() != 1.0


@pytest.mark.parametrize("bias", [True, False])
def test_linear_torch_parity_outside_autocast(bias):
    torch.manual_seed(2)
    ours = Linear(24, 40, bias=bias)
    ref = torch.nn.Linear(24, 40, bias=bias)
    ref.load_state_dict(ours.state_dict(), strict=False)
    x = torch.randn(3, 5, 24, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y2 = ours(x), ref(x2)
    g = torch.randn_like(y)
    y.backward(g)
    y2.backward(g)
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad)
    assert torch.equal(ours.weight.grad, ref.weight.grad)
    if bias:
        assert torch.equal(ours.bias.grad, ref.bias.grad)
    # disabled autocast is "outside" too
    with fp_recipes.autocast(enabled=False, recipe=DelayedScaling()):
        assert torch.equal(ours(x), y)


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_layernorm_linear_torch_parity(norm, zero_centered):
    torch.manual_seed(3)
    k, n = 32, 16
    ours = LayerNormLinear(k, n, normalization=norm, zero_centered_gamma=zero_centered, eps=1e-5,
                           return_layernorm_output=True)
    with torch.no_grad():
        ours.layer_norm_weight.normal_(0.0 if zero_centered else 1.0, 0.1)
        if ours.layer_norm_bias is not None:
            ours.layer_norm_bias.normal_(0, 0.1)
    norm_ref = torch.nn.LayerNorm(k, eps=1e-5) if norm == "LayerNorm" else torch.nn.RMSNorm(k, eps=1e-5)
    lin_ref = torch.nn.Linear(k, n)
    with torch.no_grad():
        norm_ref.weight.copy_(ours.layer_norm_weight + (1 if zero_centered else 0))
        if norm == "LayerNorm":
            norm_ref.bias.copy_(ours.layer_norm_bias)
        lin_ref.weight.copy_(ours.weight)
        lin_ref.bias.copy_(ours.bias)
    x = torch.randn(4, 6, k, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, ln = ours(x)
    ln2 = norm_ref(x2)
    y2 = lin_ref(ln2)
    assert torch.equal(ln, ln2) and torch.equal(y, y2)
    g = torch.randn_like(y)
    y.backward(g)
    y2.backward(g)
    assert torch.equal(x.grad, x2.grad)
    assert torch.equal(ours.weight.grad, lin_ref.weight.grad)
    assert torch.equal(ours.layer_norm_weight.grad, norm_ref.weight.grad)


@pytest.mark.parametrize("name", ["delayed_hybrid", "current", "nvfp4", "nvfp4_row_scaled"])
def test_layernorm_linear_matches_reference(name):
    """The GEMM of LayerNormLinear sees norm(x) as its activation; the norm is torch's."""
    torch.manual_seed(4)
    recipe = RECIPES[name]()
    mod = LayerNormLinear(64, 32, normalization="RMSNorm", return_layernorm_output=True)
    x = torch.randn(32, 64, requires_grad=True)
    dy = torch.randn(32, 32) * 1e-2
    with fp_recipes.autocast(recipe=recipe):
        mod(x)  # one forward: delayed scales move off 1.0
    # a fresh module loading that state (buffers are pending until its quantizers are built)
    mod2 = LayerNormLinear(64, 32, normalization="RMSNorm", return_layernorm_output=True)
    mod2.load_state_dict(mod.state_dict())
    with fp_recipes.autocast(recipe=recipe):
        y, ln = mod2(x)
    qs = mod2.quantizer_sets[0]
    snaps = {"x": _state_snapshot(qs.activation), "w": _state_snapshot(qs.weight)}
    ln.retain_grad()
    snaps["dy"] = _state_snapshot(qs.grad_output)
    y.backward(dy)
    (y_ref, y_tol), (dx_ref, dx_tol), (dw_ref, dw_tol) = _reference(qs, ln.detach(), mod2.weight, mod2.bias,
                                                                     dy, snaps)
    assert_close_gemm(y.detach(), y_ref, y_tol + 2 ** -23 * mod2.bias.detach().double().abs(), "y")
    assert_close_gemm(ln.grad, dx_ref, dx_tol, "dgrad (into the norm)")
    assert_close_gemm(mod2.weight.grad, dw_ref, dw_tol, "wgrad")


def test_linear_empty_tokens_and_leading_dims():
    mod = Linear(32, 16)
    for recipe in (DelayedScaling(), Float8CurrentScaling()):
        x = torch.zeros(0, 32, requires_grad=True)
        with fp_recipes.autocast(recipe=recipe):
            y = mod(x)
        assert y.shape == (0, 16)
        y.sum().backward()
        assert x.grad.shape == (0, 32) and torch.equal(mod.weight.grad, torch.zeros(16, 32))
        mod.zero_grad()
    x = torch.randn(2, 3, 32)
    with fp_recipes.autocast(recipe=Float8CurrentScaling()):
        assert mod(x).shape == (2, 3, 16)


def test_nvfp4_shape_errors_are_clear():
    mod = Linear(40, 16)  # 40 features: not a multiple of 16
    with fp_recipes.autocast(recipe=NVFP4BlockScaling()):
        with pytest.raises(ValueError, match="multiple of 16"):
            mod(torch.randn(16, 40))
    mod = Linear(32, 24)  # 24 output features: the 2-D weight tiles need a multiple of 16
    with fp_recipes.autocast(recipe=NVFP4BlockScaling()):
        with pytest.raises(ValueError, match="weight"):
            mod(torch.randn(16, 32))


@pytest.mark.parametrize("tokens", [1, 24, 37])
def test_nvfp4_odd_token_counts_are_padded(tokens):
    """Tokens are zero-padded to a multiple of 16 for NVFP4: identical to padding by hand."""
    torch.manual_seed(8)
    recipe = NVFP4BlockScaling(disable_stochastic_rounding=True)
    mod = Linear(32, 16)
    x = torch.randn(tokens, 32, requires_grad=True)
    xp = torch.nn.functional.pad(x.detach(), (0, 0, 0, (-tokens) % 16)).requires_grad_(True)
    dy = torch.randn(tokens, 16)
    with fp_recipes.autocast(recipe=recipe):
        y = mod(x)
        yp = mod(xp)
    assert y.shape == (tokens, 16) and torch.equal(y, yp[:tokens])
    y.backward(dy)
    w_grad = mod.weight.grad.clone()
    mod.zero_grad()
    yp.backward(torch.nn.functional.pad(dy, (0, 0, 0, (-tokens) % 16)))
    assert torch.equal(x.grad, xp.grad[:tokens]) and torch.equal(w_grad, mod.weight.grad)


def test_wrong_feature_count_is_clear():
    mod = Linear(32, 16)
    with fp_recipes.autocast(recipe=Float8CurrentScaling()):
        with pytest.raises(ValueError, match="features"):
            mod(torch.randn(4, 30))


# ------------------------------------------------------------------------------------------- grouped

def _copy_grouped_into_linears(g: GroupedLinear):
    lins = []
    for i in range(g.num_gemms):
        lin = Linear(g.in_features, g.out_features, bias=g.use_bias)
        with torch.no_grad():
            lin.weight.copy_(getattr(g, f"weight{i}"))
            if g.use_bias:
                lin.bias.copy_(getattr(g, f"bias{i}"))
        lins.append(lin)
    return lins


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", [None, "delayed_hybrid", "current", "nvfp4_rn_1d_nohadamard",
                                  "nvfp4_bwd_dequantized", "nvfp4"])
def test_grouped_equals_loop_of_linear(name, device):
    """Same weights, same recipe: GroupedLinear gives exactly the loop of Linear (same GEMMs per group).
    NVFP4 with odd splits pads each expert's tokens like Linear pads its own. On CUDA the grouped
    forward may run as one torch._scaled_grouped_mm (different accumulation order): compared with the
    GEMM bound there instead of bit equality."""
    torch.manual_seed(5)
    num, k, n = 4, 32, 16
    splits = [5, 0, 17, 30]
    grp = GroupedLinear(num, k, n, device=device)
    lins = [lin.to(device) for lin in _copy_grouped_into_linears(grp)]
    x = torch.randn(sum(splits), k, device=device, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    dy = torch.randn(sum(splits), n, device=device)
    recipe = RECIPES[name]() if name else None
    if recipe is not None:  # build the quantizers (a forward only), then align the SR streams
        with fp_recipes.autocast(recipe=recipe):
            grp(x, splits)
            [lin(xi) for lin, xi in zip(lins, torch.split(x2, splits))]
        for g, lin in enumerate(lins):
            src, dst = grp.quantizer_sets[g].grad_output, lin.quantizer_sets[0].grad_output
            if hasattr(src, "seed"):
                dst.seed, dst.offset = src.seed, src.offset
    for step in range(2):
        x.grad = x2.grad = None
        grp.zero_grad()
        for lin in lins:
            lin.zero_grad()
        with fp_recipes.autocast(enabled=recipe is not None, recipe=recipe):
            y = grp(x, splits)
            y2 = torch.cat([lin(xi) for lin, xi in zip(lins, torch.split(x2, splits))])
        y.backward(dy)
        y2.backward(dy)
        same = torch.equal if device == "cpu" else \
            (lambda a, b: torch.allclose(a, b, rtol=2 ** -6, atol=1e-3 * b.abs().max().item()))
        assert same(y, y2), f"step {step}"
        assert same(x.grad, x2.grad)
        for i, lin in enumerate(lins):
            assert same(getattr(grp, f"weight{i}").grad, lin.weight.grad)
            assert same(getattr(grp, f"bias{i}").grad, lin.bias.grad)
    assert torch.equal(grp.weight1.grad, torch.zeros(n, k, device=device))  # the empty expert


def test_grouped_many_groups_and_all_empty():
    torch.manual_seed(6)
    num = 70  # more than 64 groups (seed 001)
    grp = GroupedLinear(num, 16, 16, bias=False)
    splits = [(i * 7) % 5 for i in range(num)]
    x = torch.randn(sum(splits), 16, requires_grad=True)
    with fp_recipes.autocast(recipe=DelayedScaling(amax_history_len=2)):
        y = grp(x, splits)
    y.sum().backward()
    ref = torch.cat([xi @ w.t() for xi, w in zip(torch.split(x.detach(), splits), grp.weights())])
    assert torch.allclose(y.detach(), ref, rtol=0.15, atol=0.15)  # E4M3: 2^-4 relative per operand
    # every expert got its own scale; the empty ones kept theirs
    qs = grp.quantizer_sets
    assert len(qs) == num
    for i, m in enumerate(splits):
        hist = qs[i].activation.amax_history
        assert (hist.max() > 0) == (m > 0)
    x0 = torch.zeros(0, 16, requires_grad=True)
    with fp_recipes.autocast(recipe=Float8CurrentScaling()):
        y0 = grp(x0, [0] * num)
    y0.sum().backward()
    assert y0.shape == (0, 16)
    # the first call accumulated real gradients; the all-empty call adds exact zeros to them
    ref_grads = [torch.zeros(16, 16) for _ in range(num)]
    grp.zero_grad()
    with fp_recipes.autocast(recipe=Float8CurrentScaling()):
        grp(torch.zeros(0, 16, requires_grad=True), [0] * num).sum().backward()
    assert all(torch.equal(w.grad, z) for w, z in zip(grp.weights(), ref_grads))


def test_grouped_bad_splits():
    grp = GroupedLinear(3, 16, 16)
    with pytest.raises(ValueError, match="m_splits"):
        grp(torch.randn(10, 16), [5, 5])
    with pytest.raises(ValueError, match="sum"):
        grp(torch.randn(10, 16), [5, 5, 1])
    with pytest.raises(ValueError, match=">= 0"):
        grp(torch.randn(10, 16), [12, -2, 0])


def test_grouped_torch_parity_outside_autocast():
    torch.manual_seed(7)
    grp = GroupedLinear(3, 8, 4)
    x = torch.randn(9, 8, requires_grad=True)
    splits = [2, 0, 7]
    y = grp(x, splits)
    ref = torch.cat([torch.nn.functional.linear(xi, w, b)
                     for xi, w, b in zip(torch.split(x, splits), grp.weights(), grp.biases())])
    assert torch.equal(y, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["delayed_hybrid", "delayed_e4m3_recent", "current_pow2"])
def test_grouped_fp8_multi_cast_equals_per_expert_quantization(name, device, monkeypatch):
    """The FP8 multi-cast (one grouped quantization per operand, GEMMs on buffer addresses/views)
    computes what one quantization and one GEMM per expert compute: bit for bit on CPU, within the GEMM
    bound on CUDA (where the per-expert lists may run the fprop as one grouped GEMM)."""
    from fp_recipes.modules import grouped_linear as GL

    torch.manual_seed(9)
    splits = [32, 0, 16, 48, 7]
    k, n = 32, 48
    results = []
    calls = []
    orig = GL.fp8_multi_cast
    monkeypatch.setattr(GL, "fp8_multi_cast", lambda *a, **kw: (calls.append(1), orig(*a, **kw))[1])
    for fast in (True, False):
        monkeypatch.setattr(GL, "MULTI_CAST", fast)
        before = len(calls)
        torch.manual_seed(10)
        grp = GroupedLinear(len(splits), k, n, bias=True, device=device)
        x = torch.randn(sum(splits), k, device=device, requires_grad=True)
        dy = torch.randn(sum(splits), n, device=device)
        recipe = RECIPES[name]()
        outs = []
        for _ in range(3):  # delayed scales move between steps
            x.grad = None
            grp.zero_grad()
            with fp_recipes.autocast(recipe=recipe):
                y = grp(x, splits)
            y.backward(dy)
            outs.append([y.detach(), x.grad.clone()] + [w.grad.clone() for w in grp.weights()]
                        + [b.grad.clone() for b in grp.biases()])
        outs.append([qs.activation.scale.reshape(1) for qs in grp.quantizer_sets] if name.startswith("delayed")
                    else [])
        # every quantizer's state (amax histories, scales): an expert with no rows records nothing
        outs.append([t for key, t in sorted(grp.state_dict().items()) if key.startswith("qstate_")])
        results.append(outs)
        assert (len(calls) > before) == fast  # the multi-cast ran, or not at all
    for step_fast, step_slow in zip(*results):
        for a, b in zip(step_fast, step_slow):
            if device == "cpu":
                assert torch.equal(a, b)
            else:
                assert torch.allclose(a, b, rtol=2 ** -6, atol=1e-3 * b.abs().max().item())


def test_grouped_fp8_cast_addresses_match_their_views():
    """The CUDA GEMM lists of the grouped FP8 path take raw addresses computed from the multi-cast's
    buffer layout; they must be the addresses of the views the portable path would use (checked on
    CPU buffers with the same layout as ops.cuda_fp8.fp8_multi_cast_buffers writes)."""
    from itertools import accumulate

    from fp_recipes.quantizers.grouped import Fp8MultiCast

    rows, cols = [5, 0, 16, 3], 32
    starts = list(accumulate(rows, initial=0))
    total, g = starts[-1], len(rows)
    data = torch.arange(total * cols, dtype=torch.uint8).view(total, cols).view(torch.float8_e4m3fn)
    data_t = torch.arange(total * cols, dtype=torch.uint8).view(torch.float8_e4m3fn)
    f32 = torch.arange(6 * g, dtype=torch.float32)
    casts = Fp8MultiCast(data, data_t, f32, data.dtype, rows, cols, starts)
    gs = [0, 2, 3]
    assert casts.data_ptrs(gs) == [casts.data(i).data_ptr() for i in gs]
    assert casts.data_t_ptrs(gs) == [casts.data_t(i).data_ptr() for i in gs]
    assert casts.scale_ptrs(gs) == [casts.scale_inv(i).data_ptr() for i in gs]
    assert [p - f32.data_ptr() for p in casts.scale_ptrs(range(g))] == [16 * i for i in range(g)]
    for i in gs:
        assert casts.data_t(i).shape == (cols, rows[i])
        assert casts.scale_inv(i).item() == 4 * i
    assert [a.item() for a in casts.amaxes()] == [4 * g + i for i in range(g)]
    trimmed = casts.columnwise_only()
    assert trimmed.data_buf is None and trimmed.data_t(2).shape == (cols, 16)
    assert casts.data_buf is data


def test_grouped_fp8_fallback_gemm_gets_16_byte_aligned_pointers(monkeypatch):
    """A GEMM the cuBLASLt list skipped (or every GEMM without it) goes to torch._scaled_mm one by one;
    cuBLASLt refuses operand and scale pointers that are not 16-byte aligned, and views into the
    multi-cast buffers can be misaligned (a wgrad operand at starts[g] * cols bytes, the reference
    twin's packed scale_inv vector): _gemm_into must hand over aligned ones, with the same values.
    Checked on CPU with torch._scaled_mm replaced by an FP32 emulation that records the alignments."""
    from fp_recipes.gemm import grouped as GF

    seen = []

    def fake_scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=None, use_fast_accum=False, out=None):
        seen.append([t.data_ptr() % 16 for t in (a, b, scale_a, scale_b)])
        res = ((a.float() @ b.float()) * scale_a * scale_b).to(out_dtype)
        if out is not None:
            out.copy_(res)
            return out
        return res

    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    monkeypatch.setattr(GF, "_SCALED_MM_OUT_OK", True)
    torch.manual_seed(3)
    m, n, k = 8, 16, 32
    raw = torch.randn(m * k + 24).to(torch.float8_e4m3fn)
    a = raw[24:].view(m, k)  # starts 24 bytes into its buffer
    assert a.data_ptr() % 16 != 0
    b = torch.randn(n, k).to(torch.float8_e4m3fn)
    scales = torch.tensor([0.5, 2.0, 0.25])  # a packed vector: entry 1 at 4 bytes
    sa, sb = scales[1], scales[2]
    assert sa.data_ptr() % 16 != 0
    expect = (a.float() @ b.float().t()) * 2.0 * 0.25
    for out in (None, torch.empty(m, n)):
        res = GF._gemm_into(out, a, sa, b, sb, torch.float32, native=True)
        assert torch.equal(res, expect)
    assert seen and all(r == [0, 0, 0, 0] for r in seen)


@pytest.mark.parametrize("fast", [True, False])
def test_grouped_fp8_expert_without_rows_keeps_its_delayed_state(fast, monkeypatch):
    """An expert that gets no rows in a step saw no activation and no grad_output: its activation and
    grad_output histories neither record nor roll, its scales stay (its weight was cast: that one
    rolls). The histories must be non-zero before that step, or a wrongly recorded (and rolled) history
    of zeros would look the same. Both the multi-cast and the per-expert quantization."""
    from fp_recipes.modules import grouped_linear as GL

    monkeypatch.setattr(GL, "MULTI_CAST", fast)
    torch.manual_seed(11)
    grp = GroupedLinear(3, 32, 16, bias=True)
    recipe = DelayedScaling(amax_history_len=4)

    def step(splits):
        x = torch.randn(sum(splits), 32, requires_grad=True)
        with fp_recipes.autocast(recipe=recipe):
            y = grp(x, splits)
        y.backward(torch.randn_like(y))

    step([8, 8, 8])
    step([4, 8, 4])
    qs = grp.quantizer_sets[1]
    before = {role: (q.amax_history.clone(), q.scale.clone())
              for role, q in (("act", qs.activation), ("grad", qs.grad_output), ("w", qs.weight))}
    assert all(h.abs().sum() > 0 for h, _ in before.values())
    step([8, 0, 16])
    for role, q in (("act", qs.activation), ("grad", qs.grad_output)):
        assert torch.equal(q.amax_history, before[role][0]), role
        assert torch.equal(q.scale, before[role][1]), role
    assert not torch.equal(qs.weight.amax_history, before["w"][0])


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("kind", ["linear", "layernorm_linear", "grouped"])
def test_second_backward_with_retain_graph(kind, fast, monkeypatch):
    """Every module keeps its backward operands as saved tensors: retain_graph=True lets a second
    backward through the same graph give the same gradients again; without it, torch's own error."""
    from fp_recipes.modules import grouped_linear as GL

    monkeypatch.setattr(GL, "MULTI_CAST", fast)
    torch.manual_seed(0)
    if kind == "grouped":
        mod = GroupedLinear(2, 16, 16, bias=False)
        run = lambda x: mod(x, [3, 5])  # noqa: E731
    else:
        mod = Linear(16, 16) if kind == "linear" else LayerNormLinear(16, 16)
        run = mod
    params = [p for p in mod.parameters()]
    x = torch.randn(8, 16, requires_grad=True)
    with fp_recipes.autocast(recipe=RECIPES["current_pow2"]()):
        y = run(x)
    y.sum().backward(retain_graph=True)
    first = [t.grad.clone() for t in [x] + params]
    y.sum().backward()
    for t, g in zip([x] + params, first):
        assert torch.equal(t.grad, 2 * g)
    with fp_recipes.autocast(recipe=RECIPES["current_pow2"]()):
        y = run(x)
    y.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.sum().backward()


def test_grouped_fp8_kernel_takes_only_uniform_members():
    """The multi-cast kernel trusts its members; mixed dtypes or a non-contiguous member take the
    checked ops path instead."""
    from fp_recipes.quantizers import grouped as GF

    a, b = torch.randn(4, 16), torch.randn(4, 16)
    q = type("Q", (), {"scale": torch.ones(())})()
    assert GF._kernel_ready([a, b], [q, q], True)
    assert not GF._kernel_ready([a, b.to(torch.bfloat16)], [q, q], True)
    assert not GF._kernel_ready([a, torch.randn(16, 4).t()], [q, q], True)
    q64 = type("Q", (), {"scale": torch.ones((), dtype=torch.float64)})()
    assert not GF._kernel_ready([a, b], [q, q64], True)
    assert GF._kernel_ready([a, b], [q, q64], False)


@pytest.mark.parametrize("setting,expected", [(None, (True, False, False)), ("all", (True, True, True)),
                                              ("none", (False, False, False)), ("dgrad", (False, True, False)),
                                              ("fprop,wgrad", (True, False, True))])
@pytest.mark.parametrize("kind", ["linear", "layernorm_linear", "grouped"])
@pytest.mark.parametrize("recipe_cls", [DelayedScaling, Float8CurrentScaling])
def test_fast_accumulation_reaches_each_gemm(recipe_cls, kind, setting, expected, monkeypatch):
    """The recipe's fast_accumulation picks, per GEMM, cuBLASLt's fast accumulation: the fprop GEMM in the forward,
    dgrad (transpose_b) and wgrad (transpose_a) in the backward receive their own flag (the real GEMMs run; the
    flag is recorded on the way in). Default: fprop only, as TransformerEngine and torchao."""
    from _modules_helpers import record_gemm_accumulation

    seen = record_gemm_accumulation(monkeypatch)
    recipe = recipe_cls() if setting is None else recipe_cls(fast_accumulation=setting)
    torch.manual_seed(0)
    if kind == "grouped":
        mod = GroupedLinear(2, 32, 16)
        x = torch.randn(24, 32, requires_grad=True)
        with fp_recipes.autocast(recipe=recipe):
            y = mod(x, [8, 16])
    else:
        mod = Linear(32, 16) if kind == "linear" else LayerNormLinear(32, 16)
        x = torch.randn(24, 32, requires_grad=True)
        with fp_recipes.autocast(recipe=recipe):
            y = mod(x)
    y.sum().backward()
    assert seen == list(zip(("fprop", "dgrad", "wgrad"), expected))


def test_fast_accumulation_under_checkpoint_torch_autocast_and_threads(monkeypatch):
    """As a real job runs it: inside non-reentrant activation checkpointing under torch.autocast(bf16), the recompute
    repeats the forward's flag; two threads under different recipes each get their own recipe's flags (the autocast
    state is per thread) and the same results as running alone."""
    import threading

    from fp_recipes.modules import linear_function as LF

    seen = {}
    real = LF.gemm

    def spy(a, b, **kw):
        which = "wgrad" if kw.get("transpose_a") else "dgrad" if kw.get("transpose_b") else "fprop"
        seen.setdefault(threading.current_thread().name, []).append((which, kw.get("use_fast_accum", False)))
        return real(a, b, **kw)

    monkeypatch.setattr(LF, "gemm", spy)

    def run(recipe, seed=0):
        g = torch.Generator().manual_seed(seed)  # (not the global generator: two threads draw at once)
        mod = Linear(32, 16)
        with torch.no_grad():
            mod.weight.copy_(torch.randn(16, 32, generator=g) / 8)
            mod.bias.copy_(torch.randn(16, generator=g))
        x = torch.randn(24, 32, generator=g).requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16), fp_recipes.autocast(recipe=recipe):
            y = torch.utils.checkpoint.checkpoint(mod, x, use_reentrant=False)
        y.float().sum().backward()
        return y.detach(), x.grad, mod.weight.grad

    run(DelayedScaling(fast_accumulation="dgrad"))
    assert seen.pop(threading.current_thread().name) == [("fprop", False), ("fprop", False), ("dgrad", True),
                                                          ("wgrad", False)]
    recipes = {"t_all": Float8CurrentScaling(fast_accumulation="all"), "t_none": Float8CurrentScaling(fast_accumulation="none")}
    alone = {name: run(r, seed=1) for name, r in recipes.items()}
    seen.clear()
    results = {}
    barrier = threading.Barrier(2)

    def worker(name):
        barrier.wait()
        results[name] = run(recipes[name], seed=1)

    threads = [threading.Thread(target=worker, args=(n,), name=n) for n in recipes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["t_all"] == [("fprop", True), ("fprop", True), ("dgrad", True), ("wgrad", True)]
    assert seen["t_none"] == [("fprop", False), ("fprop", False), ("dgrad", False), ("wgrad", False)]
    for name in recipes:
        for got, want in zip(results[name], alone[name]):
            assert torch.equal(got, want), name
