"""torchrun worker (2 gloo processes): 5 training steps at TP=1, TP=2 and TP=2 + sequence parallel
on the fp_recipes Megatron backend (delayed FP8); rank 0 writes losses and state checks as JSON."""

import json
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, __import__("os").path.dirname(__file__))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _megatron_fixtures import apply_cpu_patches, build_gpt, init_parallel, tiny_config, train  # noqa: E402

from fp_recipes import DelayedScaling  # noqa: E402
from fp_recipes.integrations.megatron import get_gpt_decoder_block_spec  # noqa: E402


def run(tp: int, sp: bool):
    init_parallel(tp)
    cfg = tiny_config(tensor_model_parallel_size=tp, sequence_parallel=sp)
    model = build_gpt(cfg, get_gpt_decoder_block_spec(cfg, recipe=DelayedScaling(amax_history_len=4)))
    losses = train(model, 5)
    state = {k: v.tolist() for k, v in model.named_buffers() if "qstate" in k and "scale" in k}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, state)
    return losses, all(s == everyone[0] for s in everyone)


def main() -> None:
    apply_cpu_patches()
    init_parallel(1)  # gloo on the CPU, NCCL with FP_RECIPES_TEST_DEVICE=cuda
    out = {}
    for name, tp, sp in (("tp1", 1, False), ("tp2", 2, False), ("tp2_sp", 2, True)):
        losses, same = run(tp, sp)
        out[name] = {"losses": losses, "state_identical_on_ranks": same}
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
