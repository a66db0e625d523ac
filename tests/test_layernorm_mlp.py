"""LayerNormMLP: the same outputs, gradients and quantizer state as LayerNormLinear -> activation -> Linear built
from the same parameters, under every recipe kind; torch parity outside autocast for every activation; the gated
activations' halves; clear errors; TransformerEngine's flat parameter names load; a delayed-scaling checkpoint
round-trips."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fp_recipes
from fp_recipes import DelayedScaling, Float8CurrentScaling, LayerNormLinear, LayerNormMLP, Linear, NVFP4BlockScaling
from fp_recipes.ops import activations

RECIPES = {
    "delayed": lambda: DelayedScaling(amax_history_len=4),
    "current": Float8CurrentScaling,
    "nvfp4": NVFP4BlockScaling,
}


def _pair(activation: str, normalization: str = "LayerNorm", bias: bool = True):
    """A LayerNormMLP and the three modules it stands for, with the same parameters."""
    torch.manual_seed(0)
    mlp = LayerNormMLP(64, 96, bias=bias, normalization=normalization, activation=activation)
    with torch.no_grad():  # (non-trivial norm parameters)
        mlp.fc1.layer_norm_weight.uniform_(0.5, 1.5)
        if mlp.fc1.layer_norm_bias is not None:
            mlp.fc1.layer_norm_bias.uniform_(-0.5, 0.5)
    fc1 = LayerNormLinear(64, mlp.fc1.out_features, bias=bias, normalization=normalization)
    fc2 = Linear(96, 64, bias=bias)
    fc1.load_state_dict(mlp.fc1.state_dict())
    fc2.load_state_dict(mlp.fc2.state_dict())
    # (NVFP4 stochastic rounding draws from a per-module seed taken at construction, from torch's generator)
    fc1._sr_seed, fc2._sr_seed = mlp.fc1._sr_seed, mlp.fc2._sr_seed
    return mlp, fc1, fc2


def _step(forward, params, x, dy):
    x = x.clone().requires_grad_(True)
    y = forward(x)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad.clone() for p in params]


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("activation", ["gelu", "gelu_erf", "relu", "silu", "swiglu"])
def test_equals_the_composition_under_every_recipe(name, activation):
    mlp, fc1, fc2 = _pair(activation)
    act = activations.GATED.get(activation) or activations.ELEMENTWISE[activation].forward
    recipe = RECIPES[name]()  # (each module keeps its own state for it)
    torch.manual_seed(1)
    for step in range(3):  # (delayed scaling: the scales of step 2 come from the updates of steps 0-1)
        x, dy = torch.randn(32, 64), torch.randn(32, 64)
        with fp_recipes.autocast(recipe=recipe):
            got = _step(mlp, list(mlp.parameters()), x, dy)
        with fp_recipes.autocast(recipe=recipe):
            want = _step(lambda v: fc2(act(fc1(v))), list(fc1.parameters()) + list(fc2.parameters()), x, dy)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), (name, activation, step, i)
        for m in (mlp, fc1, fc2):
            m.zero_grad(set_to_none=True)
    for mine, theirs in ((mlp.fc1, fc1), (mlp.fc2, fc2)):
        ours, ref = mine.state_dict(), theirs.state_dict()
        assert sorted(ours) == sorted(ref)
        for key, value in ours.items():
            assert not torch.is_tensor(value) or torch.equal(value, ref[key]), key


@pytest.mark.parametrize("activation", sorted(activations.NAMES))
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_torch_parity_outside_autocast(activation, normalization):
    mlp = LayerNormMLP(48, 80, normalization=normalization, activation=activation, bias=activation != "relu")
    x = torch.randn(5, 7, 48)
    norm = (F.layer_norm(x, (48,), mlp.fc1.layer_norm_weight, mlp.fc1.layer_norm_bias, 1e-5)
            if normalization == "LayerNorm" else F.rms_norm(x, (48,), mlp.fc1.layer_norm_weight, 1e-5))
    h = F.linear(norm, mlp.fc1.weight, mlp.fc1.bias)
    torch_act = {"gelu": lambda t: F.gelu(t, approximate="tanh"), "gelu_erf": F.gelu, "relu": F.relu,
                 "silu": F.silu}
    if activation in torch_act:
        a = torch_act[activation](h)
    else:
        first, second = h.chunk(2, dim=-1)
        a = {"geglu": lambda t: F.gelu(t, approximate="tanh"), "reglu": F.relu, "swiglu": F.silu}[activation](first) \
            * second
    assert mlp.fc1.out_features == 80 * (2 if activation in activations.GATED else 1)
    assert torch.equal(mlp(x), F.linear(a, mlp.fc2.weight, mlp.fc2.bias))


def test_return_layernorm_output_and_first_microbatch():
    mlp = LayerNormMLP(32, 64, return_layernorm_output=True)
    x = torch.randn(16, 32)
    y, ln = mlp(x, is_first_microbatch=True)
    assert torch.equal(ln, F.layer_norm(x, (32,), mlp.fc1.layer_norm_weight, mlp.fc1.layer_norm_bias, 1e-5))
    assert y.shape == (16, 32)


def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match="activation='gelu_new' is not supported; allowed: gelu, gelu_erf"):
        LayerNormMLP(32, 64, activation="gelu_new")
    with pytest.raises(ValueError, match="hidden_size and ffn_hidden_size must be positive"):
        LayerNormMLP(32, 0)
    with pytest.raises(ValueError, match="normalization='BatchNorm' is not supported"):
        LayerNormMLP(32, 64, normalization="BatchNorm")


def test_transformer_engine_parameter_names_load():
    mlp = LayerNormMLP(32, 64, activation="swiglu")
    te_state = {"layer_norm_weight": torch.rand(32), "layer_norm_bias": torch.rand(32),
                "fc1_weight": torch.rand(128, 32), "fc1_bias": torch.rand(128),
                "fc2_weight": torch.rand(32, 64), "fc2_bias": torch.rand(32)}
    result = mlp.load_state_dict(dict(te_state), strict=False)
    assert not result.unexpected_keys
    assert not [k for k in result.missing_keys if not k.endswith("_extra_state")]
    assert torch.equal(mlp.fc1.weight, te_state["fc1_weight"]) and torch.equal(mlp.fc2.bias, te_state["fc2_bias"])
    assert torch.equal(mlp.fc1.layer_norm_bias, te_state["layer_norm_bias"])


def test_delayed_state_round_trips_through_a_checkpoint():
    recipe = DelayedScaling(amax_history_len=4)
    mlp = LayerNormMLP(32, 64)
    for _ in range(2):
        with fp_recipes.autocast(recipe=recipe):
            mlp(torch.randn(16, 32)).sum().backward()
    state = mlp.state_dict()
    assert any(k.startswith("fc1.qstate_") for k in state) and any(k.startswith("fc2.qstate_") for k in state)
    other = LayerNormMLP(32, 64)
    other.load_state_dict(state)
    x = torch.randn(16, 32)
    with fp_recipes.autocast(recipe=recipe):
        want = mlp(x)
    with fp_recipes.autocast(recipe=recipe):
        got = other(x)
    assert torch.equal(got, want)


def test_set_recipe_reaches_both_gemms():
    mlp = LayerNormMLP(32, 64).set_recipe(Float8CurrentScaling())
    assert mlp.fc1.recipe is mlp.fc2.recipe is not None
    mlp(torch.randn(16, 32))
    assert mlp.fc1.quantizer_sets is not None and mlp.fc2.quantizer_sets is not None


@pytest.mark.parametrize("name", ["delayed", "current"])
@pytest.mark.parametrize("amp", [False, True])
def test_input_activation_equals_the_activation_then_the_layer(name, amp):
    """quantized_linear(..., input_activation=) (FC2 taking FC1's output): the bytes and gradients of the activation's
    op followed by the layer, under torch.autocast too (there the activation runs on the FP32 input, as the op would
    outside the layer), with the quantizer's fused cast taken where it applies."""
    torch.manual_seed(3)
    fc2, ref = Linear(96, 64), Linear(96, 64)
    ref.load_state_dict(fc2.state_dict())
    recipe = RECIPES[name]()
    for step in range(2):
        h = torch.randn(32, 96) * 3
        dy = torch.randn(32, 64)
        outs = []
        for run in (lambda v: fc2.forward_activation(v, "gelu"), lambda v: ref(F.gelu(v, approximate="tanh"))):
            v = h.clone().requires_grad_(True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp), fp_recipes.autocast(recipe=recipe):
                y = run(v)
            y.float().backward(dy)
            outs.append([y.detach(), v.grad])
        outs[0] += [fc2.weight.grad, fc2.bias.grad]
        outs[1] += [ref.weight.grad, ref.bias.grad]
        for i, (a, b) in enumerate(zip(*outs)):
            assert torch.equal(a, b), (name, amp, step, i)
        fc2.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_in_place_activation_backward_equals_autograds(dtype):
    """``Activation.backward_`` (the Linear's backward writes the input's gradient over its dgrad output) gives the
    bits of the backward autograd records for the op, in the given tensor: zeros, ties at relu's 0, infinities, NaN."""
    from fp_recipes.ops.activations import ELEMENTWISE

    x = torch.randn(37, 65) * 4
    x.view(-1)[:6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e30])
    x = x.to(dtype)
    for name, act in ELEMENTWISE.items():
        v = x.clone().requires_grad_(True)
        dy = torch.randn(37, 65).to(dtype)
        act.forward(v).backward(dy)
        out = dy.clone()
        got = act.backward_(out, x)
        assert got.data_ptr() == out.data_ptr(), name
        assert torch.equal(got.view(torch.uint8), v.grad.view(torch.uint8)), (name, dtype)


def test_a_quantizer_fuses_no_activation_off_cuda():
    from fp_recipes.quantizers import make_quantizer
    from fp_recipes.quantizers.roles import ModuleKind, QuantizerRole, TensorKind

    spec = DelayedScaling().plan(QuantizerRole(ModuleKind.LINEAR, TensorKind.ACTIVATION, 0, None))
    q = make_quantizer(spec)
    x = torch.randn(16, 32)
    assert not q.fuses_activation("gelu", x)
    want = q.quantize(F.gelu(x, approximate="tanh"))
    got = make_quantizer(spec).quantize_activation(x, "gelu")
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))


def test_bad_input_activation_is_clear():
    from fp_recipes.modules.linear_function import quantized_linear

    with pytest.raises(ValueError, match="input_activation='swiglu' is not supported; allowed: gelu, gelu_erf"):
        quantized_linear(torch.randn(4, 8), torch.randn(8, 8), None, None, input_activation="swiglu")


@pytest.mark.skipif(not __import__("fp_recipes.modules.base", fromlist=["x"]).compile_supported(),
                    reason="fp_recipes modules compile from torch 2.11")
@pytest.mark.parametrize("name", ["delayed", "current"])
def test_compiles_with_fullgraph_and_equals_eager(name):
    """torch.compile (aot_eager: bit for bit) of a LayerNormMLP, its FC2 applying the activation in its input's
    quantization: one graph, eager's outputs, gradients and scaling state after every step."""
    mlp, _, _ = _pair("gelu")
    _equals_a_plain_twin(name, mlp, torch.compile(mlp, fullgraph=True, backend="aot_eager"))


def _equals_a_plain_twin(name: str, mlp: LayerNormMLP, run) -> None:
    """Three steps of ``run`` (``mlp`` compiled, checkpointed, ...) against an uncompiled twin of ``mlp`` under its own
    recipe: outputs and gradients equal bit for bit at every step, and the scaling state equal after them."""
    twin = LayerNormMLP(64, 96, activation="gelu")
    twin.load_state_dict(mlp.state_dict())
    twin.fc1._sr_seed, twin.fc2._sr_seed = mlp.fc1._sr_seed, mlp.fc2._sr_seed
    recipe, twin_recipe = RECIPES[name](), RECIPES[name]()
    for step in range(3):
        x, dy = torch.randn(32, 64), torch.randn(32, 64)
        with fp_recipes.autocast(recipe=recipe):
            got = _step(run, list(mlp.parameters()), x, dy)
        with fp_recipes.autocast(recipe=twin_recipe):
            want = _step(twin, list(twin.parameters()), x, dy)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), (name, step, i)
        for m in (mlp, twin):
            m.zero_grad(set_to_none=True)
    for key, value in twin.state_dict().items():
        assert not torch.is_tensor(value) or torch.equal(mlp.state_dict()[key], value), key


@pytest.mark.parametrize("name", ["delayed", "current", "nvfp4"])
def test_activation_checkpointing_changes_nothing(name):
    """Inside torch.utils.checkpoint (non-reentrant, as training jobs wrap blocks) the steps equal the uncheckpointed
    ones: outputs, gradients and the delayed-scaling state (the recompute records nothing twice)."""
    from torch.utils.checkpoint import checkpoint

    mlp, _, _ = _pair("gelu")
    torch.manual_seed(5)
    _equals_a_plain_twin(name, mlp, lambda v: checkpoint(mlp, v, use_reentrant=False))


def test_two_threads_each_get_their_own_recipe():
    """Two threads stepping their own LayerNormMLP, one under FP8 and one with quantization off (a rollout thread
    beside a training thread): each result equals the same work done alone."""
    from _threads import run_in_threads

    torch.manual_seed(6)
    a, b = LayerNormMLP(64, 96), LayerNormMLP(64, 96)
    a_ref, b_ref = LayerNormMLP(64, 96), LayerNormMLP(64, 96)
    a_ref.load_state_dict(a.state_dict())
    b_ref.load_state_dict(b.state_dict())
    x = torch.randn(32, 64)
    with fp_recipes.autocast(recipe=Float8CurrentScaling()):
        want_a = a_ref(x)
    want_b = b_ref(x)

    def run(mod, quantized):
        out = None
        for _ in range(20):
            with fp_recipes.autocast(enabled=quantized, recipe=Float8CurrentScaling()):
                out = mod(x)
        return out

    got_a, got_b = run_in_threads(run, [(a, True), (b, False)])
    assert torch.equal(got_a, want_a) and torch.equal(got_b, want_b)
