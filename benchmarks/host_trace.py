"""Where an eager ``Linear`` step's host time goes, thread by thread: a torch.profiler trace with its Python tracer.

cProfile times every thread on one clock and cannot say which thread ran what (RESULTS.md session 43 run 1); an
ablation drifts by more than the parts it removes (run 3). torch.profiler's trace keeps each event's thread, so
the backward body, which the autograd engine runs on its device thread, is timed apart from the main thread's
forward and the engine's wait. Per recipe: the host time of a step without the profiler, then a traced run whose
events are summarised per thread (busy time per step, the Python functions and the CUDA runtime calls with the
most own time) and saved as a Chrome trace (``--out DIR``, gzip) for a closer look (``--summarize FILE``).

    python benchmarks/host_trace.py [--recipes off,current,delayed] [--size 256] [--steps 20] [--out DIR]
    python benchmarks/host_trace.py --summarize DIR/trace_delayed.json.gz --steps 20
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
import time
from collections import defaultdict
from typing import Dict, List, Tuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fp_recipes  # noqa: E402
from fp_recipes import DelayedScaling, Float8CurrentScaling, Linear  # noqa: E402

RECIPES = {"off": None, "current": Float8CurrentScaling, "delayed": DelayedScaling}


def make_step(recipe, size: int, device: str):
    """One training step of a Linear (bias) as a loop runs it: autocast, forward, backward, an optimizer-like
    in-place update of the weight (so every step casts the weight again)."""
    dev = torch.device(device)
    mod = Linear(size, size, bias=True, params_dtype=torch.bfloat16, device=dev)
    x = torch.randn(size, size, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(size, size, device=dev, dtype=torch.bfloat16)

    def step() -> None:
        x.grad = None
        mod.weight.grad = mod.bias.grad = None
        with fp_recipes.autocast(enabled=recipe is not None, recipe=recipe):
            y = mod(x)
        y.backward(dy)
        with torch.no_grad():
            mod.weight.add_(0.0)

    return step


def host_ms(step, device: str, batches: int = 7, per_batch: int = 30) -> float:
    """Median over batches of the host time per step (the device synchronised between batches, untimed)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(20):
        step()
    sync()
    out = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(per_batch):
            step()
        out.append((time.perf_counter() - t0) / per_batch * 1e3)
        sync()
    out.sort()
    return out[len(out) // 2]


def trace(step, steps: int, path: str, device: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts, with_stack=True) as prof:
        for _ in range(steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
    raw = path[:-3] if path.endswith(".gz") else path
    prof.export_chrome_trace(raw)
    if path.endswith(".gz"):
        with open(raw, "rb") as f, gzip.open(path, "wb") as g:
            g.write(f.read())
        os.remove(raw)


def load_events(path: str) -> List[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


#: trace categories that are not a host thread's work (the GPU's; the profiler's own span)
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "Trace")
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def summarize(path: str, steps: int, top: int = 18) -> Dict[str, dict]:
    """Per host thread: busy time per step (the union of its top-level events), and the own time per step of
    the Python functions (category python_function), torch ops (cpu_op) and CUDA runtime calls with the most."""
    by_tid: Dict[Tuple, List[dict]] = defaultdict(list)
    for e in load_events(path):
        if e.get("cat") in _DEVICE_CATS:
            continue
        e["name"] = _ADDRESS.sub("", e["name"])  # (a bound method's object address differs per call)
        by_tid[(e.get("pid"), e.get("tid"))].append(e)
    out: Dict[str, dict] = {}
    for tid, evs in by_tid.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        own: Dict[Tuple[str, str], float] = defaultdict(float)
        count: Dict[Tuple[str, str], int] = defaultdict(int)
        stack: List[list] = []  # [end, event, child time]
        busy = 0.0
        for e in evs:
            ts, dur = float(e["ts"]), float(e["dur"])
            while stack and stack[-1][0] <= ts:
                end, ev, child = stack.pop()
                own[(ev.get("cat", ""), ev["name"])] += float(ev["dur"]) - child
            if stack:
                stack[-1][2] += dur
            else:
                busy += dur
            count[(e.get("cat", ""), e["name"])] += 1
            stack.append([ts + dur, e, 0.0])
        while stack:
            end, ev, child = stack.pop()
            own[(ev.get("cat", ""), ev["name"])] += float(ev["dur"]) - child
        cats: Dict[str, float] = defaultdict(float)
        for (cat, _), t in own.items():
            cats[cat] += t
        rows = sorted(own.items(), key=lambda kv: -kv[1])[:top]
        out[str(tid[1])] = {
            "busy_us_per_step": busy / steps,
            "own_us_per_step_by_category": {c: t / steps for c, t in sorted(cats.items(), key=lambda kv: -kv[1])},
            "top_own_us_per_step": [(cat, name[:100], t / steps, count[(cat, name)] / steps) for (cat, name), t in rows],
        }
    return out


def print_summary(name: str, summary: Dict[str, dict]) -> None:
    for tid, s in sorted(summary.items(), key=lambda kv: -kv[1]["busy_us_per_step"]):
        if s["busy_us_per_step"] < 1.0:
            continue
        cats = ", ".join(f"{c or '-'} {t:.1f}" for c, t in s["own_us_per_step_by_category"].items())
        print(f"  [{name}] thread {tid}: busy {s['busy_us_per_step']:.1f} us/step; own us/step by category: {cats}")
        for cat, fn, t, n in s["top_own_us_per_step"]:
            print(f"      {t:8.1f} us  x{n:4.1f}  {cat:16s} {fn}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default="off,current,delayed")
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=18)
    p.add_argument("--out", default=None, help="directory for the Chrome traces and summary.json")
    p.add_argument("--summarize", default=None, help="summarise a saved trace instead of running")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.summarize:
        print_summary(os.path.basename(args.summarize), summarize(args.summarize, args.steps, args.top))
        return 0
    out_dir = args.out or "."
    os.makedirs(out_dir, exist_ok=True)
    steps = {}
    for name in args.recipes.split(","):
        make = RECIPES[name]
        steps[name] = make_step(make() if make is not None else None, args.size, args.device)
    # every row's host time first: a profiler session leaves the process slower for a while (CUPTI's callbacks)
    times = {name: host_ms(step, args.device) for name, step in steps.items()}
    results = {}
    for name, step in steps.items():
        ms = times[name]
        path = os.path.join(out_dir, f"trace_{name}.json.gz")
        trace(step, args.steps, path, args.device)
        summary = summarize(path, args.steps, args.top)
        print(f"== {name}: host {ms * 1e3:.1f} us a step without the profiler (Linear {args.size}^3 + bias, "
              f"{args.device}); traced {args.steps} steps -> {path}")
        print_summary(name, summary)
        results[name] = {"host_us_per_step": ms * 1e3, "threads": summary}
    with open(os.path.join(out_dir, "host_trace.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
