"""NVFP4 quantization speed: the CUDA kernels against the device-to-device copy bandwidth of the same run.

Shapes (16384, 6144) and (16384, 8192), BF16 input. Each variant is timed with the shared helpers of
benchmarks/_timing.py (CUDA-graph replay of back-to-back calls, eager CUDA events as a second number):
"kernel" rows call the raw kernel with preallocated outputs and a known amax (as after a cross-rank
reduction), "op" rows the whole public op (amax pass + quantize + Python). GB/s counts the fewest
bytes the work must move (x read once, packed data + scales written); "x plain" is the time over
plain rowwise quantization. The eager-torch reference twin is timed once per shape.

Usage: python benchmarks/bench_quantize_nvfp4.py [--json out.json] [--quick]
``run(table, quick)`` adds the same rows to benchmarks/bench_quantize.py's table.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import Table, copy_bandwidth, measure, median_ms  # noqa: E402

SHAPES = [(16384, 6144), (16384, 8192)]
DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "quantize_nvfp4.json")
BF16 = 2  # csrc/common.h DType::kBFloat16

# (case, rowwise, columnwise, options of the raw kernel)
KERNEL_VARIANTS = [
    ("plain rowwise", True, False, {}),
    ("rowwise+columnwise", True, True, {}),
    ("2D rowwise+columnwise", True, True, dict(block_2d=True)),
    ("row-scaled rowwise", True, False, dict(row_scaled=True)),
    ("4over6 fast MAE rowwise", True, False, dict(fos=2)),
    ("4over6 strict MAE rowwise", True, False, dict(fos=1)),
    ("4over6 fast MSE rowwise", True, False, dict(fos=2, mse=True)),
    ("4over6 strict MSE rowwise", True, False, dict(fos=1, mse=True)),
    ("4over6 fast MAE 2D row+col", True, True, dict(fos=2, block_2d=True)),
    ("4over6 fast MAE row+col", True, True, dict(fos=2)),  # 1-D: the tile2 kernel since session 25
    ("4over6 strict MAE row+col", True, True, dict(fos=1)),
    ("RHT columnwise", False, True, dict(rht=True)),
    ("rowwise + RHT columnwise", True, True, dict(rht=True)),
    ("SR rowwise", True, False, dict(sr=True)),
    ("SR rowwise + RHT SR columnwise", True, True, dict(rht=True, sr=True)),
    ("SR row + RHT SR col + bias grad", True, True, dict(rht=True, sr=True, bias=True)),  # a grad_output's cast
    # the Philox seed and counter read from device memory (what a CUDA graph of make_graphed_callables launches)
    ("SR rowwise, device rng", True, False, dict(sr=True, rng=True)),
    ("SR row + RHT SR col, device rng", True, True, dict(rht=True, sr=True, rng=True)),
    # + the BF16 unit GEMM operands written by the same kernel (issue 13: the emulated GEMM reads them)
    ("plain rowwise + unit", True, False, dict(unit=(True, False))),
    ("2D row+col + row unit", True, True, dict(block_2d=True, unit=(True, False))),
    ("rowwise + RHT col + row unit", True, True, dict(rht=True, unit=(True, False))),
    ("SR row + RHT SR col + both units", True, True, dict(rht=True, sr=True, unit=(True, True))),
]

OP_VARIANTS = [
    ("op: nvfp4_amax", None),
    ("op: plain rowwise (amax computed)", dict()),
    ("op: row-scaled rowwise (row amaxes)", dict(row_scaled=True)),  # v7: row amax fused into the quantize launch
    ("op: row-scaled 4over6 fast MAE (row amaxes)", dict(row_scaled=True, four_over_six=True, err_fast_math=True)),
    ("op: rowwise+columnwise (amax computed)", dict(columnwise=True)),
    ("op: 2D rowwise+columnwise (amax computed)", dict(columnwise=True, block_2d=True)),
    ("op: rowwise + RHT columnwise", dict(columnwise=True, rht=True)),
    ("op: 4over6 fast MAE rowwise", dict(four_over_six=True, err_fast_math=True)),
    ("op: 4over6 strict MAE rowwise", dict(four_over_six=True)),
]


def _kernel_call(ext, x, bufs, amaxes, row, col, opts):
    m, n = x.shape
    data, scale, data_t, scale_t, unit, unit_t = bufs
    amax, row_amax, rht_amax = amaxes
    want_u, want_ut = opts.get("unit", (False, False))
    rs, rht = opts.get("row_scaled", False), opts.get("rht", False)

    bias, keep = {}, ()
    if opts.get("rng"):  # (seed 1234, offset 5: the ints of the other rows)
        keep = (torch.tensor([1234, 5], dtype=torch.int64, device=x.device),)
        bias = dict(rng_state=keep[0].data_ptr())
    if opts.get("bias"):  # the fused bias gradient (FP32 tile sums, BF16 db); needs a session-25+ extension
        keep = (torch.empty((m + 63) // 64, n, dtype=torch.float32, device=x.device),
                torch.empty(n, dtype=torch.bfloat16, device=x.device))
        bias = dict(bias_partials=keep[0].data_ptr(), bias_out=keep[1].data_ptr(), bias_dtype=2)

    def call(_keep=keep):  # (the closure holds the bias buffers)
        ext.nvfp4_quantize(
            x.data_ptr(), BF16, m, n, data.data_ptr() if row else 0, scale.data_ptr() if row else 0,
            (row_amax if rs else amax).data_ptr(), rs, data_t.data_ptr() if col else 0,
            scale_t.data_ptr() if col else 0, (rht_amax if rht else amax).data_ptr(), rht,
            opts.get("block_2d", False), opts.get("fos", 0), opts.get("mse", False), 448.0,
            opts.get("sr", False), 1234, 5, torch.cuda.current_stream().cuda_stream, x.device.index,
            unit=unit.data_ptr() if want_u else 0, unit_t=unit_t.data_ptr() if want_ut else 0, **bias)

    return call


def bench_shape(table: Table, m: int, n: int, quick: bool) -> list[dict]:
    from fp_recipes.ops import cuda_nvfp4 as K
    from fp_recipes.ops import ref_nvfp4 as R
    from fp_recipes.ops.backend import extension

    ext = extension()
    iters = 20 if quick else 50
    shape = f"{m}x{n} bf16"
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    amax, row_amax = K.nvfp4_amax(x), K.nvfp4_row_amax(x)
    rht_amax = K.nvfp4_quantize(x, rowwise=False, columnwise=True, rht=True).amax_t
    bufs = (torch.empty(m, n // 2, dtype=torch.uint8, device="cuda"),
            torch.empty(m, n // 16, dtype=torch.uint8, device="cuda"),
            torch.empty(n, m // 2, dtype=torch.uint8, device="cuda"),
            torch.empty(n, m // 16, dtype=torch.uint8, device="cuda"),
            torch.empty(m, n, dtype=torch.bfloat16, device="cuda"),
            torch.empty(n, m, dtype=torch.bfloat16, device="cuda"))
    in_bytes, out_bytes = m * n * 2, m * n // 2 + m * n // 16
    results = []
    plain_ms = None
    for case, row, col, opts in KERNEL_VARIANTS:
        if opts.get("bias") and not getattr(ext, "nvfp4_fused_bias_grad", False):
            print(f"  {case}: skipped (this extension has no fused bias gradient)")
            continue
        if opts.get("rng") and not getattr(ext, "nvfp4_device_rng_state", False):
            print(f"  {case}: skipped (this extension reads no device rng state)")
            continue
        t = measure(lambda c=_kernel_call(ext, x, bufs, (amax, row_amax, rht_amax), row, col, opts): c(), [()],
                    iters=iters)
        plain_ms = t.ms if plain_ms is None else plain_ms
        nbytes = in_bytes + out_bytes * (int(row) + int(col)) + in_bytes * sum(opts.get("unit", (False, False)))
        r = table.add(f"nvfp4 {case}", "fp_recipes kernel", shape, nbytes, t, note=f"x plain {t.ms / plain_ms:.2f}")
        results.append(dict(case=case, kind="kernel", us=t.ms * 1e3, eager_us=t.eager_ms * 1e3, gbps=r.gbps,
                            pct_copy=r.pct_copy, x_plain=t.ms / plain_ms))
    for case, kw in OP_VARIANTS:
        fn = (lambda: K.nvfp4_amax(x)) if kw is None else (lambda kw=kw: K.nvfp4_quantize(x, **kw))
        nbytes = in_bytes + (0 if kw is None else out_bytes * (1 + int(kw.get("columnwise", False))))
        t = measure(fn, [()], iters=iters)
        r = table.add(f"nvfp4 {case}", "fp_recipes op", shape, nbytes, t, note=f"x plain {t.ms / plain_ms:.2f}")
        results.append(dict(case=case, kind="op", us=t.ms * 1e3, eager_us=t.eager_ms * 1e3, gbps=r.gbps,
                            pct_copy=r.pct_copy, x_plain=t.ms / plain_ms))
    for case, kw in (("reference: plain rowwise", dict()), ("reference: 4over6 strict MAE", dict(four_over_six=True))):
        ms = median_ms(lambda kw=kw: R.nvfp4_quantize(x, **kw), [()], warmup=1, iters=3)
        r = table.add(f"nvfp4 {case}", "eager torch twin", shape, in_bytes + out_bytes, ms,
                      note=f"x plain {ms / plain_ms:.1f}")
        results.append(dict(case=case, kind="reference", us=ms * 1e3, gbps=r.gbps, pct_copy=r.pct_copy,
                            x_plain=ms / plain_ms))
        torch.cuda.empty_cache()
    del x, bufs
    torch.cuda.empty_cache()
    return results


def run(table: Table, quick: bool = False, shapes=None) -> dict:
    """Add the NVFP4 rows to a shared table (benchmarks/bench_quantize.py calls this)."""
    return {f"{m}x{n}": bench_shape(table, m, n, quick) for m, n in (shapes or SHAPES)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=DEFAULT_JSON)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", default="", help="e.g. 16384x6144 (default: both shapes)")
    args = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    dev = torch.cuda.get_device_name()
    table = Table(copy_bandwidth())
    print(f"device: {dev}; D2D copy bandwidth (read+write): {table.copy_gbps:.0f} GB/s", flush=True)
    per_shape = run(table, args.quick, shapes)
    table.print()
    print(f"\n{'shape':<12} {'variant':<44} {'us':>8} {'GB/s':>7} {'%copy':>6} {'x plain':>8}")
    for shape, rows in per_shape.items():
        for r in rows:
            print(f"{shape:<12} {r['case']:<44} {r['us']:>8.1f} {r['gbps']:>7.0f} {r['pct_copy']:>6.1f} "
                  f"{r['x_plain']:>8.2f}")
    table.write_json(args.json, nvfp4=per_shape)


if __name__ == "__main__":
    main()
