"""The recipes the demo compares, and where their GEMMs run on a device.

Names are what ``--recipes`` takes. Recipes are built with the defaults the user would get, so the
environment applies as everywhere (``NVTE_NVFP4_4OVER6=all`` changes ``nvfp4``); only the fields that
define a variant (``nvfp4_rs_4over6``) are passed as arguments, and arguments beat the environment.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

__all__ = ["RECIPE_NAMES", "DEFAULT_RECIPES", "QUICK_CPU_RECIPES", "build_recipe", "gemm_path", "parse_recipes", "env_recipe_name"]


def _nvfp4_rs_4over6():
    from ..recipes import NVFP4BlockScaling

    # row-scaled activations need RHT, 2-D weight tiles and stochastic rounding off (as in TE)
    return NVFP4BlockScaling(row_scaled_activation=True, disable_rht=True, disable_2d_quantization=True,
                             disable_stochastic_rounding=True, nvfp4_4over6="all",
                             nvfp4_4over6_err_mode="MSE", nvfp4_4over6_err_use_fast_math=True)


def _builders() -> Dict[str, Callable[[], Any]]:
    from ..recipes import DelayedScaling, Float8CurrentScaling, NVFP4BlockScaling, PerTokenScaling

    return {
        "baseline": lambda: None,
        "delayed": DelayedScaling,
        "current": Float8CurrentScaling,
        "nvfp4": NVFP4BlockScaling,
        "nvfp4_rs_4over6": _nvfp4_rs_4over6,
        "per_token": PerTokenScaling,
    }


RECIPE_NAMES = ("baseline", "delayed", "current", "nvfp4", "nvfp4_rs_4over6", "per_token")
DEFAULT_RECIPES = ("baseline", "delayed", "current", "nvfp4", "nvfp4_rs_4over6")
# --quick on a CPU leaves out the variant whose exact CPU reference is slowest (4over6 tries two
# candidates per block with its error metric: ~3x NVFP4's cost per step); --recipes all brings it back
QUICK_CPU_RECIPES = ("baseline", "delayed", "current", "nvfp4")
_DESCRIPTIONS = {
    "baseline": "no quantization (BF16 on GPU, FP32 on CPU)",
    "delayed": "DelayedScaling(): FP8, scale from the amax history",
    "current": "Float8CurrentScaling(): FP8, scale from this tensor's amax",
    "nvfp4": "NVFP4BlockScaling(): 16x16 weight tiles, RHT, stochastic rounding",
    "nvfp4_rs_4over6": "NVFP4BlockScaling(row_scaled_activation, nvfp4_4over6=all, MSE, fast math)",
    "per_token": "PerTokenScaling(): one scale per token (E5M6)",
}


def describe(name: str) -> str:
    return _DESCRIPTIONS[name]


def env_recipe_name(environ: Optional[Dict[str, str]] = None) -> Optional[str]:
    """The demo name of ``FP_RECIPES_RECIPE`` when it is set (``none`` -> ``baseline``)."""
    import os

    raw = (os.environ if environ is None else environ).get("FP_RECIPES_RECIPE", "").strip().lower()
    if not raw:
        return None
    return "baseline" if raw == "none" else raw


def parse_recipes(text: Optional[str], quick_cpu: bool = False) -> List[str]:
    """``--recipes`` (comma-separated; ``all``) -> names, baseline first; ValueError on a bad name.

    Without ``--recipes``: ``FP_RECIPES_RECIPE`` set -> baseline and that recipe, else the default five
    (four for ``--quick`` on a CPU: :data:`QUICK_CPU_RECIPES`)."""
    if text is None:
        chosen = env_recipe_name()
        if chosen is None:
            return list(QUICK_CPU_RECIPES if quick_cpu else DEFAULT_RECIPES)
        if chosen not in RECIPE_NAMES:
            raise ValueError(f"FP_RECIPES_RECIPE={chosen!r} names no recipe; allowed: "
                             "none, delayed, current, nvfp4, per_token")
        names = [chosen]
    else:
        names = [n.strip().lower() for n in text.split(",") if n.strip()]
        if names == ["all"]:
            return list(RECIPE_NAMES)
        if not names:
            raise ValueError(f"--recipes {text!r} names no recipe; choose from {', '.join(RECIPE_NAMES)}")
    unknown = [n for n in names if n not in RECIPE_NAMES]
    if unknown:
        raise ValueError(f"unknown recipe {', '.join(repr(u) for u in unknown)} in --recipes; "
                         f"choose from {', '.join(RECIPE_NAMES)} (or all)")
    ordered = ["baseline"] + [n for n in RECIPE_NAMES if n in names and n != "baseline"]
    return ordered


def build_recipe(name: str):
    return _builders()[name]()


def gemm_path(name: str, recipe: Any, device: torch.device) -> str:
    """native | emulated, with what runs the GEMM."""
    from ..gemm import fp8_native_gemm_available, nvfp4_native_gemm_available
    from ..gemm.fp8 import fp8_gemm_engine

    if recipe is None:
        return "native (torch matmul)"
    if name in ("delayed", "current"):
        if fp8_native_gemm_available(device):
            return f"native ({fp8_gemm_engine(device)})"
        return "emulated (exact FP8 values, FP32 matmul)"
    if name.startswith("nvfp4"):
        if nvfp4_native_gemm_available(device):
            return "native (FP4 GEMM)"
        return "emulated (exact E2M1xE4M3 products, BF16 GEMM)"
    return "emulated (dequantized operands)"
