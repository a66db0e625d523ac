"""The fused FP8 cast of an activation's output (``ops/cuda_fp8_act.py``) against its twin, torch's activation then
the plain cast, byte for byte: odd shapes and tails, one row, BF16/FP16/FP32 input, both scalings and formats,
every copy choice, zeros, huge values, infinities and NaN. Then LayerNormMLP on CUDA against its three modules,
with the fused cast taken, and the fallback when the first-use check fails. Needs a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fp_recipes
from fp_recipes import DelayedScaling, Float8CurrentScaling, LayerNormLinear, LayerNormMLP, Linear
from fp_recipes.ops import cuda_fp8, cuda_fp8_act

pytestmark = pytest.mark.cuda
DEV = "cuda"


@pytest.fixture(scope="module", autouse=True)
def _kernel():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    assert cuda_fp8_act.available(), "fp_recipes._C has no fp8_act_quantize: rebuild the extension"


def _x(shape, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 12, shape, generator=g).float())
    if x.numel() > 8:
        x.view(-1)[:6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e30])
    return x.to(dtype).to(DEV)


def _bytes(t):
    if t is None:
        return None
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(torch.int32)


def _same(got, want, what):
    for name in ("data", "data_t", "scale_inv", "amax", "scale"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), (what, name)
        if a is not None:
            assert torch.equal(_bytes(a), _bytes(b)), (what, name)


def test_the_first_use_check_passes_here():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert cuda_fp8_act.fusion_ok(torch.device(DEV), dtype, "gelu"), dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 16), (3, 7), (65, 1008), (257, 1040), (2048, 512)])
def test_fused_cast_equals_the_activation_then_the_cast(dtype, shape):
    x = _x(shape, dtype, sum(shape))
    a = F.gelu(x, approximate="tanh")
    for fmt in ("e4m3", "e5m2"):
        for rowwise, columnwise in ((True, True), (True, False), (False, True)):
            what = (dtype, shape, fmt, rowwise, columnwise)
            scale = torch.tensor(0.375, device=DEV)
            h_got, h_want = torch.full((), 0.5, device=DEV), torch.full((), 0.5, device=DEV)
            got = cuda_fp8_act.fp8_act_quantize(x, "gelu", fmt, rowwise, columnwise, scale=scale, record=h_got)
            want = cuda_fp8.fp8_quantize_recording(a, scale, fmt, rowwise, columnwise, h_want)
            _same(got, want, ("delayed",) + what)
            assert torch.equal(_bytes(h_got), _bytes(h_want)), what  # bits: NaN inputs record NaN
            for pow2, eps in ((False, 0.0), (True, 1e-3)):
                got = cuda_fp8_act.fp8_act_quantize(x, "gelu", fmt, rowwise, columnwise, use_power_2_scales=pow2,
                                                    amax_epsilon=eps)
                want = cuda_fp8.fp8_current_scaling_quantize(a, fmt, use_power_2_scales=pow2, amax_epsilon=eps,
                                                             rowwise=rowwise, columnwise=columnwise)
                _same(got, want, ("current", pow2) + what)


def test_op_outputs_are_fp32_whatever_the_default_dtype(monkeypatch):
    """The traced ops' FP32 values are FP32 under another default dtype (they are allocated one by one there)."""
    x = _x((64, 96), torch.bfloat16, 7)
    hist = torch.zeros(4, device=DEV)
    torch.set_default_dtype(torch.float64)
    try:
        out = torch.ops.fp_recipes.fp8_delayed_act_cast.default(x, torch.tensor(0.5, device=DEV, dtype=torch.float32),
                                                                hist, "e4m3", True, True, "gelu")
        cur = torch.ops.fp_recipes.fp8_current_act_cast.default(x, "e4m3", False, 0.0, True, True, "gelu")
    finally:
        torch.set_default_dtype(torch.float32)
    assert [t.dtype for t in out[2:]] == [torch.float32] * 2 and [t.dtype for t in cur[2:]] == [torch.float32] * 3
    want = cuda_fp8.fp8_current_scaling_quantize(F.gelu(x, approximate="tanh"), "e4m3", rowwise=True, columnwise=True)
    assert torch.equal(cur[0].view(torch.uint8), want.data.view(torch.uint8))


def test_an_empty_input_gives_the_plain_casts_scales():
    x = torch.empty(0, 64, device=DEV, dtype=torch.bfloat16)
    got = cuda_fp8_act.fp8_act_quantize(x, "gelu", "e4m3", True, True)
    want = cuda_fp8.fp8_current_scaling_quantize(x, "e4m3", rowwise=True, columnwise=True)
    _same(got, want, "empty current")


def _mlp_steps(recipe_factory, fused: bool, monkeypatch, fail_check: bool = True) -> list:
    """A LayerNormMLP (gelu) trained 3 steps and its three modules trained the same way: outputs, gradients.
    ``fused``: whether FC2's cast is expected to be the fused one; not ``fused`` and ``fail_check``: the first-use
    check is made to fail (the fallback)."""
    torch.manual_seed(0)
    mlp = LayerNormMLP(256, 512, params_dtype=torch.bfloat16, device=DEV)
    fc1 = LayerNormLinear(256, 512, params_dtype=torch.bfloat16, device=DEV)
    fc2 = Linear(512, 256, params_dtype=torch.bfloat16, device=DEV)
    fc1.load_state_dict(mlp.fc1.state_dict())
    fc2.load_state_dict(mlp.fc2.state_dict())
    assert cuda_fp8_act.fusion_ok(torch.device(DEV), torch.bfloat16, "gelu")  # (its probe casts, before counting)
    calls = []
    real = cuda_fp8_act.fp8_act_quantize

    def counting(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(cuda_fp8_act, "fp8_act_quantize", counting)
    if not fused and fail_check:
        monkeypatch.setitem(cuda_fp8_act._CHECKED, (torch.cuda.current_device(), torch.bfloat16, "gelu"), False)
    r_mlp, r_ref = recipe_factory(), recipe_factory()
    outs = []
    for _ in range(3):
        x = torch.randn(200, 256, device=DEV, dtype=torch.bfloat16)
        dy = torch.randn(200, 256, device=DEV, dtype=torch.bfloat16)
        for mods, run, recipe in ((mlp, mlp, r_mlp),
                                  (None, lambda v: fc2(F.gelu(fc1(v), approximate="tanh")), r_ref)):
            v = x.clone().requires_grad_(True)
            with fp_recipes.autocast(recipe=recipe):
                y = run(v)
            y.backward(dy)
            params = list(mlp.parameters()) if mods is not None else list(fc1.parameters()) + list(fc2.parameters())
            outs.append([y.detach(), v.grad] + [p.grad.clone() for p in params])
            for p in params:
                p.grad = None
    assert (len(calls) == 3) == fused, calls
    return outs


def _opt_in_current(monkeypatch):
    """Current scaling takes the fused cast only when asked (``fuse_activation``: its two passes are compute-bound)."""
    from fp_recipes.quantizers.float8 import Float8CurrentScalingQuantizer

    monkeypatch.setattr(Float8CurrentScalingQuantizer, "fuse_activation", True)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("fused", [True, False])
def test_layernorm_mlp_equals_its_modules_on_cuda(recipe, fused, monkeypatch):
    factory = (lambda: DelayedScaling(amax_history_len=4)) if recipe == "delayed" else Float8CurrentScaling
    if recipe == "current":
        _opt_in_current(monkeypatch)
    outs = _mlp_steps(factory, fused, monkeypatch)
    for step in range(3):
        got, want = outs[2 * step], outs[2 * step + 1]
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), (recipe, fused, step, i)


def test_current_scaling_takes_the_composition_by_default(monkeypatch):
    """Without the opt-in, a current-scaling LayerNormMLP makes no fused cast (torch's GELU, then the plain cast) and
    gives what its three modules give."""
    from fp_recipes.quantizers.float8 import Float8CurrentScalingQuantizer

    assert Float8CurrentScalingQuantizer.fuse_activation is False
    outs = _mlp_steps(Float8CurrentScaling, False, monkeypatch, fail_check=False)  # (asserts no fused call)
    for step in range(3):
        for i, (a, b) in enumerate(zip(outs[2 * step], outs[2 * step + 1])):
            assert torch.equal(a, b), (step, i)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_compiled_layernorm_mlp_takes_the_fused_op_and_equals_eager(recipe, monkeypatch):
    """Under torch.compile (aot_eager: bit for bit) FC2's input cast is the fused op, and the steps equal eager's."""
    from fp_recipes.modules.base import compile_supported

    if not compile_supported():
        pytest.skip("fp_recipes modules compile from torch 2.11")
    factory = (lambda: DelayedScaling(amax_history_len=4)) if recipe == "delayed" else Float8CurrentScaling
    if recipe == "current":
        _opt_in_current(monkeypatch)
    torch.manual_seed(0)
    mlp = LayerNormMLP(256, 512, params_dtype=torch.bfloat16, device=DEV)
    twin = LayerNormMLP(256, 512, params_dtype=torch.bfloat16, device=DEV)
    twin.load_state_dict(mlp.state_dict())
    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    r_c, r_e = factory(), factory()
    op = "fp_recipes::fp8_delayed_act_cast" if recipe == "delayed" else "fp_recipes::fp8_current_act_cast"
    for step in range(3):
        x = torch.randn(128, 256, device=DEV, dtype=torch.bfloat16)
        dy = torch.randn(128, 256, device=DEV, dtype=torch.bfloat16)
        outs = []
        for run, mod, r in ((compiled, mlp, r_c), (twin, twin, r_e)):
            v = x.clone().requires_grad_(True)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                with fp_recipes.autocast(recipe=r):
                    y = run(v)
                y.backward(dy)
            if mod is mlp:
                assert any(e.name == op for e in prof.events()), f"{op} did not run"
            outs.append([y.detach(), v.grad] + [p.grad.clone() for p in mod.parameters()])
            mod.zero_grad(set_to_none=True)
        for i, (a, b) in enumerate(zip(*outs)):
            assert torch.equal(a, b), (recipe, step, i)



def _mlp_case(seed: int, steps: int = 3) -> tuple:
    """A delayed-scaling LayerNormMLP (gelu, BF16, CUDA) and ``steps`` (x, dy) pairs, made from ``seed`` on the calling
    thread (the global RNG is not shared with other threads' work)."""
    torch.manual_seed(seed)
    mlp = LayerNormMLP(256, 512, params_dtype=torch.bfloat16, device=DEV)
    data = [(torch.randn(192, 256, device=DEV, dtype=torch.bfloat16),
             torch.randn(192, 256, device=DEV, dtype=torch.bfloat16)) for _ in range(steps)]
    return mlp, data


def _mlp_run(mlp: LayerNormMLP, data: list, wrap) -> list:
    """``mlp`` trained on ``data`` with ``wrap(mlp)`` as its forward under its own recipe: each step's output, input
    gradient and parameter gradients, then the scaling state."""
    recipe = DelayedScaling(amax_history_len=4)
    run = wrap(mlp)
    outs = []
    for x, dy in data:
        x = x.clone().requires_grad_(True)
        with fp_recipes.autocast(recipe=recipe):
            y = run(x)
        y.backward(dy)
        outs += [y.detach(), x.grad] + [p.grad.clone() for p in mlp.parameters()]
        mlp.zero_grad(set_to_none=True)
    return outs + [v for v in mlp.state_dict().values() if torch.is_tensor(v)]


def test_fused_mlp_under_checkpointing_and_from_two_threads_equals_plain_steps(monkeypatch):
    """As a training job runs it: inside torch.utils.checkpoint (the forward recomputed in the backward) and from two
    threads at once (each its own module and recipe), the fused path's steps equal the plain eager ones, bit for
    bit, scaling state included."""
    from torch.utils.checkpoint import checkpoint

    from _threads import run_in_threads

    assert cuda_fp8_act.fusion_ok(torch.device(DEV), torch.bfloat16, "gelu")
    calls = []
    real = cuda_fp8_act.fp8_act_quantize

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cuda_fp8_act, "fp8_act_quantize", counting)
    plain = _mlp_run(*_mlp_case(1), lambda m: m)
    assert len(calls) == 3, calls  # (the fused cast, once per step)
    ckpt = _mlp_run(*_mlp_case(1), lambda m: (lambda v: checkpoint(m, v, use_reentrant=False)))
    assert len(calls) >= 6, calls
    for i, (a, b) in enumerate(zip(ckpt, plain)):
        assert torch.equal(a, b), ("checkpointed", i)
    cases = [_mlp_case(2), _mlp_case(3)]
    alone = [_mlp_run(*_mlp_case(seed), lambda m: m) for seed in (2, 3)]
    threaded = run_in_threads(lambda mlp, data: _mlp_run(mlp, data, lambda m: m), cases)
    for t, (got, want) in enumerate(zip(threaded, alone)):
        assert len(got) == len(want)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), ("thread", t, i)
