"""Quantization kernel bandwidth: FP8 per-tensor casts, grouped FP8, per-token E5M6/E4M3.

For every case: GB/s counting the bytes the op must read + write at the least, as a percentage of the
device-to-device copy bandwidth measured in the same run; the eager pure-torch reference twin; and
torch.compile comparators: torchao's float8 dynamic cast (``hp_tensor_to_float8_dynamic``, tensorwise and
rowwise/axiswise) and a compiled ``(x * scale).clamp().to(float8)`` + amax for the given-scale cast.
What each comparator computes is printed in the note column.

Usage: python benchmarks/bench_quantize.py [--json PATH] [--quick] [--no-compile]
       [--only fp8,per_token,grouped,multi,nvfp4]
NVFP4 rows come from benchmarks/bench_quantize_nvfp4.py (H5) when it defines ``run(table, quick)``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import Table, copy_bandwidth, measure, median_ms, rotation_count  # noqa: E402

DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "quantize.json")
E4M3 = torch.float8_e4m3fn


def _inputs(shape, dtype, bytes_per_set, seed=0):
    n = rotation_count(bytes_per_set)
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).mul_(3).to(dtype) for _ in range(n)]


def _shape_str(shape) -> str:
    return "x".join(str(s) for s in shape)


def _try(table: Table, label: str, fn) -> None:
    """Run a comparator; one that cannot run here is reported (printed and in the JSON), not fatal."""
    try:
        fn()
    except Exception as exc:
        msg = f"{label} skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        print(f"  [{msg}]", flush=True)
        table.notes.append(msg)


def _compiled_cast_amax():
    @torch.compile(fullgraph=True)
    def cast(x, scale):
        y = (x.float() * scale).clamp(-448.0, 448.0).to(E4M3)
        return y, x.abs().amax().float()

    return cast


def _torchao_dynamic(rowwise: bool):
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    cfg = LinearMMConfig()

    @torch.compile(fullgraph=True)
    def cast(x):
        if rowwise:
            t = hp_tensor_to_float8_dynamic(x, E4M3, cfg, scaling_granularity=ScalingGranularity.AXISWISE,
                                            axiswise_dim=-1)
        else:
            t = hp_tensor_to_float8_dynamic(x, E4M3, cfg)
        return t._data, t._scale

    return cast


# ---- FP8 per tensor ------------------------------------------------------------------------------

def run_fp8(table: Table, quick: bool, compile_: bool) -> None:
    from fp_recipes.ops import cuda_fp8 as cu
    from fp_recipes.ops import ref_fp8

    iters = 20 if quick else 100
    for shape in ((16384, 8192), (8192, 7168)):
        n = shape[0] * shape[1]
        s = _shape_str(shape)
        xs = _inputs(shape, torch.bfloat16, 3 * n)
        scale = torch.tensor(0.5, device="cuda")
        args = [(x, scale) for x in xs]
        print(f"FP8 per-tensor, bf16 {s}:", flush=True)
        table.add("fp8 cast+amax (delayed)", "fp_recipes", s, 3 * n,
                  measure(lambda x, sc: cu.fp8_quantize(x, sc, "e4m3"), args, iters=iters))
        table.add("fp8 cast+amax rowwise+colwise", "fp_recipes", s, 4 * n,
                  measure(lambda x, sc: cu.fp8_quantize(x, sc, "e4m3", columnwise=True), args, iters=iters))
        table.add("fp8 current scaling", "fp_recipes", s, 3 * n,
                  measure(lambda x, sc: cu.fp8_current_scaling_quantize(x, "e4m3"), args, iters=iters),
                  note="2 launches: amax, then cast (reads x twice)")
        table.add("fp8 current scaling pow2+colwise", "fp_recipes", s, 4 * n,
                  measure(lambda x, sc: cu.fp8_current_scaling_quantize(x, "e4m3", use_power_2_scales=True,
                                                                          columnwise=True), args, iters=iters))
        # an MLP's FC2 input: GELU then the cast (torch's GELU writes BF16, the cast reads it) against the fused
        # cast of gelu(x) (ops/cuda_fp8_act.py); bytes: x read, both FP8 copies written (+ the amax pass for current)
        from fp_recipes.ops import cuda_fp8_act as act

        if act.available():
            hist = torch.zeros((), device="cuda")
            table.add("fp8 row+col of gelu(x) (delayed)", "fp_recipes fused", s, 4 * n,
                      measure(lambda x, sc: act.fp8_act_quantize(x, "gelu", "e4m3", True, True, scale=sc, record=hist),
                              args, iters=iters))
            table.add("fp8 row+col of gelu(x) (delayed)", "torch gelu, then the cast", s, 4 * n,
                      measure(lambda x, sc: cu.fp8_quantize(F.gelu(x, approximate="tanh"), sc, "e4m3", columnwise=True),
                              args, iters=iters))
            table.add("fp8 row+col of gelu(x) (current)", "fp_recipes fused", s, 4 * n,
                      measure(lambda x, sc: act.fp8_act_quantize(x, "gelu", "e4m3", True, True), args, iters=iters))
            table.add("fp8 row+col of gelu(x) (current)", "torch gelu, then the cast", s, 4 * n,
                      measure(lambda x, sc: cu.fp8_current_scaling_quantize(F.gelu(x, approximate="tanh"), "e4m3",
                                                                            columnwise=True), args, iters=iters))
        # the grad_output casts of a Linear with a bias: the bias gradient fused into the cast's pass,
        # against the same cast followed by the standalone kernel and by torch's column sum
        table.add("fp8 cast+amax row+col + dbias (delayed)", "fp_recipes fused", s, 4 * n,
                  measure(lambda x, sc: cu.fp8_quantize_dbias(x, sc, "e4m3", True, True, None, torch.bfloat16),
                          args, iters=iters))
        table.add("fp8 cast+amax row+col + dbias (delayed)", "cast, then bias_grad kernel", s, 4 * n,
                  measure(lambda x, sc: (cu.fp8_quantize(x, sc, "e4m3", columnwise=True),
                                         cu.bias_grad(x, torch.bfloat16)), args, iters=iters))
        table.add("fp8 cast+amax row+col + dbias (delayed)", "cast, then torch sum", s, 4 * n,
                  measure(lambda x, sc: (cu.fp8_quantize(x, sc, "e4m3", columnwise=True),
                                         x.sum(0, dtype=torch.float32).to(torch.bfloat16)), args, iters=iters))
        table.add("fp8 current row+col + dbias", "fp_recipes fused", s, 4 * n,
                  measure(lambda x, sc: cu.fp8_current_scaling_quantize_dbias(x, "e4m3", False, 0.0, True, True,
                                                                              torch.bfloat16), args, iters=iters),
                  note="amax pass, then cast + tile sums, then the reduction")
        table.add("fp8 current row+col + dbias", "cast, then torch sum", s, 4 * n,
                  measure(lambda x, sc: (cu.fp8_current_scaling_quantize(x, "e4m3", columnwise=True),
                                         x.sum(0, dtype=torch.float32).to(torch.bfloat16)), args, iters=iters))
        table.add("bias_grad alone", "fp_recipes", s, n,
                  measure(lambda x, sc: cu.bias_grad(x, torch.bfloat16), args, iters=iters))
        table.add("bias_grad alone", "torch sum(0, float32)", s, n,
                  measure(lambda x, sc: x.sum(0, dtype=torch.float32).to(torch.bfloat16), args, iters=iters))
        qs = [(cu.fp8_quantize(x, scale, "e4m3").data, scale) for x in xs]
        table.add("fp8 dequantize -> bf16", "fp_recipes", s, 3 * n,
                  measure(lambda q, sc: cu.fp8_dequantize(q, sc, torch.bfloat16), qs, iters=iters))
        table.add("fp8 cast+amax (delayed)", "eager reference twin", s, 3 * n,
                  median_ms(lambda x, sc: ref_fp8.fp8_quantize(x, sc, "e4m3"), args, warmup=1, iters=3))
        if compile_:
            def compiled_delayed():
                f = _compiled_cast_amax()
                table.add("fp8 cast+amax (delayed)", "torch.compile clamp+to", s, 3 * n,
                          measure(f, args, iters=iters), note="(x*s).clamp(+-448).to(e4m3) + amax, inductor")

            def torchao_current():
                f = _torchao_dynamic(rowwise=False)
                table.add("fp8 current scaling", "torchao compiled", s, 3 * n,
                          measure(lambda x, sc: f(x), args, iters=iters),
                          note="hp_tensor_to_float8_dynamic tensorwise, torch.compile")

            _try(table, "torch.compile cast", compiled_delayed)
            _try(table, "torchao tensorwise", torchao_current)
        del xs, qs, args
        torch.cuda.empty_cache()


# ---- per token -----------------------------------------------------------------------------------

def run_per_token(table: Table, quick: bool, compile_: bool) -> None:
    from fp_recipes.ops import cuda_fp8 as cu
    from fp_recipes.ops import ref_per_token

    iters = 20 if quick else 100
    shape = (16384, 7168)
    t, h = shape
    n = t * h
    s = _shape_str(shape)
    xs = _inputs(shape, torch.bfloat16, 2 * n + 3 * n // 2)
    args = [(x,) for x in xs]
    print(f"Per-token, bf16 {s}:", flush=True)
    cases = [
        ("per-token e5m6 row, ue8m0", "e5m6", True, "ue8m0", None, 2 * n + 3 * n // 2 + t),
        ("per-token e5m6 row, fp32 sf", "e5m6", False, "fp32", None, 2 * n + 3 * n // 2 + 4 * t),
        ("per-token e5m6 blk128, ue8m0", "e5m6", True, "ue8m0", 128, 2 * n + 3 * n // 2 + n // 128),
        ("per-token e4m3 row, fp32 sf", "e4m3", False, "fp32", None, 3 * n + 4 * t),
        ("per-token e4m3 blk128, ue8m0", "e4m3", True, "ue8m0", 128, 3 * n + n // 128),
    ]
    for label, fmt, rsf, sfmt, bs, nbytes in cases:
        table.add(label, "fp_recipes", s, nbytes,
                  measure(lambda x: cu.per_token_cast(x, fmt, round_sf=rsf, scale_format=sfmt, block_size=bs),
                            args, iters=iters))
    q = [cu.per_token_cast(x, "e5m6", round_sf=True, scale_format="ue8m0") for x in xs]
    table.add("cast_back e5m6 -> bf16", "fp_recipes", s, 3 * n // 2 + 2 * n + t,
              measure(lambda p: cu.cast_back(p.data, p.scales, "e5m6", scale_format="ue8m0"),
                        [(p,) for p in q], iters=iters))
    q8 = [cu.per_token_cast(x, "e4m3") for x in xs]
    table.add("cast_back e4m3 -> bf16", "fp_recipes", s, 3 * n + 4 * t,
              measure(lambda p: cu.cast_back(p.data, p.scales, "e4m3"), [(p,) for p in q8], iters=iters))
    table.add("per-token e5m6 row, ue8m0", "eager reference twin", s, 2 * n + 3 * n // 2 + t,
              median_ms(lambda x: ref_per_token.per_token_cast(x, "e5m6", round_sf=True, scale_format="ue8m0"),
                        args, warmup=1, iters=3))
    if compile_:
        def torchao_rowwise():
            f = _torchao_dynamic(rowwise=True)
            table.add("per-token e4m3 row, fp32 sf", "torchao compiled", s, 3 * n + 4 * t,
                      measure(f, args, iters=iters), note="hp_tensor_to_float8_dynamic axiswise dim -1, compiled")

        _try(table, "torchao rowwise", torchao_rowwise)
    del xs, q, q8
    torch.cuda.empty_cache()


# ---- grouped -------------------------------------------------------------------------------------

def moe_splits(num_groups: int, total_rows: int, seed: int) -> list[int]:
    """Rows per expert like a DeepSeek-style router: skewed, some experts empty at high counts."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.distributions.Gamma(torch.full((num_groups,), 0.7), torch.ones(num_groups)).sample()
    weights = weights * (torch.rand(num_groups, generator=g) > 0.05)  # a few idle experts
    counts = torch.multinomial(weights / weights.sum(), total_rows, replacement=True, generator=g)
    return torch.bincount(counts, minlength=num_groups).tolist()


def run_grouped(table: Table, quick: bool, compile_: bool) -> None:
    from fp_recipes.ops import cuda_fp8 as cu
    from fp_recipes.ops import ref_fp8

    iters = 20 if quick else 100
    hidden, total_rows = 7168, 16384
    n = hidden * total_rows
    xs = _inputs((total_rows, hidden), torch.bfloat16, 3 * n)
    scale = torch.tensor(0.5, device="cuda")
    single_q = measure(lambda x: cu.fp8_quantize(x, scale, "e4m3"), [(x,) for x in xs], iters=iters)
    single_row = table.add("grouped baseline: single tensor", "fp_recipes", f"{total_rows}x{hidden}", 3 * n, single_q,
                           note="fp8_quantize on the same total bytes")
    qs = [cu.fp8_quantize(x, scale, "e4m3").data for x in xs]
    single_dq = measure(lambda q: cu.fp8_dequantize(q, scale, torch.bfloat16), [(q,) for q in qs], iters=iters)
    single_dq_row = table.add("grouped baseline: single dequant", "fp_recipes", f"{total_rows}x{hidden}", 3 * n,
                              single_dq)
    for num_groups in (8, 64, 256):
        splits = moe_splits(num_groups, total_rows, seed=num_groups)
        offsets = torch.tensor([0] + torch.tensor(splits).mul(hidden).cumsum(0).tolist(), dtype=torch.int64,
                               device="cuda")
        scales = torch.rand(num_groups, device="cuda") + 0.5
        shape = f"G={num_groups} rows {min(splits)}..{max(splits)}"
        cu.fp8_grouped_quantize(xs[0], offsets, scales, "e4m3")  # validates offsets once (cached)
        row = table.add("fp8 grouped cast+amax", "fp_recipes", shape, 3 * n,
                        measure(lambda x: cu.fp8_grouped_quantize(x, offsets, scales, "e4m3"), [(x,) for x in xs],
                                  iters=iters))
        row.note = f"{100.0 * row.gbps / single_row.gbps:.1f}% of single-tensor GB/s {row.note}"
        gq = [cu.fp8_grouped_quantize(x, offsets, scales, "e4m3") for x in xs]
        row = table.add("fp8 grouped dequantize -> bf16", "fp_recipes", shape, 3 * n,
                        measure(lambda r: cu.fp8_grouped_dequantize(r.data, offsets, r.scale_inv, torch.bfloat16),
                                  [(r,) for r in gq], iters=iters))
        row.note = f"{100.0 * row.gbps / single_dq_row.gbps:.1f}% of single-tensor GB/s {row.note}"
        if num_groups == 64:
            table.add("fp8 grouped cast+amax", "eager reference twin", shape, 3 * n,
                      median_ms(lambda x: ref_fp8.fp8_grouped_quantize(x, offsets, scales, "e4m3"), [(x,) for x in xs],
                                warmup=1, iters=3))
        del gq
    del xs, qs
    torch.cuda.empty_cache()


# ---- multi-tensor (G separate tensors, one launch) -----------------------------------------------

def _host_us(fn, iters: int = 200) -> float:
    """Host microseconds per call (small inputs, so the GPU never holds the host back)."""
    import time

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / iters * 1e6


def run_multi(table: Table, quick: bool, compile_: bool) -> None:
    """G = 8 experts of 2048 x 7168 bf16, both copies (rowwise + transposed), in one multi-tensor call,
    against the single-tensor cast+transpose of the same total (16384 x 7168); plus host time per call
    of the multi op against G single-tensor calls."""
    from fp_recipes.ops import cuda_fp8 as cu

    iters = 20 if quick else 100
    g, rows, hidden = 8, 2048, 7168
    total = g * rows
    n = total * hidden
    nbytes = 4 * n  # read bf16, write both FP8 copies
    xs = _inputs((total, hidden), torch.bfloat16, 3 * n)
    scale = torch.tensor(0.5, device="cuda")
    scales = [torch.tensor(0.5 + 0.125 * i, device="cuda") for i in range(g)]
    splits = [list(x.split(rows)) for x in xs]
    s_single, s_multi = f"{total}x{hidden}", f"G={g} x {rows}x{hidden}"
    print(f"FP8 multi-tensor, bf16 {s_multi}, both copies:", flush=True)
    base = table.add("single cast+transpose (delayed)", "fp_recipes", s_single, nbytes,
                     measure(lambda x: cu.fp8_quantize(x, scale, "e4m3", columnwise=True), [(x,) for x in xs],
                             iters=iters), note="baseline for the multi rows")
    row = table.add("multi cast+transpose (delayed)", "fp_recipes", s_multi, nbytes,
                    measure(lambda m: cu._fp8_multi_quantize_impl(m, scales, "e4m3", True, True),
                            [(m,) for m in splits], iters=iters))
    row.note = f"{100.0 * row.gbps / base.gbps:.1f}% of single-tensor GB/s {row.note}"
    row.extra["pct_of_single"] = 100.0 * row.gbps / base.gbps
    base = table.add("single cast+transpose (current)", "fp_recipes", s_single, nbytes,
                     measure(lambda x: cu.fp8_current_scaling_quantize(x, "e4m3", columnwise=True),
                             [(x,) for x in xs], iters=iters), note="baseline for the multi rows")
    row = table.add("multi cast+transpose (current)", "fp_recipes", s_multi, nbytes,
                    measure(lambda m: cu._fp8_multi_current_impl(m, "e4m3", False, 0.0, True, True),
                            [(m,) for m in splits], iters=iters))
    row.note = f"{100.0 * row.gbps / base.gbps:.1f}% of single-tensor GB/s {row.note}"
    row.extra["pct_of_single"] = 100.0 * row.gbps / base.gbps
    # The per-expert loop the multi op replaces (G single-tensor calls).
    table.add("per-expert loop cast+transpose (delayed)", "fp_recipes", s_multi, nbytes,
              measure(lambda m: [cu.fp8_quantize(x, s, "e4m3", columnwise=True) for x, s in zip(m, scales)],
                      [(m,) for m in splits], iters=iters), note=f"{g} single-tensor calls")
    del xs, splits
    torch.cuda.empty_cache()
    small = list(torch.randn((g * 16, hidden), device="cuda").to(torch.bfloat16).split(16))
    host = {
        "multi delayed (eager entry)": _host_us(lambda: cu._fp8_multi_quantize_impl(small, scales, "e4m3", True, True)),
        "multi delayed (dispatched op)": _host_us(lambda: cu.fp8_multi_quantize(small, scales, "e4m3", columnwise=True)),
        "multi current (eager entry)": _host_us(lambda: cu._fp8_multi_current_impl(small, "e4m3", False, 0.0, True,
                                                                                   True)),
        f"{g} x single delayed": _host_us(lambda: [cu._fp8_quantize_impl(x, s, "e4m3", True, True)
                                                   for x, s in zip(small, scales)]),
        f"{g} x single current": _host_us(lambda: [cu._fp8_current_impl(x, "e4m3", False, 0.0, True, True)
                                                   for x in small]),
    }
    for k, v in host.items():
        print(f"  host time per call, {k:<32} {v:8.1f} us", flush=True)
    table.notes.append("host us per call (G=8, both copies): " + ", ".join(f"{k} {v:.1f}" for k, v in host.items()))


SECTIONS = {"fp8": run_fp8, "per_token": run_per_token, "grouped": run_grouped, "multi": run_multi}


def main(argv=None) -> Table:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=DEFAULT_JSON, help="where to write the results (default %(default)s)")
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile / torchao comparators")
    ap.add_argument("--only", default="fp8,per_token,grouped,multi,nvfp4", help="comma-separated sections")
    a = ap.parse_args(argv)
    import fp_recipes

    info = fp_recipes.backend_info()
    print(f"device: {torch.cuda.get_device_name()}  backend: {info['summary']}  torch {torch.__version__}", flush=True)
    copy = copy_bandwidth()
    print(f"D2D copy bandwidth (read+write): {copy:.0f} GB/s", flush=True)
    table = Table(copy)
    wanted = [s.strip() for s in a.only.split(",") if s.strip()]
    for name in wanted:
        if name == "nvfp4":
            try:
                mod = importlib.import_module("bench_quantize_nvfp4")
            except ImportError as exc:
                print(f"nvfp4 section not available: {exc}")
                continue
            if hasattr(mod, "run"):
                try:
                    mod.run(table, a.quick)
                except Exception:
                    traceback.print_exc()
            continue
        try:
            SECTIONS[name](table, a.quick, not a.no_compile)
        except Exception:
            traceback.print_exc()
    table.print()
    table.write_json(a.json, quick=a.quick, backend=info["summary"])
    return table


if __name__ == "__main__":
    main()
