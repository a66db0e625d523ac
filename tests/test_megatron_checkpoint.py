"""Megatron distributed checkpointing on the fp_recipes backend (CPU, gloo, one process): save with
``dist_checkpointing.save`` (torch_dist, synchronous), load into a fresh model, continue training:
losses, weights and the delayed-scaling state equal the uninterrupted run bit for bit."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("megatron.core")
warnings.filterwarnings("ignore")

from _megatron_fixtures import (build_gpt, load_checkpoint, megatron_on_cpu, moe_overrides,  # noqa: E402
                                quant_recipe_config, quantizer_state, save_checkpoint, tiny_config,
                                train)

from fp_recipes import DelayedScaling  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def megatron_cpu():
    with megatron_on_cpu(1):
        yield


def spec_for(config, recipe=None):
    from fp_recipes.integrations.megatron import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(config, recipe=recipe)


CASES = {
    # delayed FP8 everywhere, from a recipe object
    "delayed": (lambda: tiny_config(), DelayedScaling(amax_history_len=4)),
    # per-module recipes through quant_recipe: BF16 / delayed FP8 / NVFP4 with RHT and stochastic
    # rounding (the SR streams' state is in each module's extra state)
    "quant_recipe_mixed": (lambda: tiny_config(quant_recipe=quant_recipe_config({"recipe": "nvfp4"})),
                           None),
    # MoE grouped experts (expert-axis keys) under delayed FP8
    "moe": (lambda: tiny_config(**moe_overrides()), DelayedScaling(amax_history_len=4)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dist_checkpoint_round_trip_continues_bitwise(case, tmp_path):
    make_config, recipe = CASES[case]
    config = make_config()
    model = build_gpt(config, spec_for(config, recipe))
    # plain SGD: no optimizer state, so the model's checkpoint is the whole training state
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    train(model, 2, opt=opt)
    saved_q = quantizer_state(model)
    assert saved_q, "no delayed-scaling state to checkpoint"
    assert any(not torch.equal(v, torch.ones_like(v)) for k, v in saved_q.items() if k.endswith("_scale"))
    save_checkpoint(model, str(tmp_path))
    uninterrupted = train(model, 3, start=2, opt=opt)

    fresh = build_gpt(config, spec_for(config, recipe), seed=4321)  # other weights, initial scales
    fresh_q = quantizer_state(fresh)
    assert fresh_q.keys() == saved_q.keys()
    assert any(not torch.equal(fresh_q[k], v) for k, v in saved_q.items())
    load_checkpoint(fresh, str(tmp_path))
    for k, v in quantizer_state(fresh).items():
        assert torch.equal(v, saved_q[k]), k
    resumed = train(fresh, 3, start=2)

    assert resumed == uninterrupted  # bitwise: same floats, same order
    final, got = model.state_dict(), fresh.state_dict()
    assert final.keys() == got.keys()
    for k, v in final.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, got[k]), k


def test_checkpoint_of_another_history_length_fails_clearly(tmp_path):
    config = tiny_config()
    model = build_gpt(config, spec_for(config, DelayedScaling(amax_history_len=4)))
    train(model, 1)
    save_checkpoint(model, str(tmp_path))
    other = build_gpt(config, spec_for(config, DelayedScaling(amax_history_len=8)))
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    # Megatron's own shape validation names the per-layer key (our qstate key layout makes it one)
    with pytest.raises(CheckpointException, match=r"shape mismatch.*\(8,\).*layer1\.qstate_activation0_amax_history"):
        load_checkpoint(other, str(tmp_path))
