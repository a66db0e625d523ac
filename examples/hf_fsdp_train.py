"""Train a Hugging Face model with FSDP2 and an fp_recipes recipe chosen only by environment variables.

This is how an RL or fine-tuning launch script uses fp_recipes: the model code is transformers', the
sharding is PyTorch's ``fully_shard``, the mixed precision is ``torch.autocast(dtype=bfloat16)`` over
FP32 master weights, and the recipe comes from the environment (``FP_RECIPES_RECIPE``, ``NVTE_*``),
so switching numerics needs no code change::

    FP_RECIPES_RECIPE=current torchrun --nproc-per-node 2 examples/hf_fsdp_train.py --steps 50
    FP_RECIPES_RECIPE=nvfp4 NVTE_NVFP4_4OVER6=weights torchrun --nproc-per-node 2 examples/hf_fsdp_train.py
    FP_RECIPES_RECIPE=none torchrun ... # the BF16 baseline

Checkpoints are ``torch.distributed.checkpoint`` (model, optimizer and quantizer state);
``--resume DIR`` continues a run bit-identically. On CPU it uses gloo; on GPUs, NCCL.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import fp_recipes
from fp_recipes.integrations.fsdp import all_gather_bytes, enable_quantized_all_gather, precompute_weight_amaxes
from fp_recipes.modules.base import QuantizedModule

SIZES = {  # hidden, layers, heads, intermediate, sequence length, micro-batch per rank
    "tiny": (64, 2, 4, 128, 64, 4),
    "small": (512, 4, 8, 1536, 256, 8),
    "medium": (1024, 8, 16, 2816, 512, 8),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantized-all-gather", action="store_true",
                   help="all-gather weights already quantized (fp_recipes.integrations.fsdp)")
    p.add_argument("--no-precompute-amaxes", action="store_true",
                   help="with --quantized-all-gather: let every weight's all-gather all-reduce its own amax instead "
                        "of one all-reduce per step (precompute_weight_amaxes after the optimizer step)")
    p.add_argument("--save", type=Path, default=None, help="save a checkpoint here at --save-at")
    p.add_argument("--save-at", type=int, default=None, help="step after which to save (default: last)")
    p.add_argument("--resume", type=Path, default=None, help="continue from a checkpoint")
    p.add_argument("--json", type=Path, default=None, help="write the losses here (rank 0)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


def build_model(size: str, seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, inter, seq, _ = SIZES[size]
    config = LlamaConfig(vocab_size=256, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, intermediate_size=inter,
                         max_position_embeddings=seq, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # every nn.Linear of the decoder becomes an fp_recipes.Linear; the LM head stays high precision
    fp_recipes.convert_model(model, module_filter_fn=lambda module, fqn: not fqn.endswith("lm_head"))
    return model


def corpus() -> torch.Tensor:
    """Bytes of the running Python's own source (available offline everywhere)."""
    import json as _json  # any stdlib module's folder will do

    root = Path(_json.__file__).resolve().parent.parent
    data = b"".join(p.read_bytes() for p in sorted(root.glob("*.py"))[:40])
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batch(tokens: torch.Tensor, step: int, rank: int, batch_size: int, seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    starts = torch.randint(0, tokens.numel() - seq - 1, (batch_size,), generator=g)
    return torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()])


def train(args: argparse.Namespace, rank: int, world: int, device: torch.device, cuda: bool) -> None:
    """The training run of one rank (the process group is up): the model sharded with FSDP2, the recipe from the
    environment, an optional resume and checkpoint, the report and JSON on rank 0."""
    recipe = fp_recipes.recipe_from_env(default="delayed")  # None when FP_RECIPES_RECIPE=none
    model = build_model(args.size, args.seed).to(device)
    if args.quantized_all_gather and recipe is not None:
        enable_quantized_all_gather(model, recipe)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    quantized_gather = args.quantized_all_gather and recipe is not None
    precompute = quantized_gather and not args.no_precompute_amaxes
    start = 0
    if args.resume is not None:
        if recipe is not None:
            # dcp.load fills only the keys this fresh model has: build the quantizer state the
            # checkpoint holds (delayed-scaling buffers, the recipe in the extra state) first
            for module in model.modules():
                if isinstance(module, QuantizedModule):
                    module.init_quantizer_state(recipe)
        model_sd, opt_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": opt_sd, "step": torch.zeros((), dtype=torch.long)}
        dcp.load(state, checkpoint_id=str(args.resume))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = int(state["step"])
    if precompute:
        precompute_weight_amaxes(model)  # (after a resume's load: the loaded weights')
    tokens = corpus()
    _, _, _, _, seq, mb = SIZES[args.size]
    name = "none" if recipe is None else type(recipe).__name__
    losses = []
    precompute_s = []  # host seconds of each timed precompute_weight_amaxes call (no sync: what the step pays on the host)
    warmup = start + min(2, max(0, args.steps - start - 1))  # steps left out of the step time
    t0 = t_warm = time.perf_counter()
    for step in range(start, args.steps):
        if step == warmup:
            if cuda:
                torch.cuda.synchronize()
            t_warm = time.perf_counter()
        ids = batch(tokens, step, rank, mb, seq).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16), \
                fp_recipes.autocast(enabled=recipe is not None, recipe=recipe):
            logits = model(ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if precompute:
            t_pre = time.perf_counter()
            precompute_weight_amaxes(model)  # the next step's weight amaxes: one all-reduce, not one per weight
            if step >= warmup:
                precompute_s.append(time.perf_counter() - t_pre)
        losses.append(loss.item())
        if rank == 0:
            tok_s = (step + 1 - start) * mb * seq * world / (time.perf_counter() - t0)
            print(f"step {step + 1:4d}  loss {losses[-1]:.4f}  tokens/s {tok_s:,.0f}  recipe {name}", flush=True)
        if args.save is not None and step + 1 == (args.save_at or args.steps):
            model_sd, opt_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": opt_sd, "step": torch.tensor(step + 1)},
                     checkpoint_id=str(args.save))
    if cuda:
        torch.cuda.synchronize()
    timed = args.steps - warmup
    step_ms = 1e3 * (time.perf_counter() - t_warm) / timed if timed > 0 else float("nan")
    if rank == 0:
        sent = all_gather_bytes(model)
        owners = [o for o in (getattr(m, "_fp_recipes_all_gather_owner", None) for m in model.modules()) if o]
        amax_reduces = sum(o.stats.amax_reduces for o in owners)
        amax_precomputed = sum(o.stats.amax_precomputed for o in owners)
        s = hp = None
        if sent:
            s, hp = map(sum, zip(*sent.values()))
            print(f"quantized all-gather: {s:,} bytes sent by this rank, {hp:,} with the ordinary one "
                  f"({s / hp:.3f}x); weight amaxes all-reduced per gather {amax_reduces}, precomputed "
                  f"{amax_precomputed}")
        pre_ms = 1e3 * sum(precompute_s) / len(precompute_s) if precompute_s else None
        print(f"step time {step_ms:.2f} ms over {timed} steps, {mb * seq * world / step_ms * 1e3:,.0f} tokens/s"
              + (f"; precompute_weight_amaxes {pre_ms:.3f} ms of host time a step" if pre_ms is not None else ""),
              flush=True)
        if args.json is not None:
            args.json.write_text(json.dumps({
                "recipe": name, "start": start, "losses": losses, "quantized_all_gather": bool(sent),
                "step_ms": step_ms, "tokens_per_s": mb * seq * world / step_ms * 1e3, "world": world,
                "size": args.size, "bytes_sent_per_rank": s, "bytes_high_precision": hp,
                "precompute_amaxes": precompute, "amax_reduces": amax_reduces, "amax_precomputed": amax_precomputed,
                "precompute_host_ms": pre_ms,
                "device": torch.cuda.get_device_name(device) if cuda else "cpu"}))


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    train(args, rank, world, device, cuda)
    # train() has returned: the model, the optimizer and their FSDP2 DTensors (whose device mesh refers to the process
    # group) are garbage, collected here while the interpreter is whole, so that tearing the group down below does
    # not wait for interpreter shutdown. (A mitigation for a rare abort of rank 0 at exit, "terminate called without an
    # active exception", after a finished run in tests/test_example_hf_fsdp.py; pytorch/pytorch#65513 describes gloo's
    # threads destroyed unjoined when a group outlives its destroy_process_group.)
    gc.collect()
    # every rank past its last collective before any tears the group down (gloo aborted a rank that destroyed it
    # while the other was still writing its report)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
