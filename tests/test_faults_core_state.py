"""Module state faults of issue 11: strict checkpoint loading, state per recipe, inference mode first,
input dtypes, reproducible stochastic rounding, the module's own recipe, threads."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import fp_recipes
from fp_recipes import (DelayedScaling, Float8CurrentScaling, GroupedLinear, LayerNormLinear, Linear,
                        NVFP4BlockScaling)
from fp_recipes.modules.amax_reduction import reducer


def _train(mod, recipe, steps=2, seed=0, d=32):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(32, d, generator=g) * 2
        with fp_recipes.autocast(recipe=recipe):
            y = mod(x)
        (y.float() ** 2).sum().backward()


def _delayed_state(mod) -> dict:
    return {k: v.clone() for k, v in mod.state_dict().items() if "qstate_" in k}


# ----------------------------------------------------------------------------------------------
# checkpoints (item 8)


def test_strict_load_rejects_a_misspelt_state_key_and_changes_nothing():
    torch.manual_seed(0)
    src = Linear(32, 32)
    _train(src, DelayedScaling(amax_history_len=4))
    sd = src.state_dict()
    sd["qstate_activaton0_scale"] = sd.pop("qstate_activation0_scale")
    for fresh in (True, False):
        dst = Linear(32, 32)
        if not fresh:
            _train(dst, DelayedScaling(amax_history_len=4), seed=1)
        before = {k: v.clone() for k, v in dst.state_dict().items() if isinstance(v, torch.Tensor)}
        with pytest.raises(RuntimeError, match="qstate_activaton0_scale"):
            dst.load_state_dict(sd, strict=True)
        after = {k: v for k, v in dst.state_dict().items() if isinstance(v, torch.Tensor)}
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        assert dst._pending is None
    # a state name the module cannot have (GEMM index out of range) is unknown too
    sd = src.state_dict()
    sd["qstate_weight1_scale"] = sd["qstate_weight0_scale"]
    with pytest.raises(RuntimeError, match="qstate_weight1_scale"):
        Linear(32, 32).load_state_dict(sd, strict=True)


def test_history_length_mismatch_fails_the_load_and_changes_nothing():
    torch.manual_seed(0)
    src = Linear(32, 32)
    _train(src, DelayedScaling(amax_history_len=4))
    dst = Linear(32, 32)
    _train(dst, DelayedScaling(amax_history_len=8), seed=1)
    before = {k: v.clone() for k, v in dst.state_dict().items() if isinstance(v, torch.Tensor)}
    with pytest.raises(RuntimeError, match="different amax_history_len"):
        dst.load_state_dict(src.state_dict())
    after = {k: v for k, v in dst.state_dict().items() if isinstance(v, torch.Tensor)}
    assert all(torch.equal(before[k], after[k]) for k in before)  # weights too
    # the same without the recipe identity (a checkpoint of an older version): shapes are checked
    sd = src.state_dict()
    sd["_extra_state"] = {"quantizer_state": {}}
    with pytest.raises(RuntimeError, match="different amax_history_len"):
        dst.load_state_dict(sd)
    after = {k: v for k, v in dst.state_dict().items() if isinstance(v, torch.Tensor)}
    assert all(torch.equal(before[k], after[k]) for k in before)
    # and the module still trains under its own recipe
    _train(dst, DelayedScaling(amax_history_len=8), steps=1)


@pytest.mark.parametrize("other", [NVFP4BlockScaling, Float8CurrentScaling])
def test_delayed_checkpoint_run_under_another_recipe_is_an_error_naming_both(other):
    torch.manual_seed(0)
    src = Linear(32, 32)
    _train(src, DelayedScaling(amax_history_len=4))
    dst = Linear(32, 32)
    dst.load_state_dict(src.state_dict(), strict=True)
    with pytest.raises(ValueError, match=r"DelayedScaling\(.*\).*" + other.__name__):
        with fp_recipes.autocast(recipe=other()):
            dst(torch.randn(16, 32))
    # under the checkpoint's recipe the state applies, bit for bit
    with fp_recipes.autocast(recipe=DelayedScaling(amax_history_len=4)):
        dst(torch.randn(16, 32))
    q_src, q_dst = src.quantizer_sets[0].weight, dst.quantizer_sets[0].weight
    assert torch.equal(q_src.scale, q_dst.scale)


def test_pending_state_is_saved_again_before_the_first_forward():
    torch.manual_seed(0)
    src = Linear(32, 32)
    _train(src, DelayedScaling(amax_history_len=4))
    mid = Linear(32, 32)
    mid.load_state_dict(src.state_dict())
    dst = Linear(32, 32)
    dst.load_state_dict(mid.state_dict(), strict=True)
    assert _delayed_state(src).keys() == _delayed_state(dst).keys()
    x = torch.randn(16, 32)
    for m in (src, dst):
        with fp_recipes.autocast(recipe=DelayedScaling(amax_history_len=4)):
            m(x)
    for k, v in _delayed_state(src).items():
        assert torch.equal(v, dst.state_dict()[k]), k


def test_torch_linear_checkpoint_loads_strictly():
    ref = torch.nn.Linear(32, 16)
    mod = Linear(32, 16)
    _train(mod, DelayedScaling(amax_history_len=4), d=32)
    mod.load_state_dict(ref.state_dict(), strict=True)
    assert torch.equal(mod.weight, ref.weight)


# ----------------------------------------------------------------------------------------------
# state per recipe (item 4)


def test_a_probe_under_another_recipe_keeps_the_delayed_state():
    torch.manual_seed(0)
    control = Linear(32, 32)
    probed = copy.deepcopy(control)
    recipe = DelayedScaling(amax_history_len=4)
    _train(control, recipe)
    _train(probed, recipe)
    before = _delayed_state(probed)
    with fp_recipes.autocast(recipe=recipe):
        with fp_recipes.autocast(recipe=NVFP4BlockScaling()):
            probe = probed(torch.randn(32, 32))
        probe.sum().backward()
        probed.zero_grad()
    after = _delayed_state(probed)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert set(probed.state_dict()) == set(control.state_dict())
    assert probed.state_dict()["_extra_state"]["recipe"]["recipe"] == "DelayedScaling"
    control.zero_grad()
    _train(control, recipe, steps=1, seed=5)
    _train(probed, recipe, steps=1, seed=5)
    for k, v in control.state_dict().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, probed.state_dict()[k]), k
    assert torch.equal(control.weight.grad, probed.weight.grad)


def test_other_recipes_state_moves_with_the_module():
    mod = Linear(32, 32)
    _train(mod, DelayedScaling(amax_history_len=4))
    _train(mod, Float8CurrentScaling(), steps=1)
    mod.to(torch.float64).to(torch.float32)  # a round trip through _apply
    _train(mod, DelayedScaling(amax_history_len=4), steps=1)
    assert mod.quantizer_sets[0].activation.scale.dtype == torch.float32


# ----------------------------------------------------------------------------------------------
# inference mode first (item 5)


@pytest.mark.parametrize("make", [lambda: Linear(32, 32), lambda: LayerNormLinear(32, 32),
                                  lambda: GroupedLinear(2, 32, 32)])
def test_first_forward_under_inference_mode_then_training(make):
    mod = make()
    run = (lambda x: mod(x, [16, 16])) if isinstance(mod, GroupedLinear) else mod
    recipe = DelayedScaling(amax_history_len=4)
    with torch.inference_mode():
        with fp_recipes.autocast(recipe=recipe):
            run(torch.randn(32, 32))
    for name, buf in mod.named_buffers():
        assert not buf.is_inference(), name
    for _ in range(2):
        with fp_recipes.autocast(recipe=recipe):
            y = run(torch.randn(32, 32))
        y.sum().backward()
    assert mod.quantizer_sets[0].activation.amax_history.abs().sum() > 0


# ----------------------------------------------------------------------------------------------
# input dtypes (item 7)


@pytest.mark.parametrize("recipe", [NVFP4BlockScaling, DelayedScaling, Float8CurrentScaling])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float64])
def test_every_module_rejects_non_float_inputs_under_every_recipe(recipe, dtype):
    x = (torch.randn(32, 32) * 4).to(dtype)
    for mod, call in ((Linear(32, 32), None), (LayerNormLinear(32, 32), None),
                      (GroupedLinear(2, 32, 32), [16, 16])):
        with fp_recipes.autocast(recipe=recipe()):
            with pytest.raises((TypeError, RuntimeError)) as info:
                mod(x) if call is None else mod(x, call)
        msg = str(info.value)
        if not isinstance(mod, LayerNormLinear) or dtype == torch.float64:
            assert str(dtype).replace("torch.", "") in msg and "float32, bfloat16, float16" in msg, msg


# ----------------------------------------------------------------------------------------------
# reproducible stochastic rounding (item 9)


def _sr_run(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(Linear(32, 64), torch.nn.GELU(), Linear(64, 32))
    data = torch.Generator().manual_seed(7)
    for _ in range(3):
        x = torch.randn(32, 32, generator=data)
        with fp_recipes.autocast(recipe=NVFP4BlockScaling()):
            y = model(x)
        y.float().square().sum().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
                p.grad = None
    return model


def test_same_seed_same_stochastic_rounding_in_one_process():
    a, b = _sr_run(1), _sr_run(1)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    c = _sr_run(2)
    assert c[0]._sr_seed != a[0]._sr_seed
    # distinct streams per module, kept by deepcopy and state_dict
    assert a[0]._sr_seed != a[2]._sr_seed
    assert a[0].quantizer_sets[0].grad_output.seed != a[2].quantizer_sets[0].grad_output.seed
    assert copy.deepcopy(a[0])._sr_seed == a[0]._sr_seed
    fresh = Linear(32, 64)
    fresh.load_state_dict(a[0].state_dict())
    with fp_recipes.autocast(recipe=NVFP4BlockScaling()):
        fresh(torch.randn(32, 32))
    g_a, g_f = a[0].quantizer_sets[0].grad_output, fresh.quantizer_sets[0].grad_output
    assert (g_f.seed, g_f.offset) == (g_a.seed, g_a.offset)


# ----------------------------------------------------------------------------------------------
# the module's own recipe (item 3)


def test_module_recipe_without_autocast_equals_autocast():
    torch.manual_seed(0)
    ref = Linear(32, 32)
    own = copy.deepcopy(ref).set_recipe(DelayedScaling(amax_history_len=4))
    recipe = DelayedScaling(amax_history_len=4)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(32, 32, generator=g)
        with fp_recipes.autocast(recipe=recipe):
            y_ref = ref(x)
        y_own = own(x)  # no autocast: the module's recipe
        assert torch.equal(y_ref, y_own)
        y_ref.float().square().sum().backward()
        y_own.float().square().sum().backward()
        assert reducer.pending_forward() == 0  # the backward flushed the forward amaxes
        assert torch.equal(ref.weight.grad, own.weight.grad)
        for k, v in _delayed_state(ref).items():
            assert torch.equal(v, own.state_dict()[k]), k
    # an explicit autocast overrides it, enabled or not
    x = torch.randn(32, 32)
    with fp_recipes.autocast(enabled=False):
        assert torch.equal(own(x), torch.nn.functional.linear(x, own.weight, own.bias))
    own.set_recipe(None)
    assert torch.equal(own(x), torch.nn.functional.linear(x, own.weight, own.bias))


# ----------------------------------------------------------------------------------------------
# threads (item 2, module level)


def test_a_thread_without_autocast_runs_plain_torch_while_another_quantizes():
    mod = Linear(32, 32)
    x = torch.randn(32, 32)
    inside, done = threading.Event(), threading.Event()
    out = {}

    def other():
        inside.wait(10)
        out["y"] = mod(x)
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with fp_recipes.autocast(recipe=NVFP4BlockScaling()):
        inside.set()
        assert done.wait(10)
        yq = mod(x)
    t.join()
    assert torch.equal(out["y"], torch.nn.functional.linear(x, mod.weight, mod.bias))
    assert not torch.equal(yq, out["y"])


def test_backward_from_another_thread_uses_the_forward_recipe():
    torch.manual_seed(0)
    a = Linear(32, 32)
    b = copy.deepcopy(a)
    x = torch.randn(32, 32)
    with fp_recipes.autocast(recipe=NVFP4BlockScaling(disable_stochastic_rounding=True)):
        ya, yb = a(x), b(x)
    ya.sum().backward()
    with fp_recipes.autocast(recipe=DelayedScaling()):  # another recipe around the other backward
        t = threading.Thread(target=yb.sum().backward)
        t.start()
        t.join()
    assert torch.equal(a.weight.grad, b.weight.grad)
