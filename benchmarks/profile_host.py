"""Where the host time of one ``fp_recipes.Linear`` forward+backward goes on a GPU machine: cProfile over
many steps per recipe (the GPU runs ahead of nothing: at 4096^3 a quantized step's GPU time is below its
host time), the functions with the most own time and the most cumulative time.

    python benchmarks/profile_host.py [--recipes delayed,current,nvfp4] [--steps 200] [--top 30] [--compiled]

``--compiled``: the quantized Linear under torch.compile(fullgraph=True), autocast outside (as bench_model.py's
compiled rows): where a compiled step's host time goes (guards, the compiled autograd function, the ops).
``--graphed``: the quantized Linear captured by ``fp_recipes.make_graphed_callables`` (as bench_model.py's CUDA-graph
rows): where a replayed step's host time goes (the replay's checks, the graph launches, the input, gradient and
``.grad`` copies, the autograd engine).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import fp_recipes
from fp_recipes import DelayedScaling, Float8CurrentScaling, Linear, NVFP4BlockScaling

RECIPES = {"off": None, "delayed": DelayedScaling, "current": Float8CurrentScaling, "nvfp4": NVFP4BlockScaling}


def make_step(recipe, m: int, k: int, n: int, compiled: bool = False, graphed: bool = False):
    dev = torch.device("cuda")
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    mod = Linear(k, n, bias=False, params_dtype=torch.bfloat16, device=dev)
    run = torch.compile(mod, fullgraph=True) if compiled and recipe is not None else mod
    if graphed and recipe is not None:
        sample = x.detach().clone().requires_grad_()
        run = fp_recipes.make_graphed_callables(mod, (sample,), recipe=recipe)  # (carries its own autocast)

    def step():
        x.grad = None
        mod.weight.grad = None
        if recipe is None or graphed:
            y = run(x)
        else:
            with fp_recipes.autocast(recipe=recipe):
                y = run(x)
        y.backward(dy)
        with torch.no_grad():
            mod.weight.add_(1e-6)  # an optimizer step: the weight changes, its cast is redone

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", default="off,delayed,current,nvfp4")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--shape", default="4096,4096,4096")
    p.add_argument("--compiled", action="store_true", help="the quantized rows under torch.compile(fullgraph=True)")
    p.add_argument("--graphed", action="store_true", help="the quantized rows captured by make_graphed_callables")
    args = p.parse_args()
    m, k, n = map(int, args.shape.split(","))
    for name in args.recipes.split(","):
        make = RECIPES[name]
        step = make_step(make() if make else None, m, k, n, args.compiled, args.graphed)
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        host = (time.perf_counter() - t0) / args.steps * 1e3
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            step()
        prof.disable()
        torch.cuda.synchronize()
        mode = (" compiled" if args.compiled else " CUDA graph" if args.graphed else "") if make else ""
        print(f"\n===== {name}{mode}: {host:.3f} ms host per step without "
              f"the profiler ({args.steps} steps, Linear {m}x{k}x{n}) =====")
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).strip_dirs().sort_stats(key).print_stats(args.top)
            lines = s.getvalue().splitlines()
            start = next(i for i, line in enumerate(lines) if "ncalls" in line)
            print(f"-- by {key} (per {args.steps} steps)")
            print("\n".join(lines[start:start + args.top + 1]))


if __name__ == "__main__":
    main()
