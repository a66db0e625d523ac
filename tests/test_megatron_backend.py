"""The Megatron-core backend at TP=1 on CPU (gloo, one process): real GPTModels on Megatron's local
spec and on ours, compared; recipes from TransformerConfig, recipe objects and quant_recipe."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("megatron.core")
warnings.filterwarnings("ignore")

from _megatron_fixtures import (NVFP4_ROW_4OVER6, build_gpt, local_spec, loss_of,  # noqa: E402
                                megatron_on_cpu, moe_overrides, quant_recipe_config, tiny_config,
                                train)

import fp_recipes  # noqa: E402
from fp_recipes import DelayedScaling, Float8CurrentScaling, NVFP4BlockScaling  # noqa: E402



@pytest.fixture(scope="module", autouse=True)
def megatron_cpu():
    with megatron_on_cpu(1):
        yield


def ours(config, recipe=None):
    """The one-line switch: this backend's decoder block spec (final norm included)."""
    from fp_recipes.integrations.megatron import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(config, recipe=recipe)


def our_key(local_key: str) -> str:
    """Megatron local-spec parameter name -> this backend's (fused norms, grouped experts)."""
    k = local_key.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_")
    if ".experts.local_experts." in k:
        head, tail = k.split(".experts.local_experts.")
        idx, rest = tail.split(".", 1)
        lin, attr = rest.rsplit(".", 1)
        return f"{head}.experts.{lin}.{attr}{idx}"
    if "pre_mlp_layernorm" in k and ".mlp.router" not in k:
        return k
    return k


def dense_key(local_key: str) -> str:
    k = our_key(local_key)
    return k.replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")


def params(model):
    return {k: v for k, v in model.named_parameters()}


def test_dense_same_init_types_and_bitwise_equal_to_local():
    from fp_recipes.integrations.megatron import (FpLayerNormColumnParallelLinear, FpNorm,
                                                  FpRowParallelLinear)
    cfg = tiny_config()
    a, b = build_gpt(cfg, ours(cfg)), build_gpt(cfg, local_spec(cfg))
    layer = a.decoder.layers[0]
    assert type(layer.self_attention.linear_qkv) is FpLayerNormColumnParallelLinear
    assert type(layer.self_attention.linear_proj) is FpRowParallelLinear
    assert type(layer.mlp.linear_fc1) is FpLayerNormColumnParallelLinear
    assert type(layer.mlp.linear_fc2) is FpRowParallelLinear
    assert type(a.decoder.final_layernorm) is FpNorm
    pa, pb = params(a), params(b)
    assert len(pa) == len(pb)
    for k, v in pb.items():  # same seed, same weights (Megatron's init_method + CPU init)
        assert torch.equal(pa[dense_key(k)], v), k
    la, lb = loss_of(a), loss_of(b)
    la.backward()
    lb.backward()
    assert torch.equal(la, lb)  # quantization off: Megatron's own local GEMMs, same math
    for k, v in pb.items():
        assert torch.equal(pa[dense_key(k)].grad, v.grad), k


def test_moe_matches_local_sequential_experts():
    from fp_recipes.integrations.megatron import FpColumnParallelGroupedLinear, FpRowParallelGroupedLinear
    cfg = tiny_config(**moe_overrides())
    a, b = build_gpt(cfg, ours(cfg)), build_gpt(cfg, local_spec(cfg))
    experts = a.decoder.layers[0].mlp.experts
    assert type(experts.linear_fc1) is FpColumnParallelGroupedLinear
    assert type(experts.linear_fc2) is FpRowParallelGroupedLinear
    pa, pb = params(a), params(b)
    assert len(pa) == len(pb)
    with torch.no_grad():
        for k, v in pb.items():
            pa[our_key(k)].copy_(v)
    la, lb = loss_of(a), loss_of(b)
    la.backward()
    lb.backward()
    # Grouped experts (TEGroupedMLP: F.linear per expert, probs applied after the activation) vs
    # SequentialMLP (matmul + bias, its own order): the same products, FP32 rounding differs.
    assert torch.allclose(la, lb, rtol=0, atol=1e-5), (la.item(), lb.item())
    for k, v in pb.items():
        g = pa[our_key(k)].grad
        assert torch.allclose(g, v.grad, rtol=1e-4, atol=1e-6), k


@pytest.mark.parametrize("name,recipe,bound", [
    ("delayed", DelayedScaling(amax_history_len=4), 0.02),
    ("current", Float8CurrentScaling(), 0.02),
    ("nvfp4", NVFP4BlockScaling(**NVFP4_ROW_4OVER6), 0.05),
])
def test_quantized_training_close_to_bf16(name, recipe, bound):
    # Bounds: 3 SGD steps of a tiny GPT from the same weights; loss ~4.9. FP8 moves it by ~1e-3 and
    # NVFP4 (E2M1) by ~5e-3 here; the bounds are ~10x that (a wrong scale or a BF16 fallback gives
    # either a blow-up or exactly the BF16 curve, both checked).
    cfg = tiny_config()
    base = train(build_gpt(cfg, ours(cfg)), 3)
    model = build_gpt(cfg, ours(cfg, recipe=recipe))
    qlosses = train(model, 3)
    diffs = [abs(x - y) for x, y in zip(base, qlosses)]
    assert max(diffs) < bound, (name, base, qlosses)
    assert max(diffs) > 0, "quantized run equals BF16 exactly: nothing was quantized"
    fc1 = model.decoder.layers[0].mlp.linear_fc1
    assert fc1.recipe is recipe and fc1.quantizer_sets is not None
    if name == "delayed":  # scales were updated from reduced amaxes, for all three operands
        for op in ("activation", "weight", "grad_output"):
            assert getattr(fc1, f"qstate_{op}0_scale").item() != 1.0, op


def test_moe_grouped_trains_quantized():
    cfg = tiny_config(**moe_overrides())
    base = train(build_gpt(cfg, ours(cfg)), 2)
    model = build_gpt(cfg, ours(cfg, recipe=NVFP4BlockScaling(**NVFP4_ROW_4OVER6)))
    q = train(model, 2)
    assert 0 < max(abs(x - y) for x, y in zip(base, q)) < 0.05, (base, q)  # bound as above
    assert model.decoder.layers[0].mlp.experts.linear_fc1.quantizer_sets is not None


def recipes_by_path(model):
    from fp_recipes.integrations.megatron import MegatronQuantized
    return {n: m.recipe for n, m in model.named_modules() if isinstance(m, MegatronQuantized)}


def test_config_recipe_and_first_last_layers_bf16():
    from fp_recipes.integrations.megatron import recipe_from_config
    delayed = tiny_config(fp8="e4m3", fp8_recipe="delayed", fp8_margin=1, fp8_amax_history_len=8,
                          fp8_amax_compute_algo="max")
    assert recipe_from_config(delayed) == DelayedScaling(fp8_format="E4M3", margin=1, amax_history_len=8,
                                                         amax_compute_algo="max")
    assert recipe_from_config(tiny_config(fp4="nvfp4", fp4_recipe="nvfp4")) == NVFP4BlockScaling()
    # (Megatron itself refuses delayed scaling with first_last_layers_bf16)
    cfg = tiny_config(num_layers=3, fp8="hybrid", fp8_recipe="tensorwise", first_last_layers_bf16=True,
                      num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=1)
    model = build_gpt(cfg, ours(cfg))
    got = recipes_by_path(model)
    assert len(got) == 12
    for path, recipe in got.items():
        if ".layers.1." in path:
            assert recipe == Float8CurrentScaling(fp8_format="HYBRID"), path
        else:
            assert recipe is None, path
    losses = train(model, 1)
    assert all(torch.isfinite(torch.tensor(losses)))


def test_quant_recipe_matchers_each_module():
    cfg = tiny_config(quant_recipe=quant_recipe_config())
    model = build_gpt(cfg, ours(cfg))
    for path, recipe in recipes_by_path(model).items():
        if path.endswith("layers.0.self_attention.linear_proj"):
            assert recipe is None, path
        elif ".mlp.linear_fc" in path:
            assert recipe == NVFP4BlockScaling(**NVFP4_ROW_4OVER6), path
        else:
            assert recipe == DelayedScaling(amax_history_len=4), path
    assert all(torch.isfinite(torch.tensor(train(model, 1))))


def test_autocast_overrides_module_recipes():
    cfg = tiny_config()
    plain = loss_of(build_gpt(cfg, ours(cfg)))
    model = build_gpt(cfg, ours(cfg, recipe=Float8CurrentScaling()))
    with fp_recipes.autocast(enabled=False):
        off = loss_of(model)
    assert torch.equal(off, plain)
    quantized = loss_of(model)
    assert not torch.equal(quantized, plain)
    with fp_recipes.autocast(recipe=Float8CurrentScaling()):
        assert torch.equal(loss_of(model), quantized)


@pytest.mark.parametrize("overrides,option", [
    (dict(fp4="nvfp4", fp4_recipe="nvfp4", fp4_param=True), "fp4_param"),
    (dict(fp8="hybrid", fp8_recipe="mxfp8"), "fp8_recipe"),
    (dict(fp8="hybrid", fp8_recipe="delayed", fp8_param=True), "fp8_param"),
    (dict(fp8="hybrid", fp8_recipe="delayed", recompute_granularity="full", recompute_method="uniform",
          recompute_num_layers=1), "quant_recipe"),
])
def test_bad_config_fails_at_build(overrides, option):
    cfg = tiny_config(**overrides)
    with pytest.raises(ValueError, match=option):
        build_gpt(cfg, ours(cfg))


@pytest.mark.parametrize("graphs", [
    # (Megatron's local graph manager reads the CUDA device's properties when a block is built)
    pytest.param(dict(cuda_graph_impl="local"), marks=pytest.mark.cuda, id="local"),
    pytest.param(dict(enable_cuda_graph=True), marks=pytest.mark.cuda, id="enable_cuda_graph"),
    pytest.param(dict(cuda_graph_impl="transformer_engine"), id="te")])
@pytest.mark.parametrize("route", ["fp8", "quant_recipe"])
def test_megatron_cuda_graphs_around_quantized_layers_fail_at_build(graphs, route, monkeypatch):
    """Megatron's own capture would freeze the recipe's host-side state into its graphs (silently): refused, on
    every route a recipe takes; a BF16 model keeps Megatron's graphs."""
    from megatron.core.quantization.quant_config import RecipeConfig
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    # local graphs need a cudagraph-safe RNG tracker (Megatron checks the flag when it builds a layer's manager)
    monkeypatch.setattr(get_cuda_rng_tracker(), "use_cudagraphable_rng", True)
    if route == "fp8":
        quant = dict(fp8="hybrid", fp8_recipe="delayed")
    else:
        quant = dict(quant_recipe=RecipeConfig.from_config_dict(
            {"configs": {"n": {"recipe": "nvfp4"}},
             "matchers": {"m": {"type": "glob", "pattern": "*", "config": "n", "enabled": True}}}))
    cfg = tiny_config(**graphs, **quant)
    with pytest.raises(ValueError, match=r"cuda_graph_impl='(local|transformer_engine)'.*make_graphed_callables"):
        build_gpt(cfg, ours(cfg))
    cfg = tiny_config(**graphs)
    build_gpt(cfg, ours(cfg))  # no recipe: nothing of ours to freeze


def test_bad_quant_recipe_payload_and_gather_output_fail_at_build():
    from megatron.core.quantization.quant_config import RecipeConfig
    from fp_recipes.integrations.megatron import FpColumnParallelLinear
    bad = RecipeConfig.from_config_dict({"configs": {"x": {"recipe": "nvfp4", "row_scaled_actvation": True}},
                                         "matchers": {"m": {"type": "glob", "pattern": "*", "config": "x",
                                                            "enabled": True}}})
    cfg = tiny_config(quant_recipe=bad)
    with pytest.raises(ValueError, match="row_scaled_actvation"):
        build_gpt(cfg, ours(cfg))
    cfg = tiny_config()
    with pytest.raises(ValueError, match="gather_output"):
        FpColumnParallelLinear(64, 64, config=cfg, init_method=torch.nn.init.zeros_, gather_output=True,
                               bias=False, skip_bias_add=False, is_expert=False)


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recompute_on_quant_recipe_route_is_bitwise(granularity):
    from megatron.core.quantization.quant_config import RecipeConfig
    qr = RecipeConfig.from_config_dict({"configs": {"d": {"recipe": "delayed", "amax_history_len": 4}},
                                        "matchers": {"m": {"type": "glob", "pattern": "*", "config": "d",
                                                           "enabled": True}}})
    extra = dict(recompute_granularity=granularity)
    if granularity == "full":
        extra.update(recompute_method="uniform", recompute_num_layers=1)
    grads = []
    for kw in ({}, extra):
        cfg = tiny_config(quant_recipe=qr, **kw)
        model = build_gpt(cfg, ours(cfg))
        train(model, 2)  # the delayed state moves
        model.zero_grad(set_to_none=True)
        loss_of(model, 5).backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        grads[-1].update({k: b.clone() for k, b in model.named_buffers() if "qstate" in k})
    plain, recomputed = grads
    assert plain.keys() == recomputed.keys()
    for k in plain:
        assert torch.equal(plain[k], recomputed[k]), k


def test_sharded_state_dict_has_unique_quantizer_state_keys():
    """Every layer's delayed-scaling state gets its own dist-checkpoint key (layers differ in recipe
    here: layer 0's linear_proj is BF16), and the keys validate as one complete checkpoint."""
    cfg = tiny_config(quant_recipe=quant_recipe_config())
    model = build_gpt(cfg, ours(cfg))
    train(model, 1)
    sharded = model.sharded_state_dict()
    keys = [v.key for k, v in sharded.items() if "qstate_" in k]
    assert "decoder.layers.self_attention.linear_proj.layer2.qstate_activation0_scale" in keys
    assert not any(k.startswith("decoder.layers.self_attention.linear_proj.layer1.") for k in keys)
    assert "decoder.layers.self_attention.linear_qkv.layer1.qstate_activation0_scale" in keys
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize("moe", [False, True])
def test_fast_accumulation_reaches_every_gemm_of_a_megatron_model(moe, monkeypatch):
    """A launch script's env toggle: FP_RECIPES_FP8_FAST_ACCUMULATION=all makes the recipe Megatron's fp8 config
    resolves to run every GEMM of a real GPTModel (attention, MLP; with MoE the grouped experts, the recipe passed
    to the spec) in fast accumulation; without it only the forward GEMMs do (TransformerEngine's default)."""
    from fp_recipes.integrations.megatron import recipe_from_config
    from _modules_helpers import record_gemm_accumulation

    seen = record_gemm_accumulation(monkeypatch)
    for env, want in ((None, {"fprop": True, "dgrad": False, "wgrad": False}), ("all", dict.fromkeys(
            ("fprop", "dgrad", "wgrad"), True))):
        if env is None:
            monkeypatch.delenv("FP_RECIPES_FP8_FAST_ACCUMULATION", raising=False)
        else:
            monkeypatch.setenv("FP_RECIPES_FP8_FAST_ACCUMULATION", env)
        cfg = tiny_config(fp8="hybrid", fp8_recipe="tensorwise")
        recipe = recipe_from_config(cfg)
        assert recipe.fast_accumulation == tuple(g for g, on in want.items() if on)
        if moe:  # (Megatron's own fp8 config with grouped experts asks for TransformerEngine: pass the recipe)
            cfg = tiny_config(**moe_overrides())
            model = build_gpt(cfg, ours(cfg, recipe=recipe))
        else:
            model = build_gpt(cfg, ours(cfg))
        seen.clear()
        train(model, 1)
        kinds = {which for which, _ in seen}
        assert kinds == {"fprop", "dgrad", "wgrad"} and len(seen) >= 12, seen
        assert all(flag == want[which] for which, flag in seen), (env, seen)
