"""What one host-side call costs on this GPU machine: a torch kernel launch, ``torch.empty``, a call into
``fp_recipes._C`` with and without a kernel launch, a cuBLASLt GEMM through the cached plan, and the CUDA
runtime/driver calls (with their mean host time) that one ``Linear`` forward+backward makes per recipe.

The host-time targets of issues 13/14 are sums of such calls: this table says which ones a step can
afford. Tiny shapes, so the GPU keeps up and no launch waits for queue space.

    python benchmarks/host_costs.py [--json out.json] [--shape 4096,4096,4096]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fp_recipes import DelayedScaling, Float8CurrentScaling, NVFP4BlockScaling  # noqa: E402
from fp_recipes import _extension  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_host import make_step  # noqa: E402


def per_call_us(fn, calls: int = 2000, batch: int = 100) -> float:
    """Median over batches of the host time per call (the GPU is synchronised between batches, outside the
    timed region, so no call waits for queue space)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(calls // batch):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter() - t0) / batch * 1e6)
        torch.cuda.synchronize()
    samples.sort()
    return samples[len(samples) // 2]


def primitive_costs() -> dict[str, float]:
    dev = torch.device("cuda")
    ext = _extension.extension()
    one = torch.zeros(1, device=dev)
    x = torch.randn(16, 16, device=dev, dtype=torch.bfloat16)
    amax = torch.zeros(1, device=dev)
    scale = torch.ones(1, device=dev)
    scale_inv = torch.ones(1, device=dev)
    q = torch.empty(16, 16, device=dev, dtype=torch.float8_e4m3fn)
    qt = torch.empty(16, 16, device=dev, dtype=torch.float8_e4m3fn)
    d = torch.empty(16, 16, device=dev, dtype=torch.bfloat16)
    stream = _extension.current_stream(dev)
    xp, ap, sp, sip, qp, qtp, dp = (t.data_ptr() for t in (x, amax, scale, scale_inv, q, qt, d))
    ws = torch.empty(32 << 20, dtype=torch.uint8, device=dev)
    from fp_recipes.gemm import cublaslt

    cublaslt._load()
    rows = {
        "python no-op function call": lambda: None,
        "_extension.current_stream(dev)": lambda: _extension.current_stream(dev),
        "torch.empty(1024, cuda)": lambda: torch.empty(1024, device=dev),
        "torch.empty((16,16), fp8, cuda)": lambda: torch.empty((16, 16), dtype=torch.float8_e4m3fn, device=dev),
        "tensor.view(-1)": lambda: x.view(-1),
        "tensor.data_ptr()": lambda: x.data_ptr(),
        "torch launch: one.add_(1)": lambda: one.add_(1),
        "torch launch: one.zero_()": lambda: one.zero_(),
        "torch.mm 16x16 bf16": lambda: torch.mm(x, x),
        "torch._scaled_mm 16x16x16": lambda: torch._scaled_mm(q, qt.t(), scale, scale, out_dtype=torch.bfloat16),
        "_C.device_count() (no launch)": lambda: ext.device_count(),
        "_C.fp8_amax 16 elems (launch)": lambda: ext.fp8_amax(xp, 2, 256, ap, stream),
        "_C.fp8_quantize 16x16 row (launch)": lambda: ext.fp8_quantize(xp, 2, 16, 16, sp, 3, qp, 0, sip, ap,
                                                                        stream),
        "_C.fp8_quantize 16x16 row+col": lambda: ext.fp8_quantize(xp, 2, 16, 16, sp, 3, qp, qtp, sip, ap, stream),
        "_C.fp8_current_scaling_quantize 16x16": lambda: ext.fp8_current_scaling_quantize(
            xp, 2, 16, 16, 3, False, 0.0, qp, qtp, sp, sip, ap, stream),
        "_C.lt_fp8_gemm 16x16x16 (cached plan)": lambda: ext.lt_fp8_gemm(
            qp, 16, qtp, 16, sp, sp, dp, 0, 16, 16, 16, 3, 3, 2, -1, False, ws.data_ptr(), ws.numel(),
            torch.cuda.current_device(), stream),
    }
    return {name: per_call_us(fn) for name, fn in rows.items()}


def layer_costs(size: int = 256, device: str = "cuda") -> dict[str, float]:
    """Host us per call of each layer of an eager FP8 Linear step at ``size``^3, delayed against current scaling:
    the C++ cast alone, the quantizer's cast (Python around it), the delayed-scaling records and the C++ update
    of the scales (one per autocast exit and one per backward pass), the module's forward (no grad, then with
    the autograd node), a whole step, and the backward through the engine against its node called directly
    (:func:`backward_costs`; BF16's too). Says which layer makes a delayed step's host time exceed a current
    one's (benchmarks/RESULTS.md session 43 run 3: by ~150-260 us on an H200 host)."""
    import fp_recipes
    from fp_recipes import Linear
    from fp_recipes.modules import amax_reduction
    from fp_recipes.ops.cuda_fp8 import DTYPE_CODE

    dev = torch.device(device)
    fast = _extension.fast_ops() if dev.type == "cuda" else None
    x = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()
    dy = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    rows: dict[str, float] = {}
    code = DTYPE_CODE[torch.float8_e4m3fn]
    for name, make in (("current", Float8CurrentScaling), ("delayed", DelayedScaling)):
        recipe = make()
        mod = Linear(size, size, bias=True, params_dtype=torch.bfloat16, device=dev)

        def step():
            xg.grad = None
            mod.weight.grad = mod.bias.grad = None
            with fp_recipes.autocast(recipe=recipe):
                y = mod(xg)
            y.backward(dy)

        amax_reduction._FAST_PLANS.clear()
        for _ in range(3):
            step()
        plans = list(amax_reduction._FAST_PLANS.values())
        with fp_recipes.autocast(recipe=recipe):
            sets = mod.gemm_quantizers()
            aq = sets[0].activation
            if fast is not None:
                if name == "delayed":
                    slot, sc = aq._slot0(), aq.scale
                    rows[f"{name}: C++ cast x (row+col)"] = per_call_us(
                        lambda: fast.fp8_cast(x, code, True, True, False, False, 0.0, sc, slot, None))
                else:
                    rows[f"{name}: C++ cast x (row+col)"] = per_call_us(
                        lambda: fast.fp8_cast(x, code, True, True, True, False, 0.0, None, None, None))
            rows[f"{name}: quantizer.quantize(x)"] = per_call_us(lambda: aq.quantize(x))
            if name == "delayed":
                reducer = amax_reduction.reducer
                rows[f"{name}: reducer.record_forward"] = per_call_us(lambda: reducer.record_forward(aq, None))
            with torch.no_grad():
                rows[f"{name}: module forward, no grad"] = per_call_us(lambda: mod(x))
            rows[f"{name}: module forward, autograd node"] = per_call_us(lambda: mod(xg))
        for i, plan in enumerate(plans):
            rows[f"{name}: scale update {i} (C++ DelayedUpdates.run)"] = per_call_us(plan.run)
        rows[f"{name}: whole step"] = per_call_us(step, calls=600, batch=50)
        rows.update(backward_costs(name, mod, xg, dy, recipe))
    rows.update(backward_costs("BF16", Linear(size, size, bias=True, params_dtype=torch.bfloat16, device=dev), xg, dy,
                               None))
    return rows


def backward_costs(name: str, mod: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, recipe) -> dict[str, float]:
    """The backward of one forward, repeated (retain_graph): through the autograd engine (which runs a CUDA graph
    task on its device thread), and its node called directly on this thread (``y.grad_fn(dy)``: the backward body,
    its casts and GEMMs, no engine). Their difference is the engine's share of the backward's host time."""
    import fp_recipes

    with fp_recipes.autocast(enabled=recipe is not None, recipe=recipe):
        y = mod(x)
    params = [p for p in (x, mod.weight, mod.bias) if p is not None]

    def engine() -> None:
        for p in params:
            p.grad = None
        y.backward(dy, retain_graph=True)

    node = y.grad_fn
    call = node.apply if hasattr(node, "apply") else node  # (a Python Function's node / a C++ node)

    def direct() -> None:
        with torch.no_grad():
            call(dy)

    return {f"{name}: backward through the engine (retain_graph)": per_call_us(engine),
            f"{name}: backward node called directly ({type(node).__name__})": per_call_us(direct)}


def linear_api_calls(recipe, shape, steps: int = 5) -> dict:
    """CUDA runtime/driver calls and aten ops per forward+backward of one Linear (torch.profiler, CPU
    activity with CUDA: the runtime API rows carry their host time)."""
    from torch.profiler import ProfilerActivity, profile

    step = make_step(recipe, *shape)  # profile_host.py's step: the weight changes after every step
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    # host time per step, no profiler: best batch of 20 steps (GPU synchronised between batches)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            step()
        best = min(best, (time.perf_counter() - t0) / 20 * 1e3)
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    api, ops, kernels = {}, {}, {}
    for e in prof.key_averages():
        key = e.key
        per_step = e.count / steps
        host_us = e.self_cpu_time_total / max(e.count, 1)
        if key.startswith(("cuda", "cu")) and not key.startswith("cudaDeviceSynchronize"):
            api[key] = (per_step, host_us)
        elif key.startswith("aten::"):
            ops[key] = (per_step, host_us)
        elif getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA"):
            kernels[key[:90]] = per_step
    return {"host_ms_per_step": best, "api": api, "aten": ops, "kernels": kernels}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--shape", default="4096,4096,4096")
    p.add_argument("--recipes", default="off,delayed,current,nvfp4")
    p.add_argument("--layers", action="store_true", help="only the per-layer costs of an eager FP8 Linear step, "
                   "delayed against current scaling (layer_costs)")
    p.add_argument("--layer-size", type=int, default=256)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("host_costs: needs a GPU")
        return 0
    print(f"device: {torch.cuda.get_device_name()} | torch {torch.__version__}")
    if args.layers:
        layers = layer_costs(args.layer_size)
        print(f"\n| layer of an eager FP8 Linear {args.layer_size}^3 step | host us per call |\n|---|---|")
        for name, us in layers.items():
            print(f"| {name} | {us:.2f} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "size": args.layer_size, "layers_us": layers}, f, indent=1)
        return 0
    prim = primitive_costs()
    print("\n| call | host us per call |\n|---|---|")
    for name, us in prim.items():
        print(f"| {name} | {us:.2f} |")
    shape = tuple(map(int, args.shape.split(",")))
    recipes = {"off": None, "delayed": DelayedScaling, "current": Float8CurrentScaling, "nvfp4": NVFP4BlockScaling}
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "primitives_us": prim, "linear": {}}
    for name in args.recipes.split(","):
        make = recipes[name]
        r = linear_api_calls(make() if make else None, shape)
        out["linear"][name] = r
        print(f"\n== Linear {shape} fwd+bwd, {name}: host {r['host_ms_per_step']:.3f} ms per step")
        print("| CUDA API call | per step | host us each |\n|---|---|---|")
        for key, (cnt, us) in sorted(r["api"].items(), key=lambda kv: -kv[1][0] * kv[1][1]):
            print(f"| {key} | {cnt:g} | {us:.2f} |")
        print("| aten op (top 15 by host time) | per step | host us each (self) |\n|---|---|---|")
        for key, (cnt, us) in sorted(r["aten"].items(), key=lambda kv: -kv[1][0] * kv[1][1])[:15]:
            print(f"| {key} | {cnt:g} | {us:.2f} |")
        print("| kernel | per step |\n|---|---|")
        for key, cnt in sorted(r["kernels"].items(), key=lambda kv: -kv[1]):
            print(f"| {key} | {cnt:g} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
