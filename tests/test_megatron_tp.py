"""TP=2 and TP=2 + sequence parallel on the fp_recipes Megatron backend: 2 real gloo processes
(torchrun), one launch for every check."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

HERE = os.path.dirname(__file__)


@pytest.mark.slow
def test_tp2_and_sequence_parallel_match_tp1(tmp_path):
    out = tmp_path / "tp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(HERE, "_megatron_tp_worker.py"), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    ref = res["tp1"]["losses"]
    for name in ("tp1", "tp2", "tp2_sp"):
        assert res[name]["state_identical_on_ranks"], name  # delayed scales equal on both ranks
    for name in ("tp2", "tp2_sp"):
        # TP splits the row-parallel GEMMs' reduction (FP32 partial sums added by all-reduce), so
        # losses match TP=1 to FP32 rounding; the FP8 scales are identical (amax reduced over TP+DP).
        assert all(abs(a - b) < 1e-4 for a, b in zip(ref, res[name]["losses"])), (name, ref, res[name])
