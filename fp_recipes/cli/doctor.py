"""``python -m fp_recipes doctor`` (alias ``info``): what runs here, and does it work.

Versions; the backend and why (the extension and its archs, or the reference path and why); the GPU
and its arch; for each recipe where its quantization and its GEMMs run (CUDA kernel or pure-torch
reference; native or emulated GEMM), with a tiny self-check of that path: one ``Linear`` forward and
backward under ``autocast``, finite and close to the unquantized result. Exit code 1 when something
the environment asks for cannot run here (a bad or unknown variable, a recipe that cannot be built,
a failed self-check of the recipe ``FP_RECIPES_RECIPE`` selects).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import sys
import warnings
from typing import Any, Dict, List, Optional

__all__ = ["add_parser", "run", "collect", "self_check"]

# relative error of a Linear's output vs FP32 that a working path stays under (E4M3: 2^-4 per element
# at worst, averaged over K=64 products far less; NVFP4's E2M1: up to 25% per element, ~10-15% typical)
_TOLERANCE = {"delayed": 0.08, "current": 0.08, "per_token": 0.08, "nvfp4": 0.35}


def _version(dist: str) -> Optional[str]:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _recipes() -> Dict[str, Any]:
    from fp_recipes.recipes import DelayedScaling, Float8CurrentScaling, NVFP4BlockScaling, PerTokenScaling

    return {"delayed": DelayedScaling, "current": Float8CurrentScaling, "nvfp4": NVFP4BlockScaling,
            "per_token": PerTokenScaling}


def self_check(recipe: Any, kind: str, device: Any) -> Dict[str, Any]:
    """One Linear (64 -> 64, 32 tokens) forward+backward under ``recipe``: pass when finite and close to FP32."""
    import torch

    import fp_recipes

    try:
        torch.manual_seed(0)
        lin = fp_recipes.Linear(64, 64, device=device)
        x = torch.randn(32, 64, device=device)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        lin = lin.to(dtype)
        xq = x.to(dtype).requires_grad_(True)
        with fp_recipes.autocast(recipe=recipe):
            y = lin(xq)
        y.float().square().mean().backward()
        ref = torch.nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float())
        err = float((y.float() - ref).norm() / ref.norm())
        ok = bool(torch.isfinite(y).all() and torch.isfinite(xq.grad).all()) and err < _TOLERANCE[kind]
        return {"ok": ok, "relative_error": round(err, 4), "tolerance": _TOLERANCE[kind]}
    except Exception as exc:  # noqa: BLE001 - the doctor reports every failure, it does not raise
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}


def collect() -> Dict[str, Any]:
    import torch

    import fp_recipes
    from fp_recipes.gemm import fp8_native_gemm_available
    from fp_recipes.gemm.fp8 import fp8_gemm_engine
    from fp_recipes._info import backend_info

    from .env_cmd import recipe_errors

    info = backend_info()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kernels = info["backend"] == "cuda"
    report: Dict[str, Any] = {
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "torch_cuda": torch.version.cuda, "fp_recipes": fp_recipes.__version__,
                     "pydantic": _version("pydantic"), "megatron-core": _version("megatron-core"),
                     "tqdm": _version("tqdm"), "matplotlib": _version("matplotlib")},
        "backend": info["backend"], "backend_why": info["summary"], "summary": info["summary"],
        "extension": info["extension"], "extension_error": info["extension_error"],
        "built_archs": info["built_archs"], "host_path": info["host_path"],
        "gpu": info.get("device_name"), "gpu_arch": info.get("device_arch"),
        "nvfp4": _nvfp4_paths(device, kernels),
        "recipes": {},
    }
    for kind, cls in _recipes().items():
        quant = "CUDA kernels (fp_recipes._C)" if kernels else "reference (pure torch)"
        if kind in ("delayed", "current"):
            gemm = f"native ({fp8_gemm_engine(device)})" if fp8_native_gemm_available(device) else "emulated"
        elif kind == "nvfp4":
            gemm = ("native (torch._scaled_mm, FP4 tensor cores)" if report["nvfp4"]["gemm"] == "native"
                    else "emulated (exact products, BF16 GEMM)")
        else:
            gemm = "emulated (dequantized operands)"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                recipe = _defaults_only(cls)
            except Exception as exc:  # noqa: BLE001
                recipe, check = None, {"ok": False, "error": str(exc).splitlines()[0]}
            else:
                check = self_check(recipe, kind, device)
        report["recipes"][kind] = {"quantization": quant, "gemm": gemm, "self_check": check}
    report["env_problems"] = [f"{what}: {msg}" for what, msg in recipe_errors()]
    from fp_recipes.recipes.env import report as env_report

    env = env_report()
    report["env_problems"] += [f"unknown variable {u['name']}" + (f" (did you mean {u['suggestion']}?)"
                               if u["suggestion"] else "") for u in env["unknown"]]
    report["env_problems"] += [f"{r['name']}: {r['status']}" for r in env["variables"]
                               if r["status"].startswith("error")]
    report["env_recipe"] = _env_recipe_check(device)
    return report


def _nvfp4_paths(device: Any, kernels: bool) -> Dict[str, Any]:
    """Which NVFP4 GEMM runs on ``device`` and why (the first-use self-check runs here on sm_100+), how the
    quantize kernels encode E2M1, and the standing note that the native path never ran on Blackwell."""
    from fp_recipes.gemm import nvfp4 as G
    from fp_recipes.recipes.env import EnvVarError

    out: Dict[str, Any] = {"gemm": "emulated", "gemm_why": "", "policy": None, "note": G.NATIVE_NOT_RUN_NOTE,
                           "e2m1": None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reason below says it
        try:
            out["policy"] = G.requested_policy()
            d = G.decision(device)
            out["gemm"], out["gemm_why"] = d.path, d.reason
        except EnvVarError as exc:  # reported among env_problems too
            out["gemm_why"] = f"not decided: {exc}"
        if kernels and device.type == "cuda":
            try:
                from fp_recipes.ops import cuda_nvfp4

                out["e2m1"] = cuda_nvfp4.e2m1_encoding(device)
            except Exception as exc:  # noqa: BLE001 - the doctor reports, it does not raise
                out["e2m1"] = f"unknown ({type(exc).__name__}: {exc})"
    return out


def _defaults_only(cls: Any) -> Any:
    """The recipe with its field defaults (the environment is checked separately)."""
    import os
    from unittest import mock

    from fp_recipes.recipes.env import TABLE

    names = {v.name for v in TABLE}
    clean = {k: v for k, v in os.environ.items() if k not in names}
    with mock.patch.dict(os.environ, clean, clear=True):
        return cls()


def _env_recipe_check(device: Any) -> Optional[Dict[str, Any]]:
    """The recipe the environment selects (FP_RECIPES_RECIPE), checked on this machine; None when unset."""
    import os

    from fp_recipes.recipes import recipe_from_env

    if not (os.environ.get("FP_RECIPES_RECIPE") or "").strip():
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            recipe = recipe_from_env()
        except (ValueError, TypeError):
            return None  # reported among env_problems
    if recipe is None:
        return {"recipe": "none", "self_check": {"ok": True}}
    kind = recipe.recipe_name
    return {"recipe": kind, "self_check": self_check(recipe, kind, device)}


def add_parser(sub, name: str, alias: bool = False) -> None:
    text = ("alias of doctor" if alias else
            "versions, backend and why, GPU, and per recipe where quantization and GEMMs run, with a self-check")
    p = sub.add_parser(name, help=text)
    p.add_argument("--json", action="store_true", help="print JSON")


def _lines(rep: Dict[str, Any]) -> List[str]:
    v = rep["versions"]
    out = ["versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val is not None)]
    if v["torch_cuda"] is None:
        out.append("torch CUDA build: none (a CPU-only torch)")
    missing = [k for k, val in v.items() if val is None and k != "torch_cuda"]
    if missing:
        out.append("not installed: " + ", ".join(missing))
    out.append(f"backend: {rep['backend_why']}")
    if rep["extension_error"]:
        out.append(f"  extension: {rep['extension_error']}")
    out.append(f"host path (FP_RECIPES_TORCH_OPS): {rep['host_path']}")
    out.append(f"GPU: {rep['gpu']} ({rep['gpu_arch']})" if rep["gpu"] else "GPU: none (every op runs its "
               "pure-torch reference, every quantized GEMM is emulated exactly)")
    nv = rep["nvfp4"]
    out.append(f"NVFP4 GEMM: {nv['gemm']} ({nv['gemm_why']}); FP_RECIPES_NVFP4_GEMM={nv['policy'] or '?'}")
    if nv["e2m1"] is not None:
        out.append(f"NVFP4 quantize kernels' E2M1 encoding: {nv['e2m1']}")
    out.append(f"  note: {nv['note']}")
    head = ("recipe", "quantization", "GEMM", "self-check")
    rows = []
    for kind, r in rep["recipes"].items():
        c = r["self_check"]
        check = (f"pass (rel. error {c['relative_error']})" if c["ok"] else
                 f"FAIL ({c.get('error') or 'rel. error %s > %s' % (c.get('relative_error'), c.get('tolerance'))})")
        rows.append((kind, r["quantization"], r["gemm"], check))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    out.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    if rep["env_recipe"] is not None:
        c = rep["env_recipe"]["self_check"]
        out.append(f"FP_RECIPES_RECIPE={rep['env_recipe']['recipe']} with this environment: "
                   + ("pass" if c["ok"] else f"FAIL ({c.get('error') or c})"))
    for p in rep["env_problems"]:
        out.append(f"PROBLEM: {p}")
    return out


def run(args: argparse.Namespace) -> int:
    rep = collect()
    bad_env = bool(rep["env_problems"]) or (rep["env_recipe"] is not None
                                            and not rep["env_recipe"]["self_check"]["ok"])
    rep["ok"] = not bad_env and all(r["self_check"]["ok"] for r in rep["recipes"].values())
    if args.json:
        print(json.dumps(rep, indent=2, default=str))
    else:
        print("\n".join(_lines(rep)))
    if bad_env:
        print("fp_recipes doctor: the environment asks for something that cannot run here (see PROBLEM lines)",
              file=sys.stderr)
        return 1
    return 0 if rep["ok"] else 1
