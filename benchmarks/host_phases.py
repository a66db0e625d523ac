"""Where the host time of one ``fp_recipes.Linear`` step goes, by phase, on a GPU machine: autocast entry,
forward, autocast exit (delayed scaling: the amax reduction and scale update), backward. A small layer
(default 256^3) keeps the GPU ahead of the host, so every number is the host's time to enqueue; the
wall clock around each phase (no profiler, whose per-call hooks distort Python-heavy code), the median
over many steps. The weight changes after every step (an optimizer step: the weight cast is redone).

    python benchmarks/host_phases.py [--recipes off,delayed,current,nvfp4] [--size 256] [--steps 400] [--json F]
                                     [--host-paths both --rounds 3]

``--ablate``: the delayed-scaling row again with one piece of its bookkeeping removed per row (the forward
records, the autocast exit's update, the backward records and their end-of-pass update, the capture checks), to
attribute its host time; those rows do not train correctly (scales never update), they only time the rest.

``--host-paths both`` measures every recipe with the torch-linked host path (``fp_recipes._torch_ops``) and with
the Python one (what FP_RECIPES_TORCH_OPS=off selects), alternating in one process for ``--rounds`` rounds: a
host's speed drifts between processes and machine instances by more than the difference measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

import fp_recipes
from fp_recipes import DelayedScaling, Float8CurrentScaling, Linear, NVFP4BlockScaling

from _host_path import python_host_path

RECIPES = {"off": None, "delayed": DelayedScaling, "current": Float8CurrentScaling, "nvfp4": NVFP4BlockScaling}
PHASES = ("enter", "forward", "exit", "backward", "weight update")


def phases(recipe, size: int, steps: int) -> dict:
    dev = torch.device("cuda")
    x = torch.randn(size, size, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    mod = Linear(size, size, bias=True, params_dtype=torch.bfloat16, device=dev)
    times = {p: [] for p in PHASES}

    def step(record: bool) -> None:
        x.grad = None
        mod.weight.grad = mod.bias.grad = None
        t0 = time.perf_counter()
        ctx = fp_recipes.autocast(enabled=recipe is not None, recipe=recipe)
        ctx.__enter__()
        t1 = time.perf_counter()
        y = mod(x)
        t2 = time.perf_counter()
        ctx.__exit__(None, None, None)
        t3 = time.perf_counter()
        y.backward(dy)
        t4 = time.perf_counter()
        with torch.no_grad():
            mod.weight.add_(1e-6)  # as an optimizer step
        t5 = time.perf_counter()
        if record:
            for p, a, b in zip(PHASES, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)):
                times[p].append((b - a) * 1e6)

    for _ in range(30):
        step(False)
    torch.cuda.synchronize()
    for i in range(steps):
        step(True)
        if i % 50 == 49:
            torch.cuda.synchronize()  # keep the launch queue short: enqueue time, not queue-full stalls
    torch.cuda.synchronize()
    out = {p: statistics.median(v) for p, v in times.items()}
    out["total"] = sum(out[p] for p in PHASES)
    return out


@contextlib.contextmanager
def ablated(part: str):
    """Remove one piece of delayed scaling's per-step bookkeeping (attribution only: the scales stop updating)."""
    from unittest import mock

    from fp_recipes.modules import amax_reduction, base
    from fp_recipes.modules.amax_reduction import reducer

    targets = {
        "no forward records": [(reducer, "record_forward", lambda q, g: None)],
        "no exit update": [(reducer, "on_outermost_exit", lambda state=None: None)],
        "no backward records": [(reducer, "record_backward", lambda q, g: None),
                                (reducer, "record_backward_many", lambda qs, g: None)],
        "no capture checks": [(amax_reduction, "stream_capturing", lambda: False),
                              (base, "stream_capturing", lambda: False)],
    }[part]
    with contextlib.ExitStack() as stack:
        for obj, name, repl in targets:
            stack.enter_context(mock.patch.object(obj, name, repl))
        yield


ABLATIONS = ("no forward records", "no exit update", "no backward records", "no capture checks")


def compare_host_paths(names, size: int, steps: int, rounds: int) -> dict:
    """Median over ``rounds`` of each (recipe, host path)'s phases, the paths alternating within each round."""
    from fp_recipes import _extension

    if _extension.fast_ops() is None:
        raise SystemExit(f"--host-paths both: fp_recipes._torch_ops is {_extension.fast_ops_status()}")
    runs: dict = {}
    for _ in range(rounds):
        for name in names:
            for path in ("torch_ops", "python"):
                recipe = RECIPES[name]() if RECIPES[name] is not None else None
                with python_host_path() if path == "python" else contextlib.nullcontext():
                    runs.setdefault((name, path), []).append(phases(recipe, size, steps))
    return {f"{name} {path}": {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            for (name, path), rs in runs.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default="off,delayed,current,nvfp4")
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--json", default=None)
    p.add_argument("--host-paths", choices=("current", "both"), default="current",
                   help="both: each recipe with the torch-linked and the Python host path, alternating")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ablate", action="store_true", help="add delayed-scaling rows with parts of its bookkeeping "
                   "removed (attribution only)")
    args = p.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; Linear {args.size}^3 + bias, "
          "host us per phase (median)")
    print(f"{'recipe':10s}" + "".join(f"{ph:>14s}" for ph in PHASES) + f"{'total':>10s}")
    results = {}
    if args.host_paths == "both":
        results = compare_host_paths(args.recipes.split(","), args.size, args.steps, args.rounds)
        for name, r in results.items():
            print(f"{name:18s}" + "".join(f"{r[ph]:14.1f}" for ph in PHASES) + f"{r['total']:10.1f}", flush=True)
    for name in args.recipes.split(",") if args.host_paths == "current" else ():
        recipe = RECIPES[name]() if RECIPES[name] is not None else None
        r = results[name] = phases(recipe, args.size, args.steps)
        print(f"{name:10s}" + "".join(f"{r[ph]:14.1f}" for ph in PHASES) + f"{r['total']:10.1f}", flush=True)
    if args.ablate:  # alternating: a host's speed drifts within a process by more than the parts measured
        runs: dict = {}
        rows = ("current", "delayed") + tuple(f"delayed, {part}" for part in ABLATIONS)
        for _ in range(args.rounds):
            for row in rows:
                part = row.partition(", ")[2]
                with ablated(part) if part else contextlib.nullcontext():
                    recipe = Float8CurrentScaling() if row == "current" else DelayedScaling()
                    runs.setdefault(row, []).append(phases(recipe, args.size, args.steps))
        print(f"ablation: median of {args.rounds} alternating rounds")
        for row in rows:
            rs = runs[row]
            r = results[f"ablation: {row}"] = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
            print(f"{row:30s}" + "".join(f"{r[ph]:14.1f}" for ph in PHASES) + f"{r['total']:10.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "size": args.size,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
