"""Where the time of one Linear / GroupedLinear training step goes (GPU): host synchronisations (torch's
sync debug mode, with the Python line that caused each), the host time to enqueue one step, and the
top CUDA kernels / CPU ops of a few steps (torch.profiler).

    python benchmarks/profile_linear.py
"""

from __future__ import annotations

import os
import sys
import argparse
import time
import traceback
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fp_recipes  # noqa: E402
from fp_recipes import DelayedScaling, Float8CurrentScaling, GroupedLinear, Linear  # noqa: E402


def _linear_step(recipe, m=8192, k=8192, n=8192):
    dev = torch.device("cuda")
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    mod = Linear(k, n, bias=False, params_dtype=torch.bfloat16, device=dev)

    def step():
        x.grad = None
        mod.weight.grad = None
        with fp_recipes.autocast(recipe=recipe):
            y = mod(x)
        y.backward(dy)

    return step


def _grouped_step(recipe, m=16384, experts=8, k=7168, n=2048, forward_only=False):
    """One GroupedLinear training step (or, forward_only, one forward under no_grad) on fresh tensors."""
    dev = torch.device("cuda")
    splits = [m // experts] * experts
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    mod = GroupedLinear(experts, k, n, bias=False, params_dtype=torch.bfloat16, device=dev)

    def forward():
        with torch.no_grad(), fp_recipes.autocast(recipe=recipe):
            mod(x, splits)

    def step():
        x.grad = None
        for p in mod.parameters():
            p.grad = None
        with fp_recipes.autocast(recipe=recipe):
            y = mod(x, splits)
        y.backward(dy)

    return forward if forward_only else step


_SYNC_MESSAGE = "called a synchronizing CUDA operation"


def _arm_sync_debug() -> None:
    """The first set_sync_debug_mode() call emits a one-time 'prototype feature ... synchronizing
    operations' warning from torch itself (it was once counted here as a sync of the first case):
    swallow it before measuring anything."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.cuda.set_sync_debug_mode("warn")
        torch.cuda.set_sync_debug_mode("default")


def _syncs(step) -> None:
    """Real stream synchronisations of one step (torch's sync debug warnings only), each with the
    Python stack that caused it (also on the autograd engine's threads)."""
    seen: dict = {}
    real_show = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if _SYNC_MESSAGE not in str(message):
            if "synchroniz" in str(message):
                print(f"    (other warning, not counted: {str(message)[:120]} at {filename}:{lineno})")
            return
        stack = [f for f in traceback.extract_stack()[:-1] if "warnings.py" not in f.filename]
        mine = [f for f in stack if "fp_recipes" in f.filename or "benchmarks" in f.filename]
        key = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in (stack[-1:] + mine[-4:][::-1]))
        seen[key] = seen.get(key, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = real_show
    print(f"    host syncs in one step: {sum(seen.values())}")
    for key, count in sorted(seen.items(), key=lambda kv: -kv[1])[:10]:
        print(f"      {count}x at {key}")


def _enqueue_ms(step, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        best = min(best, (time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return best


def _gpu_busy_ms(step, steps: int = 3) -> float:
    """GPU kernel time of one step (sum of kernel durations, so the floor a host-bound step could reach
    if its launches were free)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us / steps / 1e3


def _profile(step, rows: int = 12) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    print(ka.table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60))
    print(ka.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))


def _median_ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(starts, ends))[iters // 2]


def _isolate() -> None:
    """Which part of the delayed-scaling step costs what: the cast kernels alone, and the step with the
    scale updates switched off."""
    from fp_recipes import ops
    from fp_recipes.modules import amax_reduction

    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    scale = torch.full((), 64.0, device="cuda")
    print("\n== cast kernels on 8192x8192 bf16 (rowwise + columnwise)")
    print(f"    fp8_quantize (delayed, amax fused): "
          f"{_median_ms(lambda: ops.fp8_quantize(x, scale, 'e4m3', rowwise=True, columnwise=True)):.3f} ms")
    print(f"    fp8_current_scaling_quantize:       "
          f"{_median_ms(lambda: ops.fp8_current_scaling_quantize(x, 'e4m3', rowwise=True, columnwise=True)):.3f} ms")
    step = _linear_step(DelayedScaling())
    print(f"    Linear delayed step:                  {_median_ms(step, 10):.3f} ms")
    real = amax_reduction.batched_update_scales
    amax_reduction.batched_update_scales = lambda qs: None
    try:
        print(f"    Linear delayed step, no scale update: {_median_ms(step, 10):.3f} ms")
    finally:
        amax_reduction.batched_update_scales = real


def _host_tiny(experts: int = 8, m: int = 64, k: int = 256, n: int = 256, reps: int = 200,
               with_profiler: bool = False) -> None:
    """Host microseconds per GroupedLinear step and per piece of it at tiny shapes (GPU work negligible,
    so wall time per call is the host's cost to enqueue): where a host-bound step's time goes."""
    from fp_recipes.gemm import cublaslt
    from fp_recipes.ops import cuda_fp8
    from fp_recipes.quantizers.grouped import Fp8MultiCast

    dev = torch.device("cuda")
    splits = [m] * experts
    x = torch.randn(m * experts, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m * experts, n, device=dev, dtype=torch.bfloat16)
    parts = list(x.detach().split(splits))
    scales = [torch.ones((), device=dev) for _ in range(experts)]

    def per_call_us(fn) -> float:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps * 1e6

    print(f"\n== host time at tiny shapes ({experts} experts x {m} rows, K={k}, N={n}; us per call)")
    for label, recipe in (("delayed", DelayedScaling()), ("current", Float8CurrentScaling())):
        step = _grouped_step(recipe, m=m * experts, experts=experts, k=k, n=n)
        fwd = _grouped_step(recipe, m=m * experts, experts=experts, k=k, n=n, forward_only=True)
        print(f"    {label}: step {per_call_us(step):7.1f}   forward only (no_grad) {per_call_us(fwd):7.1f}")
        if with_profiler and label == "current":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(20):
                    step()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
    w3 = torch.randn(experts, n, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    offs = torch.cumsum(torch.tensor(splits, device=dev), 0).to(torch.int32)

    def bf16_step():
        x.grad = None
        w3.grad = None
        torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs).backward(dy)

    print(f"    bf16 torch._grouped_mm step    {per_call_us(bf16_step):7.1f}")
    mc = cuda_fp8.fp8_multi_cast_buffers
    print(f"    multi-cast delayed (buffers)   {per_call_us(lambda: mc(parts, 'e4m3', scales=scales)):7.1f}")
    print(f"    multi-cast current (buffers)   {per_call_us(lambda: mc(parts, 'e4m3')):7.1f}")
    data, data_t, f32, starts, t_layout = mc(parts, 'e4m3', scales=scales)
    casts = Fp8MultiCast(data, data_t, f32, data.dtype, splits, k, starts, None, t_layout)
    w8 = torch.randn(n * experts, k, device=dev).to(torch.float8_e4m3fn)
    wc = Fp8MultiCast(w8, w8.view(-1), f32, w8.dtype, [n] * experts, k, [n * g for g in range(experts + 1)])
    y = torch.empty(m * experts, n, device=dev, dtype=torch.bfloat16)
    gs = list(range(experts))
    ptrs = [y.data_ptr() + g * m * n * 2 for g in gs]
    print(f"    {experts} GEMMs, one cublaslt call     "
          f"{per_call_us(lambda: cublaslt.fp8_gemms_ptr(casts.data_ptrs(gs), casts.scale_ptrs(gs), wc.data_ptrs(gs), wc.scale_ptrs(gs), ptrs, splits, [n] * experts, [k] * experts, casts.dtype, wc.dtype, torch.bfloat16, dev)):7.1f}")
    a0, b0, s0 = casts.data(0), wc.data(0), casts.scale_inv(0)
    print(f"    1 torch._scaled_mm              "
          f"{per_call_us(lambda: torch._scaled_mm(a0, b0.t(), scale_a=s0, scale_b=s0, out_dtype=torch.bfloat16)):7.1f}")
    print(f"    1 torch.empty                   {per_call_us(lambda: torch.empty(16, device=dev)):7.1f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=["all", "linear", "grouped"], default="all")
    p.add_argument("--grouped-m", type=int, default=16384, help="tokens of the GroupedLinear cases")
    p.add_argument("--no-torch-profiler", action="store_true", help="skip the torch.profiler tables")
    p.add_argument("--no-isolate", action="store_true", help="skip the cast-kernel / no-update timings")
    p.add_argument("--host-tiny", action="store_true", help="only the host-time table at tiny shapes")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_linear: needs a CUDA GPU")
        return 2
    print(f"device: {torch.cuda.get_device_name()} | backend {fp_recipes.backend_info()['summary']}")
    _arm_sync_debug()
    if args.host_tiny:
        _host_tiny(with_profiler=not args.no_torch_profiler)
        return 0
    cases = []
    if args.only in ("all", "linear"):
        cases += [("Linear 8192^3 delayed", _linear_step(DelayedScaling())),
                  ("Linear 8192^3 current", _linear_step(Float8CurrentScaling()))]
    if args.only in ("all", "grouped"):
        m = args.grouped_m
        cases += [(f"GroupedLinear M={m} delayed", _grouped_step(DelayedScaling(), m=m)),
                  (f"GroupedLinear M={m} current", _grouped_step(Float8CurrentScaling(), m=m))]
    for label, step in cases:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        print(f"\n== {label}")
        _syncs(step)
        torch.cuda.synchronize()
        print(f"    host time to enqueue one step (best of 5): {_enqueue_ms(step):.3f} ms")
        print(f"    step time (median of 10, CUDA events):     {_median_ms(step, 10):.3f} ms")
        print(f"    GPU kernel time of one step (profiler):    {_gpu_busy_ms(step):.3f} ms")
    if args.only in ("all", "linear") and not args.no_isolate:
        _isolate()
    if not args.no_torch_profiler:
        for label, step in (cases if args.only == "grouped" else cases[::2]):
            print(f"\n== torch.profiler: {label}")
            _profile(step)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
