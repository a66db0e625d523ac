"""scripts/compare_megatron_layouts.py, run as the two-GPU script runs it: recipes matched by name (the
reference may be a one-GPU run of fewer recipes), the final-loss difference signed, the tolerance on |d|."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(tp: int, dp: int, finals: dict) -> dict:
    results = [{"recipe": name, "losses": [3.0, 2.5, final], "final_loss": final, "val_loss": final,
                "tokens_per_s_per_gpu": 1000.0, "state_differs_at_steps": []} for name, final in finals.items()]
    return {"device": "cpu", "world_size": tp * dp, "megatron_core": "x", "steps": 3, "model": {}, "tp": tp,
            "sp": False, "dp": dp, "results": results}


def _compare(tmp_path: Path, *runs: dict) -> tuple:
    paths = []
    for i, run in enumerate(runs):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(run))
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_megatron_layouts.py"), str(out),
                           *map(str, paths)], capture_output=True, text=True, timeout=60)
    return proc, json.loads(out.read_text())


def test_reference_with_fewer_recipes_and_signed_difference(tmp_path):
    one_gpu = _run(1, 1, {"bf16": 2.0, "fp8_delayed": 2.0})
    tp2 = _run(2, 1, {"fp8_delayed": 1.9, "bf16": 2.02, "nvfp4": 2.1})  # another order, one extra recipe
    proc, out = _compare(tmp_path, one_gpu, tp2)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # delayed is 5 % lower: outside 3 %
    rows = {(r["recipe"], r["layout"]): r for r in out["rows"]}
    assert abs(rows[("bf16", "TP=2 DP=1")]["final_signed"] - 0.01) < 1e-9
    delayed = rows[("fp8_delayed", "TP=2 DP=1")]
    assert abs(delayed["final_signed"] + 0.05) < 1e-9 and not delayed["within_tolerance"]
    assert "-5.00 %" in proc.stdout and "+1.00 %" in proc.stdout
    assert ("nvfp4", "TP=2 DP=1") not in rows  # not in the reference: no row to compare against


def test_within_tolerance_exits_0(tmp_path):
    proc, out = _compare(tmp_path, _run(1, 1, {"bf16": 2.0}), _run(2, 1, {"bf16": 2.05}))
    assert proc.returncode == 0 and out["all_within_tolerance"], proc.stdout


def test_a_layout_without_a_reference_recipe_is_reported(tmp_path):
    proc, _ = _compare(tmp_path, _run(1, 1, {"bf16": 2.0, "fp8_current": 2.0}), _run(2, 1, {"bf16": 2.0}))
    assert "| fp8_current | TP=2 DP=1 | not run in this layout |" in proc.stdout
