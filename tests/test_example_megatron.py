"""examples/megatron_gpt.py runs as a user runs it: one process, and under torchrun with TP=2 +
sequence parallelism (2 gloo processes). Same global batches in both, so TP=2 reproduces TP=1's
losses to FP32 rounding, and the delayed-scaling state is identical on both ranks after every step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "megatron_gpt.py")


def _run(cmd, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NVTE_", "FP_RECIPES_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.mark.slow
def test_one_process_and_tp2_sp_give_the_same_losses(tmp_path):
    args = ["--tiny", "--cpu", "--steps", "4", "--recipes", "fp8_delayed,nvfp4_row_4over6"]
    one = _run([sys.executable, EXAMPLE, *args, "--json", str(tmp_path / "one.json")], tmp_path)
    assert "gap to bf16" in one.stdout and "fp8_delayed" in one.stdout
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", EXAMPLE,
          *args, "--tp", "2", "--sp", "--json", str(tmp_path / "tp2.json")], tmp_path)
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "tp2"))
    assert (b["tp"], b["sp"], b["dp"], b["world_size"]) == (2, True, 1, 2)
    assert [r["recipe"] for r in a["results"]] == ["bf16", "fp8_delayed", "nvfp4_row_4over6"]
    for ra, rb in zip(a["results"], b["results"]):
        assert rb["state_differs_at_steps"] == [], rb["recipe"]
        assert ra["losses"][-1] < ra["losses"][0]
        if ra["recipe"] in ("bf16", "fp8_delayed"):
            # FP32 on the CPU: TP changes only the order of the row-parallel partial sums (delayed
            # scales are reduced over TP+DP, so they are those of TP=1)
            tol = 1e-4
        else:
            # NVFP4's per-tensor and per-row amaxes are taken per TP shard (a row-parallel GEMM's
            # activation holds half of each row's K), as TransformerEngine does: close, not equal
            tol = 1e-2 * ra["losses"][0]
        assert all(abs(x - y) < tol for x, y in zip(ra["losses"], rb["losses"])), (ra["recipe"], ra, rb)


def test_bad_layouts_are_one_line(tmp_path):
    for args, msg in ((["--sp"], "--sp (sequence parallelism) needs --tp > 1"),
                      (["--tp", "3"], "--tp must be a positive divisor")):
        proc = subprocess.run([sys.executable, EXAMPLE, "--tiny", *args], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 2 and msg in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
