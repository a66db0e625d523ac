"""Where the GPU time of one model-benchmark step goes (bench_model.py's stack of transformer blocks): per
row, the kernels of a few steps grouped by kind (GEMM, attention, quantization, normalization, other),
then the top kernels. A row whose GEMMs are FP8 but whose step is barely faster than BF16 shows here
what else it spends time on.

    python benchmarks/profile_model.py [--size h2048_t8192] [--rows "BF16 eager,FP8 current"] [--top 15]
                                       [--compiled] [--host]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_model import SIZES, build, make_step, recipes  # noqa: E402

KINDS = (("GEMM", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")),
         ("attention", ("flash", "fmha", "attention", "sdpa")),
         ("quantize", ("fp_recipes", "cast_transpose", "amax", "nvfp4", "delayed_update")),
         ("norm", ("layer_norm", "layernorm", "rms")),
         ("memset/copy", ("memset", "memcpy", "copy")))


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def kernel_table(prof, steps: int) -> tuple:
    """({kernel name: [ms per step, launches]}, {kind: ms per step}) of a torch.profiler run of ``steps``."""
    per_kernel = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[e.name][0] += e.device_time_total / steps / 1e3
            per_kernel[e.name][1] += 1
    by_kind = defaultdict(float)
    for name, (ms, _) in per_kernel.items():
        by_kind[kind_of(name)] += ms
    return per_kernel, by_kind


def profile_row(label: str, step, steps: int, top: int, host: bool = False) -> None:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if host else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_kernel, by_kind = kernel_table(prof, steps)
    total = sum(by_kind.values())
    launches = sum(n for _, n in per_kernel.values()) / steps
    print(f"\n== {label}: {total:.2f} ms of kernels per step ({launches:.0f} kernels)")
    if host:
        # where the host time goes: the CPU-side ops with the most self time per step
        cpu = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
        for e in sorted(cpu, key=lambda e: -e.self_cpu_time_total)[:top]:
            print(f"   host {e.self_cpu_time_total / steps / 1e3:7.3f} ms  x{e.count / steps:5.0f}  {e.key[:100]}")
    print("   " + "  ".join(f"{k} {v:.2f}" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])))
    for name, (ms, n) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"   {ms:7.3f} ms  x{n / steps:4.0f}  [{kind_of(name)}] {name[:110]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="h2048_t8192", choices=list(SIZES))
    p.add_argument("--rows", default="BF16 eager,FP8 current,FP8 delayed,NVFP4 default")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--compiled", action="store_true",
                   help="quantized rows under torch.compile(fullgraph=True) (autocast outside), as bench_model's rows")
    p.add_argument("--host", action="store_true", help="also the CPU-side ops with the most host time per step")
    args = p.parse_args()
    hidden, ffn, tokens, layers = SIZES[args.size]
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; {args.size}: hidden {hidden}, "
          f"ffn {ffn}, tokens {tokens}, {layers} blocks")
    table = recipes()
    for label in args.rows.split(","):
        if label == "BF16 eager":
            step = make_step(build(hidden, ffn, layers, False), x, dy)
        else:
            model = build(hidden, ffn, layers, True)
            run = torch.compile(model, fullgraph=True) if args.compiled else None
            step = make_step(model, x, dy, table[label], run=run)
            if args.compiled:
                label += " torch.compile"
        profile_row(label, step, args.steps, args.top, host=args.host)
        del step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
