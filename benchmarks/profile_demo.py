"""Where the time of one training step of the demo's model goes (``python -m fp_recipes demo``'s GPT, the
GPU default size ``large``), per recipe: wall time per step, GPU kernel time per step (the sum of kernel
durations: kernels of one stream do not overlap), so the GPU's idle time (a host-bound step shows it),
and the kernels grouped by kind.

The demo's MoE layers read the experts' token counts on the host (``counts.tolist()``, a sync), so after
each of them the GPU waits while the host enqueues the next layers: host work per module shows up here
as idle GPU time, not in a kernel table.

    python benchmarks/profile_demo.py [--size large] [--recipes off,delayed,current] [--steps 4] [--top 12]
                                      [--data random|demo] [--train 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fp_recipes  # noqa: E402
from fp_recipes.demo.model import GPT, SIZES  # noqa: E402
from fp_recipes.demo.train import AUX_LOSS_WEIGHT  # noqa: E402
from fp_recipes.demo.runs import build_recipe  # noqa: E402
from profile_model import kernel_table, kind_of  # noqa: E402


def make_step(name: str, size: str, corpus=None):
    cfg = SIZES[size]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = GPT(cfg, device=dev, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    recipe = None if name == "off" else build_recipe(name)
    gen = torch.Generator(device="cpu").manual_seed(1)

    def step() -> None:
        if corpus is None:  # random bytes: the router of a fresh model spreads them evenly
            x = torch.randint(0, 256, (cfg.batch, cfg.seq_len + 1), generator=gen)
            inp, tgt = x[:, :-1].to(dev), x[:, 1:].to(dev)
        else:  # the demo's text: a trained router's expert loads are uneven
            starts = torch.randint(0, corpus.train.numel() - cfg.seq_len - 1, (cfg.batch,), generator=gen)
            inp, tgt = (t.to(dev) for t in corpus.batch(starts, cfg.seq_len))
        with fp_recipes.autocast(enabled=recipe is not None, recipe=recipe):
            logits, aux = model(inp)
        loss = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten())
        opt.zero_grad(set_to_none=True)
        (loss + AUX_LOSS_WEIGHT * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss.item()

    loads: list = []  # the experts' row counts of the first MoE layer's last call

    def record_loads(module, args) -> None:
        loads[:] = list(args[1])

    from fp_recipes import GroupedLinear

    first = next((m for m in model.modules() if isinstance(m, GroupedLinear)), None)
    if first is not None:
        first.register_forward_pre_hook(record_loads)
    step.loads = loads
    return step, cfg.batch * cfg.seq_len


def profile_recipe(name: str, size: str, steps: int, top: int, corpus=None, train: int = 3) -> dict:
    step, tokens = make_step(name, size, corpus)
    for _ in range(train):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    wall = (time.perf_counter() - t0) / steps * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_kernel, by_kind = kernel_table(prof, steps)
    gpu = sum(by_kind.values())
    print(f"\n== {name}: wall {wall:.1f} ms/step ({tokens / wall * 1e3:,.0f} tokens/s), kernels {gpu:.1f} ms, "
          f"GPU idle {wall - gpu:.1f} ms ({(wall - gpu) / wall:.0%})")
    print("   " + "  ".join(f"{k} {v:.1f}" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])))
    if step.loads:
        print(f"   rows per expert, first MoE layer, last step: {step.loads}")
    for kname, (ms, n) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"   {ms:7.3f} ms  x{n / steps:4.0f}  [{kind_of(kname)}] {kname[:100]}")
    return {"recipe": name, "wall_ms": wall, "kernel_ms": gpu, "idle_ms": wall - gpu, "tokens_per_s": tokens / wall * 1e3,
            "by_kind_ms": dict(by_kind), "expert_rows": list(step.loads)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="large", choices=list(SIZES))
    p.add_argument("--recipes", default="off,delayed,current")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--data", choices=["random", "demo"], default="random",
                   help="random bytes, or the demo's text (Python's standard library)")
    p.add_argument("--train", type=int, default=3, help="steps trained before measuring (the router learns)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("profile_demo: needs a GPU")
        return 0
    print(f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | size {args.size}")
    corpus = None
    if args.data == "demo":
        from fp_recipes.demo.data import load_corpus

        corpus = load_corpus(None, SIZES[args.size].seq_len)
    rows = [profile_recipe(n, args.size, args.steps, args.top, corpus, args.train) for n in args.recipes.split(",")]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
