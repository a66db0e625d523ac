"""Why a Linear step's pipelined time can exceed both its GPU time and its host time measured one step at a time
(bench_model.py --linear, session 28: FP8 delayed step 0.944 ms, host 0.719 ms, GPU 0.383 ms): per recipe, N steps
back to back with no synchronisation, the host time of every step (perf_counter between step starts), and the
GPU-event time of the whole window; with Python's cyclic GC on and off. A step whose host time has a long tail
(a blocking call, a GC pass, the caching allocator returning memory) shows it in max / p90 against the median.

``--weights changing`` (default) changes the weight after every step, as an optimizer step does, so every forward
casts it (bench_model.py's setting); ``fixed`` leaves it, as for the 2nd..nth micro-batch of gradient accumulation,
where the module reuses its cached quantized weight (session 28's runs 3 and 4 measured this case).

    python benchmarks/step_gaps.py [--recipes off,delayed,current,nvfp4] [--size 4096] [--steps 200]
                                   [--weights changing|fixed] [--json F]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

import fp_recipes
from fp_recipes import DelayedScaling, Float8CurrentScaling, Linear, NVFP4BlockScaling

RECIPES = {"off": None, "delayed": DelayedScaling, "current": Float8CurrentScaling, "nvfp4": NVFP4BlockScaling}


def window(recipe, size: int, steps: int, collect: bool, changing: bool) -> dict:
    dev = torch.device("cuda")
    x = torch.randn(size, size, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    mod = Linear(size, size, bias=False, params_dtype=torch.bfloat16, device=dev)

    def step() -> None:
        x.grad = None
        mod.weight.grad = None
        with fp_recipes.autocast(enabled=recipe is not None, recipe=recipe):
            y = mod(x)
        y.backward(dy)
        if changing:
            with torch.no_grad():
                mod.weight.add_(1e-6)  # as an optimizer step: the next forward casts the weight again

    for _ in range(10):
        step()
    torch.cuda.synchronize()
    if not collect:
        gc.collect()
        gc.disable()
    try:
        hosts = []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t_prev = time.perf_counter()
        for _ in range(steps):
            step()
            t = time.perf_counter()
            hosts.append((t - t_prev) * 1e3)
            t_prev = t
        end.record()
        host_total = sum(hosts)
        torch.cuda.synchronize()
    finally:
        gc.enable()
    hosts.sort()
    return {"step_ms": start.elapsed_time(end) / steps, "host_mean_ms": host_total / steps,
            "host_median_ms": statistics.median(hosts), "host_p90_ms": hosts[int(0.9 * len(hosts))],
            "host_max_ms": hosts[-1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", default="off,delayed,current,nvfp4")
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--weights", choices=("changing", "fixed"), default="changing")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    changing = args.weights == "changing"
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; Linear {args.size}^3, no bias, "
          f"{args.steps} steps back to back, weights {args.weights}, ms")
    print(f"{'recipe':10s} {'gc':4s} {'step':>8s} {'host mean':>10s} {'median':>8s} {'p90':>8s} {'max':>8s}")
    rows = []
    for name in args.recipes.split(","):
        for collect in (True, False):
            r = window(RECIPES[name] and RECIPES[name](), args.size, args.steps, collect, changing)
            r.update(recipe=name, gc=collect)
            rows.append(r)
            print(f"{name:10s} {'on' if collect else 'off':4s} {r['step_ms']:8.3f} {r['host_mean_ms']:10.3f} "
                  f"{r['host_median_ms']:8.3f} {r['host_p90_ms']:8.3f} {r['host_max_ms']:8.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "size": args.size,
                       "weights": args.weights, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
