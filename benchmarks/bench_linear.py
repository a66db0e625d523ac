"""Forward+backward time of fp_recipes' Linear and GroupedLinear per recipe, at LLM shapes, against
BF16 torch (``nn.Linear``, ``torch._grouped_mm``) and torchao's tensorwise ``Float8Linear`` (compiled),
all measured in the same run on the same GPU.

Method: one step = forward under the recipe's autocast + backward of a fixed grad_output (input, weight
grads; no bias, like torchao's benchmark); CUDA events around each step, median of ``--iters`` steps
after ``--warmup`` steps. The delayed-scaling amax reduction and scale update are part of every step
(no process group: no collective). Activations and weights are BF16.

    python benchmarks/bench_linear.py [--quick] [--json benchmarks/results/linear.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fp_recipes  # noqa: E402
from fp_recipes.gemm import cublaslt  # noqa: E402
from fp_recipes import (DelayedScaling, Float8CurrentScaling, GroupedLinear, Linear,  # noqa: E402
                        NVFP4BlockScaling)


def _time_steps(step: Callable[[], None], warmup: int, iters: int) -> Dict[str, float]:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    t0 = time.perf_counter()
    for i in range(iters):
        starts[i].record()
        step()
        ends[i].record()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3 / iters
    times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    return {"median_ms": statistics.median(times), "min_ms": min(times), "wall_ms_per_step": wall}


# ---------------------------------------------------------------------------------------- Linear

def _linear_cases(m: int, k: int, n: int, recipes: Dict[str, Any]) -> List[tuple]:
    dev = torch.device("cuda")
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    cases = []

    ref = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)

    def bf16_step():
        x.grad = None
        ref.weight.grad = None
        ref(x).backward(dy)

    cases.append(("bf16 nn.Linear", bf16_step))

    try:
        with warnings.catch_warnings():  # torchao's own deprecation notices on import are noise in a table
            warnings.simplefilter("ignore")
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        ao = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16))
        convert_to_float8_training(ao, config=Float8LinearConfig.from_recipe_name("tensorwise"))
        ao_c = torch.compile(ao)

        def ao_step():
            x.grad = None
            ao[0].weight.grad = None
            ao_c(x).backward(dy)

        cases.append(("torchao Float8Linear tensorwise (compiled)", ao_step))
    except Exception as exc:  # report, do not hide
        print(f"torchao unavailable: {type(exc).__name__}: {exc}")

    for name, recipe in recipes.items():
        mod = Linear(k, n, bias=False, params_dtype=torch.bfloat16, device=dev)

        def step(mod=mod, recipe=recipe):
            x.grad = None
            mod.weight.grad = None
            with fp_recipes.autocast(recipe=recipe):
                y = mod(x)
            y.backward(dy)

        cases.append((f"fp_recipes Linear {name}", step))
    return cases


# ---------------------------------------------------------------------------------- GroupedLinear

def odd_splits(m_total: int, experts: int, seed: int = 0) -> List[int]:
    """Uneven expert loads with odd row counts (a trained router's), summing to ``m_total``."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(experts, generator=g) + 0.5
    s = [int(m_total * float(v) / float(w.sum())) | 1 for v in w]
    s[-1] = m_total - sum(s[:-1])
    return s


def _grouped_cases(m_total: int, experts: int, k: int, n: int, recipes: Dict[str, Any],
                   with_generic: bool = True, odd: bool = False) -> List[tuple]:
    dev = torch.device("cuda")
    splits = odd_splits(m_total, experts) if odd else [m_total // experts] * experts
    x = torch.randn(m_total, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m_total, n, device=dev, dtype=torch.bfloat16)
    cases = []

    w = torch.randn(experts, n, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    offs = torch.cumsum(torch.tensor(splits, device=dev), 0).to(torch.int32)

    def grouped_mm_step():
        x.grad = None
        w.grad = None
        y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        y.backward(dy)

    try:
        grouped_mm_step()
        cases.append(("bf16 torch._grouped_mm (autograd)", grouped_mm_step))
    except Exception as exc:
        print(f"torch._grouped_mm fwd+bwd unavailable: {type(exc).__name__}: {exc}")

    loop = GroupedLinear(experts, k, n, bias=False, params_dtype=torch.bfloat16, device=dev)

    def loop_step():
        x.grad = None
        for p in loop.parameters():
            p.grad = None
        loop(x, splits).backward(dy)

    cases.append(("bf16 GroupedLinear (no autocast: loop of F.linear)", loop_step))

    from fp_recipes.gemm import grouped as GF
    from fp_recipes.modules import grouped_linear as GL

    for name, recipe in recipes.items():
        mod = GroupedLinear(experts, k, n, bias=False, params_dtype=torch.bfloat16, device=dev)
        fp8 = name.startswith(("delayed", "current"))
        paths = ["fp8 path"] + (["fp8 path, 32 MiB cuBLASLt workspace", "fp8 path, per-expert _scaled_mm"]
                                if fp8 else []) + (["generic"] if fp8 and with_generic else [])
        for path in paths:
            def step(mod=mod, recipe=recipe, path=path):
                GL.MULTI_CAST = path != "generic"
                GF.USE_CUBLASLT = "_scaled_mm" not in path
                cublaslt.GROUPED_WORKSPACE_BYTES = 32 * 2**20 if "32 MiB cuBLASLt workspace" in path else 0
                x.grad = None
                for p in mod.parameters():
                    p.grad = None
                with fp_recipes.autocast(recipe=recipe):
                    y = mod(x, splits)
                y.backward(dy)

            label = f"fp_recipes GroupedLinear {name}" + (f" [{path}]" if fp8 else "")
            cases.append((label, step))
    return cases


def _run(cases: List[tuple], flops: float, warmup: int, iters: int, baseline_label: str) -> List[Dict[str, Any]]:
    """Time each case; print each row as soon as it is measured (a time limit keeps what ran)."""
    rows = []
    base_ms = None
    for label, step in cases:
        t_case = time.perf_counter()
        gc.collect()  # a collection inside the timed steps would be charged to whichever case is running
        try:
            t = _time_steps(step, warmup, iters)
        except Exception as exc:
            print(f"  {label}: FAILED {type(exc).__name__}: {exc}")
            traceback.print_exc(limit=3)
            rows.append({"case": label, "error": f"{type(exc).__name__}: {exc}"})
            continue
        finally:
            from fp_recipes.gemm import grouped as GF
            from fp_recipes.modules import grouped_linear as GL
            GL.MULTI_CAST = True
            GF.USE_CUBLASLT = True
            cublaslt.GROUPED_WORKSPACE_BYTES = 0
        if label == baseline_label:
            base_ms = t["median_ms"]
        row = {"case": label, **t, "tflops": flops / (t["median_ms"] * 1e-3) / 1e12}
        rows.append(row)
        torch.cuda.synchronize()
        print(f"  {label:<68} {t['median_ms']:8.3f} ms  {row['tflops']:6.0f} TFLOP/s"
              + (f"  {base_ms / t['median_ms']:.2f}x bf16" if base_ms else "")
              + f"  ({time.perf_counter() - t_case:.0f} s incl. warm-up/compile)", flush=True)
    for row in rows:
        if "median_ms" in row and base_ms:
            row["speedup_vs_bf16"] = base_ms / row["median_ms"]
    return rows


def _print(title: str, rows: List[Dict[str, Any]]) -> None:
    print(f"\n{title}")
    print(f"{'case':<70} {'median ms':>10} {'TFLOP/s':>8} {'vs bf16':>8} {'wall ms':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:<70} {'error':>10}  {r['error'][:80]}")
            continue
        print(f"{r['case']:<70} {r['median_ms']:>10.3f} {r['tflops']:>8.0f} "
              f"{r.get('speedup_vs_bf16', float('nan')):>7.2f}x {r['wall_ms_per_step']:>8.3f}")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer iterations and only M=16k for grouped")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-nvfp4", action="store_true", help="skip the (emulated on <sm_100) NVFP4 rows")
    p.add_argument("--only", choices=["all", "linear", "grouped"], default="all", help="which module to time")
    p.add_argument("--grouped-m", default=None,
                   help="comma-separated token counts for GroupedLinear (default 16384,32768,65536; --quick: 16384)")
    p.add_argument("--odd-splits", action="store_true",
                   help="GroupedLinear: uneven, odd expert row counts (benchmarks.bench_linear.odd_splits) "
                        "instead of an even split")
    p.add_argument("--no-generic", action="store_true",
                   help="GroupedLinear: skip the generic (per-expert module) FP8 path rows")
    p.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "linear.json"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_linear: needs a CUDA GPU")
        return 2
    iters = 10 if args.quick else args.iters
    torch.backends.cuda.matmul.allow_tf32 = False
    info = fp_recipes.backend_info()
    print(f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | backend {info['summary']}")
    recipes: Dict[str, Any] = {"delayed": DelayedScaling(), "current": Float8CurrentScaling()}
    if not args.no_nvfp4:
        recipes["nvfp4 (emulated GEMM)"] = NVFP4BlockScaling()
    results: Dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "backend": info["summary"], "python": platform.python_version(),
                               "linear": [], "grouped": []}

    def save() -> None:
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as fh:
                json.dump(results, fh, indent=2)

    m = k = n = 8192
    if args.only in ("all", "linear"):
        print(f"\nLinear M=K=N={m}")
        rows = _run(_linear_cases(m, k, n, recipes), 3 * 2.0 * m * k * n, args.warmup, iters, "bf16 nn.Linear")
        _print(f"Linear fwd+bwd, M=K=N={m}, BF16 in/out", rows)
        results["linear"].append({"m": m, "k": k, "n": n, "rows": rows})
        save()
        torch.cuda.empty_cache()

    experts, kk, nn_ = 8, 7168, 2048
    if args.grouped_m:
        m_list = [int(v) for v in args.grouped_m.split(",") if v]
    else:
        m_list = [16384] if args.quick else [16384, 32768, 65536]
    for m_total in (m_list if args.only in ("all", "grouped") else []):
        print(f"\nGroupedLinear {experts} experts, M={m_total}, K={kk}, N={nn_}")
        grows = _run(_grouped_cases(m_total, experts, kk, nn_, recipes, with_generic=not args.no_generic,
                                    odd=args.odd_splits),
                     3 * 2.0 * m_total * kk * nn_, args.warmup, iters, "bf16 torch._grouped_mm (autograd)")
        split = f"odd split {odd_splits(m_total, experts)}" if args.odd_splits else "even split"
        _print(f"GroupedLinear fwd+bwd, {experts} experts, M={m_total} ({split}), K={kk}, N={nn_}", grows)
        results["grouped"].append({"m_total": m_total, "experts": experts, "k": kk, "n": nn_, "rows": grows,
                                  "splits": odd_splits(m_total, experts) if args.odd_splits else None})
        save()
        torch.cuda.empty_cache()
    if args.json:
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
