"""convert_model on Hugging Face MoE models (issue 16 c): fused 3-D experts become grouped GEMMs.

Tiny random models built from transformers config classes (nothing downloaded): Mixtral, Qwen2-MoE
(shared expert + shared_expert_gate), Qwen3-MoE (top-3) and DeepSeek-V3 (MLA attention, grouped
sigmoid router, shared experts, a dense first layer). Checked:
- quantization off: logits bit-identical before and after conversion (the converted experts run the
  same per-expert F.linear calls on the same rows in the same order, and add each token's
  contributions in the same order and dtype as transformers' eager experts loop). Gradients agree to
  fp32 summation-order rounding (relative max error <= 1e-5; measured <= 4e-7): the backward adds a
  token's k expert contributions to its input gradient in one gather-backward, where autograd
  accumulates them per expert in its own order, so the FP32 sums may round differently;
- state-dict keys: the converted model loads the original checkpoint strictly, and the original
  model loads the converted one (the only extra keys are fp_recipes quantizer state);
- training under each recipe: per-step losses close to the same model trained without quantization
  (bounds at the test).
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fp_recipes  # noqa: E402
from fp_recipes import DelayedScaling, Float8CurrentScaling, Linear, NVFP4BlockScaling, convert_model  # noqa: E402
from fp_recipes.integrations.convert import default_module_filter  # noqa: E402
from fp_recipes.integrations.hf_moe import GroupedExperts  # noqa: E402

VOCAB = 128
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64, experts_implementation="eager", attn_implementation="eager")


def _configs():
    t = transformers
    return {
        "mixtral": (t.MixtralForCausalLM, lambda: t.MixtralConfig(
            intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, **_COMMON)),
        "qwen2_moe": (t.Qwen2MoeForCausalLM, lambda: t.Qwen2MoeConfig(
            intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, **_COMMON)),
        "qwen3_moe": (t.Qwen3MoeForCausalLM, lambda: t.Qwen3MoeConfig(
            intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=3, head_dim=16,
            **_COMMON)),
        "deepseek_v3": (t.DeepseekV3ForCausalLM, lambda: t.DeepseekV3Config(
            intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3,
            n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=None,
            kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
            **dict(_COMMON, num_key_value_heads=4))),
    }


MODELS = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"]


def _build(name: str, seed: int = 0, layers: int = 2) -> torch.nn.Module:
    cls, config = _configs()[name]
    torch.manual_seed(seed)
    cfg = config()
    cfg.num_hidden_layers = layers
    model = cls(cfg)
    with torch.no_grad():  # some routers start at zero (every expert tied): give them real preferences
        for fqn, p in model.named_parameters():
            if fqn.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return model


def _ids(batch=2, seq=16, seed=1):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _experts(model):
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


@pytest.mark.parametrize("name", MODELS)
def test_experts_convert_and_logits_stay_bit_identical(name):
    model = _build(name)
    ids = _ids()
    ref = model(ids, labels=ids)
    ref.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    params_before = {n: p for n, p in model.named_parameters()}
    originals = {n: type(m).__name__ for n, m in model.named_modules() if n.endswith("mlp.experts")}

    assert convert_model(model) is model
    experts = {n: m for n, m in model.named_modules() if n.endswith("mlp.experts")}
    assert experts and set(experts) == set(originals)
    assert all(isinstance(m, GroupedExperts) and m.replaces == originals[n] for n, m in experts.items())
    # attention projections are fp_recipes Linears; the head stays torch (default filter)
    assert isinstance(model.model.layers[1].self_attn.o_proj, Linear)
    assert type(model.lm_head) is torch.nn.Linear
    # the same parameter objects under the same names: optimizers and checkpoints keep working
    assert {n: p for n, p in model.named_parameters()} == params_before

    again = {n: m for n, m in convert_model(model).named_modules()}  # converting twice changes nothing
    assert all(again[n] is m for n, m in experts.items())
    out = model(ids, labels=ids)
    assert torch.equal(out.logits, ref.logits)
    assert torch.equal(out.loss, ref.loss)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys()
    for n, g in grads.items():
        err = (g - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp_min(1e-30)
        assert err <= 1e-5, f"{n}: relative gradient error {err:.3g}"


def test_router_linears_and_head_stay_high_precision_by_default():
    model = _build("qwen2_moe")
    keeps = default_module_filter(model).keeps
    assert keeps == {"lm_head", "model.layers.0.mlp.shared_expert_gate", "model.layers.1.mlp.shared_expert_gate"}
    convert_model(model)
    mlp = model.model.layers[0].mlp
    assert type(mlp.shared_expert_gate) is torch.nn.Linear  # router-like gate (out_features=1)
    assert isinstance(mlp.shared_expert.gate_proj, Linear)  # the shared expert is an MLP: converted
    assert type(mlp.gate).__name__ == "Qwen2MoeTopKRouter"  # a raw-weight router: never converted
    assert type(model.lm_head) is torch.nn.Linear


def test_module_filter_fn_decides_alone_when_given():
    model = _build("mixtral")
    seen = []

    def keep_experts_high_precision(module, fqn):
        seen.append(fqn)
        return not fqn.endswith("experts")

    convert_model(model, module_filter_fn=keep_experts_high_precision)
    assert not _experts(model)
    assert type(model.model.layers[0].mlp.experts).__name__ == "MixtralExperts"
    assert isinstance(model.lm_head, Linear)  # the caller's filter converts the head
    assert "lm_head" in seen and "model.layers.0.mlp.experts" in seen
    with pytest.raises(TypeError, match="must return a bool"):
        convert_model(_build("mixtral"), module_filter_fn=lambda m, fqn: None)
    with pytest.raises(TypeError, match="callable"):
        convert_model(_build("mixtral"), module_filter_fn="lm_head")


def test_state_dict_keys_load_both_ways():
    original = _build("deepseek_v3")
    ids = _ids()
    ref = original(ids).logits
    converted = convert_model(_build("deepseek_v3", seed=5))
    missing_unexpected = converted.load_state_dict(original.state_dict(), strict=True)
    assert not missing_unexpected.missing_keys and not missing_unexpected.unexpected_keys
    assert torch.equal(converted(ids).logits, ref)
    with fp_recipes.autocast(recipe=DelayedScaling()):  # build quantizer state, so it is saved too
        converted(ids)
    saved = converted.state_dict()
    extra = set(saved) - set(original.state_dict())
    assert extra and all(k.rsplit(".", 1)[-1] == "_extra_state" or ".qstate_" in k for k in extra)
    assert any(".experts.gate_up.qstate_" in k for k in extra)  # per-expert delayed-scaling state
    fresh = _build("deepseek_v3", seed=7)
    result = fresh.load_state_dict(saved, strict=False)
    assert not result.missing_keys and set(result.unexpected_keys) == extra
    assert torch.equal(fresh(ids).logits, ref)


def test_hooks_on_the_experts_module_are_kept():
    model = _build("mixtral")
    calls = []
    model.model.layers[0].mlp.experts.register_forward_hook(lambda m, a, o: calls.append(type(m).__name__))
    convert_model(model)
    model(_ids())
    assert calls == ["GroupedExperts"]


def test_unsupported_expert_layout_is_left_alone_with_a_warning():
    t = transformers
    config = t.GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            vocab_size=VOCAB)
    holder = torch.nn.Module()
    holder.experts = t.models.gpt_oss.modeling_gpt_oss.GptOssExperts(config)
    with pytest.warns(UserWarning, match=r"experts \(GptOssExperts\) stays in high precision: layout .*is_transposed"):
        convert_model(holder)
    assert type(holder.experts).__name__ == "GptOssExperts"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_model(holder, module_filter_fn=lambda m, fqn: fqn != "experts")


def test_bad_routing_is_a_clear_error():
    model = convert_model(_build("mixtral"))
    experts = _experts(model)[0]
    x = torch.randn(5, 64)
    with pytest.raises(ValueError, match="expert 4 but there are 4 experts"):
        experts(x, torch.tensor([[0, 4]] * 5), torch.full((5, 2), 0.5))
    with pytest.raises(ValueError, match=r"hidden_states \(T, H\)"):
        experts(x, torch.zeros(4, 2, dtype=torch.long), torch.full((4, 2), 0.5))
    empty = experts(x[:0], torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))  # no tokens: fine
    assert empty.shape == (0, 64)


# Loss bounds vs the same converted model trained without quantization (same init, same batches,
# AdamW): FP8 (E4M3 forward / E5M2 gradients, per-tensor scales, relative error of a GEMM operand
# ~2-4%) moves each step's loss by well under 1% (measured <= 0.32% over 12 steps); NVFP4 (E2M1, one
# mantissa bit, ~10% operand error, stochastic rounding of gradients) by a few percent (measured
# 1.8%). A recipe that quantized the experts wrongly (a transposed operand, a missing scale) does not
# come within these bounds; one that skipped the experts is caught by the state check.
@pytest.mark.parametrize("recipe,bound", [
    (DelayedScaling(), 0.01), (Float8CurrentScaling(), 0.01),
    pytest.param(NVFP4BlockScaling(), 0.05, marks=pytest.mark.slow),
], ids=["delayed", "current", "nvfp4"])
def test_converted_moe_trains_close_to_unquantized(recipe, bound, _baseline_losses):
    model, losses = _train_mixtral(recipe)
    for step, (got, ref) in enumerate(zip(losses, _baseline_losses)):
        assert abs(got - ref) <= bound * ref, f"step {step}: loss {got:.5f} vs unquantized {ref:.5f}"
    assert losses[-1] < 0.85 * losses[0]
    for experts in _experts(model):  # the experts really ran quantized, one quantizer set per expert
        for proj in (experts.gate_up, experts.down):
            assert proj.quantizer_sets is not None and len(proj.quantizer_sets) == 4
    assert len(_experts(model)) == 1
    if isinstance(recipe, DelayedScaling):
        hist = _experts(model)[0].gate_up.qstate_activation0_amax_history
        assert hist.abs().sum() > 0


STEPS = 6


def _train_mixtral(recipe):
    model = convert_model(_build("mixtral", layers=1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = _ids(batch=2, seq=32)
    losses = []
    for _ in range(STEPS):
        with fp_recipes.autocast(enabled=recipe is not None, recipe=recipe):
            loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


@pytest.fixture(scope="module")
def _baseline_losses():
    return _train_mixtral(None)[1]


def test_default_grouped_mm_implementation_agrees_to_fp32_rounding():
    # transformers' default experts_implementation ("grouped_mm") uses a grouped GEMM kernel and sums
    # the top-k outputs in FP32 in routing-slot order: not the eager loop's operations, so equal only
    # to FP32 rounding of a few GEMMs (relative 1e-5 on logits of magnitude ~1).
    model = _build("mixtral")
    model.set_experts_implementation("grouped_mm")
    ids = _ids()
    ref = model(ids).logits
    convert_model(model)
    out = model(ids).logits
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_save_pretrained_without_extra_state_loads_into_the_original_class(tmp_path):
    model = convert_model(_build("qwen3_moe", layers=1))
    ids = _ids()
    with fp_recipes.autocast(recipe=DelayedScaling()):
        model(ids)
    ref = model(ids).logits
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("._extra_state")}
    model.save_pretrained(tmp_path, state_dict=state)
    back = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path, experts_implementation="eager",
                                                         attn_implementation="eager")
    assert torch.equal(back(ids).logits, ref)


def test_docs_huggingface_examples_run():
    from pathlib import Path
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "huggingface.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/huggingface.md", "exec"), namespace)
    model = namespace["model"]
    assert _experts(model) and namespace["loss"].item() > 0
