"""The bias gradient of a Linear's grad_output: ``ops.bias_grad``'s fixed summation order (the contract),
the CUDA kernels (alone, fused into the FP8 casts and into the NVFP4 tile kernel of dy, one call per
grouped layer) against it byte for byte, and the modules that use it.

The order (ops/ref_fp8.py, bias_grad): FP32 sums of 16-row segments, four per 64-row tile, tiles added in
order, rows past M counted as +0.0, one rounding to the bias dtype. CPU tests check the reference against
an element-by-element NumPy FP32 loop written from that description; GPU tests (marked ``cuda``) check
every kernel path against the reference run on the same CUDA tensors.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fp_recipes
from fp_recipes import DelayedScaling, Float8CurrentScaling, ops
from fp_recipes.ops import ref_fp8

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HAS_CUDA = torch.cuda.is_available()


def loop_bias_grad(x: torch.Tensor) -> np.ndarray:
    """The documented order, one FP32 add at a time (NumPy float32 scalars: IEEE, round to nearest)."""
    f = x.detach().float().cpu().numpy()
    m, n = f.shape
    tiles = -(-m // 64)
    out = np.zeros(n, dtype=np.float32)
    with np.errstate(all="ignore"):
        for c in range(n):
            acc = None
            for t in range(tiles):
                segs = []
                for q in range(4):
                    s = None
                    for j in range(16):
                        r = 64 * t + 16 * q + j
                        v = np.float32(f[r, c]) if r < m else np.float32(0.0)
                        s = v if s is None else np.float32(s + v)
                    segs.append(s)
                p = np.float32(np.float32(np.float32(segs[0] + segs[1]) + segs[2]) + segs[3])
                acc = p if acc is None else np.float32(acc + p)
            out[c] = np.float32(0.0) if acc is None else acc
    return out


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit equality, NaN meeting NaN (payloads are not part of the contract)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    nan_g, nan_w = torch.isnan(got), torch.isnan(want)
    if not torch.equal(nan_g, nan_w):
        return False
    g = torch.where(nan_g, torch.zeros_like(got), got)
    w = torch.where(nan_w, torch.zeros_like(want), want)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[g.element_size()]
    return torch.equal(g.contiguous().view(width), w.contiguous().view(width))


def special_input(shape, dtype, kind: str, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-10, 10, (n,), generator=g).float())
    if kind == "zeros":
        x = torch.zeros(n) * -1.0  # negative zeros: the sum of -0.0s is +0.0 once a +0.0 pad or sum joins
    elif kind == "huge" and n:
        lim = torch.finfo(dtype).max
        x[::5] = lim
        x[1::7] = -lim
        x[2::11] = float("inf")
    elif kind == "nan" and n:
        x[n // 2] = float("nan")
        x[1::13] = float("-inf")
    return x.to(dtype).reshape(shape).to(device)


# ---- the reference is the documented order ------------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 1), (15, 3), (16, 2), (63, 4), (64, 3), (65, 2), (130, 5), (0, 3), (4, 0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_the_documented_order(shape, dtype):
    for kind in ("random", "zeros", "huge", "nan"):
        x = special_input(shape, dtype, kind, seed=shape[0] * 7 + shape[1])
        got = ops.bias_grad(x, torch.float32)
        want = torch.from_numpy(loop_bias_grad(x))
        assert same_bits(got, want), (shape, dtype, kind, got, want)


def test_reference_rounds_once_to_the_bias_dtype():
    x = special_input((200, 9), torch.bfloat16, "random", seed=3)
    f32 = ops.bias_grad(x, torch.float32)
    for dt in (torch.float16, torch.bfloat16):
        assert same_bits(ops.bias_grad(x, dt), f32.to(dt))


def test_reference_is_close_to_torch_sum_and_exact_on_integers():
    x = torch.randn(1000, 64, dtype=torch.float32)
    assert torch.allclose(ops.bias_grad(x), x.double().sum(0).float(), rtol=1e-5, atol=1e-4)
    ints = torch.randint(-100, 100, (777, 33)).float()  # every partial sum is an exact FP32 integer
    assert torch.equal(ops.bias_grad(ints), ints.sum(0))


def test_bad_input_gets_a_clear_error():
    with pytest.raises(TypeError, match="float32, float16, bfloat16"):
        ops.bias_grad(torch.zeros(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="2-D"):
        ops.bias_grad(torch.zeros(4))
    with pytest.raises(TypeError, match="out_dtype must be float32, float16 or bfloat16"):
        ops.bias_grad(torch.zeros(4, 4), torch.float64)


# ---- modules use it ------------------------------------------------------------------------------

def _linear_bias_grad(device: str, recipe, dtype=torch.bfloat16, tokens=200, k=64, n=48):
    torch.manual_seed(0)
    lin = fp_recipes.Linear(k, n, bias=True, params_dtype=dtype, device=device)
    x = torch.randn(tokens, k, dtype=dtype, device=device, requires_grad=True)
    dy = (torch.randn(tokens, n, dtype=torch.float32, device=device) * 3).to(dtype)
    with fp_recipes.autocast(recipe=recipe):
        y = lin(x)
    y.backward(dy)
    return lin.bias.grad, dy


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()], ids=["delayed", "current"])
def test_linear_bias_grad_is_ops_bias_grad_cpu(recipe):
    db, dy = _linear_bias_grad("cpu", recipe)
    assert same_bits(db, ops.bias_grad(dy, db.dtype))


# ---- CUDA ---------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

CUDA_SHAPES = [(1, 1), (1, 17), (3, 5), (63, 64), (64, 64), (65, 63), (200, 72), (129, 4104), (1000, 17),
               (4096, 256), (0, 8), (8, 0), (70000, 8)]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("shape", CUDA_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_bias_grad_matches_reference(shape, dtype):
    from fp_recipes.ops import cuda_fp8

    for kind in ("random", "zeros", "huge", "nan"):
        x = special_input(shape, dtype, kind, seed=shape[0] + 31 * shape[1], device="cuda")
        for out_dtype in DTYPES:
            got = cuda_fp8.bias_grad(x, out_dtype)
            want = ref_fp8.bias_grad(x, out_dtype)
            assert same_bits(got, want), (shape, dtype, kind, out_dtype)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("shape", [(1, 16), (63, 64), (64, 64), (65, 72), (200, 136), (128, 4096), (1000, 24),
                                   (0, 16), (37, 30)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("copies", [(True, False), (False, True), (True, True)])
def test_cuda_fused_casts_match_the_cast_and_the_reference(shape, dtype, copies):
    """The casts with the fused bias gradient write the bytes of the plain casts, and db == reference."""
    from fp_recipes.ops import cuda_fp8

    rowwise, columnwise = copies
    for kind in ("random", "huge", "nan"):
        x = special_input(shape, dtype, kind, seed=7 * shape[0] + shape[1], device="cuda")
        scale = torch.tensor(0.37, device="cuda")
        for bias_dtype in (torch.float32, torch.bfloat16):
            want_db = ref_fp8.bias_grad(x, bias_dtype)
            # delayed scaling, with and without a record slot
            rec_a, rec_b = torch.full((), 0.5, device="cuda"), torch.full((), 0.5, device="cuda")
            got, db = cuda_fp8.fp8_quantize_dbias(x, scale, "e4m3", rowwise, columnwise, rec_a, bias_dtype)
            want = cuda_fp8.fp8_quantize_recording(x, scale, "e4m3", rowwise, columnwise, rec_b)
            assert same_bits(db, want_db), ("delayed db", shape, dtype, kind)
            assert same_bits(rec_a, rec_b)
            for a, b in ((got.data, want.data), (got.data_t, want.data_t)):
                assert (a is None) == (b is None)
                if a is not None:
                    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            assert same_bits(got.amax, want.amax) and same_bits(got.scale_inv, want.scale_inv)
            _, db_none = cuda_fp8.fp8_quantize_dbias(x, scale, "e4m3", rowwise, columnwise, None, bias_dtype)
            assert same_bits(db_none, want_db)
            # current scaling
            got, db = cuda_fp8.fp8_current_scaling_quantize_dbias(x, "e5m2", False, 0.0, rowwise, columnwise,
                                                                  bias_dtype)
            want = cuda_fp8.fp8_current_scaling_quantize(x, "e5m2", rowwise=rowwise, columnwise=columnwise)
            assert same_bits(db, want_db), ("current db", shape, dtype, kind)
            if rowwise:
                assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
            if columnwise:
                assert torch.equal(got.data_t.view(torch.uint8), want.data_t.view(torch.uint8))
            assert same_bits(got.amax, want.amax) and same_bits(got.scale, want.scale)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("rows", [[64, 0, 32, 128], [1], [0, 0], [17, 33, 5] * 23])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_grouped_bias_grads_match_per_expert_reference(rows, dtype):
    from fp_recipes.ops import cuda_fp8

    dy = special_input((sum(rows), 40), dtype, "random", seed=len(rows), device="cuda")
    dtypes = [torch.bfloat16 if g % 3 else torch.float32 for g in range(len(rows))]
    dtypes[-1] = None  # a member without a bias
    got = cuda_fp8.bias_grads_rows(dy, rows, dtypes)
    for g, (part, dt) in enumerate(zip(dy.split(rows), dtypes)):
        if dt is None:
            assert got[g] is None
        else:
            assert same_bits(got[g], ref_fp8.bias_grad(part, dt)), g


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling(), fp_recipes.NVFP4BlockScaling()],
                         ids=["delayed", "current", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_linear_bias_grad_is_the_reference_of_its_dy(recipe, dtype):
    """The Linear's bias gradient (fused into dy's cast for FP8, the standalone kernel otherwise) is the
    reference order's bits of the dy it received, as on CPU."""
    db, dy = _linear_bias_grad("cuda", recipe, dtype=dtype, tokens=320, k=128, n=96)
    assert same_bits(db, ref_fp8.bias_grad(dy, db.dtype))
    db_cpu, _ = _linear_bias_grad("cpu", recipe, dtype=dtype, tokens=320, k=128, n=96)
    assert same_bits(db.cpu(), ref_fp8.bias_grad(dy.cpu(), db.dtype))
    assert db_cpu.dtype == db.dtype


def _autocast_checkpoint_bias_grad(device: str, recipe, checkpoint: bool):
    """A Linear with FP32 parameters under torch.autocast(bf16) and fp_recipes.autocast, optionally inside
    torch.utils.checkpoint (as RL / fine-tuning jobs run it): its bias gradient and the dy it received."""
    torch.manual_seed(1)
    lin = fp_recipes.Linear(96, 64, bias=True, device=device)  # FP32 parameters
    x = torch.randn(130, 96, device=device, requires_grad=True)
    seen = {}

    def fwd(inp):
        y = lin(inp)
        y.register_hook(lambda g: seen.__setitem__("dy", g))
        return y

    with torch.autocast(device_type=device, dtype=torch.bfloat16), fp_recipes.autocast(recipe=recipe):
        y = torch.utils.checkpoint.checkpoint(fwd, x, use_reentrant=False) if checkpoint else fwd(x)
    y.float().square().sum().backward()
    return lin.bias.grad, seen["dy"]


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling(), fp_recipes.NVFP4BlockScaling()],
                         ids=["delayed", "current", "nvfp4"])
def test_bias_grad_under_torch_autocast_and_checkpoint_cpu(recipe):
    """FP32 bias, BF16 dy: the bias gradient is ops.bias_grad(dy, float32), with and without activation
    checkpointing, and the same bits either way."""
    db, dy = _autocast_checkpoint_bias_grad("cpu", recipe, checkpoint=False)
    db_ck, dy_ck = _autocast_checkpoint_bias_grad("cpu", recipe, checkpoint=True)
    assert db.dtype == torch.float32 and dy.dtype == torch.bfloat16
    assert same_bits(db, ops.bias_grad(dy, torch.float32))
    assert torch.equal(dy, dy_ck) and same_bits(db_ck, db)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling(), fp_recipes.NVFP4BlockScaling()],
                         ids=["delayed", "current", "nvfp4"])
def test_cuda_bias_grad_under_torch_autocast_and_checkpoint(recipe):
    """The fused path (BF16 dy, FP32 bias; NVFP4: the tile kernel's) under torch.autocast and checkpointing:
    the twin's bits."""
    db, dy = _autocast_checkpoint_bias_grad("cuda", recipe, checkpoint=False)
    db_ck, _ = _autocast_checkpoint_bias_grad("cuda", recipe, checkpoint=True)
    assert same_bits(db, ref_fp8.bias_grad(dy, torch.float32))
    assert same_bits(db_ck, db)


# ---- NVFP4: the bias gradient fused into dy's columnwise quantization (the v7 tile kernel) ---------

NVFP4_FUSED_CONFIGS = {
    "plain": dict(),
    "rht_sr": dict(rht=True, stochastic_rounding=True),  # the default recipe's grad_output
    "4over6_fast": dict(four_over_six=True, err_fast_math=True),  # the row-scaled + 4over6 "fast" recipe's
    "4over6_strict_mse": dict(four_over_six=True, err_mode="MSE"),
}


def _nvfp4_plan(cfg: dict):
    from fp_recipes.ops import cuda_nvfp4

    opts = dict(rowwise=True, columnwise=True, block_2d=False, row_scaled=False, four_over_six=False,
                e4m3_max=448, err_mode="MAE", err_fast_math=False, rht=False, stochastic_rounding=False)
    opts.update(cfg)
    return cuda_nvfp4.QuantizePlan(**opts)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("shape", [(16, 16), (48, 96), (80, 1040), (208, 160), (320, 48), (1040, 32), (64, 80)])
@pytest.mark.parametrize("dtype,cfg", [(d, c) for d in DTYPES for c in NVFP4_FUSED_CONFIGS
                                       if d == torch.bfloat16 or "rht" not in c])  # RHT takes BF16 only
def test_cuda_nvfp4_fused_bias_grad_matches_the_cast_and_the_reference(shape, dtype, cfg):
    """The NVFP4 quantization with the fused bias gradient writes the bytes of the plain quantization (same
    seed and offset), and db == the reference order's bits, for 64-row tiles cut by M (M % 64 != 0), tile
    columns cut by N, NaN/Inf/huge/-0 inputs and every bias dtype."""
    from fp_recipes.ops import cuda_nvfp4

    kw = NVFP4_FUSED_CONFIGS[cfg]
    for kind in ("random", "huge", "nan", "zeros"):
        x = special_input(shape, dtype, kind, seed=3 * shape[0] + shape[1], device="cuda")
        for bias_dtype in DTYPES:
            fused = cuda_nvfp4.nvfp4_quantize_planned_dbias(x, _nvfp4_plan(kw), 77, 2**33 + 5, bias_dtype)
            assert fused is not None, "the fused launch declined a 1-D columnwise quantization"
            got, db = fused
            want = cuda_nvfp4.nvfp4_quantize_planned(x, _nvfp4_plan(kw), None, 77, 2**33 + 5)
            assert same_bits(db, ref_fp8.bias_grad(x, bias_dtype)), (cfg, shape, dtype, kind, bias_dtype)
            for i, (a, b) in enumerate(zip(got, want)):
                assert (a is None) == (b is None), i
                if a is not None:
                    assert same_bits(a, b) if a.dtype == torch.float32 else \
                        torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (cfg, shape, dtype, kind, i)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("shape", [(80, 1040), (208, 352), (64, 80)])  # strips of 4 + 1, 4 + 2, one strip of 2
@pytest.mark.parametrize("cfg", ["plain", "rht_sr", "4over6_fast"])
def test_cuda_nvfp4_fused_bias_grad_in_strips(shape, cfg):
    """The same with tile2's strips of 4 tiles a thread block forced (the launcher's walk for large tensors): the
    fused cast's bytes and db against the plain quantization in the same walk and the reference bias gradient, and
    the bytes against the default walk's."""
    import _tile2_walk
    from fp_recipes.ops import cuda_nvfp4

    kw = NVFP4_FUSED_CONFIGS[cfg]
    x = special_input(shape, torch.bfloat16, "huge", seed=shape[1], device="cuda")
    tiles = cuda_nvfp4.nvfp4_quantize_planned(x, _nvfp4_plan(kw), None, 77, 5)
    with _tile2_walk.walk("strips"):
        got, db = cuda_nvfp4.nvfp4_quantize_planned_dbias(x, _nvfp4_plan(kw), 77, 5, torch.float32)
        want = cuda_nvfp4.nvfp4_quantize_planned(x, _nvfp4_plan(kw), None, 77, 5)
    assert same_bits(db, ref_fp8.bias_grad(x, torch.float32)), (cfg, shape)
    for i, (a, b, c) in enumerate(zip(got, want, tiles)):
        assert (a is None) == (b is None) == (c is None), i
        if a is not None:
            eq = same_bits if a.dtype == torch.float32 else lambda u, v: torch.equal(u.view(torch.uint8),
                                                                                     v.view(torch.uint8))
            assert eq(a, b) and eq(a, c), (cfg, shape, i)


@pytest.mark.cuda
@needs_cuda
def test_cuda_nvfp4_fused_bias_grad_declines_what_it_does_not_fuse():
    from fp_recipes.ops import cuda_nvfp4

    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    assert cuda_nvfp4.nvfp4_quantize_planned_dbias(x, _nvfp4_plan(dict(columnwise=False)), 0, 0,
                                                   torch.float32) is None
    assert cuda_nvfp4.nvfp4_quantize_planned_dbias(x, _nvfp4_plan(dict(block_2d=True)), 0, 0,
                                                   torch.float32) is None
    assert cuda_nvfp4.nvfp4_quantize_planned_dbias(x, _nvfp4_plan({}), 0, 0, torch.float64) is None
    with pytest.raises(ValueError, match="multiple of 16"):
        cuda_nvfp4.nvfp4_quantize_planned_dbias(torch.randn(40, 64, device="cuda", dtype=torch.bfloat16),
                                               _nvfp4_plan({}), 0, 0, torch.float32)  # M % 16 != 0
    with pytest.raises(ValueError, match="N=72 must be a multiple of 16"):
        cuda_nvfp4.nvfp4_quantize_planned_dbias(torch.randn(64, 72, device="cuda", dtype=torch.bfloat16),
                                               _nvfp4_plan({}), 0, 0, torch.float32)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("recipe", [fp_recipes.NVFP4BlockScaling(), fp_recipes.NVFP4BlockScaling(
    row_scaled_activation=True, disable_rht=True, disable_2d_quantization=True, disable_stochastic_rounding=True,
    nvfp4_4over6="all", nvfp4_4over6_err_use_fast_math=True)], ids=["default", "rs46"])
def test_cuda_nvfp4_linear_fused_bias_grad_changes_no_bit(recipe, monkeypatch):
    """A Linear with a bias under NVFP4: every gradient with the fused bias gradient equals the run with the
    standalone kernel, and the fused run launches no standalone bias kernel."""
    from fp_recipes.ops import cuda_nvfp4

    def run():
        torch.manual_seed(0)
        lin = fp_recipes.Linear(128, 96, bias=True, params_dtype=torch.bfloat16, device="cuda")
        x = torch.randn(320, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        dy = torch.randn(320, 96, dtype=torch.bfloat16, device="cuda")
        with fp_recipes.autocast(recipe=recipe):
            y = lin(x)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            y.backward(dy)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return (x.grad, lin.weight.grad, lin.bias.grad), names

    calls = []
    real = cuda_nvfp4.nvfp4_quantize_planned_dbias
    monkeypatch.setattr(cuda_nvfp4, "nvfp4_quantize_planned_dbias", lambda *a: calls.append(1) or real(*a))
    fused, names = run()
    assert calls and not any("bias_partials_kernel" in n for n in names), names
    monkeypatch.setattr(cuda_nvfp4, "nvfp4_quantize_planned_dbias", lambda *a: None)
    plain, names = run()
    assert any("bias_partials_kernel" in n for n in names), names
    for a, b in zip(fused, plain):
        assert same_bits(a, b)
