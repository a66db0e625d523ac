"""No host synchronisation in a training step (issue 14): after a warm-up step, a forward + backward +
optimizer step of Linear, LayerNormLinear and GroupedLinear under every recipe runs inside
``torch.cuda.set_sync_debug_mode("error")``, which raises on anything that makes the host wait for
the GPU: ``.item()``, ``bool(tensor)``, ``.tolist()``, ``nonzero``, a device-to-host copy that is not
non-blocking into pinned memory, a blocking host-to-device copy from pageable memory.

The warm-up step may synchronise: first-use checks (the NVFP4 native GEMM's self-check, a grouped
layer's offsets validated once per offsets tensor), cuBLASLt plans, pinned buffers. Later steps must
not: a step that waits for the GPU leaves it idle while the host enqueues the next kernels."""

from __future__ import annotations

import pytest
import torch

import fp_recipes
from fp_recipes import DelayedScaling, Float8CurrentScaling, NVFP4BlockScaling, PerTokenScaling

RECIPES = {
    "delayed": DelayedScaling,
    "current": Float8CurrentScaling,
    "nvfp4": NVFP4BlockScaling,
    "per_token": PerTokenScaling,
}
TOKENS, FEATURES = 256, 256
SPLITS = [64, 32, 16, 144]  # multiples of 16 (NVFP4 blocks along the tokens), summing to TOKENS


def _module(kind: str):
    kw = {"device": "cuda", "params_dtype": torch.bfloat16}
    if kind == "linear":
        m = fp_recipes.Linear(FEATURES, FEATURES, **kw)
        return m, lambda x: m(x)
    if kind == "layernorm_linear":
        m = fp_recipes.LayerNormLinear(FEATURES, FEATURES, **kw)
        return m, lambda x: m(x)
    m = fp_recipes.GroupedLinear(len(SPLITS), FEATURES, FEATURES, **kw)
    return m, lambda x: m(x, SPLITS)


def _run_steps_without_sync(module, call, recipe, *, under_autocast: bool) -> None:
    x = torch.randn(TOKENS, FEATURES, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(TOKENS, FEATURES, device="cuda", dtype=torch.bfloat16)
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)

    def step() -> None:
        if under_autocast:
            with fp_recipes.autocast(recipe=recipe):
                y = call(x)
        else:
            y = call(x)
        y.backward(dy)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: first-use checks may synchronise
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):  # a step after an optimizer step, and steps that reuse cached state
            step()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    for p in module.parameters():
        assert torch.isfinite(p).all()


@pytest.mark.cuda
@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("kind", ["linear", "layernorm_linear", "grouped_linear"])
def test_a_step_never_waits_for_the_gpu(kind, recipe_name):
    torch.manual_seed(0)
    module, call = _module(kind)
    _run_steps_without_sync(module, call, RECIPES[recipe_name](), under_autocast=True)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["linear", "layernorm_linear", "grouped_linear"])
def test_a_module_recipe_step_never_waits_for_the_gpu(kind):
    """Under the module's own recipe (no autocast), the backward flushes the forward's delayed-scaling
    amaxes: that update must not synchronise either."""
    torch.manual_seed(0)
    module, call = _module(kind)
    recipe = DelayedScaling()
    module.set_recipe(recipe)
    _run_steps_without_sync(module, call, recipe, under_autocast=False)


@pytest.mark.cuda
def test_the_sync_check_catches_a_host_read():
    """The mode this file relies on does raise on a host read (so a passing test means something)."""
    t = torch.ones(2, device="cuda")
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            t.sum().item()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
