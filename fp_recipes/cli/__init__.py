"""``python -m fp_recipes {env, demo, bench, doctor}`` (``info`` is an alias of ``doctor``).

* ``env``: the environment variables (``fp_recipes.cli.env_cmd``);
* ``demo``: train a small GPT once per recipe (``fp_recipes.demo``); extra arguments are passed on;
* ``bench``: the GPU benchmarks in ``benchmarks/`` (``fp_recipes.cli.bench``);
* ``doctor``: versions, backend, and whether each recipe runs natively here (``fp_recipes.cli.doctor``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

__all__ = ["main"]


def _cmd_demo(rest: List[str]) -> int:
    try:
        demo = importlib.import_module("fp_recipes.demo")
    except ModuleNotFoundError as exc:
        if exc.name != "fp_recipes.demo":
            raise
        print("fp_recipes demo: the demo package (fp_recipes/demo/) is not part of this installation; "
              "`python -m fp_recipes env` and `python -m fp_recipes doctor` work.", file=sys.stderr)
        return 2
    return int(demo.main(rest) or 0)


def _parser() -> argparse.ArgumentParser:
    from . import bench, doctor, env_cmd

    parser = argparse.ArgumentParser(prog="python -m fp_recipes",
                                     description="fp_recipes: FP8 and NVFP4 training for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    env_cmd.add_parser(sub)
    sub.add_parser("demo", help="train a small GPT once per recipe and compare (see demo --help)", add_help=False)
    bench.add_parser(sub)
    doctor.add_parser(sub, "doctor")
    doctor.add_parser(sub, "info", alias=True)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":  # everything after `demo` belongs to the demo
        return _cmd_demo(argv[1:])
    args = _parser().parse_args(argv)
    from . import bench, doctor, env_cmd

    if args.command == "env":
        return env_cmd.run(args)
    if args.command == "bench":
        return bench.run(args)
    return doctor.run(args)
