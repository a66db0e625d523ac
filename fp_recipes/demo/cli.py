"""Arguments, input checks and the run loop of ``python -m fp_recipes demo``.

Every bad input (a missing or empty --data, an unknown recipe, a device this machine lacks, a
non-positive size, an output path that cannot be written, a bad environment variable) ends with one
line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any, Dict, List, Optional

import torch

__all__ = ["main", "run_demo", "DemoInputError"]

QUICK_STEPS = 100  # --quick on CPU: the five default recipes in about 90 s on 2 cores
DEFAULT_STEPS = {"tiny": 300, "small": 400, "medium": 500, "large": 300}
PROG = "python -m fp_recipes demo"


class DemoInputError(ValueError):
    """Bad input to the demo: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + error
        raise DemoInputError(f"{message} (see {PROG} --help)")


def _parser() -> argparse.ArgumentParser:
    from .model import SIZES
    from .runs import DEFAULT_RECIPES, QUICK_CPU_RECIPES, RECIPE_NAMES

    p = _Parser(prog=PROG, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                description="Train a small GPT-style byte-level language model (fp_recipes modules: "
                "LayerNormLinear, Linear, a GroupedLinear MoE) once per recipe from identical weights and "
                "batches, and compare train/validation loss, speed and memory.")
    p.add_argument("--recipes", default=None,
                   help=f"comma-separated subset of {', '.join(RECIPE_NAMES)}, or all; the baseline always "
                   f"runs. Default: {','.join(DEFAULT_RECIPES)} ({','.join(QUICK_CPU_RECIPES)} with --quick on "
                   "CPU), or baseline + FP_RECIPES_RECIPE when set")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="a text file or a folder of text files (default: this Python's standard-library source)")
    p.add_argument("--model", choices=sorted(SIZES), default=None,
                   help="model size (default: tiny with --quick, small on CPU, large on a GPU)")
    p.add_argument("--quick", action=argparse.BooleanOptionalAction, default=None,
                   help=f"tiny model, {QUICK_STEPS} steps (default: on for CPU, off for GPU)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"training steps per recipe (default: {QUICK_STEPS} with --quick, else "
                   + ", ".join(f"{k} {v}" for k, v in DEFAULT_STEPS.items()) + ")")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: the model size's)")
    p.add_argument("--seq-len", type=int, default=None, help="bytes per sequence (default: the model size's)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when available)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="parameter/activation dtype (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and batches")
    p.add_argument("--eval-every", type=int, default=None, help="steps between validation evaluations "
                   "(default: steps/10)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="folder for loss_curves.png and results.json (default: runs/<timestamp>/)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the JSON here")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _device(text: Optional[str]) -> torch.device:
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise DemoInputError(f"--device {text}: not a device the demo runs on; allowed: cpu, cuda, cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise DemoInputError(f"--device {text}: the demo runs on cpu or cuda only; allowed: cpu, cuda, cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch is a CPU-only build" if torch.version.cuda is None
                   else f"torch (CUDA {torch.version.cuda}) sees no GPU")
            raise DemoInputError(f"--device {text}: no CUDA GPU is available ({why}); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DemoInputError(f"--device {text}: there are {torch.cuda.device_count()} GPU(s), "
                                 f"indices 0..{torch.cuda.device_count() - 1}")
    return dev


def _positive(name: str, value: Optional[int]) -> None:
    if value is not None and value < 1:
        raise DemoInputError(f"{name} must be a positive integer, got {value}")


def _check_writable_dir(path: str, flag: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise DemoInputError(f"{flag} {path}: cannot create the folder ({exc.strerror})") from None
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise DemoInputError(f"{flag} {path}: not a writable folder")


def _check_writable_file(path: str) -> None:
    existed = os.path.exists(path)
    if os.path.isdir(path):
        raise DemoInputError(f"--json {path}: is a folder; give a file path")
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise DemoInputError(f"--json {path}: cannot write it ({exc.strerror})") from None
    if not existed:
        os.remove(path)


def _settings(args: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    from .model import SIZES

    for name in ("steps", "batch", "seq_len", "eval_every"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    quick = args.quick if args.quick is not None else device.type == "cpu"
    model = args.model or ("tiny" if quick else ("large" if device.type == "cuda" else "small"))
    cfg = SIZES[model]
    if quick:
        cfg = dataclasses.replace(cfg, batch=min(cfg.batch, 8))  # 512 tokens a step
    cfg = dataclasses.replace(cfg, batch=args.batch or cfg.batch, seq_len=args.seq_len or cfg.seq_len)
    steps = args.steps or (QUICK_STEPS if quick else DEFAULT_STEPS[model])
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    return {"quick": quick, "model": model, "cfg": cfg, "steps": steps, "dtype": dtype,
            "eval_every": args.eval_every or max(1, steps // 10)}


def run_demo(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    """Parse, check, train every recipe; returns the report (raises DemoInputError on bad input)."""
    from .._info import backend_info
    from .data import load_corpus
    from .report import format_table, write_json, write_plot
    from .runs import DEFAULT_RECIPES, build_recipe, describe, env_recipe_name, gemm_path, parse_recipes
    from .train import train_one

    args = _parser().parse_args(argv)
    device = _device(args.device)
    s = _settings(args, device)
    cfg = s["cfg"]
    try:
        names = parse_recipes(args.recipes, quick_cpu=s["quick"] and device.type == "cpu")
    except ValueError as exc:
        raise DemoInputError(str(exc)) from None
    recipes = {}
    for name in names:  # build every recipe first: a bad env var fails before any training
        try:
            recipes[name] = build_recipe(name)
        except ValueError as exc:
            raise DemoInputError(f"recipe {name}: {_first_line(exc)}") from None
    out = args.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    _check_writable_dir(out, "--out")
    if args.json:
        _check_writable_file(args.json)
    try:
        corpus = load_corpus(args.data, cfg.seq_len)
    except ValueError as exc:
        raise DemoInputError(str(exc)) from None

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[s["dtype"]]
    steps = s["steps"]
    batch_starts = corpus.batch_starts(steps, cfg.batch, cfg.seq_len, args.seed)
    val_starts = corpus.val_starts(4 * cfg.batch, cfg.seq_len)
    info = backend_info()
    unigram = corpus.unigram_loss()
    tokens = steps * cfg.batch * cfg.seq_len
    print(f"fp_recipes demo: model {s['model']} ({_params(cfg):,} parameters), {steps} steps x "
          f"{cfg.batch}x{cfg.seq_len} bytes = {tokens:,} tokens per recipe, {s['dtype']} on {device}"
          + (f" ({info['device_name']})" if info.get("device_name") else ""))
    print(f"data: {corpus.source}: {corpus.train.numel():,} train / {corpus.val.numel():,} validation bytes")
    print(f"backend: {info.get('summary')}")
    print(f"unigram baseline (validation loss of byte frequencies alone): {unigram:.4f} nats/byte")
    left_out = [n for n in DEFAULT_RECIPES if n not in names] if args.recipes is None and env_recipe_name() is None else []
    if left_out:
        print(f"--quick on CPU leaves out {', '.join(left_out)} (its exact CPU reference is ~3x slower than "
              "nvfp4's); --recipes all runs every recipe")
    sys.stdout.flush()
    results = []
    for name in names:
        recipe = recipes[name]
        results.append(train_one(name, describe(name), recipe, cfg, corpus, steps, args.seed, device, torch_dtype,
                                 batch_starts, val_starts, s["eval_every"], gemm_path(name, recipe, device),
                                 progress=not args.no_progress))
    base = results[0].val_loss
    for r in results[1:]:
        r.gap_pct = 100.0 * (r.val_loss - base) / base
    report = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "device": str(device),
        "device_name": info.get("device_name"), "backend": info.get("summary"), "torch": torch.__version__,
        "model": s["model"], "model_config": cfg.as_dict(), "parameters": _params(cfg), "steps": steps,
        "quick": s["quick"], "dtype": s["dtype"], "seed": args.seed, "data": corpus.source,
        "train_bytes": corpus.train.numel(), "val_bytes": corpus.val.numel(), "unigram_val_loss": unigram,
        "results": [dataclasses.asdict(r) for r in results],
    }
    print()
    print(format_table(report))
    json_path = os.path.join(out, "results.json")
    write_json(report, json_path)
    written = [json_path]
    if not args.no_plot:
        png = os.path.join(out, "loss_curves.png")
        write_plot(report, png)
        written.append(png)
    if args.json:
        write_json(report, args.json)
        written.append(args.json)
    for path in written:
        print(f"wrote {path}")
    return report


def _params(cfg) -> int:
    """Parameter count of ``GPT(cfg)`` without building it (a medium model is large for a CPU)."""
    d, f, e = cfg.d_model, cfg.d_ffn, cfg.experts
    attn = 2 * d + 3 * d * d + 3 * d + d * d + d
    dense = 2 * d + d * f + f + f * d + d
    moe = 2 * d + d * e + e * (d * f + f + f * d + d)
    moe_layers = cfg.n_layers // 2
    blocks = cfg.n_layers * attn + (cfg.n_layers - moe_layers) * dense + moe_layers * moe
    return 256 * d + cfg.seq_len * d + blocks + 2 * d + d * 256


def _first_line(exc: BaseException) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):  # a pydantic ValidationError: its messages without the boilerplate
        try:
            return "; ".join(e["msg"].removeprefix("Value error, ") for e in errors())
        except Exception:  # noqa: BLE001 - fall back to the plain text
            pass
    return str(exc).strip().splitlines()[0]


def main(argv: Optional[List[str]] = None) -> int:
    try:
        run_demo(argv)
    except DemoInputError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except FloatingPointError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
