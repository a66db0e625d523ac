"""convert_model keeps what was registered on the original nn.Linear (issue 11): forward hooks and
forward pre-hooks (plain, with_kwargs, always_call), backward hooks, state-dict hooks, their handles,
the training flag, requires_grad, device and dtype, and plain attributes set on the module."""

from __future__ import annotations

import torch

import fp_recipes
from fp_recipes import DelayedScaling, Linear, convert_model


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32, dtype=dtype), torch.nn.ReLU(),
                               torch.nn.Linear(32, 16, bias=False, dtype=dtype))


def test_forward_hooks_and_pre_hooks_survive_and_run_in_order():
    model = _model()
    calls = []

    def pre(mod, args):
        calls.append(("pre", type(mod).__name__))
        return (args[0] * 2,)

    def pre_kw(mod, args, kwargs):
        calls.append(("pre_kw", type(mod).__name__))
        return (args[0] + 1,), kwargs

    def post(mod, args, out):
        calls.append(("post", type(mod).__name__))
        return out * 3

    def post_kw(mod, args, kwargs, out):
        calls.append(("post_kw", type(mod).__name__))
        return out - 1

    def always(mod, args, out):
        calls.append(("always", type(mod).__name__))

    lin = model[0]
    lin.register_forward_pre_hook(pre)
    lin.register_forward_pre_hook(pre_kw, with_kwargs=True)
    lin.register_forward_hook(post)
    lin.register_forward_hook(post_kw, with_kwargs=True)
    lin.register_forward_hook(always, always_call=True)
    x = torch.randn(4, 16)
    before = model(x)
    calls_before = list(calls)
    calls.clear()

    convert_model(model)
    assert isinstance(model[0], Linear)
    after = model(x)
    assert torch.equal(after, before)  # hooks applied in the same order, same math
    assert [c[0] for c in calls] == [c[0] for c in calls_before] == ["pre", "pre_kw", "post", "post_kw", "always"]
    assert all(c[1] == "Linear" and type(model[0]) is Linear for c in calls)


def test_hook_handles_still_remove_the_hook_after_conversion():
    model = _model()
    seen = []
    handle = model[2].register_forward_hook(lambda m, a, o: seen.append(1))
    pre_handle = model[2].register_forward_pre_hook(lambda m, a: seen.append(0))
    convert_model(model)
    model(torch.randn(2, 16))
    assert seen == [0, 1]
    handle.remove()
    pre_handle.remove()
    model(torch.randn(2, 16))
    assert seen == [0, 1]
    assert not model[2]._forward_hooks and not model[2]._forward_pre_hooks


def test_backward_and_state_dict_hooks_survive():
    model = _model()
    grads = []
    model[0].register_full_backward_hook(lambda m, gi, go: grads.append(go[0].shape))
    model[0].register_state_dict_post_hook(lambda m, sd, prefix, local: sd.__setitem__(prefix + "tag", torch.ones(1)))
    convert_model(model)
    model(torch.randn(3, 16)).sum().backward()
    assert grads == [torch.Size([3, 32])]
    assert "0.tag" in model.state_dict()


def test_hooks_fire_under_autocast_too():
    model = _model()
    outs = []
    model[0].register_forward_hook(lambda m, a, o: outs.append(o.detach().clone()))
    convert_model(model)
    with fp_recipes.autocast(recipe=DelayedScaling()):
        y = model[0](torch.randn(4, 16))
    assert len(outs) == 1 and torch.equal(outs[0], y)


def test_training_flag_requires_grad_device_dtype_and_attributes_kept():
    model = _model(torch.bfloat16)
    model[0].eval()
    model[2].weight.requires_grad_(False)
    model[0].my_tag = "keep me"
    model[2]._is_hf_initialized = True
    convert_model(model)
    assert model.training and not model[0].training and model[2].training
    assert model[0].weight.requires_grad and not model[2].weight.requires_grad
    assert model[0].weight.dtype == torch.bfloat16 and model[0].bias.dtype == torch.bfloat16
    assert model[0].weight.device.type == "cpu"
    assert model[0].my_tag == "keep me" and model[2]._is_hf_initialized is True
    y = model(torch.randn(2, 16, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16


def test_weight_norm_linear_keeps_its_parameters_and_pre_hook():
    lin = torch.nn.utils.weight_norm(torch.nn.Linear(8, 4))
    x = torch.randn(2, 8)
    before = lin(x)
    model = convert_model(torch.nn.Sequential(lin))
    assert isinstance(model[0], Linear)
    names = {n for n, _ in model.named_parameters()}
    assert names == {"0.bias", "0.weight_g", "0.weight_v"}
    assert torch.equal(model(x), before)
    model(x).sum().backward()
    assert model[0].weight_g.grad is not None and model[0].weight_v.grad is not None
