"""``python -m fp_recipes``: env (table, --json, --strict, --markdown), demo, info."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


from fp_recipes.__main__ import main
from fp_recipes.recipes.env import TABLE

ROOT = Path(__file__).resolve().parents[1]


def test_env_table_lists_every_variable(monkeypatch, capsys):
    monkeypatch.setenv("NVTE_NVFP4_4OVER6", "weights")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for var in TABLE:
        assert var.name in out
    line = next(l for l in out.splitlines() if l.startswith("NVTE_NVFP4_4OVER6 "))
    assert "weights" in line and "NVFP4BlockScaling.nvfp4_4over6" in line and "ok" in line
    assert "none | weights | activations | all" in line


def test_env_json(monkeypatch, capsys):
    monkeypatch.setenv("FP_RECIPES_DELAYED_MARGIN", "x")
    monkeypatch.setenv("NVTE_NVFP4_DISABLE_RTH", "1")
    assert main(["env", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {r["name"]: r for r in data["variables"]}
    assert set(rows) == {v.name for v in TABLE}
    assert rows["FP_RECIPES_DELAYED_MARGIN"]["value"] == "x"
    assert rows["FP_RECIPES_DELAYED_MARGIN"]["status"].startswith("error")
    assert rows["FP_RECIPES_DELAYED_MARGIN"]["sets"] == "DelayedScaling.margin"
    assert rows["NVTE_NVFP4_DISABLE_RHT"]["value"] is None
    assert rows["NVTE_NVFP4_DISABLE_RHT"]["default"] == "0"
    assert data["unknown"] == [{"name": "NVTE_NVFP4_DISABLE_RTH", "value": "1",
                                "suggestion": "NVTE_NVFP4_DISABLE_RHT"}]


def test_env_strict(monkeypatch, capsys):
    assert main(["env", "--strict"]) == 0
    monkeypatch.setenv("NVTE_NVFP4_DISABLE_RHT", "1")
    monkeypatch.setenv("FP_RECIPES_CUDA_ARCHS", "90a")
    assert main(["env", "--strict"]) == 0
    monkeypatch.setenv("NVTE_FP8_CURRENT_SCALING_POWER2_SCALES", "1")
    assert main(["env"]) == 0  # only --strict fails
    assert main(["env", "--strict"]) == 1
    captured = capsys.readouterr()
    assert "did you mean NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES?" in captured.out
    assert "NVTE_FP8_CURRENT_SCALING_POWER2_SCALES" in captured.err
    monkeypatch.delenv("NVTE_FP8_CURRENT_SCALING_POWER2_SCALES")
    monkeypatch.setenv("NVTE_NVFP4_DISABLE_RHT", "maybe")
    assert main(["env", "--strict", "--json"]) == 1


def test_env_markdown(capsys):
    from fp_recipes.recipes.env import render_markdown

    assert main(["env", "--markdown"]) == 0
    assert capsys.readouterr().out == render_markdown()


def test_demo_missing_module_explains(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fp_recipes.demo", None)  # import of it now fails
    assert main(["demo"]) == 2
    assert "fp_recipes/demo/" in capsys.readouterr().err


def test_demo_passes_arguments(monkeypatch):
    import types

    seen = {}
    fake = types.ModuleType("fp_recipes.demo")
    fake.main = lambda argv: seen.setdefault("argv", argv) and 0
    monkeypatch.setitem(sys.modules, "fp_recipes.demo", fake)
    assert main(["demo", "--steps", "3", "--help"]) == 0
    assert seen["argv"] == ["--steps", "3", "--help"]


def test_info(capsys):
    from fp_recipes import backend_info

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert str(backend_info()["summary"]) in out
    assert main(["info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"] == backend_info()["summary"]


def test_module_entry_point_runs():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NVTE_", "FP_RECIPES_"))}
    env["FP_RECIPES_RECIPEE"] = "nvfp4"
    out = subprocess.run([sys.executable, "-m", "fp_recipes", "env", "--strict"], cwd=ROOT,
                         capture_output=True, text=True, env=env)
    assert out.returncode == 1
    assert "did you mean FP_RECIPES_RECIPE?" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "fp_recipes", "nope"], cwd=ROOT,
                         capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_env_shows_the_recipe_autocast_would_build(monkeypatch, capsys):
    monkeypatch.setenv("FP_RECIPES_RECIPE", "nvfp4")
    monkeypatch.setenv("NVTE_NVFP4_DISABLE_RHT", "1")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "autocast() recipe (FP_RECIPES_RECIPE): NVFP4BlockScaling" in out
    assert "[env NVTE_NVFP4_DISABLE_RHT=1]" in out
    assert main(["env", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)["recipe"]
    assert rec["config"]["recipe"] == "nvfp4" and rec["config"]["disable_rht"] is True
    assert rec["provenance"]["disable_rht"] == "env NVTE_NVFP4_DISABLE_RHT=1"
    monkeypatch.setenv("FP_RECIPES_RECIPE", "none")
    assert main(["env"]) == 0
    assert "none (quantization off)" in capsys.readouterr().out


def test_env_strict_fails_on_a_recipe_that_cannot_be_built(monkeypatch, capsys):
    monkeypatch.setenv("FP_RECIPES_RECIPE", "nvfp4")
    monkeypatch.setenv("NVTE_NVFP4_4OVER6", "all")  # 4over6 on activations needs RHT off
    assert main(["env"]) == 0
    assert main(["env", "--strict"]) == 1
    out = capsys.readouterr().out
    assert "ERROR: nvfp4_4over6='all' (from env NVTE_NVFP4_4OVER6=all)" in out
    assert "validation error" not in out  # the message, not pydantic's wrapping
    monkeypatch.setenv("NVTE_NVFP4_DISABLE_RHT", "1")
    assert main(["env", "--strict"]) == 0
