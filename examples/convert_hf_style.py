"""``fp_recipes.convert_model`` on a model written with plain ``torch.nn`` (the way Hugging Face
models are written: ``nn.Linear``, ``nn.LayerNorm``), trained with and without conversion.

``convert_model(model)`` swaps every ``nn.Linear`` for ``fp_recipes.Linear`` in place, keeping the same
parameter objects, hooks and attributes; outside ``fp_recipes.autocast`` the converted model computes
exactly what the original computed. Quantization happens only inside ``autocast``:
``convert_model(model, recipe=r)`` just stores ``r`` as ``model.fp_recipe`` for the training code to
pass on. The recipe here comes from the environment (``FP_RECIPES_RECIPE``, default delayed scaling).

    python examples/convert_hf_style.py
    FP_RECIPES_RECIPE=nvfp4 EXAMPLE_STEPS=100 python examples/convert_hf_style.py
"""

from __future__ import annotations

import copy
import os

import torch
import torch.nn.functional as F

import fp_recipes


class MLPBlock(torch.nn.Module):
    """An encoder-style feed-forward block as a transformers model writes it."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.LayerNorm = torch.nn.LayerNorm(hidden)
        self.dense_in = torch.nn.Linear(hidden, intermediate)
        self.dense_out = torch.nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dense_out(F.gelu(self.dense_in(self.LayerNorm(x))))


class TinyClassifier(torch.nn.Module):
    def __init__(self, features: int = 64, hidden: int = 128, classes: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(features, hidden)
        self.layers = torch.nn.ModuleList(MLPBlock(hidden, 4 * hidden) for _ in range(layers))
        self.classifier = torch.nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.classifier(h)


def train(model: torch.nn.Module, recipe, steps: int, seed: int = 0) -> list:
    """The same loop for both models; ``recipe=None`` trains without quantization."""
    teacher = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
    torch.manual_seed(seed + 1)
    for p in teacher.parameters():
        torch.nn.init.normal_(p, std=0.3)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 64, generator=gen)
        target = teacher(x).argmax(-1)
        with fp_recipes.autocast(enabled=recipe is not None, recipe=recipe):
            logits = model(x)
        loss = F.cross_entropy(logits.float(), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    steps = int(os.environ.get("EXAMPLE_STEPS", "60"))
    torch.manual_seed(0)
    original = TinyClassifier()
    converted = fp_recipes.convert_model(copy.deepcopy(original), recipe=fp_recipes.recipe_from_env())
    x = torch.randn(8, 64)
    same = torch.equal(original(x), converted(x))  # outside autocast: the very same computation
    n = sum(isinstance(m, fp_recipes.Linear) for m in converted.modules())
    print(f"converted {n} nn.Linear -> fp_recipes.Linear; identical outside autocast: {same}")
    recipe = converted.fp_recipe
    print("recipe:", type(recipe).__name__ if recipe is not None else "none")
    base = train(original, None, steps)
    quant = train(converted, recipe, steps)
    tail = max(1, steps // 10)
    b, q = sum(base[-tail:]) / tail, sum(quant[-tail:]) / tail
    print(f"plain torch.nn : loss {base[0]:.4f} -> {b:.4f}")
    print(f"converted      : loss {quant[0]:.4f} -> {q:.4f} ({100 * (q - b) / b:+.2f}% vs plain)")


if __name__ == "__main__":
    main()
