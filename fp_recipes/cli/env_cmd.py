"""``python -m fp_recipes env``: every variable, its value, the field it sets; ``--strict`` for launch scripts.

``--strict`` exits 1 when a set ``NVTE_*``/``FP_RECIPE*`` name is unknown (a typo), a value is not
allowed, or a recipe the environment touches cannot be built: it builds every recipe whose fields a
set variable reaches (and the one ``FP_RECIPES_RECIPE`` picks) and reports each error it would raise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Any, Dict, List, Mapping, Optional, Tuple

__all__ = ["add_parser", "run", "recipe_errors"]


def _message(exc: BaseException) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):  # a pydantic ValidationError: keep only the messages
        try:
            return "; ".join(e["msg"].removeprefix("Value error, ") for e in errors())
        except Exception:  # noqa: BLE001 - fall back to the text
            pass
    return str(exc)


def touched_recipes(environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """Class names of the recipes whose fields a set variable reaches, in table order."""
    from fp_recipes.recipes.env import TABLE

    environ = os.environ if environ is None else environ
    names: List[str] = []
    for var in TABLE:
        if var.use == "recipe" and (environ.get(var.name) or "").strip():
            names += [r for r in var.recipes if r not in names]
    return names


def recipe_errors(environ: Optional[Mapping[str, str]] = None) -> List[Tuple[str, str]]:
    """(what was built, the error) for every recipe the environment touches that cannot be built."""
    from fp_recipes import recipes as R

    environ = os.environ if environ is None else environ
    out: List[Tuple[str, str]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the table already reports unknown and deprecated names
        for cls_name in touched_recipes(environ):
            try:
                getattr(R, cls_name)()
            except (ValueError, TypeError) as exc:
                out.append((f"{cls_name}()", _message(exc)))
        if (environ.get("FP_RECIPES_RECIPE") or "").strip():
            try:
                R.recipe_from_env()
            except (ValueError, TypeError) as exc:
                what = "recipe_from_env() (FP_RECIPES_RECIPE)"
                msg = _message(exc)
                if not any(msg == m for _, m in out):
                    out.append((what, msg))
    return out


def _resolved_recipe() -> Tuple[Optional[Any], Optional[str]]:
    """What ``autocast()`` would use now: (recipe or None for 'none', None) or (None, the error)."""
    from fp_recipes.recipes import recipe_from_env

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return recipe_from_env(), None
        except (ValueError, TypeError) as exc:
            return None, _message(exc)


def add_parser(sub) -> None:
    p = sub.add_parser("env", help="environment variables: values, fields, allowed values; --strict checks them",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--strict", action="store_true",
                   help="exit 1 if a set NVTE_*/FP_RECIPE* variable is unknown, a value is not allowed, or a "
                   "recipe the environment touches cannot be built")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print JSON")
    fmt.add_argument("--markdown", action="store_true", help="print docs/envvars.md")


def run(args: argparse.Namespace) -> int:
    from fp_recipes.recipes import env

    if args.markdown:
        sys.stdout.write(env.render_markdown())
        return 0
    rep: Dict[str, Any] = env.report()
    recipe, recipe_error = _resolved_recipe()
    rep["recipe"] = {
        "config": recipe.to_config() if recipe is not None else None,
        "provenance": recipe.provenance() if recipe is not None else None,
        "error": recipe_error,
    }
    build_errors = recipe_errors()
    rep["recipe_errors"] = [{"recipe": what, "error": msg} for what, msg in build_errors]
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
        for what, msg in build_errors:
            print(f"ERROR building {what} from this environment: {msg}")
    bad = [r["name"] for r in rep["variables"] if r["status"].startswith("error")]
    problems = [f"unknown {u['name']}" + (f" (did you mean {u['suggestion']}?)" if u["suggestion"] else "")
                for u in rep["unknown"]]
    problems += [f"bad value {name}" for name in bad]
    problems += [f"{what} fails" for what, _ in build_errors]
    if args.strict and problems:
        print(f"fp_recipes env --strict: {len(problems)} problem(s): {'; '.join(problems)}", file=sys.stderr)
        return 1
    return 0
