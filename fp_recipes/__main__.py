"""``python -m fp_recipes``: env | demo | info.

* ``env``: every environment variable fp_recipes reads, its current value, the field it sets and
  the allowed values. ``--strict`` exits 1 when a variable with our prefixes is unknown or a value
  is not allowed (for launch scripts); ``--json`` for machines; ``--markdown`` renders
  docs/envvars.md.
* ``demo``: a small training run comparing recipes (``fp_recipes.demo``); extra arguments are
  passed on.
* ``info``: which backend runs the ops (``fp_recipes.backend_info()``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any, List, Optional


def _cmd_env(args: argparse.Namespace) -> int:
    from fp_recipes.recipes import env

    if args.markdown:
        sys.stdout.write(env.render_markdown())
        return 0
    rep = env.report()
    recipe, recipe_error = _resolved_recipe()
    rep["recipe"] = {
        "config": recipe.to_config() if recipe is not None else None,
        "provenance": recipe.provenance() if recipe is not None else None,
        "error": recipe_error,
    }
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        print(env.render_text())
        print()
        if recipe_error:
            print(f"autocast() recipe (FP_RECIPES_RECIPE): ERROR: {recipe_error}")
        else:
            text = recipe.describe() if recipe is not None else "none (quantization off)"
            print(f"autocast() recipe (FP_RECIPES_RECIPE): {text}")
    bad = [r["name"] for r in rep["variables"] if r["status"].startswith("error")]
    if args.strict and (rep["unknown"] or bad or recipe_error):
        problems = [u["name"] for u in rep["unknown"]] + bad
        if recipe_error:
            problems.append("the recipe autocast() would build")
        print(f"fp_recipes env --strict: {len(problems)} problem(s): {', '.join(problems)}",
              file=sys.stderr)
        return 1
    return 0


def _resolved_recipe() -> "tuple[Optional[Any], Optional[str]]":
    """What ``autocast()`` would use now: (recipe or None for 'none', None) or (None, the error)."""
    import warnings

    from fp_recipes.recipes import recipe_from_env

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the table above already reports unknown/deprecated names
        try:
            recipe = recipe_from_env()
        except ValueError as exc:
            errors = getattr(exc, "errors", None)
            if callable(errors):  # a pydantic ValidationError: keep only the messages
                msgs = [e["msg"].removeprefix("Value error, ") for e in errors()]
                return None, "; ".join(msgs)
            return None, str(exc)
    return recipe, None


def _cmd_demo(args: argparse.Namespace, rest: List[str]) -> int:
    try:
        demo = importlib.import_module("fp_recipes.demo")
    except ModuleNotFoundError as exc:
        if exc.name != "fp_recipes.demo":
            raise
        print("fp_recipes demo: the demo module (fp_recipes/demo.py) is not part of this checkout "
              "yet; `python -m fp_recipes env` and `python -m fp_recipes info` work.",
              file=sys.stderr)
        return 2
    result = demo.main(rest)
    return int(result or 0)


def _cmd_info(args: argparse.Namespace) -> int:
    from fp_recipes.ops.backend import backend_info

    info = backend_info()
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        width = max(len(k) for k in info)
        for key, value in info.items():
            print(f"{key:<{width}}  {value}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fp_recipes",
                                     description="fp_recipes: FP8 and NVFP4 training for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    p_env = sub.add_parser("env", help="environment variables: values, fields, allowed values")
    p_env.add_argument("--strict", action="store_true",
                       help="exit 1 if an unknown NVTE_NVFP4_*/NVTE_FP8_*/FP_RECIPES_* variable is "
                       "set or a value is not allowed")
    fmt = p_env.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print JSON")
    fmt.add_argument("--markdown", action="store_true", help="print docs/envvars.md")
    sub.add_parser("demo", help="a small training run comparing recipes (extra args passed on)",
                   add_help=False)
    p_info = sub.add_parser("info", help="backend: CUDA extension or pure-torch reference")
    p_info.add_argument("--json", action="store_true", help="print JSON")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if argv and argv[0] == "demo":  # everything after `demo` belongs to the demo
        return _cmd_demo(argparse.Namespace(command="demo"), argv[1:])
    args = parser.parse_args(argv)
    if args.command == "env":
        return _cmd_env(args)
    return _cmd_info(args)


if __name__ == "__main__":
    sys.exit(main())
