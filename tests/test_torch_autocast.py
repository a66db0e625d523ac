"""fp_recipes modules under ``torch.autocast`` (Hugging Face Trainer ``bf16=True``, accelerate, RL
trainers: FP32 master weights, BF16 activations): the autocast dtype is the activation and output
dtype, as for ``torch.nn.Linear`` and in TransformerEngine; the input gradient comes back in the
input's dtype, parameter gradients in the parameters' dtype. With quantization off the modules are
torch's own ops, so results equal ``torch.nn`` under autocast bit for bit."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import fp_recipes

RECIPES = {
    "delayed": lambda: fp_recipes.DelayedScaling(amax_history_len=4),
    "current": lambda: fp_recipes.Float8CurrentScaling(),
    "nvfp4": lambda: fp_recipes.NVFP4BlockScaling(),  # RHT and stochastic rounding on (the defaults)
    "per_token": lambda: fp_recipes.PerTokenScaling(),
    "current_hp_backward": lambda: fp_recipes.Float8CurrentScaling(backward_override="high_precision"),
}
MODULES = ("Linear", "LayerNormLinear", "GroupedLinear")
AMP = torch.bfloat16


def _make(kind: str, bias: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "Linear":
        return fp_recipes.Linear(64, 32, bias=bias)
    if kind == "LayerNormLinear":
        return fp_recipes.LayerNormLinear(64, 32, bias=bias)
    return fp_recipes.GroupedLinear(2, 64, 32, bias=bias)


def _call(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x, [16, 16]) if isinstance(m, fp_recipes.GroupedLinear) else m(x)


def _params(m: torch.nn.Module) -> dict:
    return dict(m.named_parameters())


def _input(dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 64, generator=g).to(dtype).requires_grad_()


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("kind", MODULES)
def test_output_dtype_is_torch_autocasts(recipe, kind):
    """Fails without the torch.autocast support: the modules returned FP32 under autocast(bf16)."""
    m = _make(kind)
    x = _input()
    with torch.autocast("cpu", dtype=AMP):
        want = torch.nn.functional.linear(x, torch.ones(32, 64)).dtype
        with fp_recipes.autocast(recipe=RECIPES[recipe]()):
            y = _call(m, x)
    assert want == AMP and y.dtype == want
    y.float().square().mean().backward()
    assert x.grad.dtype == torch.float32  # the input's dtype
    for name, p in _params(m).items():
        assert p.grad is not None and p.grad.dtype == p.dtype == torch.float32, name


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_module_recipe_without_fp_recipes_autocast(recipe):
    """A module quantizing under its own recipe (no fp_recipes.autocast) honours torch.autocast too."""
    m = _make("Linear").set_recipe(RECIPES[recipe]())
    x = _input()
    with torch.autocast("cpu", dtype=AMP):
        y = m(x)
    assert y.dtype == AMP
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and m.weight.grad.dtype == torch.float32


def test_bf16_input_gets_bf16_input_gradient():
    m = _make("Linear")
    x = _input(torch.bfloat16)
    with torch.autocast("cpu", dtype=AMP), fp_recipes.autocast(recipe=fp_recipes.Float8CurrentScaling()):
        y = m(x)
    y.float().sum().backward()
    assert y.dtype == AMP and x.grad.dtype == torch.bfloat16 and m.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("fp_ctx", ["none", "disabled"])
@pytest.mark.parametrize("kind", MODULES)
def test_quantization_off_equals_torch_nn_bitwise(kind, fp_ctx):
    """No recipe (or fp_recipes.autocast(enabled=False)): outputs and all gradients are exactly those of
    torch.nn.Linear (after torch.nn.LayerNorm; per expert for GroupedLinear) under torch.autocast."""
    m = _make(kind)
    if kind == "Linear":
        ref = torch.nn.Linear(64, 32)
        ref.load_state_dict(m.state_dict(), strict=False)
        ref_call = ref
    elif kind == "LayerNormLinear":
        norm, lin = torch.nn.LayerNorm(64), torch.nn.Linear(64, 32)
        norm.weight.data.copy_(m.layer_norm_weight.data)
        norm.bias.data.copy_(m.layer_norm_bias.data)
        lin.weight.data.copy_(m.weight.data)
        lin.bias.data.copy_(m.bias.data)
        ref = torch.nn.ModuleList([norm, lin])
        ref_call = lambda x: lin(norm(x))  # noqa: E731
    else:
        ref = torch.nn.ModuleList([torch.nn.Linear(64, 32) for _ in range(2)])
        for g, lin in enumerate(ref):
            lin.weight.data.copy_(getattr(m, f"weight{g}").data)
            lin.bias.data.copy_(getattr(m, f"bias{g}").data)
        ref_call = lambda x: torch.cat([ref[0](x[:16]), ref[1](x[16:])])  # noqa: E731
    x, xr = _input(), _input()
    ctx = fp_recipes.autocast(enabled=False) if fp_ctx == "disabled" else None
    with torch.autocast("cpu", dtype=AMP):
        if ctx is not None:
            with ctx:
                y = _call(m, x)
        else:
            y = _call(m, x)
        yr = ref_call(xr)
    assert y.dtype == yr.dtype == AMP
    assert torch.equal(y, yr)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(AMP)
    y.backward(g)
    yr.backward(g)
    assert torch.equal(x.grad, xr.grad)
    got = sorted((p.grad for p in m.parameters()), key=lambda t: (t.shape, t.sum().item()))
    want = sorted((p.grad for p in ref.parameters()), key=lambda t: (t.shape, t.sum().item()))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("kind", ["Linear", "GroupedLinear"])
def test_quantized_gemms_are_not_autocast(recipe, kind):
    """Under torch.autocast the module computes what it computes on the input cast to BF16 with a BF16
    bias and the FP32 master weight, bit for bit: the quantized GEMMs (and their FP32 emulations on
    CPU) are not run by autocast, and the weight is quantized from the master weight."""
    m = _make(kind)
    ref = copy.deepcopy(m)  # the same stochastic-rounding streams
    with torch.no_grad():
        for name, p in list(ref.named_parameters()):
            if name.startswith("bias"):
                setattr(ref, name, torch.nn.Parameter(p.to(AMP)))
    make = RECIPES[recipe]
    r1, r2 = make(), make()
    for step in range(2):  # the second step uses delayed scaling's updated scales
        m.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        x = _input()
        xr = x.detach().to(AMP).requires_grad_()
        with torch.autocast("cpu", dtype=AMP), fp_recipes.autocast(recipe=r1):
            y = _call(m, x)
        with fp_recipes.autocast(recipe=r2):
            yr = _call(ref, xr)
        assert y.dtype == yr.dtype == AMP and torch.equal(y, yr), (step, (y.float() - yr.float()).abs().max())
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(3 + step)).to(AMP)
        y.backward(g)
        yr.backward(g)
        if recipe != "current_hp_backward":  # its dgrad reads the weight in BF16 under autocast (FP32 in ref)
            assert torch.equal(x.grad, xr.grad.float())
        for (name, p), (_, pr) in zip(m.named_parameters(), ref.named_parameters()):
            assert p.grad.dtype == torch.float32
            assert torch.equal(p.grad.to(pr.dtype), pr.grad), (step, name)
    for (name, b), (_, br) in zip(m.named_buffers(), ref.named_buffers()):
        assert torch.equal(b, br), name  # delayed-scaling state


def _train_step(m, x, recipe, backward_inside: bool, thread: bool = False):
    with torch.autocast("cpu", dtype=AMP), fp_recipes.autocast(recipe=recipe):
        y = _call(m, x)
        if backward_inside:
            y.float().square().mean().backward()
    if not backward_inside:
        loss = y.float().square().mean()
        if thread:  # the backward on another thread, where the forward's autocast is not visible
            t = threading.Thread(target=loss.backward)
            t.start()
            t.join()
        else:
            loss.backward()


@pytest.mark.parametrize("recipe", ["delayed", "nvfp4", "current_hp_backward"])
def test_backward_inside_autocast_or_on_another_thread_is_the_same(recipe):
    """The backward's dtypes come from the forward: a backward called inside the autocast region (which
    it inherits) or on another thread gives the gradients of one called after the region."""
    grads = []
    for inside, thread in ((False, False), (True, False), (False, True)):
        m = _make("Linear")
        x = _input()
        _train_step(m, x, RECIPES[recipe](), inside, thread)
        grads.append([x.grad] + [p.grad for p in m.parameters()])
    for other in grads[1:]:
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(grads[0], other))


def test_activation_checkpointing_under_autocast():
    """A checkpointed module recomputes under the forward's autocast: same gradients as without."""
    from torch.utils.checkpoint import checkpoint

    recipe = fp_recipes.DelayedScaling(amax_history_len=4)
    grads = []
    for ckpt in (False, True):
        m = _make("LayerNormLinear")
        x = _input()
        with torch.autocast("cpu", dtype=AMP), fp_recipes.autocast(recipe=recipe):
            y = checkpoint(m, x, use_reentrant=False) if ckpt else m(x)
        assert y.dtype == AMP
        y.float().square().mean().backward()
        grads.append([x.grad] + [p.grad for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_fp16_autocast():
    m = _make("Linear")
    x = _input()
    with torch.autocast("cpu", dtype=torch.float16), fp_recipes.autocast(recipe=fp_recipes.Float8CurrentScaling()):
        y = m(x)
    assert y.dtype == torch.float16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and m.weight.grad.dtype == torch.float32
