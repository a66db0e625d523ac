"""TransformerEngine scripts run with only their import lines changed (the recipe side), and the
errors a TE user meets name what to do."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fp_recipes
from fp_recipes import recipe

ROOT = Path(__file__).resolve().parents[1]


def test_te_recipe_names_build_our_recipes():
    r = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    assert isinstance(r, fp_recipes.DelayedScaling) and r.amax_history_len == 16
    assert r.fp8_format is fp_recipes.Format.HYBRID
    assert isinstance(recipe.Float8CurrentScaling(), fp_recipes.Float8CurrentScaling)
    assert isinstance(recipe.NVFP4BlockScaling(disable_rht=True), fp_recipes.NVFP4BlockScaling)
    assert recipe.Recipe is fp_recipes.Recipe and recipe.Format is fp_recipes.Format
    for name in ("DelayedScaling", "Float8CurrentScaling", "NVFP4BlockScaling", "Format", "Recipe"):
        assert getattr(recipe, name) is getattr(fp_recipes, name)


@pytest.mark.parametrize("name,hint", [("MXFP8BlockScaling", "Float8CurrentScaling()"),
                                       ("Float8BlockScaling", "PerTokenScaling(fmt='e4m3')"),
                                       ("CustomRecipe", "recipe.plan")])
def test_te_recipes_we_lack_say_what_to_use(name, hint):
    with pytest.raises(NotImplementedError, match="not") as info:
        getattr(recipe, name)()
    assert hint in str(info.value) and name in str(info.value)


def test_te_style_script_runs_with_only_imports_changed(tmp_path):
    """TE's quickstart pattern (recipe, Linear/LayerNormLinear, fp8_autocast, backward), with the two
    TE import lines replaced and nothing else."""
    script = textwrap.dedent('''
        import torch
        import fp_recipes as te                 # was: import transformer_engine.pytorch as te
        from fp_recipes import recipe           # was: from transformer_engine.common import recipe

        torch.manual_seed(0)
        hidden, ffn = 64, 256
        fp8_recipe = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16,
                                           amax_compute_algo="max")
        ln_qkv = te.LayerNormLinear(hidden, 3 * hidden, bias=True)
        proj = te.Linear(hidden, hidden, bias=True)
        fc1 = te.LayerNormLinear(hidden, ffn, bias=True, normalization="RMSNorm")
        fc2 = te.Linear(ffn, hidden, bias=True)
        params = [p for m in (ln_qkv, proj, fc1, fc2) for p in m.parameters()]
        opt = torch.optim.AdamW(params, lr=1e-3)
        inp = torch.randn(128, hidden)
        for step in range(3):
            with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
                q, k, v = ln_qkv(inp).chunk(3, dim=-1)
                att = torch.softmax(q @ k.t() / hidden ** 0.5, dim=-1) @ v
                x = inp + proj(att)
                out = x + fc2(torch.nn.functional.gelu(fc1(x)))
            loss = out.float().square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            print(f"step {step} loss {loss.item():.4f}")
        print("scale", float(proj.qstate_scale()[0]) if hasattr(proj, "qstate_scale") else "n/a")
    ''')
    path = tmp_path / "te_quickstart.py"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NVTE_", "FP_RECIPE"))}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(l.split()[-1]) for l in out.stdout.splitlines() if l.startswith("step")]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))


def test_quantizer_role_lists_the_valid_values():
    with pytest.raises(ValueError) as info:
        fp_recipes.QuantizerRole("linear", "activations")
    msg = str(info.value)
    for value in ("'activation'", "'weight'", "'grad_output'", "'output'", "'grad_input'"):
        assert value in msg
    assert "did you mean 'activation'?" in msg
    with pytest.raises(ValueError, match="'layernorm_linear'"):
        fp_recipes.QuantizerRole("mlp", "weight")
    assert fp_recipes.QuantizerRole("LINEAR", "Weight").tensor.value == "weight"  # any case


def test_per_token_under_backward_override_none_names_the_variable(monkeypatch):
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "none")
    with pytest.raises(ValueError, match="NVTE_BACKWARD_OVERRIDE=none"):
        fp_recipes.PerTokenScaling()
    monkeypatch.delenv("NVTE_BACKWARD_OVERRIDE")
    with pytest.raises(ValueError, match="backward_override=None"):
        fp_recipes.PerTokenScaling(backward_override=None)
    assert fp_recipes.PerTokenScaling(backward_override="High_Precision").backward_override.value == "high_precision"


@pytest.mark.parametrize("make", [lambda: fp_recipes.DelayedScaling(backward_override="dequantized"),
                                  lambda: fp_recipes.Float8CurrentScaling(backward_override="high_precision"),
                                  lambda: fp_recipes.NVFP4BlockScaling(backward_override="dequantized"),
                                  lambda: fp_recipes.PerTokenScaling()])
def test_every_spec_carries_the_backward_override(make):
    r = make()
    for tensor in ("activation", "weight", "grad_output", "output", "grad_input"):
        for module in ("linear", "layernorm_linear", "grouped_linear"):
            spec = r.plan(fp_recipes.QuantizerRole(module, tensor))
            assert spec.backward_override == r.backward_override, (tensor, module)


def test_recipes_doc_case_insensitivity_claim_holds():
    """docs/recipes.md: enum strings of recipe fields, QuantizerRole and env variables are case-insensitive."""
    assert fp_recipes.DelayedScaling(fp8_format="hybrid").fp8_format is fp_recipes.Format.HYBRID
    r = fp_recipes.NVFP4BlockScaling(nvfp4_4over6="Weights", nvfp4_4over6_err_mode="mse",
                                     backward_override="High_Precision")
    assert (r.nvfp4_4over6.value, r.nvfp4_4over6_err_mode.value, r.backward_override.value) == (
        "weights", "MSE", "high_precision")
    assert fp_recipes.PerTokenScaling(fmt="E5M6").fmt.value == "e5m6"
    text = (ROOT / "docs" / "recipes.md").read_text()
    assert "are case-insensitive" in text and "[transformer_engine.md](transformer_engine.md)" in text


def test_recipe_module_is_public_surface():
    import importlib

    fresh = importlib.import_module("fp_recipes")
    assert fresh.recipe is recipe and "recipe" in dir(fresh)
    assert fresh.recipe.Format.HYBRID is fp_recipes.Format.HYBRID
