"""Host work of one ``fp_recipes.GroupedLinear`` forward + backward on the FP8 multi path (issue 14),
measured on a CPU: aten ops dispatched, Python calls made, and wall time (the fastest of 15 timings of
``--steps`` steps: the least disturbed by other load on a shared machine).

As ``benchmarks/host_linear_cpu.py --kernels stub``: the CUDA path's Python runs on CPU tensors with a
do-nothing extension in place of ``fp_recipes._C`` (the multi-tensor cast ``fp8_multi_cast_buffers``
allocates its buffers and "launches" nothing) and a cuBLASLt layer whose grouped GEMM list only
returns (``cublaslt.fp8_gemms_ptr`` runs its Python down to the ``lt_fp8_gemms`` call). What is
replaced is only "is this a CUDA device" (``quantizers/grouped.py: _cuda_lane``, ``gemm/grouped.py:
_native``, ``cublaslt.available``) and the stream/device queries; every other line of the library
runs as on a GPU. No numbers are computed, so only host work is timed (on a GPU each launch also
costs ~10 us of driver time, each torch.empty ~6 us: the aten op count is the proxy for those)::

    python benchmarks/host_grouped_cpu.py [--experts 8 --m 16 --k 64 --n 64] [--weights changing|fixed]
                                          [--steps 50] [--json]

Rows: recipe (delayed, current) x bias (on, off). ``--weights changing`` (default) bumps every
weight's version after a step (as an optimizer step: every forward casts the weights).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import fp_recipes
from fp_recipes import DelayedScaling, Float8CurrentScaling

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_linear_cpu import _StubExtension, count, install_stub_kernels  # noqa: E402

RECIPES = {"delayed": DelayedScaling, "current": Float8CurrentScaling}


class _StubGroupedExtension(_StubExtension):
    """The do-nothing extension, whose cuBLASLt GEMM list ran every GEMM (it skipped none)."""

    @staticmethod
    def lt_fp8_gemms(*args):
        return []


def install_stub_grouped() -> None:
    """host_linear_cpu's stub kernels, plus the grouped layer's CUDA lane on CPU tensors."""
    from fp_recipes import _extension
    from fp_recipes.gemm import cublaslt, grouped as gemm_grouped
    from fp_recipes.ops import cuda_fp8
    from fp_recipes.quantizers import grouped as q_grouped

    install_stub_kernels()
    _extension._ext, _extension._ext_loaded = _StubGroupedExtension(), True
    floats = (torch.float32, torch.float16, torch.bfloat16)
    q_grouped._cuda_lane = lambda x: cuda_fp8 if x.dtype in floats else None
    gemm_grouped._native = lambda device, a, b: True
    cublaslt._state["loaded"], cublaslt._state["error"] = True, None
    _extension.current_stream = lambda device: 0
    torch.cuda.current_device = lambda: 0  # cublaslt.fp8_gemms_ptr's device guard: "already current"


def make_step(recipe_name: str, experts: int, m: int, k: int, n: int, bias: bool, changing: bool,
              splits=None):
    torch.manual_seed(0)
    recipe = RECIPES[recipe_name]()
    layer = fp_recipes.GroupedLinear(experts, k, n, bias=bias)
    splits = list(splits) if splits is not None else [m] * experts
    x = torch.randn(sum(splits), k, requires_grad=True)
    weights = layer.weights()
    params = [x, *layer.parameters()]

    def step() -> None:
        with fp_recipes.autocast(recipe=recipe):
            y = layer(x, splits)
        y.backward(torch.ones_like(y))
        for t in params:
            t.grad = None  # as optimizer.zero_grad(): no gradient accumulation in the count
        if changing:
            with torch.no_grad():
                for w in weights:
                    w.add_(0.0)  # as an optimizer step: a new version of every weight

    return step


def measure(recipe_name: str, experts: int, m: int, k: int, n: int, bias: bool, changing: bool,
            steps: int = 50, repeats: int = 15) -> dict:
    step = make_step(recipe_name, experts, m, k, n, bias, changing)
    out = count(step)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(steps):
            step()
        best = min(best, (time.perf_counter() - t) / steps)
    out["us"] = round(best * 1e6, 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--m", type=int, default=16, help="rows per expert")
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--weights", choices=("changing", "fixed"), default="changing")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    install_stub_grouped()
    out = {}
    for name in RECIPES:
        for bias in (True, False):
            out[f"{name}{'+bias' if bias else ''}"] = measure(name, args.experts, args.m, args.k, args.n, bias,
                                                              args.weights == "changing", args.steps)
    if args.json:
        print(json.dumps(out))
        return
    print(f"GroupedLinear {args.experts} x ({args.m}x{args.k} @ {args.k}x{args.n}), forward + backward, "
          f"weights {args.weights}, stub kernels, CPU")
    print(f"{'row':<14} {'aten ops':>9} {'py calls':>9} {'us':>9}")
    for name, r in out.items():
        print(f"{name:<14} {r['aten_ops']:>9} {r['python_calls']:>9} {r['us']:>9.1f}")


if __name__ == "__main__":
    main()
