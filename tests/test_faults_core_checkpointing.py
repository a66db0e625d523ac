"""Activation checkpointing is bitwise transparent (issue 11).

The same training steps run twice from identical copies of a model: once plainly, once with every
block under ``torch.utils.checkpoint`` (non-reentrant, as Hugging Face's gradient checkpointing, and
reentrant, as Megatron's). Gradients, weights and every quantizer's state (delayed-scaling scales and
amax histories, NVFP4 stochastic-rounding offsets) must be bitwise equal after every step: the
recompute inside the backward quantizes exactly as the original forward did and records nothing.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fp_recipes
from fp_recipes import DelayedScaling, Float8CurrentScaling, GroupedLinear, LayerNormLinear, Linear, NVFP4BlockScaling
from fp_recipes.modules.amax_reduction import reducer

RECIPES = {
    "delayed": lambda: DelayedScaling(amax_history_len=4),
    "current": lambda: Float8CurrentScaling(),
    "nvfp4_sr": lambda: NVFP4BlockScaling(),  # stochastic rounding of the gradients is on by default
}


class _Block(torch.nn.Module):
    def __init__(self, d: int, grouped: bool) -> None:
        super().__init__()
        self.ln = LayerNormLinear(d, 2 * d)
        self.grouped = grouped
        self.up = GroupedLinear(2, 2 * d, d) if grouped else Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.ln(x))
        h = self.up(h, [16, h.shape[0] - 16]) if self.grouped else self.up(h)
        return x + h


class _Net(torch.nn.Module):
    def __init__(self, d: int = 32, grouped: bool = False) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(d, grouped) for _ in range(2)])
        self.ckpt = None  # None: plain; True / False: checkpoint with use_reentrant=...

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x) if self.ckpt is None else checkpoint(b, x, use_reentrant=self.ckpt)
        return x


def _quantizer_state(model: torch.nn.Module) -> dict:
    out = {}
    for name, mod in model.named_modules():
        for rk, entry in getattr(mod, "_by_recipe", {}).items():
            for g, tensor, q in entry.quantizers():
                key = f"{name}.{type(rk).__name__}.{tensor.value}{g}"
                for attr in ("scale", "amax_history"):
                    if isinstance(getattr(q, attr, None), torch.Tensor):
                        out[f"{key}.{attr}"] = getattr(q, attr).clone()
                if hasattr(q, "offset"):
                    out[f"{key}.offset"] = (q.seed, q.offset)
    return out


def _assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), f"{what}: {k} differs"
        else:
            assert a[k] == b[k], f"{what}: {k} differs: {a[k]} vs {b[k]}"


def _step(model, x, recipe, backward_inside: bool):
    with fp_recipes.autocast(recipe=recipe):
        out = model(x)
        loss = (out.float() * torch.linspace(-1, 1, out.shape[-1])).square().sum()
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.01 * p.grad  # the same update in both runs


def _run(model, recipe, backward_inside, steps=3):
    torch.manual_seed(123)
    history = []
    for _ in range(steps):
        x = torch.randn(48, 32) * 3
        x.requires_grad_(model.ckpt is True)  # a reentrant checkpoint needs an input that requires grad
        model.zero_grad(set_to_none=True)
        _step(model, x, recipe, backward_inside)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        if x.grad is not None:
            grads["x"] = x.grad.clone()
        history.append((grads, {n: p.detach().clone() for n, p in model.named_parameters()},
                        _quantizer_state(model)))
    return history


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("backward_inside", [False, True], ids=["bwd_outside", "bwd_inside"])
def test_checkpointed_training_is_bitwise_the_plain_one(name, reentrant, backward_inside):
    torch.manual_seed(0)
    plain = _Net()
    ckpt = copy.deepcopy(plain)
    ckpt.ckpt = reentrant
    recipe = RECIPES[name]()
    a = _run(plain, recipe, backward_inside)
    b = _run(ckpt, recipe, backward_inside)
    for step, ((ga, wa, sa), (gb, wb, sb)) in enumerate(zip(a, b)):
        if reentrant:
            ga = dict(ga)
            ga.pop("x", None)
            gb = dict(gb)
            gb.pop("x", None)
        _assert_same(ga, gb, f"grads, step {step}")
        _assert_same(wa, wb, f"weights, step {step}")
        _assert_same(sa, sb, f"quantizer state, step {step}")
    if name == "delayed":  # the state moved (a test that compared constants would prove nothing)
        assert not torch.equal(a[0][2]["blocks.0.ln.DelayedScaling.activation0.scale"],
                               a[-1][2]["blocks.0.ln.DelayedScaling.activation0.scale"])
    assert reducer.pending_forward() == 0
    for mod in ckpt.modules():  # every recompute took its record
        if hasattr(mod, "_records"):
            assert mod._records.pop() is None


@pytest.mark.parametrize("name", ["delayed", "current"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointed_grouped_linear_is_bitwise_the_plain_one(name, reentrant):
    torch.manual_seed(1)
    plain = _Net(grouped=True)
    ckpt = copy.deepcopy(plain)
    ckpt.ckpt = reentrant
    recipe = RECIPES[name]()
    a = _run(plain, recipe, False, steps=2)
    b = _run(ckpt, recipe, False, steps=2)
    for step, ((ga, wa, sa), (gb, wb, sb)) in enumerate(zip(a, b)):
        ga.pop("x", None)
        gb.pop("x", None)
        _assert_same(ga, gb, f"grads, step {step}")
        _assert_same(sa, sb, f"quantizer state, step {step}")


def test_recompute_outside_autocast_on_another_thread_uses_the_forward_recipe():
    """The backward (and so the recompute) runs in another thread, with no autocast there."""
    import threading

    torch.manual_seed(2)
    plain = _Net()
    ckpt = copy.deepcopy(plain)
    ckpt.ckpt = False
    recipe = DelayedScaling(amax_history_len=4)
    x = torch.randn(48, 32)
    outs = []
    for model in (plain, ckpt):
        with fp_recipes.autocast(recipe=recipe):
            outs.append(model(x).float().square().sum())
    t = threading.Thread(target=outs[1].backward)
    t.start()
    t.join()
    outs[0].backward()
    for (n, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.equal(p.grad, q.grad), n
    _assert_same(_quantizer_state(plain), _quantizer_state(ckpt), "state")
