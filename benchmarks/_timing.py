"""Timing helpers shared by the quantization benchmarks (bench_quantize.py, bench_quantize_nvfp4.py).

Method: the kernels' GPU time from replaying a CUDA graph of back-to-back calls (median over replays),
and CUDA events around every eager call (median, after a warm-up) as a second number; inputs rotate over
enough independent buffers that their total exceeds the L2 cache several times, so each call reads
from device memory; bandwidth counts bytes read plus bytes written (the fewest the op must move).
The device-to-device copy bandwidth is measured the same way in the same run as the ceiling.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch


def l2_bytes() -> int:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 50 * 2**20))


def rotation_count(bytes_per_set: int, *, factor: float = 3.0, max_sets: int = 64,
                   mem_budget: Optional[int] = None) -> int:
    """How many input sets to rotate so that they span `factor` x L2 (at least 2)."""
    n = max(2, math.ceil(factor * l2_bytes() / max(1, bytes_per_set)))
    if mem_budget is not None:
        n = min(n, max(2, mem_budget // max(1, bytes_per_set)))
    return min(n, max_sets)


def time_calls(fn: Callable[..., Any], arg_sets: Sequence[tuple], *, warmup: int = 5, iters: int = 50) -> list[float]:
    """Milliseconds of GPU time of each call fn(*arg_sets[i % len]), after `warmup` calls."""
    for i in range(warmup):
        fn(*arg_sets[i % len(arg_sets)])
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        args = arg_sets[i % len(arg_sets)]
        starts[i].record()
        fn(*args)
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def median_ms(fn: Callable[..., Any], arg_sets: Sequence[tuple], *, warmup: int = 5, iters: int = 50) -> float:
    return statistics.median(time_calls(fn, arg_sets, warmup=warmup, iters=iters))


def graph_ms(fn: Callable[..., Any], arg_sets: Sequence[tuple], *, calls: int = 12, replays: int = 10) -> Optional[float]:
    """GPU milliseconds per call from replaying a CUDA graph of `calls` back-to-back calls (rotating
    over arg_sets): the kernels' own time, without host gaps between launches. None if the callable
    cannot be captured (it synchronizes, say)."""
    try:
        for a in arg_sets[: min(len(arg_sets), 3)]:
            fn(*a)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(calls):
                fn(*arg_sets[i % len(arg_sets)])
        g.replay()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - reported by the caller as "no graph"
        print(f"    (no CUDA graph: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})")
        torch.cuda.synchronize()
        return None
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del g
    torch.cuda.empty_cache()
    return statistics.median(times)


@dataclass
class Timing:
    """ms: the reported time (graph replay when available, else per-call events); eager_ms: per-call
    CUDA events around eager calls (includes any host-side gap the op leaves on the GPU)."""

    ms: float
    eager_ms: float
    method: str


def measure(fn: Callable[..., Any], arg_sets: Sequence[tuple], *, warmup: int = 5, iters: int = 50,
            graph: bool = True) -> Timing:
    eager = median_ms(fn, arg_sets, warmup=warmup, iters=iters)
    g = graph_ms(fn, arg_sets) if graph else None
    if g is None:
        return Timing(eager, eager, "events")
    return Timing(g, eager, "graph")


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def copy_bandwidth(nbytes: int = 1 << 30, iters: int = 30) -> float:
    """Device-to-device copy GB/s, counting bytes read + bytes written (2 x nbytes per copy)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = median_ms(lambda a, b: b.copy_(a), [(src, dst)], warmup=3, iters=iters)
    del src, dst
    return gbps(2 * nbytes, ms)


@dataclass
class Row:
    """One measured case: `bytes` is what the op must read + write at the least."""

    case: str
    impl: str
    shape: str
    bytes: int
    ms: float
    gbps: float
    pct_copy: float
    note: str = ""
    extra: dict = field(default_factory=dict)


class Table:
    """Collects rows against one copy-bandwidth ceiling; prints them and writes JSON."""

    def __init__(self, copy_gbps: float):
        self.copy_gbps = copy_gbps
        self.rows: list[Row] = []
        self.notes: list[str] = []

    def add(self, case: str, impl: str, shape: str, nbytes: int, ms, note: str = "", **extra) -> Row:
        if isinstance(ms, Timing):
            extra.update(eager_ms=ms.eager_ms, eager_gbps=gbps(nbytes, ms.eager_ms), method=ms.method)
            if ms.method == "graph":
                note = (note + " " if note else "") + f"[eager {gbps(nbytes, ms.eager_ms):.0f} GB/s]"
            ms = ms.ms
        g = gbps(nbytes, ms)
        row = Row(case, impl, shape, nbytes, ms, g, 100.0 * g / self.copy_gbps, note, extra)
        self.rows.append(row)
        print(f"  {case:<34} {impl:<26} {shape:<20} {ms * 1e3:>9.1f} us {g:>8.0f} GB/s {row.pct_copy:>5.1f}% "
              f"{note}", flush=True)
        return row

    def print(self) -> None:
        print(f"\nD2D copy bandwidth (read+write): {self.copy_gbps:.0f} GB/s")
        hdr = f"{'case':<34} {'impl':<26} {'shape':<20} {'us':>9} {'GB/s':>7} {'%copy':>6}  note"
        print(hdr)
        print("-" * len(hdr))
        for r in self.rows:
            print(f"{r.case:<34} {r.impl:<26} {r.shape:<20} {r.ms * 1e3:>9.1f} {r.gbps:>7.0f} {r.pct_copy:>6.1f}  {r.note}")
        for note in self.notes:
            print(f"note: {note}")

    def write_json(self, path: str, **meta) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        doc = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "copy_gbps": self.copy_gbps,
            **meta,
            "rows": [asdict(r) for r in self.rows],
            "notes": self.notes,
        }
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {path}")
