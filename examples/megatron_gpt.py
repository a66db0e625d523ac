"""Train a small Megatron-core GPT on the fp_recipes backend, once per recipe, and print a loss table.

The model is Megatron's own ``GPTModel``; the one line that puts it on fp_recipes is the spec from
``fp_recipes.integrations.megatron.get_gpt_decoder_block_spec(config)``. Each recipe reaches the
modules the way a Megatron user would give it:

    bf16               no recipe (Megatron's local GEMMs)
    fp8_delayed        TransformerConfig(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=16,
                       fp8_amax_compute_algo="max")
    fp8_current        TransformerConfig(fp8="hybrid", fp8_recipe="tensorwise")
    nvfp4_row_4over6   TransformerConfig(quant_recipe=...): every linear matched to the payload
                       {"recipe": "nvfp4", "row_scaled_activation": true, "nvfp4_4over6": "all", ...}

Every recipe starts from the same weights (same seed) and sees the same batches: byte-level tokens of
the running Python's standard-library source (as ``python -m fp_recipes demo``). The table gives the
final training loss (mean of the last 10% of steps), the held-out loss after training, its gap to BF16
and the training throughput; the same figures go to a JSON file.

    python examples/megatron_gpt.py                      # one GPU: 300 steps per recipe
    python examples/megatron_gpt.py --tiny --steps 20    # a CPU-sized model; runs anywhere

Several GPUs, through torchrun (one process per GPU): ``--tp N`` splits every layer over N GPUs with
Megatron's tensor parallelism (``--sp`` adds sequence parallelism); the remaining factor of the world
size is data parallelism (each data-parallel rank takes its slice of the same global batch, gradients
are averaged over the data-parallel group). Every layout trains on the same global batches, so the
loss curves of TP=1 and TP=2 are comparable step by step; the JSON records, per step, whether the
delayed-scaling state (amax histories and scales) was bit-identical on every rank:

    torchrun --nproc-per-node 2 examples/megatron_gpt.py --tp 2 --sp

On the GPU the parameters are BF16; on the CPU (``--cpu``, or automatically when CUDA is absent) FP32,
with the few stand-ins megatron-core needs to run a model on the CPU (see ``patch_megatron_for_cpu``)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List

import torch

RECIPES = ("bf16", "fp8_delayed", "fp8_current", "nvfp4_row_4over6")
NVFP4_ROW_4OVER6 = {"recipe": "nvfp4", "row_scaled_activation": True, "nvfp4_4over6": "all",
                    # row-scaled activations need 1D blocks, no RHT and round-to-nearest
                    "disable_rht": True, "disable_2d_quantization": True,
                    "disable_stochastic_rounding": True}
SIZES = {  # layers, hidden, heads, ffn, seq_len, batch, default steps
    "full": dict(num_layers=4, hidden_size=512, num_attention_heads=8, ffn_hidden_size=2048,
                 seq_len=256, batch=32, steps=300),
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                 seq_len=32, batch=4, steps=20),
}
VOCAB = 256  # bytes


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a CPU-sized model (2 layers, hidden 64)")
    p.add_argument("--steps", type=int, default=None, help="training steps per recipe "
                   "(default 300, --tiny 20)")
    p.add_argument("--recipes", default=",".join(RECIPES),
                   help=f"comma-separated, from: {', '.join(RECIPES)} (default: all)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even when CUDA is available")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default 1e-3, --tiny 3e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (under torchrun; default 1)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    p.add_argument("--json", default=None, help="where to write the results "
                   "(default runs/megatron_gpt-<time>.json)")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.recipes.split(",") if n.strip()]
    bad = [n for n in names if n not in RECIPES]
    if bad or not names:
        p.error(f"--recipes: unknown {bad or 'empty list'}; allowed: {', '.join(RECIPES)}")
    if "bf16" not in names:
        names.insert(0, "bf16")  # the reference every gap is measured against
    args.recipe_names = names
    size = SIZES["tiny" if args.tiny else "full"]
    args.steps = size["steps"] if args.steps is None else args.steps
    if args.steps < 2:
        p.error(f"--steps must be at least 2, got {args.steps}")
    if args.lr is None:
        args.lr = 3e-3 if args.tiny else 1e-3
    if not args.lr > 0:
        p.error(f"--lr must be positive, got {args.lr}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp < 1 or world % args.tp:
        p.error(f"--tp must be a positive divisor of the world size ({world} process(es)), got {args.tp}")
    if args.sp and args.tp == 1:
        p.error("--sp (sequence parallelism) needs --tp > 1")
    size = SIZES["tiny" if args.tiny else "full"]
    if size["batch"] % (world // args.tp):
        p.error(f"the global batch ({size['batch']}) must split evenly over {world // args.tp} "
                "data-parallel ranks")
    return args


# --------------------------------------------------------------------------- CPU stand-ins
def patch_megatron_for_cpu() -> None:
    """What megatron-core needs to run a model on the CPU (its code assumes CUDA in two spots a dense
    GPT at TP=1 reaches). Applied only for a CPU run; never part of the fp_recipes library.

    * ``GlobalMemoryBuffer.get_tensor``: core attention takes its score buffer from a global buffer
      allocated on the current CUDA device; on the CPU, a plain CPU tensor of the same shape.
    * ``CudaRNGStatesTracker.fork``: attention dropout forks the model-parallel CUDA RNG; there is no
      CUDA RNG (and dropout is 0 here), so the fork is a no-op.
    * ``torch.cuda.current_device``: sequence parallelism's gather buffers go to the current CUDA
      device; on the CPU that device is the CPU."""
    from megatron.core import utils as mcore_utils
    from megatron.core.tensor_parallel import random as mcore_random

    def cpu_buffer(self, tensor_shape, dtype, name, mem_alloc_context=None):
        return torch.empty(tuple(tensor_shape), dtype=dtype)

    @contextlib.contextmanager
    def no_fork(self, name=None):
        yield

    mcore_utils.GlobalMemoryBuffer.get_tensor = cpu_buffer
    mcore_random.CudaRNGStatesTracker.fork = no_fork
    # sequence parallelism allocates its gather buffers on the "current CUDA device"
    torch.cuda.current_device = lambda: "cpu"


# --------------------------------------------------------------------------- set-up
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device: torch.device, tp: int) -> None:
    """The process group (one process, or torchrun's world) and Megatron's parallel groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)


def transformer_config(name: str, size: Dict[str, Any], dtype: torch.dtype, tp: int = 1, sp: bool = False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw: Dict[str, Any] = dict(
        num_layers=size["num_layers"], hidden_size=size["hidden_size"],
        num_attention_heads=size["num_attention_heads"], ffn_hidden_size=size["ffn_hidden_size"],
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,  # the same weights for every recipe, on any device
        # no TransformerEngine/Apex here: Megatron's unfused paths
        bias_dropout_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        tensor_model_parallel_size=tp, sequence_parallel=sp)
    if name == "fp8_delayed":
        kw.update(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=16, fp8_amax_compute_algo="max")
    elif name == "fp8_current":
        kw.update(fp8="hybrid", fp8_recipe="tensorwise")
    elif name == "nvfp4_row_4over6":
        from megatron.core.quantization.quant_config import RecipeConfig

        kw["quant_recipe"] = RecipeConfig.from_config_dict({
            "configs": {"nv": NVFP4_ROW_4OVER6},
            "matchers": {"all": {"type": "glob", "pattern": "*", "config": "nv", "enabled": True}}})
    return TransformerConfig(**kw)


def build_model(config, seq_len: int, device: torch.device, seed: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from fp_recipes.integrations.megatron import get_gpt_decoder_block_spec

    torch.manual_seed(seed)
    if device.type == "cuda":
        model_parallel_cuda_manual_seed(seed)  # the RNG tracker attention dropout forks
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_decoder_block_spec(config),
                     vocab_size=VOCAB, max_sequence_length=seq_len,
                     position_embedding_type="learned_absolute")
    model = model.to(device)  # Megatron builds on the CPU (use_cpu_initialization) then moves it
    if config.bf16:
        # as Megatron's training loop does: the whole model in BF16 (the position embedding is created
        # in FP32), inputs cast on the way in, the loss returned in FP32
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    return model


# --------------------------------------------------------------------------- training
def data_parallel() -> tuple:
    """(this rank's index in its data-parallel group, the group's size, the group)."""
    from megatron.core import parallel_state

    return (parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size(),
            parallel_state.get_data_parallel_group())


class Batches:
    """Byte windows of the standard library: the same (seeded) global batches for every recipe and
    every parallel layout; a data-parallel rank takes its contiguous slice of each."""

    def __init__(self, seq_len: int, batch: int, steps: int, seed: int, device: torch.device,
                 budget: int) -> None:
        from fp_recipes.demo.data import load_corpus

        self.corpus = load_corpus(None, seq_len, budget=budget)
        self.seq_len, self.device, self.global_batch = seq_len, device, batch
        dp_rank, dp_size, _ = data_parallel()
        local = batch // dp_size
        self.rows = slice(dp_rank * local, (dp_rank + 1) * local)
        self.starts = self.corpus.batch_starts(steps, batch, seq_len, seed)
        self.val = self.corpus.val_starts(4 * batch, seq_len).view(4, batch)
        self.position_ids = torch.arange(seq_len, device=device).unsqueeze(0).expand(local, -1)
        # Megatron's local core attention takes an explicit mask (True = masked out)
        self.mask = torch.ones(local, 1, seq_len, seq_len, dtype=torch.bool,
                               device=device).tril().logical_not()

    def get(self, starts: torch.Tensor, split: str = "train"):
        x, y = self.corpus.batch(starts[self.rows], self.seq_len, split)
        return x.to(self.device), y.to(self.device)


def loss_on(model, batches: Batches, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x, batches.position_ids, batches.mask, labels=y).float().mean()


def dp_mean(value: torch.Tensor) -> float:
    """The global batch's mean of a per-rank mean (equal slices)."""
    import torch.distributed as dist

    _, dp_size, group = data_parallel()
    if dp_size > 1:
        value = value.detach().clone()
        dist.all_reduce(value, group=group)
        value /= dp_size
    return value.item()


def finalize_grads(model) -> None:
    """What Megatron's finalize_model_grads does for this model, without its DDP wrapper: average every
    gradient over the data-parallel group, and sum the gradients of sequence-parallel parameters
    (norm weights, replicated on every TP rank, each rank seeing its own tokens) over the TP group."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    _, dp_size, dp_group = data_parallel()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    for p in model.parameters():
        if p.grad is None:
            continue
        if tp_size > 1 and getattr(p, "sequence_parallel", False):
            dist.all_reduce(p.grad, group=tp_group)
        if dp_size > 1:
            dist.all_reduce(p.grad, group=dp_group)
            p.grad /= dp_size


def quantizer_state_identical(model) -> bool:
    """Whether every rank holds bit-identical delayed-scaling state (amax histories and scales)."""
    import torch.distributed as dist

    parts = [b.detach().reshape(-1).float() for n, b in model.named_buffers() if "qstate" in n]
    if not parts or dist.get_world_size() == 1:
        return True
    mine = torch.cat(parts).view(torch.int32)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.equal(mine, other) for other in everyone)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def train_one(name: str, args: argparse.Namespace, size: Dict[str, Any], batches: Batches,
              device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    import torch.distributed as dist

    config = transformer_config(name, size, dtype, args.tp, args.sp)
    model = build_model(config, size["seq_len"], device, args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    warmup = max(1, args.steps // 10)  # steps left out of the throughput (first-call set-up)
    losses: List[float] = []
    state_differs: List[int] = []  # steps after which some rank's delayed-scaling state differed
    elapsed = 0.0
    for step in range(args.steps):
        if step >= warmup:
            sync(device)
            t0 = time.perf_counter()
        x, y = batches.get(batches.starts[step])
        opt.zero_grad(set_to_none=True)
        loss = loss_on(model, batches, x, y)
        loss.backward()
        finalize_grads(model)
        opt.step()
        if step >= warmup:
            sync(device)
            elapsed += time.perf_counter() - t0  # the step itself, not the checks below
        losses.append(dp_mean(loss))
        if not quantizer_state_identical(model):
            state_differs.append(step)
        if not torch.isfinite(torch.tensor(losses[-1])):
            raise SystemExit(f"megatron_gpt.py: {name}: loss became {losses[-1]} at step {step}")
    tokens_per_gpu = (args.steps - warmup) * batches.global_batch * size["seq_len"] / dist.get_world_size()
    model.eval()
    with torch.no_grad():
        val = sum(dp_mean(loss_on(model, batches, *batches.get(s, "val"))) for s in batches.val) / len(batches.val)
    tail = max(1, args.steps // 10)
    return {"recipe": name, "first_loss": losses[0], "final_loss": sum(losses[-tail:]) / tail,
            "val_loss": val, "tokens_per_s_per_gpu": tokens_per_gpu / elapsed,
            "state_differs_at_steps": state_differs, "losses": losses}


def print_table(results: List[Dict[str, Any]]) -> None:
    base = next(r for r in results if r["recipe"] == "bf16")["val_loss"]
    head = (f"{'recipe':<18} {'first loss':>10} {'final loss':>10} {'val loss':>9} {'gap to bf16':>11} "
            f"{'tokens/s/GPU':>12} {'state same on ranks':>19}")
    print(head)
    print("-" * len(head))
    for r in results:
        r["gap_to_bf16"] = r["val_loss"] - base
        print(f"{r['recipe']:<18} {r['first_loss']:>10.4f} {r['final_loss']:>10.4f} {r['val_loss']:>9.4f} "
              f"{r['gap_to_bf16']:>+11.4f} {r['tokens_per_s_per_gpu']:>12,.0f} "
              f"{'every step' if not r['state_differs_at_steps'] else 'NO: ' + str(len(r['state_differs_at_steps'])) + ' steps':>19}")


def main(argv: List[str]) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", module="megatron")  # Megatron's "TE/Apex not installed" notes
    import megatron.core

    import torch.distributed as dist

    on_gpu = torch.cuda.is_available() and not args.cpu
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    if not on_gpu:
        patch_megatron_for_cpu()
    init_distributed(device, args.tp)
    rank0 = dist.get_rank() == 0
    size = dict(SIZES["tiny" if args.tiny else "full"])
    batches = Batches(size["seq_len"], size["batch"], args.steps, args.seed, device,
                      budget=(256 << 10) if args.tiny else (4 << 20))
    world = dist.get_world_size()
    layout = f"TP={args.tp}{' + SP' if args.sp else ''}, DP={world // args.tp}"
    if rank0:
        print(f"Megatron-core {megatron.core.__version__} GPT on fp_recipes: {size['num_layers']} layers, "
              f"hidden {size['hidden_size']}, {size['batch']}x{size['seq_len']} bytes/step, {args.steps} steps, "
              f"{str(dtype).replace('torch.', '')} on {world} x {device.type} ({layout})\n"
              f"data: {batches.corpus.source}", flush=True)
    results = []
    for name in args.recipe_names:
        t0 = time.perf_counter()
        results.append(train_one(name, args, size, batches, device, dtype))
        if rank0:
            print(f"  {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    if rank0:
        print()
        print_table(results)
        out = Path(args.json or f"runs/megatron_gpt-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "device": torch.cuda.get_device_name(device) if on_gpu else "cpu", "dtype": str(dtype),
            "megatron_core": megatron.core.__version__, "torch": torch.__version__, "steps": args.steps,
            "lr": args.lr, "seed": args.seed, "model": size, "data": batches.corpus.source,
            "world_size": world, "tp": args.tp, "sp": args.sp, "dp": world // args.tp,
            "results": results}, indent=1))
        print(f"\nresults: {out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
