"""Host work of one ``fp_recipes.Linear`` forward + backward on a CPU, per recipe and with quantization
off: aten ops dispatched, Python calls made, and wall time (the fastest of 15 timings of 50 steps: the
least disturbed by other load on a shared machine). On a CPU every cast is the pure-torch reference
(hundreds of small CPU kernels), so this measures the work a step issues, not GPU speed.

``--weights changing`` (default) bumps the weight's version after every step, as an optimizer step
does (every forward casts the weight); ``--weights fixed`` leaves it, as for the 2nd..nth micro-batch
of gradient accumulation, where the module reuses its cached quantized weight (docs/modules.md)::

    python benchmarks/host_linear_cpu.py [--weights changing|fixed] [--m 16 --k 64 --n 64] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fp_recipes
from fp_recipes import DelayedScaling, Float8CurrentScaling, NVFP4BlockScaling, PerTokenScaling

RECIPES = {"off": None, "delayed": DelayedScaling, "current": Float8CurrentScaling,
           "nvfp4": NVFP4BlockScaling, "per_token": PerTokenScaling}


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def measure(name: str, m: int, k: int, n: int, changing: bool) -> dict:
    torch.manual_seed(0)
    recipe = RECIPES[name]() if RECIPES[name] is not None else None
    layer = fp_recipes.Linear(k, n)
    x = torch.randn(m, k, requires_grad=True)

    def step() -> None:
        with fp_recipes.autocast(enabled=recipe is not None, recipe=recipe):
            y = layer(x)
        y.backward(torch.ones_like(y))
        if changing:
            with torch.no_grad():
                layer.weight.add_(0.0)  # as an optimizer step: a new version of the weight

    for _ in range(5):
        step()
    counter = _CountOps()
    with counter:
        step()
    calls = [0]

    def profile(frame, event, arg):
        if event in ("call", "c_call"):
            calls[0] += 1
    sys.setprofile(profile)
    step()
    sys.setprofile(None)
    best = float("inf")
    for _ in range(15):
        t = time.perf_counter()
        for _ in range(50):
            step()
        best = min(best, (time.perf_counter() - t) / 50)
    return {"aten_ops": counter.n, "python_calls": calls[0], "us": round(best * 1e6, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", choices=("changing", "fixed"), default="changing")
    p.add_argument("--m", type=int, default=16)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    out = {name: measure(name, args.m, args.k, args.n, args.weights == "changing") for name in RECIPES}
    if args.json:
        print(json.dumps(out))
        return
    print(f"Linear {args.m}x{args.k} @ {args.k}x{args.n}, forward + backward, weights {args.weights}, CPU")
    print(f"{'recipe':<10} {'aten ops':>9} {'py calls':>9} {'us':>9}")
    for name, r in out.items():
        print(f"{name:<10} {r['aten_ops']:>9} {r['python_calls']:>9} {r['us']:>9.1f}")


if __name__ == "__main__":
    main()
