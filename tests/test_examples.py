"""The examples in examples/ run as a user runs them (subprocess, tiny sizes, CPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NVTE_", "FP_RECIPE", "TRAIN_", "EXAMPLE_"))}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    out = subprocess.run([sys.executable, str(ROOT / "examples" / script)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _losses(stdout: str) -> dict:
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^step (\d+) loss (\S+)$", stdout, re.M)}


TINY = {"TRAIN_D_MODEL": "32", "TRAIN_LAYERS": "1", "TRAIN_MICRO_BATCH": "4", "TRAIN_SEQ_LEN": "32",
        "TRAIN_GRAD_ACCUM": "2"}


def test_train_gpt_env_configured_and_resumes_bit_for_bit(tmp_path):
    ckpt = str(tmp_path / "ckpt.pt")
    straight = _losses(_run("train_gpt.py", TRAIN_STEPS="4", **TINY).stdout)
    assert sorted(straight) == [1, 2, 3, 4] and straight[4] < straight[1]
    first = _run("train_gpt.py", TRAIN_STEPS="2", TRAIN_CKPT=ckpt, **TINY)
    assert f"saved {ckpt} at step 2" in first.stdout and "recipe: DelayedScaling" in first.stdout
    resumed = _run("train_gpt.py", TRAIN_STEPS="4", TRAIN_CKPT=ckpt, **TINY)
    assert f"resumed from {ckpt} at step 2" in resumed.stdout
    # model, delayed-scaling state and optimizer all restored: the same losses as the straight run
    assert _losses(first.stdout) == {1: straight[1], 2: straight[2]}
    assert _losses(resumed.stdout) == {3: straight[3], 4: straight[4]}


def test_train_gpt_recipe_from_the_environment_only():
    out = _run("train_gpt.py", TRAIN_STEPS="2", FP_RECIPES_RECIPE="nvfp4", NVTE_NVFP4_4OVER6="weights", **TINY)
    assert "recipe: NVFP4BlockScaling" in out.stdout and "[env NVTE_NVFP4_4OVER6=weights]" in out.stdout
    off = _run("train_gpt.py", TRAIN_STEPS="2", FP_RECIPES_RECIPE="none", **TINY)
    assert "recipe: none (quantization off)" in off.stdout
    assert sorted(_losses(off.stdout)) == [1, 2] and sorted(_losses(out.stdout)) == [1, 2]


def test_convert_hf_style_trains_with_and_without():
    out = _run("convert_hf_style.py", EXAMPLE_STEPS="12").stdout
    assert "converted 6 nn.Linear -> fp_recipes.Linear; identical outside autocast: True" in out
    assert "recipe: DelayedScaling" in out
    plain = re.search(r"plain torch.nn : loss (\S+) -> (\S+)", out)
    conv = re.search(r"converted      : loss (\S+) -> (\S+) \(([-+]\S+)% vs plain\)", out)
    assert plain and conv
    assert float(plain.group(2)) < float(plain.group(1)) and float(conv.group(2)) < float(conv.group(1))
    assert abs(float(conv.group(3))) < 5.0  # FP8 delayed scaling tracks FP32 closely on this task
