"""Worker for the compiled-first tests (tests/test_compile.py, tests/test_compile_cuda.py): in a fresh process,
compile a model of fp_recipes modules and train two steps with no eager quantized step before, so that the first
trace meets every first use of the library (an import, a cache written inside the trace).

    python tests/_compiled_first.py RECIPE DEVICE BACKEND      # prints "ok" on success
"""

from __future__ import annotations

import sys

import torch

import fp_recipes

RECIPES = {
    "delayed": lambda: fp_recipes.DelayedScaling(amax_history_len=4),
    "current": lambda: fp_recipes.Float8CurrentScaling(),
    "nvfp4": lambda: fp_recipes.NVFP4BlockScaling(),
    "nvfp4_row_scaled_4over6": lambda: fp_recipes.NVFP4BlockScaling(
        row_scaled_activation=True, nvfp4_4over6="weights", disable_rht=True, disable_stochastic_rounding=True,
        disable_2d_quantization=True),
    "per_token": lambda: fp_recipes.PerTokenScaling(),
}


class Model(torch.nn.Module):
    """Every module kind: LayerNormLinear, GroupedLinear (2 experts), Linear without a bias."""

    def __init__(self, device: str) -> None:
        super().__init__()
        kw = dict(params_dtype=torch.bfloat16, device=device) if device == "cuda" else {}
        self.ln_fc = fp_recipes.LayerNormLinear(64, 128, **kw)
        self.experts = fp_recipes.GroupedLinear(2, 128, 64, **kw)
        self.head = fp_recipes.Linear(64, 32, bias=False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.experts(self.ln_fc(x), [32, 16]))


def main(recipe_name: str, device: str, backend: str) -> None:
    torch.manual_seed(0)
    model = Model(device)
    run = torch.compile(model, fullgraph=True, backend=backend)
    recipe = RECIPES[recipe_name]()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(48, 64, device=device, dtype=dtype, requires_grad=True)
    for _ in range(2):
        with fp_recipes.autocast(recipe=recipe):
            y = run(x)
        y.float().square().mean().backward()
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    print("ok")


if __name__ == "__main__":
    main(*sys.argv[1:4])
