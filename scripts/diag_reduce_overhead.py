"""Which part of the NVFP4 step crashes under ``torch.compile(mode="reduce-overhead")`` (session 38: a
segmentation fault in the compiled backward with the default recipe). Each variant trains the GPU compile tests'
Stack for four steps in a fresh process and compares it with eager training (tests/test_compile_cuda.py); the
table says which variants pass, fail or crash (the exit status of the process).

    python scripts/diag_reduce_overhead.py [--variants default,no_sr,python_casts,torch_ops_sr,rs46,current]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: variant -> (recipe name of the tests' RECIPES/NVFP4_RECIPES, Python run before the training)
VARIANTS = {
    "default": ("nvfp4", ""),
    # the default recipe without stochastic rounding: is the SR op (outside the CUDA graphs) the trigger?
    "no_sr": ("nvfp4_nosr", ""),
    # the cast ops through _quantize_kernels' Python launches instead of the resolved C++ launches
    "python_casts": ("nvfp4", "from fp_recipes.ops import cuda_nvfp4; cuda_nvfp4.TRACED_OPS_PLANNED = False\n"),
    # the SR cast as the pure-torch twin (Inductor compiles it; the counter still read when the graph runs)
    "torch_ops_sr": ("nvfp4", "from fp_recipes.quantizers.nvfp4 import NVFP4Quantizer\n"
                              "NVFP4Quantizer.traced_sr_as_op = False\n"),
    "rs46": ("nvfp4_rs46", ""),
    "current": ("current", ""),
}


def run(variant: str, timeout: int, log_dir: str = "", gdb: bool = False) -> str:
    name, prelude = VARIANTS[variant]
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
            "import fp_recipes, test_compile_cuda as t\n"
            "t.RECIPES.update(t.NVFP4_RECIPES)\n"
            "t.RECIPES['nvfp4_nosr'] = lambda: fp_recipes.NVFP4BlockScaling(disable_stochastic_rounding=True)\n"
            f"{prelude}"
            f"t._compiled_training_is_eager_training({name!r}, mode='reduce-overhead')\n"
            "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    cmd = [sys.executable, "-X", "faulthandler", "-c", code]
    if gdb:  # a native backtrace of the crashing thread (all threads) when gdb is on the machine
        cmd = ["gdb", "-q", "-batch", "-ex", "set pagination off", "-ex", "handle SIGUSR1 SIGUSR2 nostop noprint",
               "-ex", "run", "-ex", "thread apply all bt 25", "--args"] + cmd
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return "timeout"
    if log_dir:
        Path(log_dir, f"{variant}{'_gdb' if gdb else ''}.log").write_text(out.stdout + "\n---- stderr\n" + out.stderr)
    if out.returncode == 0 and out.stdout.strip().endswith("ok"):
        return "pass"
    last = [ln for ln in out.stderr.splitlines() if ln.strip()][-3:]
    kind = "CRASH" if out.returncode < 0 or out.returncode == 139 else "fail"
    return f"{kind} (exit {out.returncode}): " + " | ".join(s.strip()[:160] for s in last)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--timeout", type=int, default=240)
    p.add_argument("--log-dir", default="", help="write each variant's full stdout and stderr here")
    p.add_argument("--gdb", action="store_true", help="run each variant under gdb and log every thread's backtrace")
    args = p.parse_args()
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    for v in args.variants.split(","):
        print(f"{v:14s} {run(v, args.timeout, args.log_dir, args.gdb)}", flush=True)


if __name__ == "__main__":
    main()
