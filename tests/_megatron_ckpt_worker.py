"""torchrun worker (2 gloo processes): a Megatron distributed checkpoint saved at TP=2 (+ sequence
parallel) loads at TP=1 and one saved at TP=1 loads at TP=2, on the fp_recipes backend (delayed FP8).
Each load is checked bitwise against the saving model's (gathered or sliced) weights and
delayed-scaling state; training then continues. Rank 0 writes the results as JSON."""

import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _megatron_fixtures import (apply_cpu_patches, build_gpt, init_parallel, load_checkpoint,  # noqa: E402
                                quantizer_state, save_checkpoint, tiny_config, train)

from fp_recipes import DelayedScaling  # noqa: E402
from fp_recipes.integrations.megatron import get_gpt_decoder_block_spec  # noqa: E402


def model_at(tp: int, seed: int):
    init_parallel(tp)
    cfg = tiny_config(tensor_model_parallel_size=tp, sequence_parallel=tp > 1)
    return build_gpt(cfg, get_gpt_decoder_block_spec(cfg, recipe=DelayedScaling(amax_history_len=4)),
                     seed=seed)


def full_params(model):
    """Every parameter as the whole (TP=1) tensor: TP shards gathered along their partition dim."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    size = parallel_state.get_tensor_model_parallel_world_size()
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if size > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = torch.cat(parts, dim=p.partition_dim)
        out[name] = t.clone()
    return out


def same(a: dict, b: dict) -> list:
    """Names whose tensors differ (bitwise) or are missing on one side."""
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


def main() -> None:
    apply_cpu_patches()
    init_parallel(1)  # gloo on the CPU, NCCL with FP_RECIPES_TEST_DEVICE=cuda
    base = sys.argv[2]
    res = {}

    # TP=2 + SP: train, save, continue (the uninterrupted reference)
    tp2 = model_at(2, seed=1234)
    opt = torch.optim.SGD(tp2.parameters(), lr=1e-2)
    train(tp2, 2, opt=opt)
    save_checkpoint(tp2, os.path.join(base, "tp2"))
    saved_full, saved_q = full_params(tp2), quantizer_state(tp2)
    res["tp2_uninterrupted"] = train(tp2, 3, start=2, opt=opt)

    # ... loaded at TP=1 (data parallel 2): whole weights and scales bitwise, then training goes on
    tp1 = model_at(1, seed=4321)
    load_checkpoint(tp1, os.path.join(base, "tp2"))
    res["tp2_to_tp1_weights_differ"] = same(full_params(tp1), saved_full)
    res["tp2_to_tp1_state_differs"] = same(quantizer_state(tp1), saved_q)
    opt = torch.optim.SGD(tp1.parameters(), lr=1e-2)
    res["tp1_resumed"] = train(tp1, 3, start=2, opt=opt)

    # and back: TP=1 saves, TP=2 loads its shards
    save_checkpoint(tp1, os.path.join(base, "tp1"))
    saved_full, saved_q = full_params(tp1), quantizer_state(tp1)
    res["tp1_uninterrupted"] = train(tp1, 2, start=5, opt=opt)
    tp2 = model_at(2, seed=4321)
    load_checkpoint(tp2, os.path.join(base, "tp1"))
    res["tp1_to_tp2_weights_differ"] = same(full_params(tp2), saved_full)
    res["tp1_to_tp2_state_differs"] = same(quantizer_state(tp2), saved_q)
    res["tp2_resumed"] = train(tp2, 2, start=5)

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, res)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({"ranks": everyone}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
