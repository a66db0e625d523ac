"""``python -m fp_recipes bench``: run the GPU benchmarks of ``benchmarks/`` and collect their JSON.

Each benchmark script runs in its own process (a crash or an out-of-memory in one does not take the
others down) and writes its own JSON; ``bench`` prints their tables as they run and writes one summary
JSON naming the device, the date and every result. The scripts are found in the source checkout
(``benchmarks/`` beside the package); without a CUDA GPU there is nothing to measure: exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

__all__ = ["add_parser", "run", "benchmark_commands", "BENCHMARKS"]

# script -> (what it measures, extra arguments per size)
BENCHMARKS: Dict[str, Dict[str, Any]] = {
    "bench_quantize.py": {"what": "quantization kernels (FP8, per-token, grouped, multi-tensor, NVFP4) vs copy",
                          "small": ["--quick", "--no-compile"], "full": []},
    "bench_linear.py": {"what": "Linear and GroupedLinear fwd+bwd per recipe vs BF16",
                        "small": ["--quick"], "full": []},
    "bench_model.py": {"what": "a stack of transformer blocks fwd+bwd per recipe vs BF16",
                       "small": ["--size", "small", "--no-compiled"], "full": ["--size", "full"]},
}


def benchmarks_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "benchmarks"


def benchmark_commands(size: str, out: Path, only: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    """The command line of every benchmark to run (missing scripts are marked, not dropped)."""
    root = benchmarks_dir()
    plan = []
    for script, meta in BENCHMARKS.items():
        name = script.removesuffix(".py")
        if only and name not in only:
            continue
        path = root / script
        json_path = out / f"{name}.json"
        plan.append({"name": name, "script": str(path), "what": meta["what"], "exists": path.is_file(),
                     "json": str(json_path),
                     "argv": [sys.executable, str(path), *meta[size], "--json", str(json_path)]})
    return plan


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="run the GPU benchmarks (quantize kernels, Linear/GroupedLinear, model "
                       "blocks) and write JSON", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size", choices=["small", "full"], default="small",
                   help="small: minutes, a few shapes; full: every shape of benchmarks/RESULTS.md")
    p.add_argument("--only", default=None,
                   help="comma-separated subset of " + ", ".join(s.removesuffix('.py') for s in BENCHMARKS))
    p.add_argument("--out", default=None, metavar="DIR", help="folder for the JSON (default: runs/bench-<timestamp>/)")


def run(args: argparse.Namespace) -> int:
    import torch

    only = [s.strip() for s in args.only.split(",")] if args.only else None
    known = [s.removesuffix(".py") for s in BENCHMARKS]
    if only and any(o not in known for o in only):
        bad = [o for o in only if o not in known]
        print(f"fp_recipes bench: unknown benchmark {', '.join(bad)}; choose from {', '.join(known)}",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        why = "this torch is a CPU-only build" if torch.version.cuda is None else "torch sees no CUDA GPU"
        print(f"fp_recipes bench: no CUDA GPU here ({why}); the benchmarks time GPU kernels. "
              "`python -m fp_recipes demo` runs on a CPU.", file=sys.stderr)
        return 2
    out = Path(args.out or os.path.join("runs", time.strftime("bench-%Y%m%d-%H%M%S")))
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"fp_recipes bench: --out {out}: cannot create the folder ({exc.strerror})", file=sys.stderr)
        return 2
    plan = benchmark_commands(args.size, out, only)
    summary: Dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "cuda": torch.version.cuda, "size": args.size,
                               "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "benchmarks": []}
    failed = 0
    for item in plan:
        entry = {k: item[k] for k in ("name", "what", "script")}
        if not item["exists"]:
            print(f"== {item['name']}: {item['script']} is missing in this checkout; skipped")
            entry["status"] = "missing"
        else:
            print(f"== {item['name']}: {item['what']}", flush=True)
            t0 = time.perf_counter()
            rc = subprocess.call(item["argv"], cwd=str(benchmarks_dir().parent))
            entry["seconds"] = round(time.perf_counter() - t0, 1)
            entry["status"] = "ok" if rc == 0 else f"failed (exit {rc})"
            failed += rc != 0
            if os.path.exists(item["json"]):
                with open(item["json"]) as fh:
                    entry["results"] = json.load(fh)
        summary["benchmarks"].append(entry)
    path = out / "bench.json"
    with open(path, "w") as fh:
        json.dump(summary, fh, indent=2)
    print(f"wrote {path}")
    return 1 if failed else 0
