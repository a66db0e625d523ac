"""NVFP4 quantization speed: the CUDA kernels against the device-to-device copy bandwidth of the same run.

Shapes (16384, 6144) and (16384, 8192), BF16 input. For each variant: median kernel time (CUDA events
around back-to-back launches of the raw kernels with preallocated outputs, so Python overhead stays
out), GB/s over the minimal traffic (x read once + packed data + scales written), that bandwidth as a
fraction of the measured copy bandwidth, and the time relative to plain rowwise. "given amax" rows
run the quantize kernel alone (amax known, as after a cross-rank reduction); "op" rows time the whole
public op (amax pass + quantize + Python). The eager-torch reference is timed once per shape.

Usage: python benchmarks/bench_quantize_nvfp4.py [--json out.json] [--iters 50]
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Callable

import torch

SHAPES = [(16384, 6144), (16384, 8192)]


# ---- timing helpers -------------------------------------------------------------------------------

def time_us(fn: Callable[[], object], iters: int = 50, warmup: int = 5, reps: int = 5) -> float:
    """Median over `reps` of (events around `iters` back-to-back calls) / iters, in microseconds."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / iters)
    return statistics.median(samples)


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), iters=20)
    return 2 * nbytes / (us * 1e-6) / 1e9


# ---- variants ------------------------------------------------------------------------------------

def _variants(x: torch.Tensor):
    """(name, kwargs for the raw kernel, rowwise?, columnwise?) per variant."""
    rowwise = dict(rowwise=True)
    both = dict(rowwise=True, columnwise=True)
    return [
        ("plain rowwise", rowwise, {}),
        ("rowwise+columnwise", both, {}),
        ("2D rowwise+columnwise", both, dict(block_2d=True)),
        ("row-scaled rowwise", rowwise, dict(row_scaled=True)),
        ("4over6 fast MAE rowwise", rowwise, dict(four_over_six=2)),
        ("4over6 strict MAE rowwise", rowwise, dict(four_over_six=1)),
        ("4over6 fast MSE rowwise", rowwise, dict(four_over_six=2, mse=True)),
        ("4over6 strict MSE rowwise", rowwise, dict(four_over_six=1, mse=True)),
        ("4over6 fast MAE 2D row+col", both, dict(four_over_six=2, block_2d=True)),
        ("RHT columnwise", dict(columnwise=True), dict(rht=True)),
        ("rowwise + RHT columnwise", both, dict(rht=True)),
        ("SR rowwise", rowwise, dict(stochastic_rounding=True)),
        ("SR rowwise + RHT SR columnwise", both, dict(rht=True, stochastic_rounding=True)),
    ]


def bench_shape(m: int, n: int, iters: int, copy_gbs: float) -> list[dict]:
    from fp_recipes.ops import cuda_nvfp4 as K
    from fp_recipes.ops import ref_nvfp4 as R
    from fp_recipes.ops.backend import extension

    ext = extension()
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.current_stream().cuda_stream
    dev = x.device.index
    amax = K.nvfp4_amax(x)
    row_amax = K.nvfp4_row_amax(x)
    rht_amax = torch.empty((), dtype=torch.float32, device="cuda")
    ext.nvfp4_amax(x.data_ptr(), 2, m, n, 0, rht_amax.data_ptr(), stream, dev)
    data = torch.empty(m, n // 2, dtype=torch.uint8, device="cuda")
    scale = torch.empty(m, n // 16, dtype=torch.uint8, device="cuda")
    data_t = torch.empty(n, m // 2, dtype=torch.uint8, device="cuda")
    scale_t = torch.empty(n, m // 16, dtype=torch.uint8, device="cuda")
    in_bytes = m * n * 2
    copy_bytes = m * n // 2 + m * n // 16

    rows = []
    plain_us = None
    for name, dirs, opts in _variants(x):
        row, col = dirs.get("rowwise", False), dirs.get("columnwise", False)
        rs = opts.get("row_scaled", False)
        rht = opts.get("rht", False)

        def run(row=row, col=col, rs=rs, rht=rht, opts=opts):
            ext.nvfp4_quantize(
                x.data_ptr(), 2, m, n, data.data_ptr() if row else 0, scale.data_ptr() if row else 0,
                (row_amax if rs else amax).data_ptr(), rs, data_t.data_ptr() if col else 0,
                scale_t.data_ptr() if col else 0, (rht_amax if rht else amax).data_ptr(), rht,
                opts.get("block_2d", False), opts.get("four_over_six", 0), opts.get("mse", False), 448.0,
                opts.get("stochastic_rounding", False), 1234, 5, stream, dev)

        us = time_us(run, iters=iters)
        nbytes = in_bytes + copy_bytes * (int(row) + int(col))
        gbs = nbytes / (us * 1e-6) / 1e9
        if name == "plain rowwise":
            plain_us = us
        rows.append(dict(shape=f"{m}x{n}", variant=name + " (given amax)", us=us, gbs=gbs,
                         frac_copy=gbs / copy_gbs, vs_plain=us / plain_us))

    # whole public ops (amax pass + quantize + Python wrapper)
    for name, kw, nbytes in (
        ("op: nvfp4_amax", None, in_bytes),
        ("op: plain rowwise (amax computed)", dict(), in_bytes + copy_bytes),
        ("op: row-scaled rowwise (row amax computed)", dict(row_scaled=True), in_bytes + copy_bytes),
        ("op: rowwise + RHT columnwise (both amaxes)", dict(columnwise=True, rht=True), in_bytes + 2 * copy_bytes),
        ("op: 4over6 fast MAE rowwise", dict(four_over_six=True, err_fast_math=True), in_bytes + copy_bytes),
        ("op: 4over6 strict MAE rowwise", dict(four_over_six=True), in_bytes + copy_bytes),
    ):
        fn = (lambda: K.nvfp4_amax(x)) if kw is None else (lambda kw=kw: K.nvfp4_quantize(x, **kw))
        us = time_us(fn, iters=iters)
        gbs = nbytes / (us * 1e-6) / 1e9
        rows.append(dict(shape=f"{m}x{n}", variant=name, us=us, gbs=gbs, frac_copy=gbs / copy_gbs,
                         vs_plain=us / plain_us))

    # eager torch reference (the twin), a few runs
    for name, kw in (("reference (eager torch): plain rowwise", dict()),
                     ("reference (eager torch): 4over6 strict MAE", dict(four_over_six=True))):
        us = time_us(lambda kw=kw: R.nvfp4_quantize(x, **kw), iters=2, warmup=1, reps=3)
        gbs = (in_bytes + copy_bytes) / (us * 1e-6) / 1e9
        rows.append(dict(shape=f"{m}x{n}", variant=name, us=us, gbs=gbs, frac_copy=gbs / copy_gbs,
                         vs_plain=us / plain_us))
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="bench_quantize_nvfp4.json")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    copy_gbs = copy_bandwidth_gbs()
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}; D2D copy bandwidth (read+write): {copy_gbs:.0f} GB/s")
    rows = []
    for m, n in SHAPES:
        rows += bench_shape(m, n, args.iters, copy_gbs)
    print(f"{'shape':<12} {'variant':<52} {'us':>9} {'GB/s':>7} {'/copy':>6} {'x plain':>8}")
    for r in rows:
        print(f"{r['shape']:<12} {r['variant']:<52} {r['us']:>9.1f} {r['gbs']:>7.0f} {r['frac_copy']:>6.2f} "
              f"{r['vs_plain']:>8.2f}")
    with open(args.json, "w") as f:
        json.dump(dict(device=dev, copy_gbs=copy_gbs, rows=rows), f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
