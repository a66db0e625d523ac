"""FSDP2 (real ``fully_shard``, 2 gloo processes): the quantized all-gather sends FP8 / NVFP4 bytes and
trains bit-identically to the ordinary all-gather, and to the unsharded module at the first step.

The work runs in tests/_fsdp_worker.py, launched once with torch.distributed.run for every recipe.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _fsdp_worker import STEPS, torchrun
from fp_recipes.integrations.fsdp import enable_quantized_all_gather

HERE = Path(__file__).resolve().parent
RECIPES = ("delayed", "delayed_no_reduce", "current", "nvfp4", "nvfp4_1d_4over6")
TIMEOUT_S = 150  # the run takes ~10 s on 2 CPU cores; a hang fails the tests after this


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp") / "rank"
    proc = torchrun(HERE / "_fsdp_worker.py", [out], {}, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("recipe", RECIPES)
def test_quantized_all_gather_trains_like_the_ordinary_one(runs, recipe):
    for rank, result in enumerate(runs):
        rec = result[recipe]
        assert rec["converted"] == ["0.ln_fc1.weight", "0.fc2.weight", "1.ln_fc1.weight", "1.fc2.weight",
                                    "2.weight"]
        # first step: the gathered quantized weights equal quantizing the whole weight
        assert rec["outputs_equal_plain_step0"], (rank, recipe)
        # every step: outputs, and after training parameters and delayed-scaling state, are those of
        # FSDP2 with the high-precision all-gather (same gradient reduction, so bitwise)
        assert all(rec["outputs_equal_fsdp"]), (rank, recipe, rec["outputs_equal_fsdp"])
        assert rec["params_qag"] == rec["params_fsdp"], (rank, recipe)
        assert rec["state_qag"] == rec["state_fsdp"], (rank, recipe)
        assert rec["losses"]["qag"] == rec["losses"]["fsdp"]
        # no module of the sharded models returned a view (2-D and 3-D inputs)
        assert rec["view_warnings"] == [], (rank, recipe)
    # the two ranks hold the same delayed-scaling state (without the amax reduction, the same weight
    # state: the activation and gradient amaxes are each rank's own)
    keep = (lambda name: "qstate_weight" in name) if recipe == "delayed_no_reduce" else (lambda name: True)
    states = [{k: v for k, v in r[recipe]["state_qag"].items() if keep(k)} for r in runs]
    assert states[0] == states[1]
    if recipe == "delayed_no_reduce":
        assert states[0] and runs[0][recipe]["state_qag"] != runs[1][recipe]["state_qag"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_precomputed_weight_amaxes_train_identically_with_one_reduce(runs, recipe):
    """precompute_weight_amaxes: one all-reduce for every weight's amax (before step 0 and after step 0's optimizer
    step) replaces each gather's own; a weight changed since (step 2: no precompute after step 1's optimizer step)
    reduces its own again. Outputs, parameters and delayed-scaling state equal the per-gather reduction's, bit for
    bit, on both ranks."""
    for rank, result in enumerate(runs):
        rec = result[recipe]
        assert rec["precomputed"] == [5, 5], (rank, recipe)  # the five converted weights, each call
        assert all(rec["precomputed_outputs_equal"]), (rank, recipe, rec["precomputed_outputs_equal"])
        assert rec["params_qag_pre"] == rec["params_qag"], (rank, recipe)
        assert rec["state_qag_pre"] == rec["state_qag"], (rank, recipe)
        assert rec["losses"]["qag_pre"] == rec["losses"]["qag"]
        # per weight: [gathers that reduced their own amax, gathers that took the precomputed one]; the backward's
        # gathers reuse the forward's quantized shard (no amax), so a forward gather per step counts
        assert rec["amax_gathers"]["qag"] == [[STEPS, 0]] * 5, (rank, recipe, rec["amax_gathers"])
        assert rec["amax_gathers"]["qag_pre"] == [[1, 2]] * 5, (rank, recipe, rec["amax_gathers"])
        # under activation checkpointing (precomputed before every step): the recompute's gathers reuse the
        # forward's quantized shard, so every gather took the precomputed amax (and test_activation_checkpointing...
        # checks its outputs against qag's, bit for bit)
        assert rec["amax_gathers"]["qag_ckpt"] == [[0, STEPS]] * 5, (rank, recipe, rec["amax_gathers"])


@pytest.mark.parametrize("recipe", RECIPES)
def test_activation_checkpointing_inside_fsdp2(runs, recipe):
    """Blocks under torch.utils.checkpoint inside fully_shard (ordinary and quantized all-gather): the
    recomputation re-gathers and re-quantizes the weights; outputs, losses, parameters and the
    delayed-scaling state equal the runs without checkpointing, bit for bit, on both ranks."""
    for rank, result in enumerate(runs):
        rec = result[recipe]
        assert all(rec["ckpt_outputs_equal"]) and len(rec["ckpt_outputs_equal"]) == STEPS, (rank, recipe)
        for k in ("fsdp", "qag"):
            assert rec["losses"][f"{k}_ckpt"] == rec["losses"][k], (rank, recipe, k)
            assert rec[f"params_{k}_ckpt"] == rec[f"params_{k}"], (rank, recipe, k)
            assert rec[f"state_{k}_ckpt"] == rec[f"state_{k}"], (rank, recipe, k)


@pytest.mark.parametrize("recipe,ratio", [("delayed", 1 / 4), ("delayed_no_reduce", 1 / 4), ("current", 1 / 4),
                                          # NVFP4: 4 bits + one E4M3 scale per 16, rowwise and
                                          # columnwise copies: 2 * (0.5 + 1/16) bytes per FP32 element
                                          ("nvfp4", 2 * (0.5 + 1 / 16) / 4),
                                          ("nvfp4_1d_4over6", 2 * (0.5 + 1 / 16) / 4)])
def test_all_gather_bytes(runs, recipe, ratio):
    for result in runs:
        for name, (sent, high_precision) in result[recipe]["bytes"].items():
            assert high_precision > 0
            assert sent / high_precision == ratio, (name, sent, high_precision)


def test_enable_checks_its_input():
    import fp_recipes

    model = torch.nn.Sequential(fp_recipes.Linear(32, 32))
    with pytest.raises(TypeError, match="fp_recipes recipe"):
        enable_quantized_all_gather(model, recipe="delayed")
    with pytest.raises(ValueError, match="high_precision"):
        enable_quantized_all_gather(model, fp_recipes.Float8CurrentScaling(backward_override="high_precision"))
    with pytest.raises(ValueError, match="supported"):
        enable_quantized_all_gather(model, fp_recipes.PerTokenScaling())
    assert enable_quantized_all_gather(model, fp_recipes.Float8CurrentScaling(),
                                       module_filter_fn=lambda m, fqn: fqn != "0") == []
    assert enable_quantized_all_gather(model, fp_recipes.Float8CurrentScaling()) == ["0.weight"]


def test_converted_module_without_fsdp_is_unchanged():
    """The subclass is transparent before sharding: same outputs and gradients as before."""
    import fp_recipes

    torch.manual_seed(0)
    a = fp_recipes.Linear(32, 16)
    b = fp_recipes.Linear(32, 16)
    b.load_state_dict(a.state_dict())
    enable_quantized_all_gather(b, fp_recipes.Float8CurrentScaling())
    x = torch.randn(8, 32)
    for m in (a, b):
        with fp_recipes.autocast(recipe=fp_recipes.Float8CurrentScaling()):
            m(x).sum().backward()
    assert torch.equal(a.weight.grad, b.weight.grad)
    opt = torch.optim.AdamW(b.parameters(), lr=1e-2)
    opt.step()
    assert not torch.equal(a.weight.detach(), b.weight.detach()._inner)


@pytest.mark.parametrize("recipe", [None, "delayed", "current", "nvfp4", "per_token"])
@pytest.mark.parametrize("shape", [(32, 64), (4, 8, 64), (7, 64)], ids=["2d", "3d", "2d_odd_tokens"])
@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "GroupedLinear"])
def test_outputs_are_not_views(kind, shape, recipe):
    """A quantized module's output is a fresh tensor (``._base is None``), as ``torch.nn.Linear``'s is for
    2-D input: FSDP2 hooks the output, and an in-place op on a view would drop that hook. (NVFP4 pads 7
    tokens to 16 and slices the padding off.) Quantization off is torch's own ``F.linear``, views where
    torch's are."""
    import fp_recipes

    make = {"delayed": fp_recipes.DelayedScaling, "current": fp_recipes.Float8CurrentScaling,
            "nvfp4": fp_recipes.NVFP4BlockScaling, "per_token": fp_recipes.PerTokenScaling}
    if kind == "GroupedLinear" and len(shape) != 2:
        pytest.skip("GroupedLinear takes 2-D input")
    torch.manual_seed(0)
    m = {"Linear": lambda: fp_recipes.Linear(64, 32), "LayerNormLinear": lambda: fp_recipes.LayerNormLinear(64, 32),
         "GroupedLinear": lambda: fp_recipes.GroupedLinear(2, 64, 32)}[kind]()
    x = torch.randn(*shape, requires_grad=True)
    args = (x, [3, shape[0] - 3]) if kind == "GroupedLinear" else (x,)
    with fp_recipes.autocast(enabled=recipe is not None, recipe=make[recipe]() if recipe else None):
        y = m(*args)
    if recipe is None and kind != "GroupedLinear":
        ref = torch.nn.functional.linear(x.detach(), torch.randn(32, 64), torch.randn(32))
        assert (y._base is None) == (ref._base is None)
    else:
        assert y._base is None and not y._is_view()
    if len(shape) == 2:
        assert y._base is None


@pytest.mark.parametrize("shape", [(32, 64), (4, 8, 64)], ids=["2d", "3d"])
def test_in_place_op_on_the_output_keeps_gradients(shape):
    """``out += residual`` on a quantized module's output gives the gradients of ``out = out + residual``."""
    import copy

    import fp_recipes

    torch.manual_seed(0)
    a = fp_recipes.Linear(64, 64)
    b = copy.deepcopy(a)
    x = torch.randn(*shape)
    grads = []
    for m, in_place in ((a, False), (b, True)):
        xi = x.clone().requires_grad_()
        with fp_recipes.autocast(recipe=fp_recipes.Float8CurrentScaling()):
            out = m(xi)
        if in_place:
            out += xi
        else:
            out = out + xi
        out.square().mean().backward()
        grads.append((xi.grad, m.weight.grad, m.bias.grad))
    assert all(torch.equal(p, q) for p, q in zip(*grads))
