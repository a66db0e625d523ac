"""What a model-benchmark step keeps for its backward, eager against torch.compile: the memory allocated
after the forward, and the tensors the compiled graph saves (shape, dtype, MiB), largest first. The
compiled rows of bench_model.py peak above the eager ones; this shows which saved tensors differ.

    python benchmarks/saved_tensors.py [--size h4096_t4096] [--row "FP8 current"] [--top 20]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fp_recipes  # noqa: E402
from bench_model import SIZES, build, recipes  # noqa: E402


def _mib(t: torch.Tensor) -> float:
    """The memory behind ``t``: its whole storage (q, k and v of one QKV output are views of one)."""
    return t.untyped_storage().nbytes() / 2**20


def saved_by(fn_out: torch.Tensor) -> list:
    """The tensors saved by every autograd node reachable from ``fn_out`` (each storage once)."""
    seen, out, stack, nodes = set(), [], [fn_out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in nodes:
            continue
        nodes.add(node)
        try:  # a Python Function's ctx.saved_tensors; a C++ node's _saved_* attributes
            tensors = list(getattr(node, "saved_tensors", ()) or ())
        except RuntimeError:
            tensors = []
        for name in dir(node):
            if name.startswith("_saved_"):
                v = getattr(node, name, None)
                tensors.extend(v if isinstance(v, (list, tuple)) else [v])
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                out.append((type(node).__name__, tuple(t.shape), t.dtype, _mib(t)))
        stack.extend(f for f, _ in node.next_functions)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="h4096_t4096", choices=list(SIZES))
    p.add_argument("--row", default="FP8 current")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--device", default="cuda", help="cpu: a small model, the pure-torch twins (a quick look)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: capture only)")
    args = p.parse_args()
    hidden, ffn, tokens, layers = SIZES[args.size] if args.device == "cuda" else (256, 1024, 2048, 2)
    recipe = recipes()[args.row]
    x = torch.randn(tokens, hidden, device=args.device, dtype=torch.bfloat16, requires_grad=True)
    cuda = args.device == "cuda"
    for compiled in (False, True):
        model = build(hidden, ffn, layers, True, device=args.device)
        run = torch.compile(model, fullgraph=True, backend=args.backend) if compiled else model
        for _ in range(2):  # compile, warm up
            with fp_recipes.autocast(recipe=recipe):
                y = run(x)
            y.float().sum().backward()
        if cuda:
            torch.cuda.synchronize()
        base = torch.cuda.memory_allocated() if cuda else 0
        with fp_recipes.autocast(recipe=recipe):
            y = run(x)
        kept = (torch.cuda.memory_allocated() - base) / 2**20 if cuda else float("nan")
        saved = saved_by(y)
        label = f"{args.row}{' torch.compile' if compiled else ''}"
        print(f"\n== {label} (hidden {hidden}, ffn {ffn}, {tokens} tokens, {layers} blocks): {kept:.0f} MiB allocated by the forward; "
              f"{sum(s[3] for s in saved):.0f} MiB in {len(saved)} saved tensors")
        groups = Counter()
        for node, shape, dtype, mib in saved:
            groups[(node, shape, str(dtype).replace("torch.", ""))] += mib
        for (node, shape, dtype), mib in groups.most_common(args.top):
            print(f"   {mib:8.1f} MiB  {dtype:14s} {str(shape):22s} {node}")
        del y, model, run
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
