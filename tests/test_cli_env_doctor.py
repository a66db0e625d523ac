"""``env`` typo detection and ``--strict`` recipe building, ``doctor`` and ``bench`` (CLI run as a user runs it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NVTE_", "FP_RECIPE"))}
    env.update(extra)
    return subprocess.run([sys.executable, "-m", "fp_recipes", *args], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.mark.parametrize("typo,right", [("NVTE_BACKWARD_OVERIDE", "NVTE_BACKWARD_OVERRIDE"),
                                        ("FP_RECIPE_RECIPE", "FP_RECIPES_RECIPE"),
                                        ("NVTE_NVPF4_DISABLE_RHT", "NVTE_NVFP4_DISABLE_RHT")])
def test_typos_outside_the_old_prefixes_are_caught(typo, right):
    out = _cli("env", "--strict", **{typo: "1"})
    assert out.returncode == 1
    assert f"UNKNOWN {typo}=1: ignored; did you mean {right}?" in out.stdout
    assert typo in out.stderr
    import warnings

    from fp_recipes import DelayedScaling
    from fp_recipes.recipes.env import UnknownEnvVarWarning, unknown_env

    os.environ[typo] = "1"
    try:
        with pytest.warns(UnknownEnvVarWarning, match=f"did you mean {right}"):
            DelayedScaling()
        assert unknown_env() == [(typo, right)]
    finally:
        del os.environ[typo]


def test_te_variables_we_do_not_use_are_known_and_say_why():
    out = _cli("env", "--strict", NVTE_FUSED_ATTN="1", NVTE_DEBUG="1")
    assert out.returncode == 0, out.stderr
    assert "TE ONLY NVTE_FUSED_ATTN=1: ignored by fp_recipes (attention backend selection" in out.stdout
    from fp_recipes.recipes.env import TE_NOT_USED, render_markdown

    assert all(why for why in TE_NOT_USED.values())
    assert "`NVTE_FUSED_ATTN`" in render_markdown()


@pytest.mark.parametrize("env,needle", [
    ({"NVTE_NVFP4_ROW_SCALED_ACTIVATION": "1"}, "NVFP4BlockScaling()"),
    ({"NVTE_NVFP4_PER_TOKEN_ACTIVATION": "1", "NVTE_NVFP4_ROW_SCALED_ACTIVATION": "0"}, "disagree"),
    ({"NVTE_BACKWARD_OVERRIDE": "none"}, "PerTokenScaling()"),
])
def test_strict_builds_every_recipe_the_environment_touches(env, needle):
    out = _cli("env", "--strict", **env)
    assert out.returncode == 1, out.stdout
    assert "ERROR building" in out.stdout and needle in out.stdout
    assert "fails" in out.stderr
    assert _cli("env", **env).returncode == 0  # only --strict fails


def test_strict_passes_a_consistent_environment():
    out = _cli("env", "--strict", NVTE_NVFP4_ROW_SCALED_ACTIVATION="1", NVTE_NVFP4_DISABLE_RHT="1",
               NVTE_NVFP4_DISABLE_2D_QUANTIZATION="1", NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING="1")
    assert out.returncode == 0, out.stdout + out.stderr


def test_doctor_reports_every_path_and_passes_here():
    out = _cli("doctor", "--json")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["versions"]["torch"] == torch.__version__ and rep["versions"]["fp_recipes"]
    assert set(rep["recipes"]) == {"delayed", "current", "nvfp4", "per_token"}
    for kind, r in rep["recipes"].items():
        assert r["self_check"]["ok"], (kind, r)
        assert r["gemm"].startswith(("native", "emulated"))
    text = _cli("info")
    assert text.returncode == 0 and "self-check" in text.stdout and "backend:" in text.stdout


def test_doctor_fails_when_the_environment_asks_for_what_cannot_run():
    out = _cli("doctor", NVTE_NVFP4_ROW_SCALED_ACTIVATION="1", FP_RECIPES_RECIPEE="nvfp4")
    assert out.returncode == 1
    assert "PROBLEM: NVFP4BlockScaling()" in out.stdout
    assert "PROBLEM: unknown variable FP_RECIPES_RECIPEE (did you mean FP_RECIPES_RECIPE?)" in out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_bench_without_gpu_says_so_and_exits_2():
    out = _cli("bench", "--size", "small")
    assert out.returncode == 2
    assert "no CUDA GPU here" in out.stderr and "Traceback" not in out.stderr
    assert _cli("bench", "--only", "nope").returncode == 2


def test_bench_plan_runs_every_script_by_path(tmp_path):
    from fp_recipes.cli.bench import benchmark_commands

    plan = benchmark_commands("small", tmp_path)
    assert [p["name"] for p in plan] == ["bench_quantize", "bench_linear", "bench_model"]
    for p in plan:
        assert p["argv"][1] == p["script"] and p["argv"][-2:] == ["--json", p["json"]]
        assert p["exists"] == Path(p["script"]).is_file()
    assert "--quick" in plan[0]["argv"] and ["--size", "small"] == plan[2]["argv"][2:4]
