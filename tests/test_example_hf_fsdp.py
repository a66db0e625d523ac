"""examples/hf_fsdp_train.py runs as a launch script would run it: 2 gloo processes, the recipe only
from environment variables, FSDP2 with the quantized all-gather, a distributed checkpoint saved
mid-run, and a resumed run that continues bit-identically."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _fsdp_worker import torchrun

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("transformers")
TIMEOUT_S = 150  # one launch takes ~20 s on 2 CPU cores; a hang fails the test after this


def _launch(tmp_path: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return torchrun(ROOT / "examples" / "hf_fsdp_train.py", ["--size", "tiny", *args], env,
                    timeout=TIMEOUT_S, cwd=tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("env,name", [
    ({"FP_RECIPES_RECIPE": "current"}, "Float8CurrentScaling"),
    # delayed scaling: the amax histories and scales are in the checkpoint and must come back
    ({"FP_RECIPES_RECIPE": "delayed", "FP_RECIPES_DELAYED_AMAX_HISTORY_LEN": "8"}, "DelayedScaling"),
], ids=["current", "delayed"])
def test_env_only_recipe_checkpoint_and_resume(tmp_path, env, name):
    ckpt, full, resumed = tmp_path / "ckpt", tmp_path / "full.json", tmp_path / "resumed.json"
    run = _launch(tmp_path, env, "--steps", "4", "--quantized-all-gather", "--save", str(ckpt),
                  "--save-at", "2", "--json", str(full))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-6000:]
    assert f"recipe {name}" in run.stdout
    assert "quantized all-gather:" in run.stdout and "(0.250x)" in run.stdout
    assert "returned a view tensor" not in run.stderr  # FSDP2's warning: no module output is a view
    run = _launch(tmp_path, env, "--steps", "4", "--quantized-all-gather", "--resume", str(ckpt),
                  "--json", str(resumed))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-6000:]
    a, b = json.loads(full.read_text()), json.loads(resumed.read_text())
    assert b["start"] == 2
    assert b["losses"] == a["losses"][2:]  # the resumed steps are bit-identical
    assert a["losses"][-1] < a["losses"][0]
    # every gather took the amax precompute_weight_amaxes made after the optimizer step (the resumed run's too)
    for r in (a, b):
        assert r["precompute_amaxes"] and r["amax_precomputed"] > 0 and r["amax_reduces"] == 0, r


@pytest.mark.slow
def test_precomputed_amaxes_against_per_gather_reductions(tmp_path):
    """--no-precompute-amaxes: every quantized gather all-reduces its weight's amax itself, and the run's losses
    equal those of the run with precompute_weight_amaxes bit for bit."""
    env = {"FP_RECIPES_RECIPE": "current"}
    runs = {}
    for tag, extra in (("pre", ()), ("own", ("--no-precompute-amaxes",))):
        out = tmp_path / f"{tag}.json"
        run = _launch(tmp_path, env, "--steps", "3", "--quantized-all-gather", *extra, "--json", str(out))
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-6000:]
        runs[tag] = json.loads(out.read_text())
    pre, own = runs["pre"], runs["own"]
    assert pre["amax_precomputed"] > 0 and pre["amax_reduces"] == 0, pre
    assert not own["precompute_amaxes"] and own["amax_precomputed"] == 0, own
    assert own["amax_reduces"] == pre["amax_precomputed"]  # the same gathers, each reducing its own amax
    assert own["losses"] == pre["losses"]


def test_bad_arguments_are_one_line(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_fsdp_train.py"), "--steps", "0"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 2
    assert "--steps must be at least 1" in run.stderr and "Traceback" not in run.stderr
