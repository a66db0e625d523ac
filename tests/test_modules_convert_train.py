"""convert_model on a small model, and a tiny MLP that trains on CPU with every recipe.

Training band: 60 SGD steps on a fixed synthetic regression task (teacher tanh(Wx)); the FP32 run
reaches a final loss L (mean of the last 5 steps). Every recipe must first cut its loss to below 25%
of its initial loss, then:
- FP8 (E4M3/E5M2, 3 or 2 mantissa bits, per-tensor scales): final loss <= 1.15 L. Measured: ~1.04 L.
- NVFP4 (E2M1, 1 mantissa bit, E4M3 scale per 16 values): GEMM outputs carry a relative RMS error of
  roughly 10%, which floors an MSE regression loss well above FP32's; the band is final loss
  <= 2.5 L and <= 3% of the initial loss. Measured: ~1.8 L (4over6 slightly lower).
A wrong GEMM (transposed operand, missing/misapplied scale) does not train at all, far outside both.
"""

from __future__ import annotations

import pytest
import torch

import fp_recipes
from fp_recipes import (DelayedScaling, Float8CurrentScaling, LayerNormLinear, Linear, NVFP4BlockScaling,
                        convert_model)


def test_convert_model_swaps_linears_with_same_weights():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(),
        torch.nn.Sequential(torch.nn.Linear(32, 32, bias=False), torch.nn.ReLU()),
        torch.nn.Linear(32, 8))
    x = torch.randn(4, 16)
    before = model(x)
    w_ids = [id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    out = convert_model(model, module_filter_fn=lambda mod, fqn: fqn != "3")
    assert out is model
    assert isinstance(model[0], Linear) and isinstance(model[2][0], Linear)
    assert type(model[3]) is torch.nn.Linear  # filtered out (e.g. an LM head)
    assert model[2][0].bias is None
    assert [id(model[0].weight), id(model[2][0].weight), id(model[3].weight)] == w_ids
    assert torch.equal(model(x), before)  # outside autocast: the same math
    with fp_recipes.autocast(recipe=Float8CurrentScaling()):
        y = model(x)
    assert y.shape == (4, 8) and not torch.equal(y, before)
    assert torch.allclose(y, before, rtol=0.1, atol=0.05)


def test_convert_model_top_level_linear_and_recipe_attached():
    lin = torch.nn.Linear(8, 4)
    recipe = DelayedScaling()
    new = convert_model(lin, recipe=recipe)
    assert isinstance(new, Linear) and new.weight is lin.weight and new.fp_recipe is recipe
    with pytest.raises(TypeError, match="recipe"):
        convert_model(torch.nn.Linear(8, 4), recipe="delayed")
    with pytest.raises(TypeError, match="nn.Module"):
        convert_model(lin.weight)


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = LayerNormLinear(32, 64, normalization="RMSNorm")
        self.fc2 = Linear(64, 32)
        self.head = Linear(32, 16)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.ln1(x))
        return self.head(x + self.fc2(h))


def _train(recipe, steps=60):
    torch.manual_seed(0)
    model = _MLP()
    teacher = torch.nn.Linear(32, 16)
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 32, generator=g)
        with torch.no_grad():
            t = torch.tanh(teacher(x))
        with fp_recipes.autocast(enabled=recipe is not None, recipe=recipe):
            y = model(x)
        loss = torch.nn.functional.mse_loss(y, t)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def baseline():
    return _train(None)


@pytest.mark.parametrize("name,recipe_fn", [
    ("delayed", lambda: DelayedScaling()),
    ("current", lambda: Float8CurrentScaling()),
    ("nvfp4", lambda: NVFP4BlockScaling()),
    ("nvfp4_4over6", lambda: NVFP4BlockScaling(nvfp4_4over6="weights")),
])
def test_tiny_mlp_trains_with_each_recipe(baseline, name, recipe_fn):
    losses = _train(recipe_fn())
    first, last = sum(losses[:3]) / 3, sum(losses[-5:]) / 5
    base_last = sum(baseline[-5:]) / 5
    assert base_last < 0.25 * sum(baseline[:3]) / 3  # the task itself is learnable
    assert last < 0.25 * first, f"{name}: loss {first:.4f} -> {last:.4f} did not fall enough"
    if name.startswith("nvfp4"):
        assert last <= 2.5 * base_last and last <= 0.03 * first, f"{name}: {last:.5f} vs FP32 {base_last:.5f}"
    else:
        assert last <= 1.15 * base_last, f"{name}: {last:.5f} vs FP32 {base_last:.5f}"
