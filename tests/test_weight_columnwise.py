"""A weight's columnwise FP8 copy for dgrad made in the backward instead of held from the forward
(``modules/weight_columnwise.py``, issue 14's peak-memory target): the same bits as saving it, every
policy, both per-tensor FP8 recipes, with the weight cache, under activation checkpointing, on CPU (the
twins) and CUDA (the kernels); what the forward saves; the policy's errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fp_recipes
from fp_recipes import DelayedScaling, Float8CurrentScaling
from fp_recipes.modules.base import quantized_linear
from fp_recipes.quantizers import float8

RECIPES = {"delayed": lambda: DelayedScaling(amax_history_len=4), "current": Float8CurrentScaling}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.fixture
def recasts(monkeypatch):
    """How many columnwise copies the backward made (at the quantizers' quantize_columnwise seam)."""
    calls = [0]
    for cls in (float8.Float8Quantizer, float8.Float8CurrentScalingQuantizer):
        orig = cls.quantize_columnwise

        def counted(self, *args, _orig=orig, **kwargs):
            calls[0] += 1
            return _orig(self, *args, **kwargs)
        monkeypatch.setattr(cls, "quantize_columnwise", counted)
    return calls


def _device(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def _train(model, recipe, xs, *, ckpt=False):
    """One SGD step per batch; returns the outputs, input gradients and the final state."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outs, grads = [], []
    for x in xs:
        x = x.clone().requires_grad_()
        with fp_recipes.autocast(recipe=recipe):
            y = checkpoint(model, x, use_reentrant=False) if ckpt else model(x)
        y.float().square().mean().backward()
        outs.append(y.detach())
        grads.append(x.grad)
        opt.step()
        opt.zero_grad()
    return outs, grads, {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _model(device: str, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    # 24 tokens: 64 -> 96 (more outputs than tokens: "auto" recasts), 96 -> 16 (fewer: "auto" saves)
    return torch.nn.Sequential(fp_recipes.LayerNormLinear(64, 96, params_dtype=dtype, device=device), torch.nn.GELU(),
                               fp_recipes.Linear(96, 16, params_dtype=dtype, device=device))


def _set(model, policy: str, cache: bool = True) -> torch.nn.Module:
    for m in model.modules():
        if hasattr(m, "weight_columnwise_copy"):
            m.weight_columnwise_copy = policy
            m.cache_quantized_weights = cache
    return model


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("name", list(RECIPES))
def test_recast_gives_the_saved_copys_bits(name, ckpt, device, recasts):
    """"recast" and "auto" train exactly as "save" (outputs, input gradients, weights and delayed-scaling state
    after each SGD step), with the weight cache on and off; "recast" makes one copy per layer and backward
    once the automatic cache stopped storing (the first step stores: its copy serves the backward)."""
    _device(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(24, 64, generator=g).to(device, dtype) for _ in range(4)]
    base = _model(device, dtype)
    want = _train(_set(copy.deepcopy(base), "save"), RECIPES[name](), xs, ckpt=ckpt)
    assert recasts[0] == 0
    for policy, cache, expect in (("recast", False, 2 * 4), ("recast", True, 2 * 3), ("auto", False, 4)):
        recasts[0] = 0
        got = _train(_set(copy.deepcopy(base), policy, cache), RECIPES[name](), xs, ckpt=ckpt)
        assert recasts[0] == expect, (policy, cache)
        for a, b in zip(want[0] + want[1], got[0] + got[1]):
            assert torch.equal(a, b), (policy, cache)
        assert want[2].keys() == got[2].keys()
        for k in want[2]:
            assert torch.equal(want[2][k], got[2][k]), (policy, cache, k)


@pytest.mark.parametrize("name", list(RECIPES))
def test_what_the_forward_saves(name):
    """"save" holds the weight's (in, out) FP8 copy for the backward; "recast" holds no FP8 tensor of the
    weight's size (the weight itself, resident anyway, and scalars)."""
    layer = fp_recipes.Linear(64, 96, bias=False)
    layer.cache_quantized_weights = False
    x = torch.randn(24, 64, requires_grad=True)
    for policy, weight_sized_fp8 in (("save", 1), ("recast", 0)):
        layer.weight_columnwise_copy = policy
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            with fp_recipes.autocast(recipe=RECIPES[name]()):
                y = layer(x)
        fp8 = [t for t in saved if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
        assert sum(t.numel() == layer.weight.numel() for t in fp8) == weight_sized_fp8, policy
        assert any(t.numel() == x.numel() for t in fp8)  # x's columnwise copy, in both
        y.sum().backward()


def test_policy_errors_and_scope():
    layer = fp_recipes.Linear(8, 8)
    assert layer.weight_columnwise_copy == "auto"
    with pytest.raises(ValueError, match="weight_columnwise_copy must be one of 'auto', 'save', 'recast'"):
        layer.weight_columnwise_copy = "recompute"
    grouped = fp_recipes.GroupedLinear(2, 8, 8)
    grouped.weight_columnwise_copy = "save"
    with pytest.raises(ValueError, match="GroupedLinear: weight_columnwise_copy='recast' is not supported"):
        grouped.weight_columnwise_copy = "recast"
    sets = None
    with fp_recipes.autocast(recipe=Float8CurrentScaling()):
        layer(torch.randn(4, 8))
        sets = layer.quantizer_sets
        with pytest.raises(ValueError, match="got 'Save'"):
            quantized_linear(torch.randn(4, 8), layer.weight, None, sets[0], weight_columnwise_copy="Save")
    # other formats keep their copies: NVFP4 makes no backward cast and trains as before
    torch.manual_seed(0)
    a = fp_recipes.Linear(32, 64)
    b = copy.deepcopy(a)
    a.weight_columnwise_copy, b.weight_columnwise_copy = "recast", "save"
    x = torch.randn(16, 32)
    for m in (a, b):
        with fp_recipes.autocast(recipe=fp_recipes.NVFP4BlockScaling()):
            m(x).sum().backward()
    assert torch.equal(a.weight.grad, b.weight.grad)


@pytest.mark.parametrize("name", list(RECIPES))
def test_recast_under_torch_autocast_bf16_matches_save(name, recasts):
    """FP32 master weights under torch.autocast(bfloat16) (how HF Trainer and RL jobs run): the backward casts the
    columnwise copy from the FP32 master weight, as the forward's cast did; outputs and every gradient equal
    "save"'s bit for bit."""
    torch.manual_seed(0)
    a = fp_recipes.Linear(32, 64)
    b = copy.deepcopy(a)
    a.weight_columnwise_copy, b.weight_columnwise_copy = "recast", "save"
    a.cache_quantized_weights = b.cache_quantized_weights = False
    recipe = RECIPES[name]()
    got = []
    for m in (a, b):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(3), requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16), fp_recipes.autocast(recipe=recipe):
            y = m(x)
        assert y.dtype == torch.bfloat16
        y.float().square().sum().backward()
        got.append((y.detach(), x.grad, m.weight.grad, m.bias.grad))
    for u, v in zip(*got):
        assert torch.equal(u, v)
    assert recasts[0] == 1  # a's backward made its copy; b saved one


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_the_backward_frees_what_dgrad_alone_read_before_wgrad(name, device, ckpt, monkeypatch):
    """The recast weight copy and dy's rowwise copy are read by dgrad only: both are freed before the wgrad GEMM
    allocates dW (at a wide layer's wgrad, the step's peak: a Llama FC1's copy is as large as half its dW). Also as
    a job runs it (``ckpt``): inside non-reentrant activation checkpointing under torch.autocast(bf16), where the
    gradients equal the same step's without checkpointing."""
    import weakref

    from fp_recipes.modules import linear_function

    _device(device)
    torch.manual_seed(0)
    layer = fp_recipes.Linear(64, 256, device=device)
    layer.weight_columnwise_copy = "recast"
    layer.cache_quantized_weights = False  # (a cache that stores keeps both copies from the forward: nothing to free)
    x = torch.randn(32, 64, device=device, requires_grad=True)
    orig, refs, alive = linear_function.gemm, [], []

    def spy(a, b, **kw):
        if kw.get("transpose_a"):  # wgrad: dy^T x
            alive.append([r() is not None for r in refs])
        elif kw.get("transpose_b"):  # dgrad: dy W, its operands' rowwise dy and columnwise W
            refs[:] = [weakref.ref(a.data), weakref.ref(b.data_t)]
        return orig(a, b, **kw)

    twin = copy.deepcopy(layer)
    dy = torch.randn(32, 256, device=device)

    def step(mod, inp, checkpointed):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=checkpointed), \
                fp_recipes.autocast(recipe=RECIPES[name]()):
            y = checkpoint(mod, inp, use_reentrant=False) if checkpointed else mod(inp)
        y.backward(dy.to(y.dtype))

    monkeypatch.setattr(linear_function, "gemm", spy)
    step(layer, x, ckpt)
    assert len(refs) == 2 and alive == [[False, False]]
    assert torch.isfinite(layer.weight.grad).all() and layer.weight.grad.abs().sum() > 0
    if ckpt:  # the same step under torch.autocast, not checkpointed: the same gradients
        x2 = x.detach().clone().requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16), fp_recipes.autocast(recipe=RECIPES[name]()):
            y2 = twin(x2)
        y2.backward(dy.to(y2.dtype))
        assert torch.equal(twin.weight.grad, layer.weight.grad) and torch.equal(x2.grad, x.grad)
